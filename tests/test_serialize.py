"""The default serializer: large buffers out of band, aligned, decoded as read-only views."""

from __future__ import annotations

import gc
import pickle
import warnings
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataset_rt as drt
from dataset_rt.serialize import MAGIC, MIN_OUT_OF_BAND, dumps, loads

DTYPES = [np.uint8, np.int16, np.int64, np.float32, np.float64, np.complex128, np.bool_]


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for dtype in DTYPES:
        base = (rng.random((256, 300)) * 100).astype(dtype)
        out += [base, np.asfortranarray(base), base[:, ::3], base[5]]
    return out


@pytest.mark.parametrize("index", range(len(DTYPES) * 4))
def test_arrays_of_every_dtype_and_memory_order_round_trip(index: int) -> None:
    array = _arrays()[index]
    back = loads(dumps({"a": array}))["a"]
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    contiguous = array.flags.c_contiguous or array.flags.f_contiguous
    if contiguous and array.nbytes >= MIN_OUT_OF_BAND:
        assert not back.flags.writeable  # a view of the record's bytes
        assert back.flags.f_contiguous == array.flags.f_contiguous
    else:
        assert back.flags.writeable  # non-contiguous or small: in band, its own copy


def test_other_buffer_types_round_trip() -> None:
    big = bytes(range(256)) * 400
    record = {
        "bytes": big,
        "bytearray": bytearray(big),
        "memoryview": memoryview(big),
        "picklebuffer": pickle.PickleBuffer(bytearray(big)),
        "small": memoryview(b"tiny"),
        "nested": [np.arange(300, dtype=np.int64), (np.zeros((2, 2)), "text")],
    }
    data = dumps(record)
    assert data[:8] == MAGIC
    back = loads(data)
    assert back["bytes"] == big and type(back["bytes"]) is bytes
    assert back["bytearray"] == big and type(back["bytearray"]) is bytearray
    assert type(back["memoryview"]) is memoryview and back["memoryview"].readonly
    assert bytes(back["memoryview"]) == big
    assert bytes(back["picklebuffer"]) == big
    assert bytes(back["small"]) == b"tiny"
    np.testing.assert_array_equal(back["nested"][0], np.arange(300))
    assert back["nested"][1][1] == "text"


def test_records_without_large_buffers_are_plain_pickle() -> None:
    record = {"x": 1, "small": np.arange(10)}
    data = dumps(record)
    assert data[:2] == b"\x80\x05"
    assert pickle.loads(data)["x"] == 1


def test_buffers_are_64_byte_aligned_in_cache_reads_and_loader_batches() -> None:
    records = [
        {"a": np.full(10_000 + 7 * i, i, dtype=np.float64), "b": np.ones(8200)} for i in range(50)
    ]
    cache = drt.cache(records, "aligned", progress=False)
    assert cache.serializer == "pickle"
    for i in (0, 17, 49):
        got = cache.get(i)
        assert got["a"].ctypes.data % 64 == 0 and got["b"].ctypes.data % 64 == 0
        assert not got["a"].flags.writeable and not got["a"].flags.owndata
    loader = cache.metadata.drt.loader(batch_size=7, seed=0, collate=list)
    for batch in loader:
        for record in batch:
            assert record["a"].ctypes.data % 64 == 0
            assert record["a"][0] == record["a"][-1]
            assert not record["a"].flags.writeable


def test_batches_mixing_plain_and_out_of_band_records_decode_in_order() -> None:
    # Small records are plain pickles, large ones carry out-of-band buffers: the loader
    # decodes both kinds from one batch, in the batch's order.
    records: list[Any] = []
    for i in range(60):
        if i % 3 == 0:
            records.append({"i": i, "big": np.full(20_000, i, dtype=np.int32)})
        else:
            records.append({"i": i, "small": np.full(4, i), "text": f"record {i}", "raw": b"x" * i})
    cache = drt.cache(records, "mixed", progress=False)
    loader = cache.metadata.drt.loader(batch_size=16, shuffle=False, collate=list)
    got = [r for batch in loader for r in batch]
    assert [r["i"] for r in got] == list(range(60))
    for record in got:
        i = record["i"]
        if i % 3 == 0:
            assert int(record["big"][-1]) == i and not record["big"].flags.writeable
        else:
            assert record["text"] == f"record {i}" and record["raw"] == b"x" * i
            assert record["small"].flags.writeable  # in-band arrays are the record's own


