"""drt.cache(compression=...): records compressed one by one, read back decoded."""

from __future__ import annotations

import json
import signal
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Squares, python_child, record, same_record

import dataset_rt as drt
from dataset_rt.errors import ArgumentError, CacheCorruptError, CacheNotFoundError

CODECS: list[Any] = ["zstd", ("zstd", 9), ("zstd", -3), "lz4"]


def _records(n: int) -> list[dict[str, Any]]:
    """Compressible records: a small one, and every 10th with a 256 KiB array viewed in place
    when uncompressed."""
    out = []
    for i in range(n):
        r = record(i)
        if i % 10 == 0:
            r["big"] = np.full(64 << 10, i, dtype=np.float32)
        out.append(r)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    big = "big" not in a or np.array_equal(a["big"], b["big"])
    return same_record(a, b) and big and a.keys() == b.keys()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> drt.Cache:
    root = tmp_path_factory.mktemp("compression")
    return drt.cache(_records(120), "plain", root=root, metadata=_meta, progress=False)


def _meta(r: dict[str, Any]) -> dict[str, Any]:
    return {"label": r["label"]}


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_compressed_caches_read_the_same_records_as_plain_ones(
    plain: drt.Cache, codec: Any
) -> None:
    name = f"packed-{CODECS.index(codec)}"
    cache = drt.cache(
        _records(120), name, root=plain.root, metadata=_meta, compression=codec, progress=False
    )
    expected = codec if codec != "zstd" else ("zstd", 3)
    assert cache.compression == expected
    assert drt.open(name, root=plain.root).compression == expected
    assert cache.nbytes == plain.nbytes, "nbytes counts the records as serialized"
    if codec != "lz4":  # lz4 gains little on these random bytes
        assert cache.nbytes_on_disk < plain.nbytes_on_disk * 0.6
    manifest = json.loads((cache.path / "manifest.json").read_text())
    codec_name = "lz4" if codec == "lz4" else "zstd"
    assert (manifest["format_version"], manifest["compression"]) == (5, codec_name)

    # Every read path: bytes, single records, batches, and loaders in this process and in
    # worker processes, against the uncompressed cache.
    assert [cache.get_bytes(i) for i in range(120)] == [plain.get_bytes(i) for i in range(120)]
    assert all(_same(cache.get(i, verify=True), plain.get(i)) for i in range(0, 120, 7))
    assert all(map(_same, cache.get_many(range(0, 120, 3)), plain.get_many(range(0, 120, 3))))
    for workers in (0, 2):
        batches = [
            c.metadata.drt.loader(batch_size=16, seed=4, num_workers=workers, collate=list)
            for c in (cache, plain)
        ]
        for got, want in zip(*batches, strict=True):
            assert len(got) == len(want) and all(map(_same, got, want))
    assert drt.verify(name, root=plain.root, progress=False).ok


