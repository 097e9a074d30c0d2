"""df.drt.loader: batches, sampling semantics, determinism, resumption, workers, bad input."""

from __future__ import annotations

import json
import pickle
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from helpers import python_child, slow_identity

import dataset_rt as drt
from dataset_rt.errors import (
    ArgumentError,
    LoaderStateError,
    MetadataError,
    SerializationError,
    StaleCacheError,
    TransformError,
    WeightError,
)


def make_record(i: int) -> dict[str, Any]:
    return {"x": np.full(4, i, dtype=np.int64), "label": i % 5, "name": f"s{i}"}


@pytest.fixture
def cache() -> drt.Cache:
    return drt.cache(
        (make_record(i) for i in range(300)),
        "loader-cache",
        metadata=lambda r: {"label": r["label"]},
        shard_size=4096,
        progress=False,
    )


def ids_of(batches: list[Any]) -> list[int]:
    """The sample ids in batches collated by PyTorch (dicts of tensors) or as lists."""
    out: list[int] = []
    for b in batches:
        if isinstance(b, list):
            out.extend(r["x"][0].item() for r in b)
        else:
            out.extend(b["x"][:, 0].tolist())
    return out


def test_batches_len_and_default_torch_collate(cache: drt.Cache) -> None:
    loader = cache.metadata.drt.loader(batch_size=32, seed=0)
    assert len(loader) == 10  # 300 draws in batches of 32
    batches = list(loader)
    assert len(batches) == 10
    first = batches[0]
    assert isinstance(first["x"], torch.Tensor) and first["x"].shape == (32, 4)
    assert first["label"].dtype == torch.int64
    assert len(first["name"]) == 32
    assert sum(len(b["name"]) for b in batches) == 300
    as_lists = list(cache.metadata.drt.loader(batch_size=32, seed=0, collate=list))
    assert ids_of(as_lists) == ids_of(batches)


