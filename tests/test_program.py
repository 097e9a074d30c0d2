"""Sampling as a program: schedules over the run, re-weights from the loop, and seen()."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import numpy as np
import polars as pl
import pytest

import dataset_rt as drt
from dataset_rt import Phase
from dataset_rt.errors import ArgumentError, LoaderStateError, MetadataError, WeightError

SOURCES = {"web": 600, "code": 300, "books": 100}


@pytest.fixture
def frame() -> pl.DataFrame:
    """Three caches (one per source), with a per-sample quality score."""
    parts = []
    for source, n in SOURCES.items():
        cache = drt.cache(
            ((source, i) for i in range(n)),
            f"program-{source}",
            metadata=lambda r: {"source": r[0], "quality": 1.0 + r[1] % 4},
            progress=False,
        )
        parts.append(cache.metadata)
    return pl.concat(parts).drop("weight")


SHARES = [
    {"web": 0.2, "code": 0.2, "books": 0.6},
    {"web": 0.6, "code": 0.3, "books": 0.1},
    {"web": 0.1, "code": 0.8, "books": 0.1},
]


def three_phases(frame: pl.DataFrame) -> tuple[pl.DataFrame, list[Phase]]:
    """warm-up -> main -> anneal mixtures, each keeping the quality weights within sources."""
    frame = frame.with_columns(
        [
            pl.col("source").drt.mix(shares, weight="quality").alias(f"w{i}")
            for i, shares in enumerate(SHARES)
        ]
    )
    return frame, [Phase("w0", until=3_000), Phase("w1", until=9_000), Phase("w2")]


def chi2_p(counts: dict[str, int], shares: dict[str, float]) -> float:
    """The p-value of Pearson's chi-squared test for 3 categories (2 degrees of freedom)."""
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in shares.items())
    return math.exp(-stat / 2)  # the survival function of chi2 with 2 degrees of freedom


def stream(loader: drt.Loader, batches: int | None = None) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for i, batch in enumerate(loader):
        out.extend(batch)
        if batches is not None and i + 1 == batches:
            break
    return out


def seen_records(seen: pl.DataFrame, frame: pl.DataFrame) -> list[tuple[str, int]]:
    joined = seen.join(
        frame.select("cache_id", "sample_id", "source"), on=["cache_id", "sample_id"]
    )
    ordered = joined.sort("position")
    return list(zip(ordered["source"], ordered["sample_id"], strict=True))


def test_each_phase_draws_each_source_its_share(frame: pl.DataFrame) -> None:
    frame, phases = three_phases(frame)
    # Phases end at draws 300k and 600k; 1M draws per epoch, so the run's first epoch
    # spans all three.
    phases = [Phase("w0", until=300_000), Phase("w1", until=600_000), Phase("w2")]
    loader = frame.drt.loader(batch_size=1000, seed=5, num_samples=1_000_000, schedule=phases)
    seen = loader.seen(all_ranks=True).join(
        frame.select("cache_id", "sample_id", "source"), on=["cache_id", "sample_id"]
    )
    assert seen.height == 1_000_000
    bounds = [(0, 300_000), (300_000, 600_000), (600_000, 1_000_000)]
    for i, (low, high) in enumerate(bounds):
        part = seen.filter(pl.col("position").is_between(low, high, closed="left"))
        assert set(part["phase"]) == {f"phase {i}"}
        counts = dict(part.group_by("source").len().rows())
        assert chi2_p(counts, SHARES[i]) > 0.01, (i, counts)
    # Within a source, samples are drawn by quality: quality 4 about 4x quality 1.
    web = seen.filter(pl.col("source") == "web").join(
        frame.select("cache_id", "sample_id", "quality"), on=["cache_id", "sample_id"]
    )
    by_quality = dict(web.group_by("quality").len().rows())
    assert by_quality[4.0] / by_quality[1.0] == pytest.approx(4.0, rel=0.05)