def test_copy_gives_writable_private_arrays() -> None:
    cache = drt.cache([{"a": np.zeros(10_000)}], "copies", progress=False)
    mine = cache.get(0, copy=True)["a"]
    assert mine.flags.writeable
    mine[:] = 5
    assert cache.get(0)["a"].sum() == 0  # the cache is untouched
    batch = next(iter(cache.metadata.drt.loader(batch_size=1, copy=True, collate=list)))
    batch[0]["a"][0] = 1.0  # writable


def test_views_outlive_the_cache_and_the_loader() -> None:
    records = [{"a": np.full(20_000, i, dtype=np.int32)} for i in range(20)]
    cache = drt.cache(records, "lifetime", progress=False)
    from_get = cache.get(3)["a"]
    loader = cache.metadata.drt.loader(batch_size=20, shuffle=False, collate=list)
    from_loader = [r["a"] for r in next(iter(loader))]
    del cache, loader
    gc.collect()
    assert (from_get == 3).all()
    assert [int(a[100]) for a in from_loader] == list(range(20))


def test_default_collate_stacks_read_only_arrays_without_warnings() -> None:
    records = [{"image": np.full((3, 128, 192), i, dtype=np.uint8), "label": i} for i in range(64)]
    cache = drt.cache(records, "collate", progress=False)
    frame = cache.metadata
    for num_workers in (0, 2):
        loader = frame.drt.loader(batch_size=16, shuffle=False, num_workers=num_workers)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batches = list(loader)
        images = torch.cat([b["image"] for b in batches])
        assert images.dtype == torch.uint8 and images.shape == (64, 3, 128, 192)
        assert images[:, 0, 0, 0].tolist() == list(range(64))
        assert torch.cat([b["label"] for b in batches]).tolist() == list(range(64))


def test_batch_tensors_reuse_memory_only_once_released() -> None:
    # 8 records of 256 KiB: 2 MiB batches, whose memory the default collate recycles.
    records = [{"x": np.full((256, 256), i, dtype=np.float32)} for i in range(32)]
    cache = drt.cache(records, "recycled-batches", progress=False)
    loader = cache.metadata.drt.loader(batch_size=8, shuffle=False)
    kept = next(iter(loader))["x"][2:4]  # a view keeps the whole batch's memory
    seen = set()
    for _ in range(3):
        for batch in loader:
            seen.add(batch["x"].data_ptr())
            assert batch["x"][:, 0, 0].tolist() == batch["x"][:, -1, -1].tolist()
            # Whatever the collector's timing after earlier tests, a dropped batch is
            # released before the next one is built.
            gc.collect()
    assert kept[:, 100, 100].tolist() == [2.0, 3.0]  # never overwritten by later batches
    assert len(seen) <= 3  # 12 batches on a few recycled buffers
    kept_ptr = kept.data_ptr()
    assert all(not (p <= kept_ptr < p + 8 * 256 * 256 * 4) for p in seen)