def test_shuffle_false_reads_every_row_once_in_frame_order(cache: drt.Cache) -> None:
    frame = cache.metadata.filter(pl.col("label") != 2).sort("sample_id", descending=True)
    loader = frame.drt.loader(batch_size=7, shuffle=False, collate=list)
    assert ids_of(list(loader)) == frame["sample_id"].to_list()
    assert len(loader) == -(-frame.height // 7)
    with pytest.raises(ArgumentError, match="num_samples applies to shuffled"):
        frame.drt.loader(batch_size=7, shuffle=False, num_samples=10)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_pass_of_an_evaluation_loader_reads_every_row(
    cache: drt.Cache, num_workers: int
) -> None:
    loader = cache.metadata.drt.loader(
        batch_size=32, shuffle=False, collate=list, num_workers=num_workers
    )
    every = list(range(300))
    partial = iter(loader)
    assert ids_of([next(partial), next(partial)]) == every[:64]
    del partial  # a pass stopped early, as Lightning's sanity check does
    assert ids_of(list(loader)) == every, "the next pass starts over"
    assert ids_of(list(loader)) == every
    # A loaded state is continued once, then passes start over again.
    state = {**loader.state_dict(), "position": 96}
    loader.load_state_dict(state)
    assert ids_of(list(loader)) == every[96:]
    assert ids_of(list(loader)) == every


def test_weighted_draws_follow_the_weights_and_skip_zero(cache: drt.Cache) -> None:
    weights = {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    frame = cache.metadata.with_columns(weight=pl.col("label").replace_strict(weights) * 1.0)
    n = 30_000
    loader = frame.drt.loader(batch_size=1000, seed=3, num_samples=n, collate=list)
    labels = Counter(i % 5 for i in ids_of(list(loader)))
    assert labels[0] == 0, "a zero-weight row was drawn"
    for label, w in weights.items():
        if w:
            p = w / 10
            sigma = (n * p * (1 - p)) ** 0.5
            assert abs(labels[label] - n * p) < 5 * sigma, labels


def test_epoch_and_draws_match_what_the_loader_yields(cache: drt.Cache) -> None:
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    for seed, epoch in ((0, 0), (5, 3)):
        loader = frame.drt.loader(batch_size=64, seed=seed, num_samples=500, collate=list)
        loader.set_epoch(epoch)
        seen = ids_of(list(loader))
        drawn = frame.drt.epoch(seed=seed, epoch=epoch, num_samples=500)
        assert drawn["sample_id"].to_list() == seen
        assert drawn["draw"].to_list() == list(range(500))
        counts = frame.with_columns(
            n=pl.col("weight").drt.draws(500, seed=seed, epoch=epoch)
        ).filter(pl.col("n") > 0)
        assert dict(zip(counts["sample_id"], counts["n"], strict=True)) == Counter(seen)


def test_epochs_differ_and_repeat(cache: drt.Cache) -> None:
    loader = cache.metadata.drt.loader(batch_size=50, seed=9, collate=list)
    first = ids_of(list(loader))
    assert loader.epoch == 0
    second = ids_of(list(loader))
    assert loader.epoch == 1, "iterating a finished epoch again moves to the next one"
    assert second != first
    third = ids_of(list(loader))
    assert loader.epoch == 2 and third not in (first, second)
    loader.set_epoch(2)  # an epoch that has ended, selected explicitly: it starts again
    assert ids_of(list(loader)) == third and loader.epoch == 2
    loader.set_epoch(0)
    assert ids_of(list(loader)) == first
    loader.set_epoch(1)
    assert ids_of(list(loader)) == second


def test_an_epoch_with_nothing_left_for_a_batch_ends(cache: drt.Cache) -> None:
    frame = cache.metadata
    loader = frame.drt.loader(batch_size=40, seed=3, drop_last=True, collate=list)
    # 290 of 300 positions consumed: the 10 left fill no batch of 40 under drop_last.
    loader.load_state_dict({**loader.state_dict(), "position": 290})
    assert list(loader) == [] and loader.epoch == 0
    assert loader.state_dict()["position"] == 300
    nxt = ids_of(list(loader))
    assert loader.epoch == 1 and len(nxt) == 280, "the next iteration is the next epoch"


def test_a_loop_calling_set_epoch_sees_what_it_saw_before(cache: drt.Cache) -> None:
    frame = cache.metadata
    explicit = frame.drt.loader(batch_size=40, seed=2, collate=list)
    automatic = frame.drt.loader(batch_size=40, seed=2, collate=list)
    for epoch in range(3):
        explicit.set_epoch(epoch)
        assert ids_of(list(explicit)) == ids_of(list(automatic))
        assert automatic.epoch == epoch


def test_state_across_the_automatic_advance(cache: drt.Cache) -> None:
    frame = cache.metadata
    reference = frame.drt.loader(batch_size=25, seed=4, collate=list)
    epochs = [ids_of(list(reference)) for _ in range(4)]

    loader = frame.drt.loader(batch_size=25, seed=4, collate=list)
    for _ in range(3):
        list(loader)
    end_of_2 = loader.state_dict()
    assert end_of_2["epoch"] == 2 and end_of_2["position"] == end_of_2["total"]
    iterator = iter(loader)
    head = ids_of([next(iterator), next(iterator)])
    mid_3 = loader.state_dict()
    assert mid_3["epoch"] == 3 and mid_3["position"] == 50

    resumed = frame.drt.loader(batch_size=25, seed=4, collate=list)
    resumed.load_state_dict(mid_3)  # mid-epoch 3 continues epoch 3
    assert head + ids_of(list(resumed)) == epochs[3]
    resumed = frame.drt.loader(batch_size=25, seed=4, collate=list)
    resumed.load_state_dict(end_of_2)  # the end of epoch 2 starts epoch 3
    assert ids_of(list(resumed)) == epochs[3] and resumed.epoch == 3


def test_same_stream_for_any_prefetch_and_without_torch(cache: drt.Cache) -> None:
    frame = cache.metadata
    reference = ids_of(list(frame.drt.loader(batch_size=10, seed=4, collate=list)))
    for prefetch in (1, 2, 16):
        got = ids_of(list(frame.drt.loader(batch_size=10, seed=4, prefetch=prefetch, collate=list)))
        assert got == reference
    child = python_child(
        f"""
        import sys
        sys.modules["torch"] = None  # PyTorch is not installed here
        import json, dataset_rt as drt
        c = drt.open("loader-cache", root={str(cache.root)!r})
        batches = list(c.metadata.drt.loader(batch_size=10, seed=4))
        assert type(batches[0]) is list
        print(json.dumps([r["x"][0].item() for b in batches for r in b]))
        """
    )
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert json.loads(out) == reference


@pytest.mark.parametrize("num_workers", [1, 2])
def test_workers_yield_the_same_stream(cache: drt.Cache, num_workers: int) -> None:
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    reference = ids_of(list(frame.drt.loader(batch_size=16, seed=2)))
    with_workers = frame.drt.loader(batch_size=16, seed=2, num_workers=num_workers)
    assert ids_of(list(with_workers)) == reference
    assert len(with_workers) == len(reference) // 16 + 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_count_samples_bytes_and_where_time_went(cache: drt.Cache, num_workers: int) -> None:
    frame = cache.metadata
    loader = frame.drt.loader(
        batch_size=16, seed=0, num_samples=96, transform=slow_identity, num_workers=num_workers
    )
    assert loader.stats().samples == 0
    batches = list(loader)
    stats = loader.stats()
    assert stats.batches == len(batches) == 6
    assert stats.samples == 96
    drawn = frame.drt.epoch(seed=0, epoch=0, num_samples=96)["sample_id"].to_list()
    assert stats.bytes_read == sum(len(cache.get_bytes(i)) for i in drawn)
    assert stats.transform_seconds >= 96 * 0.001  # summed over workers
    assert stats.decode_seconds > 0 and stats.collate_seconds > 0 and stats.wait_seconds > 0
    assert "96 samples" in str(stats)
    if num_workers == 0:
        # The reader keeps ahead of a 1 ms-per-record transform: after the first batch, the
        # queue is never empty.
        assert stats.empty_queue <= 1 and stats.mean_queue_depth > 1
    list(loader)  # counters keep running over epochs
    assert loader.stats().samples == 192


def test_resume_mid_epoch_in_o1_and_in_a_new_process(cache: drt.Cache, tmp_path: Path) -> None:
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    full = ids_of(list(frame.drt.loader(batch_size=20, seed=1, collate=list)))
    loader = frame.drt.loader(batch_size=20, seed=1, collate=list)
    it = iter(loader)
    head = ids_of([next(it) for _ in range(4)])
    state = loader.state_dict()
    assert state["position"] == 80 and state["epoch"] == 0
    assert all(type(v) in (int, str, bool) for v in state.values())
    torch.save(state, tmp_path / "ckpt.pt")
    fresh = frame.drt.loader(batch_size=20, seed=1, collate=list)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    fresh.set_epoch(0)  # calling set_epoch on the resumed epoch keeps the position
    assert head + ids_of(list(fresh)) == full
    # A new process continues too.
    frame.write_parquet(tmp_path / "frame.parquet")
    child = python_child(
        f"""
        import json, torch, polars as pl, dataset_rt as drt
        frame = pl.read_parquet({str(tmp_path / "frame.parquet")!r})
        loader = frame.drt.loader(batch_size=20, seed=1, collate=list,
                                  root={str(cache.root)!r})
        loader.load_state_dict(torch.load({str(tmp_path / "ckpt.pt")!r}))
        print(json.dumps([r["x"][0].item() for b in loader for r in b]))
        """
    )
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert head + json.loads(out) == full


def test_elastic_resume_across_world_sizes_and_workers(cache: drt.Cache) -> None:
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    n = 600
    uninterrupted = frame.drt.epoch(seed=8, num_samples=n)["sample_id"].to_list()
    # Four ranks with two workers each consume 3 batches of 10, then the job is stopped.
    consumed: list[int] = []
    states = []
    for rank in range(4):
        loader = frame.drt.loader(
            batch_size=10, seed=8, num_samples=n, rank=rank, world_size=4, num_workers=2
        )
        it = iter(loader)
        consumed.extend(ids_of([next(it) for _ in range(3)]))
        it.close()
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states), "every rank saves the same state"
    state = states[0]
    assert state["position"] == 120
    # Two ranks without workers take over and finish the epoch.
    rest: list[list[int]] = []
    for rank in range(2):
        loader = frame.drt.loader(
            batch_size=7, seed=8, num_samples=n, rank=rank, world_size=2, collate=list
        )
        loader.load_state_dict(state)
        rest.append(ids_of(list(loader)))
    assert len(rest[0]) == len(rest[1])
    resumed = [rest[i % 2][i // 2] for i in range(len(rest[0]) * 2)]
    assert uninterrupted[120:] == resumed[: n - 120]
    assert sorted(consumed) == sorted(uninterrupted[:120])


def test_ranks_share_one_stream_disjointly_with_equal_batch_counts(cache: drt.Cache) -> None:
    frame = cache.metadata
    for world in (2, 3):
        per_rank = [
            ids_of(
                list(
                    frame.drt.loader(
                        batch_size=8,
                        seed=6,
                        num_samples=301,
                        rank=r,
                        world_size=world,
                        collate=list,
                    )
                )
            )
            for r in range(world)
        ]
        lengths = {
            len(frame.drt.loader(batch_size=8, seed=6, num_samples=301, rank=r, world_size=world))
            for r in range(world)
        }
        assert len(lengths) == 1
        assert len({len(p) for p in per_rank}) == 1
        stream = frame.drt.epoch(seed=6, num_samples=301)["sample_id"].to_list()
        interleaved = [per_rank[i % world][i // world] for i in range(301)]
        assert interleaved == stream


def with_other_cache(cache: drt.Cache) -> pl.DataFrame:
    """``cache``'s rows and a second cache's 10 (records 1000 to 1009), each cache half."""
    other = drt.cache(
        ({"x": np.full(4, 1000 + i), "label": 9} for i in range(10)),
        "other",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    return pl.concat([cache.metadata, other.metadata]).with_columns(
        weight=pl.col("cache_id").drt.balance()
    )


def test_several_caches_in_one_frame(cache: drt.Cache) -> None:
    both = with_other_cache(cache)
    seen = ids_of(list(both.drt.loader(batch_size=50, seed=0, num_samples=2000, collate=list)))
    from_other = [i for i in seen if i >= 1000]
    assert 800 < len(from_other) < 1200
    assert set(from_other) <= set(range(1000, 1010))


def test_a_categorical_cache_id_loads_reweights_and_saves_as_strings_do(
    cache: drt.Cache,
) -> None:
    # The frames dataset_rt gives hold categorical ids with Polars 2; users' may hold strings.
    both = with_other_cache(cache).with_columns(pl.col("cache_id").cast(pl.String))
    compact = both.with_columns(pl.col("cache_id").cast(pl.Categorical))
    options: dict[str, Any] = {"batch_size": 50, "seed": 4, "num_samples": 1000, "collate": list}
    loaders = [frame.drt.loader(**options) for frame in (both, compact)]
    assert ids_of(list(loaders[0])) == ids_of(list(loaders[1]))
    # A re-weight frame of either dtype: only the other cache from here on.
    for loader, frame in zip(loaders, (both, compact), strict=True):
        loader.reweight(frame.with_columns(weight=(pl.col("label") == 9).cast(pl.Float64)))
    drawn = [ids_of(list(loader)) for loader in loaders]
    assert drawn[0] == drawn[1] and set(drawn[0]) <= set(range(1000, 1010))
    seen = [loader.seen(epoch=0) for loader in loaders]
    assert seen[0].equals(seen[1])
    # A categorical table saves (its rows checked against the cache) and reads back.
    mine = compact.filter(pl.col("cache_id") == cache.cache_id).head(7)
    cache.save_metadata(mine)
    assert cache.metadata["sample_id"].to_list() == list(range(7))
    with pytest.raises(MetadataError, match="do not belong to cache"):
        cache.save_metadata(compact)


def test_loader_snapshots_its_frame(cache: drt.Cache) -> None:
    frame = cache.metadata
    loader = frame.drt.loader(batch_size=300, shuffle=False, collate=list)
    cache.save_metadata(frame.head(10))
    assert len(ids_of(list(loader))) == 300
    assert (
        len(ids_of(list(cache.metadata.drt.loader(batch_size=300, shuffle=False, collate=list))))
        == 10
    )


def test_lazy_frames_work(cache: drt.Cache) -> None:
    lazy = cache.scan().filter(pl.col("label") == 1)
    assert set(i % 5 for i in ids_of(list(lazy.drt.loader(batch_size=16, collate=list)))) == {1}
    assert lazy.drt.epoch(seed=0).height == 60


def test_bad_arguments_and_frames(cache: drt.Cache) -> None:
    frame = cache.metadata
    with pytest.raises(ArgumentError, match="batch_size must be at least 1"):
        frame.drt.loader(batch_size=0)
    with pytest.raises(ArgumentError, match="num_workers must be at least 0"):
        frame.drt.loader(batch_size=1, num_workers=-1)
    with pytest.raises(ArgumentError, match="pass both rank and world_size"):
        frame.drt.loader(batch_size=1, rank=0)
    with pytest.raises(ArgumentError, match=r"rank must be in \[0, 1\]"):
        frame.drt.loader(batch_size=1, rank=2, world_size=2)
    with pytest.raises(MetadataError, match=r"column\(s\) \['weight'\]"):
        frame.drop("weight").drt.loader(batch_size=1)
    with pytest.raises(MetadataError, match="no rows"):
        frame.head(0).drt.loader(batch_size=1)
    with pytest.raises(WeightError, match="holds -1 at sample_id 0"):
        frame.with_columns(weight=pl.lit(-1.0)).drt.loader(batch_size=1)
    with pytest.raises(MetadataError, match="sample_id 300 is not a sample"):
        frame.with_columns(sample_id=pl.col("sample_id") + 1).drt.loader(batch_size=1)


def test_lambdas_reach_workers_and_unsendable_callables_fail_at_once(
    cache: drt.Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    frame = cache.metadata
    # Without dill: lambdas and closures travel to the workers by value.
    monkeypatch.setitem(sys.modules, "dill", None)
    offset = 1000
    loader = frame.drt.loader(
        batch_size=100,
        num_workers=1,
        seed=0,
        collate=list,
        transform=lambda r: r["x"][0].item() + offset,
    )
    reference = ids_of(list(frame.drt.loader(batch_size=100, seed=0, collate=list)))
    assert [i - offset for b in loader for i in b] == reference
    # A function holding per-process state is refused before any worker starts.
    lock = threading.Lock()
    with pytest.raises(ArgumentError, match="transform=.* cannot be sent to worker"):
        frame.drt.loader(batch_size=1, num_workers=1, transform=lambda r: (lock, r))


def test_a_rebuilt_cache_fails_loudly(cache: drt.Cache) -> None:
    frame = cache.metadata
    loader = frame.drt.loader(batch_size=10, collate=list)
    drt.cache([1, 2, 3], "loader-cache", overwrite=True, progress=False)
    with pytest.raises(StaleCacheError, match="was rebuilt"):
        next(iter(loader))
    with pytest.raises(drt.errors.CacheNotFoundError, match="no cache with cache_id"):
        frame.drt.loader(batch_size=10)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_loader_decodes_with_the_decoder_its_cache_was_opened_with(num_workers: int) -> None:
    def encode(r: int) -> bytes:
        return str(r).encode()

    drt.cache(range(20), "custom-decoded", serializer=encode, progress=False)
    with pytest.raises(SerializationError, match="pass decode="):
        drt.open("custom-decoded").metadata.drt.loader(batch_size=5)
    frame = drt.open("custom-decoded", decode=lambda b: -int(b)).metadata
    loader = frame.drt.loader(batch_size=5, shuffle=False, collate=list, num_workers=num_workers)
    assert [r for batch in loader for r in batch] == [-i for i in range(20)]


def test_decode_and_transform_errors_name_the_sample(cache: drt.Cache) -> None:
    def decode(data: memoryview) -> Any:
        record = pickle.loads(data)
        if record["x"][0] == 17:
            raise ValueError("bad pixel")
        return record

    loader = cache.metadata.drt.loader(batch_size=300, shuffle=False, decode=decode, collate=list)
    with pytest.raises(SerializationError, match="sample_id 17 of cache 'loader-cache'"):
        list(loader)

    def transform(record: dict[str, Any]) -> Any:
        if record["label"] == 3:
            raise KeyError("missing")
        return record

    loader = cache.metadata.drt.loader(
        batch_size=8, shuffle=False, transform=transform, collate=list
    )
    with pytest.raises(TransformError, match="transform failed on sample_id 3 of cache"):
        list(loader)


def test_load_state_dict_refuses_foreign_states(cache: drt.Cache) -> None:
    frame = cache.metadata
    loader = frame.drt.loader(batch_size=10, seed=1)
    other = frame.head(100).drt.loader(batch_size=10, seed=1)
    with pytest.raises(LoaderStateError, match="plan"):
        loader.load_state_dict(other.state_dict())
    with pytest.raises(LoaderStateError, match="seed"):
        loader.load_state_dict(frame.drt.loader(batch_size=10, seed=2).state_dict())
    with pytest.raises(LoaderStateError, match="not a dataset_rt loader state"):
        loader.load_state_dict({"epoch": 1})
    # Another batch size is fine: the position counts draws, not batches.
    loader.load_state_dict(frame.drt.loader(batch_size=7, seed=1).state_dict())


def test_the_frame_method_shows_and_documents_every_loader_option(cache: drt.Cache) -> None:
    import inspect

    from dataset_rt.namespace import DrtFrameNamespace

    shown = inspect.signature(cache.metadata.drt.loader).parameters
    options = [p for p in inspect.signature(drt.Loader).parameters if p != "frame"]
    assert list(shown) == options, "help(df.drt.loader) lists Loader's options, in order"
    assert shown["seed"].default == 0 and shown["shuffle"].kind is inspect.Parameter.KEYWORD_ONLY
    doc = DrtFrameNamespace.loader.__doc__ or ""
    assert all(f"``{name}``" in doc for name in options if name != "batch_size"), doc
    with pytest.raises(TypeError, match="shufle"):
        cache.metadata.drt.loader(batch_size=4, shufle=False)


@pytest.mark.parametrize("dtype", [pl.Int32, pl.UInt32, pl.UInt64])
def test_any_integer_sample_id_column_draws_what_int64_draws(
    cache: drt.Cache, dtype: pl.DataType
) -> None:
    def draws(frame: pl.DataFrame) -> list[int]:
        loader = frame.drt.loader(batch_size=50, seed=3, collate=list)
        return [int(r["x"][0]) for batch in loader for r in batch]

    frame = cache.metadata
    other = frame.with_columns(pl.col("sample_id").cast(dtype))
    assert draws(other) == draws(frame)
    too_far = other.with_columns(pl.col("sample_id") + 300)
    with pytest.raises(MetadataError, match="is not a sample of cache"):
        too_far.drt.loader(batch_size=50)