def test_seen_is_what_the_loader_yields_and_phases_span_epochs(frame: pl.DataFrame) -> None:
    frame, phases = three_phases(frame)
    loader = frame.drt.loader(batch_size=100, seed=1, schedule=phases, collate=list)
    assert len(loader) == 10  # 1,000 draws per epoch: the phases end in epochs 3 and 9
    for epoch in range(11):
        got = stream(loader)
        seen = loader.seen(epoch=epoch)
        assert got == seen_records(seen, frame)
        phase = {0: "phase 0", 3: "phase 1", 9: "phase 2"}.get(epoch)
        if phase is not None:
            assert set(seen["phase"]) == {phase}
    # seen() steps and ranks: step 3 of rank 1 of 2 is positions 601, 603, ..., 799.
    two = frame.drt.loader(batch_size=100, rank=1, world_size=2, seed=1, schedule=phases)
    step = two.seen(3)
    assert step["position"].to_list() == list(range(601, 800, 2))
    assert set(step["step"]) == {3} and set(step["rank"]) == {1}


def test_a_blend_moves_the_shares_linearly(frame: pl.DataFrame) -> None:
    frame, _ = three_phases(frame)
    phases = [Phase("w0", until=100_000, to="w2"), Phase("w2")]
    loader = frame.drt.loader(batch_size=1000, seed=2, num_samples=200_000, schedule=phases)
    seen = loader.seen(all_ranks=True).join(
        frame.select("cache_id", "sample_id", "source"), on=["cache_id", "sample_id"]
    )
    for quarter in range(4):
        low = quarter * 25_000
        t = (quarter + 0.5) / 4  # the blend's mean progress over the quarter
        part = seen.filter(pl.col("position").is_between(low, low + 25_000, closed="left"))
        expected = {k: (1 - t) * SHARES[0][k] + t * SHARES[2][k] for k in SOURCES}
        counts = dict(part.group_by("source").len().rows())
        assert chi2_p(counts, expected) > 0.01, (quarter, counts, expected)
    after = seen.filter(pl.col("position") >= 100_000)
    assert chi2_p(dict(after.group_by("source").len().rows()), SHARES[2]) > 0.01


def test_a_single_phase_draws_what_the_plain_loader_draws(frame: pl.DataFrame) -> None:
    frame = frame.with_columns(weight=pl.col("quality"))
    plain = frame.drt.loader(batch_size=64, seed=7, collate=list)
    scheduled = frame.drt.loader(batch_size=64, seed=7, collate=list, schedule=[Phase("quality")])
    for _ in range(2):
        assert stream(plain) == stream(scheduled)


@pytest.mark.parametrize("workers", [0, 2])
def test_resuming_anywhere_continues_the_stream_at_any_world_size(
    frame: pl.DataFrame, workers: int, tmp_path: Any
) -> None:
    frame, _ = three_phases(frame)
    # Epochs of 1,000 draws in batches of 24: phase 1 starts on a batch boundary (epoch 1,
    # batch 20: batch 62 of the run), the blend ends mid-batch, and a re-weight starts at
    # batch 30 of epoch 0.
    phases = [Phase("w0", until=1_480), Phase("w1", until=2_410, to="w2"), Phase("w2")]
    options: dict[str, Any] = {
        "seed": 4,
        "schedule": phases,
        "collate": list,
        "history": tmp_path / "history",
    }
    books = frame["source"].eq("books").cast(pl.Float64) + 0.1

    def loader(**more: Any) -> drt.Loader:
        return frame.drt.loader(**{"batch_size": 24, **options, **more})

    whole = loader()
    whole.reweight(books, step=30)
    expected = {e: seen_records(whole.seen(epoch=e, all_ranks=True), frame) for e in range(4)}
    rng = random.Random(0)
    stops = [1, 29, 30, 31, 61, 62, 63] + [rng.randrange(64, 160) for _ in range(2)]
    for stop in [30, 62, 63, stops[-1]] if workers else stops:
        one = loader(num_workers=workers)
        one.reweight(books, step=30)
        got: dict[int, dict[int, tuple[str, int]]] = {}
        done = 0
        while done < stop:
            done += read(one, got, rank=0, world=1, batches=stop - done)
        state = one.state_dict()
        for world, batches in ((2, 7), (3, None)):
            states = []
            for rank in range(world):
                part = loader(batch_size=8, rank=rank, world_size=world, num_workers=workers)
                part.load_state_dict(state)
                read(part, got, rank=rank, world=world, batches=batches)
                states.append(part.state_dict())
            assert all(s == states[0] for s in states)
            state = states[0]
        for e, records in got.items():
            drawn = [records[p] for p in sorted(records) if p < 1000]
            assert drawn == expected[e][: len(drawn)], (stop, e)
            assert len(drawn) == 1000 or e == state["epoch"], (stop, e)