def _mapped_file(address: int) -> str | None:
    """The file this process maps at ``address`` (from /proc/self/maps), if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5] if len(fields) > 5 else None
    return None


def _mappings_of(path: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(path))


def test_loader_arrays_view_the_mapped_shard_and_outlive_loader_and_cache() -> None:
    # 64 KiB arrays: out of band, so a loader leaves them in the shard.
    records = [{"x": np.full((128, 128), i, dtype=np.float32)} for i in range(16)]
    cache = drt.cache(records, "shard-views", progress=False)
    shard = str(cache.path / "shards" / "00000.bin")
    loader = cache.metadata.drt.loader(batch_size=4, shuffle=False, collate=list)
    arrays = [r["x"] for r in next(iter(loader))]
    assert all(_mapped_file(a.ctypes.data) == shard for a in arrays)
    assert all(not a.flags.writeable and a.ctypes.data % 64 == 0 for a in arrays)
    del loader, cache
    gc.collect()
    assert [float(a[5, 5]) for a in arrays] == [0.0, 1.0, 2.0, 3.0]
    held = _mappings_of(shard)
    assert held >= 1  # the views keep their mapping
    del arrays
    gc.collect()
    assert _mappings_of(shard) < held


def test_records_with_large_arrays_of_any_size_are_read_in_place_by_get_and_loaders() -> None:
    # Odd sizes in a cache aligned to 16 bytes: without the writer's 64-byte rule for such
    # records, most would start at an address the arrays cannot be viewed at, and be copied.
    records = [{"x": np.full(9_000 + 7 * i, i, dtype=np.float64)} for i in range(12)]
    cache = drt.cache(records, "odd-sizes", alignment=16, progress=False)
    shard = str(cache.path / "shards" / "00000.bin")
    got = [cache.get(i)["x"] for i in range(12)] + [r["x"] for r in cache.get_many([11, 3, 3])]
    loader = cache.metadata.drt.loader(batch_size=12, shuffle=False, collate=list)
    got += [r["x"] for r in next(iter(loader))]
    assert all(_mapped_file(a.ctypes.data) == shard for a in got)
    assert all(a.ctypes.data % 64 == 0 and not a.flags.writeable for a in got)
    assert [int(a[0]) for a in got] == [*range(12), 11, 3, 3, *range(12)]
    assert [len(a) for a in got[:12]] == [9_000 + 7 * i for i in range(12)]
    private = cache.get_many([5], copy=True)[0]["x"]
    assert private.flags.writeable and _mapped_file(private.ctypes.data) != shard


def test_copy_true_arrays_are_private_even_for_records_left_in_the_shard() -> None:
    records = [{"x": np.full((128, 128), i, dtype=np.float32)} for i in range(8)]
    cache = drt.cache(records, "shard-copies", progress=False)
    loader = cache.metadata.drt.loader(batch_size=4, shuffle=False, collate=list, copy=True)
    arrays = [r["x"] for r in next(iter(loader))]
    shard = str(cache.path / "shards" / "00000.bin")
    assert all(a.flags.writeable and _mapped_file(a.ctypes.data) != shard for a in arrays)
    arrays[0][0, 0] = -1.0
    assert cache.get(0)["x"][0, 0] == 0.0


def test_caches_written_in_band_still_read() -> None:
    records = [{"a": np.arange(1000) + i} for i in range(10)]
    cache = drt.cache(records, "inband", serializer="pickle-inband", progress=False)
    assert cache.serializer == "pickle-inband"
    assert cache.get_bytes(0)[:2] == b"\x80\x05"
    got = cache.get(4)["a"]
    assert got.flags.writeable and got[0] == 4
    ids = [int(b["a"][0, 0] - 0) for b in cache.metadata.drt.loader(batch_size=1, shuffle=False)]
    assert ids == list(range(10))


def test_custom_decoders_receive_bytes_that_loads_decodes() -> None:
    cache = drt.cache([{"a": np.arange(10_000)}], "custom-decode", progress=False)
    seen: list[Any] = []

    def decode(data: bytes) -> Any:
        seen.append(type(data))
        return loads(data)["a"].sum()

    batch = next(iter(cache.metadata.drt.loader(batch_size=1, decode=decode, collate=list)))
    assert batch == [np.arange(10_000).sum()] and seen == [bytes]
    assert cache.get(0, decode=decode) == np.arange(10_000).sum()


def test_damaged_out_of_band_headers_are_errors_not_crashes() -> None:
    data = bytearray(dumps({"a": np.zeros(10_000)}))
    data[8:16] = (10**6).to_bytes(8, "little")  # a buffer count far past the record
    with pytest.raises(pickle.UnpicklingError, match="shorter than its out-of-band header"):
        loads(bytes(data))


def test_metadata_is_unchanged_by_the_payload_format() -> None:
    cache = drt.cache(
        ({"a": np.zeros(10_000), "label": i % 3} for i in range(30)),
        "meta-oob",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    assert cache.metadata.columns == ["cache_id", "sample_id", "label", "weight"]
    assert cache.metadata.group_by("label").len().sort("label")["len"].to_list() == [10, 10, 10]
    assert cache.metadata.filter(pl.col("label") == 1).height == 10


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_records_fail_cleanly_never_crash(data: st.DataObject) -> None:
    """Damaged out-of-band headers and streams raise an exception; they never crash or read
    outside the record."""
    record = bytearray(dumps({"a": np.arange(9000, dtype=np.float64), "b": np.ones(300)}))
    flips = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(record) - 1), st.integers(1, 255)), min_size=1, max_size=4
        )
    )
    for at, mask in flips:
        record[at] ^= mask
    keep = data.draw(st.integers(0, len(record)))
    try:
        back = loads(bytes(record[:keep]))
    except Exception:
        return
    if isinstance(back, dict) and isinstance(back.get("a"), np.ndarray):
        assert back["a"].nbytes <= keep  # a view can only cover the record's own bytes