def test_arrays_of_compressed_records_are_decoded_aligned_copies(plain: drt.Cache) -> None:
    records = [{"big": np.full(64 << 10, i, dtype=np.float32), "i": i} for i in range(12)]
    cache = drt.cache(records, "arrays", root=plain.root, compression="zstd", progress=False)
    big = cache.get(10)["big"]
    assert big.ctypes.data % 64 == 0 and big.flags.aligned
    assert np.array_equal(big, records[10]["big"])
    loader = cache.metadata.drt.loader(batch_size=4, shuffle=False, num_workers=0)
    batch = next(iter(loader))
    assert torch.equal(batch["big"], torch.from_numpy(np.stack([r["big"] for r in records[:4]])))


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        ("gzip", r"compression must be None, \"zstd\", \(\"zstd\", level\) or \"lz4\", got 'gzip'"),
        (("lz4", 1), r"got \('lz4', 1\)"),
        (("zstd", "high"), r"got \('zstd', 'high'\)"),
        (("zstd", 99), "zstd level must be from"),
        (True, "got True"),
    ],
)
def test_unknown_codecs_and_levels_are_refused_before_anything_is_written(
    tmp_path: Any, compression: Any, message: str
) -> None:
    with pytest.raises(ArgumentError, match=message):
        drt.cache([1, 2], "refused", root=tmp_path, compression=compression, progress=False)
    with pytest.raises(CacheNotFoundError):
        drt.open("refused", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_damage_in_a_compressed_record_is_caught_never_decoded_into_wrong_data(
    tmp_path: Any,
) -> None:
    cache = drt.cache(
        [bytes([i]) * 5000 for i in range(40)],
        "damaged",
        root=tmp_path,
        serializer=bytes,
        decode=bytes,
        compression="lz4",
        progress=False,
    )
    shard = cache.path / "shards" / "00000.bin"
    data = bytearray(shard.read_bytes())
    # The first record starts after the 64-byte shard header: damage its length header,
    # adding 16 MiB to it.
    data[64 + 3] ^= 0x01
    shard.write_bytes(bytes(data))
    reopened = drt.open("damaged", root=tmp_path)
    with pytest.raises(CacheCorruptError, match="sample_id 0 fails its checksum"):
        reopened.get_bytes(0, verify=True)
    with pytest.raises(CacheCorruptError, match=r"sample_id 0: its header records 16782216"):
        reopened.get_bytes(0)
    assert reopened.get_bytes(1) == bytes([1]) * 5000
    report = drt.verify("damaged", root=tmp_path, progress=False)
    assert [p.sample_ids for p in report.problems if p.sample_ids] == [[0]]


def test_parallel_builds_and_appends_compress_like_the_build(tmp_path: Any) -> None:
    one = drt.cache(Squares(200), "one", root=tmp_path, compression="zstd", progress=False)
    two = drt.cache(
        Squares(200), "two", root=tmp_path, compression="zstd", num_proc=2, progress=False
    )
    assert [one.get_bytes(i) for i in range(200)] == [two.get_bytes(i) for i in range(200)]
    assert one.compression == two.compression == ("zstd", 3) and two.num_parts == 2
    grown = drt.append("two", [{"i": -1, "sq": np.zeros(4), "tag": "new"}], root=tmp_path)
    assert grown.compression == ("zstd", 3) and grown.get(200)["tag"] == "new"
    assert grown.num_parts == 3 and drt.verify("two", root=tmp_path, progress=False).ok


def test_info_and_the_notebook_view_show_the_codec_and_its_ratio(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataset_rt.cli import main

    cache = drt.cache(
        [b"x" * 10_000] * 10,
        "shown",
        root=tmp_path,
        serializer=bytes,
        decode=bytes,
        compression=("zstd", 5),
        progress=False,
    )
    assert main(["info", "shown", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compression zstd level 5:" in out and "x smaller)" in out
    assert "zstd level 5" in cache._repr_html_()


# A child that builds a compressed cache and is SIGKILLed at the record or kill point named
# by $KILL_AT.
BUILD_AND_DIE = """
import os, signal
import dataset_rt as drt
kill_at = os.environ["KILL_AT"]
if kill_at == "after-metadata":
    os.environ["DATASET_RT_TEST_KILL_AT"] = "build-metadata-written"
def source():
    for i in range(300):
        if kill_at == f"record-{i}":
            os.kill(os.getpid(), signal.SIGKILL)
        yield bytes([i % 256]) * 3000
drt.cache(source, "victim", shard_size=64 << 10, compression="zstd", progress=False)
"""


@pytest.mark.parametrize("kill_at", ["record-150", "after-metadata"])
def test_a_killed_compressed_build_leaves_nothing_and_the_next_call_rebuilds(kill_at: str) -> None:
    child = python_child(BUILD_AND_DIE, {"KILL_AT": kill_at})
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, out, err)
    with pytest.raises(CacheNotFoundError):
        drt.open("victim")
    rebuilt = drt.cache(
        (bytes([i % 256]) * 3000 for i in range(300)), "victim", compression="lz4", progress=False
    )
    assert rebuilt.get(299) == bytes([299 % 256]) * 3000 and rebuilt.compression == "lz4"