def read(
    loader: drt.Loader,
    got: dict[int, dict[int, tuple[str, int]]],
    *,
    rank: int,
    world: int,
    batches: int | None,
) -> int:
    """Reads up to ``batches`` batches of one epoch, filing each record under its epoch
    and global position (rank ``r``'s record ``j`` of a batch read at cursor ``c`` is
    position ``c + r + world * j``); returns the batches read."""
    it = iter(loader)
    before = loader.state_dict()
    count = 0
    for batch in it:
        for j, r in enumerate(batch):
            got.setdefault(before["epoch"], {})[before["position"] + rank + world * j] = r
        count += 1
        if batches is not None and count == batches:
            break
        before = loader.state_dict()
    return count


def test_reweight_takes_effect_at_its_step_and_resumes_from_the_history(
    frame: pl.DataFrame, tmp_path: Any
) -> None:
    frame = frame.with_columns(weight=pl.col("quality"))
    options: dict[str, Any] = {"seed": 9, "collate": list, "history": tmp_path / "history"}
    loader = frame.drt.loader(batch_size=50, **options)
    before = loader.seen()
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    # Only books from step 6 on, decided while the loader is iterating (batches read
    # ahead are dropped): steps 3-5 keep the old weights.
    books = frame.with_columns(weight=(pl.col("source") == "books").cast(pl.Float64))
    loader.reweight(books, step=6)
    batches += list(it)
    seen = loader.seen()
    assert [r for b in batches for r in b] == seen_records(seen, frame)
    early = pl.col("step") < 6
    assert (
        seen.filter(early)
        .drop("version", "phase")
        .equals(before.filter(early).drop("version", "phase"))
    )
    assert set(seen.filter(~early)["cache_id"]) == set(
        frame.filter(pl.col("source") == "books")["cache_id"]
    )
    assert seen.filter(~early)["version"].unique().to_list() == [1]
    # A second re-weight from the next epoch: a plain vector of weights, in frame order.
    code = (frame["source"] == "code").cast(pl.Float64).to_numpy()
    loader.reweight(code)
    state = loader.state_dict()
    assert len(repr(state)) < 400
    epoch1 = stream(loader)
    assert {r[0] for r in epoch1} == {"code"}
    # A fresh loader over the same frame resumes after both re-weights from the state.
    fresh = frame.drt.loader(batch_size=50, **options)
    fresh.load_state_dict(state)
    assert fresh.seen(epoch=0).equals(seen)
    assert stream(fresh) == epoch1


def test_bad_schedules_and_reweights_are_refused(frame: pl.DataFrame, tmp_path: Any) -> None:
    frame = frame.with_columns(weight=pl.col("quality"), neg=-pl.col("quality"))
    with pytest.raises(MetadataError, match=r"schedule\[1\].weights \(anneal\).*no column 'nope'"):
        frame.drt.loader(8, schedule=[Phase("weight", until=10), Phase("nope", name="anneal")])
    with pytest.raises(ArgumentError, match=r"schedule\[1\] ends at draw 5, not after its start"):
        frame.drt.loader(
            8, schedule=[Phase("weight", until=10), Phase("weight", until=5), Phase("weight")]
        )
    with pytest.raises(ArgumentError, match=r"schedule\[0\] has no 'until' but is not the last"):
        frame.drt.loader(8, schedule=[Phase("weight"), Phase("weight")])
    with pytest.raises(ArgumentError, match="needs 'until'"):
        frame.drt.loader(8, schedule=[Phase("weight", to="quality")])
    with pytest.raises(
        WeightError, match=r"schedule\[1\].weights \(phase 1\).*holds -1 at sample_id 0"
    ):
        frame.drt.loader(8, schedule=[Phase("weight", until=10), Phase("neg")])
    with pytest.raises(WeightError, match=r"schedule\[0\].to.*sums to zero"):
        frame.drt.loader(
            8, schedule=[Phase("weight", until=10, to=pl.col("quality") * 0), Phase("weight")]
        )
    with pytest.raises(ArgumentError, match="non-empty list"):
        frame.drt.loader(8, schedule=Phase("weight"))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="needs shuffle=True"):
        frame.drt.loader(8, shuffle=False, schedule=[Phase("weight")])

    loader = frame.drt.loader(8, seed=1, history=tmp_path / "h")
    state = loader.state_dict()
    links = frame.select("cache_id", "sample_id", "weight")
    stranger = pl.DataFrame(
        {"cache_id": ["f" * 32], "sample_id": [0], "weight": [1.0]}, schema=links.schema
    )
    with pytest.raises(MetadataError, match="1 row\\(s\\) the loader does not have"):
        loader.reweight(pl.concat([links, stranger]))
    with pytest.raises(MetadataError, match="have no weight in the re-weight frame"):
        loader.reweight(frame.select("cache_id", "sample_id", "weight").head(10))
    with pytest.raises(WeightError, match="reweight: weight column 'weight' holds NaN"):
        loader.reweight([*frame["weight"].to_list()[:-1], float("nan")])
    with pytest.raises(WeightError, match="reweight: 999 weights for a loader of 1000 rows"):
        loader.reweight(np.ones(999))
    _ = next(iter(loader))
    with pytest.raises(ArgumentError, match="step 0 of epoch 0 has been drawn already"):
        loader.reweight(np.ones(1000), step=0)
    assert loader.state_dict() == {**state, "position": 8}
    # States of another schedule or history.
    scheduled = frame.drt.loader(8, seed=1, schedule=[Phase("weight", until=10), Phase("quality")])
    with pytest.raises(LoaderStateError, match="plan"):
        scheduled.load_state_dict(state)
    loader.reweight(np.ones(1000))
    moved = loader.state_dict()
    other = frame.drt.loader(8, seed=1, history=tmp_path / "elsewhere")
    with pytest.raises(LoaderStateError, match="cannot be read"):
        other.load_state_dict(moved)
    assert "history" not in other.state_dict()
    (table,) = (tmp_path / "h").glob("weights-*.bin")
    table.write_bytes(table.read_bytes()[:-4] + b"\0\0\0\1")
    same = frame.drt.loader(8, seed=1, history=tmp_path / "h")
    with pytest.raises(LoaderStateError, match="damaged"):
        same.load_state_dict(moved)


TORCHRUN_SCRIPT = """
import json, os
import polars as pl
import torch.distributed as dist
import dataset_rt as drt
from dataset_rt import Phase

dist.init_process_group("gloo")
rank = dist.get_rank()
frame = pl.concat([drt.open(f"program-{s}").metadata for s in ("web", "code", "books")])
shares = json.loads(os.environ["SHARES"])
frame = frame.with_columns(
    [pl.col("source").drt.mix(s, weight="quality").alias(f"w{i}") for i, s in enumerate(shares)]
)
schedule = [Phase("w0", until=3_000), Phase("w1", until=6_000), Phase("w2")]
loader = frame.drt.loader(
    batch_size=50, seed=3, num_samples=3_000, schedule=schedule, collate=list, num_workers=2
)
records = []
for epoch in range(3):
    records += [list(r) for batch in loader for r in batch]
seen = pl.concat([loader.seen(epoch=e) for e in range(3)])
seen.write_parquet(f"seen-{rank}.parquet")
print(json.dumps({"rank": rank, "records": records}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_torchrun_ranks_see_the_global_scheduled_stream(frame: pl.DataFrame, tmp_path: Any) -> None:
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "SHARES": json.dumps(SHARES), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [*command, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ranks = [pl.read_parquet(tmp_path / f"seen-{r}.parquet") for r in range(2)]
    for out in outputs:
        # What each rank trained on is what its seen() says.
        mine = ranks[out["rank"]].join(
            frame.select("cache_id", "sample_id", "source"), on=["cache_id", "sample_id"]
        )
        ordered = mine.sort("epoch", "position")
        assert [tuple(r) for r in out["records"]] == list(
            zip(ordered["source"], ordered["sample_id"], strict=True)
        )
    # Both ranks' frames, together, are the global stream of the same loader on one process.
    frame, _ = three_phases(frame)
    schedule = [Phase("w0", until=3_000), Phase("w1", until=6_000), Phase("w2")]
    one = frame.drt.loader(batch_size=50, seed=3, num_samples=3_000, schedule=schedule)
    whole = pl.concat([one.seen(epoch=e, all_ranks=True) for e in range(3)])
    both = pl.concat(ranks).sort("epoch", "position")
    columns = ["epoch", "position", "cache_id", "sample_id", "phase"]
    assert both.select(columns).equals(whole.select(columns))
    # Exposure per source in each phase (one epoch each) follows the schedule.
    exposure = both.join(
        frame.select("cache_id", "sample_id", "source"), on=["cache_id", "sample_id"]
    )
    for i, shares in enumerate(SHARES):
        counts = dict(exposure.filter(pl.col("epoch") == i).group_by("source").len().rows())
        assert chi2_p(counts, shares) > 0.01, (i, counts)


def test_the_epoch_preview_draws_what_the_scheduled_loader_draws(frame: pl.DataFrame) -> None:
    frame, _ = three_phases(frame)
    phases = [Phase("w0", until=1_500, to="w2"), Phase("w1")]
    loader = frame.drt.loader(batch_size=100, seed=6, schedule=phases)
    for epoch in (0, 1, 2):
        preview = frame.drt.epoch(seed=6, epoch=epoch, schedule=phases)
        seen = loader.seen(epoch=epoch, all_ranks=True)
        assert preview["draw"].to_list() == seen["position"].to_list()
        assert preview.select("cache_id", "sample_id", "phase").equals(
            seen.select("cache_id", "sample_id", "phase")
        )
    with pytest.raises(ArgumentError, match="apply to shuffled epochs"):
        frame.drt.epoch(shuffle=False, schedule=phases)


def test_reweights_keep_padding_draws_and_clean_up_after_themselves(
    frame: pl.DataFrame, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataset_rt import reweights

    frame = frame.with_columns(weight=pl.col("quality"))
    options: dict[str, Any] = {"seed": 3, "collate": list, "history": tmp_path / "h"}
    # 1,001 draws on 2 ranks: rank 1's last draw pads the epoch (position 1,001).
    loader = frame.drt.loader(8, num_samples=1001, rank=1, world_size=2, **options)
    list(loader)
    before = loader.seen()
    assert before["position"].max() == 1001
    loader.reweight(np.ones(1000))  # from the next epoch: the padding draw stays as drawn
    assert loader.seen().equals(before.with_columns(pl.lit(0, pl.UInt32).alias("version")))
    # A re-weight that replaces every segment is version 1 in seen().
    fresh = frame.drt.loader(8, **options)
    fresh.reweight(np.ones(1000))
    assert fresh.seen(0)["version"].to_list() == [1] * 8
    # Weights that each fit but whose sum does not are refused, not drawn uniformly.
    with pytest.raises(WeightError, match="sums to inf"):
        fresh.reweight(np.full(1000, 1e307))
    # A null weight in a frame is a bad weight, whatever the frame's order.
    nulls = frame.select("cache_id", "sample_id", weight=pl.lit(None, pl.Float64))
    for candidate in (nulls, nulls.reverse()):
        with pytest.raises(WeightError, match="is null at sample_id"):
            fresh.reweight(candidate)
    # Only the tables of the last two programs stay in RAM.
    for i in range(4):
        fresh.reweight(np.arange(1000) % (i + 2) + 1.0)
    assert len(os.listdir(fresh._weights._scratch())) <= 2
    # A history copy that fails is retried, and no state names it until it succeeds.
    calls = []
    original = reweights.commit_reweight

    def failing(*args: Any) -> None:
        calls.append(args)
        raise ArgumentError("the re-weight could not be saved (disk full)")

    monkeypatch.setattr(reweights, "commit_reweight", failing)
    fresh.reweight(np.ones(1000))
    for _ in range(2):
        with pytest.raises(ArgumentError, match="disk full"):
            fresh.state_dict()
    monkeypatch.setattr(reweights, "commit_reweight", original)
    state = fresh.state_dict()
    assert (tmp_path / "h" / f"reweight-{state['history']}.json").is_file()
    again = frame.drt.loader(8, **options)
    again.load_state_dict(state)
    assert again.seen(0).equals(fresh.seen(0))
