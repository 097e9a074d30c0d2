"""Token caches and the packed loader: documents of ids joined and cut into fixed rows."""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

import dataset_rt as drt
from dataset_rt.errors import (
    ArgumentError,
    DatasetRTError,
    LoaderStateError,
    MetadataError,
    SerializationError,
)


def documents(n: int, seed: int = 0, high: int = 50_000) -> list[np.ndarray]:
    """Documents of 1 to 40 ids; document i starts with id i, so each is recognisable."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        doc = rng.integers(0, high, size=int(rng.integers(1, 40)), dtype=np.int64)
        doc[0] = i
        docs.append(doc)
    return docs


@pytest.fixture
def corpus() -> tuple[drt.Cache, list[np.ndarray]]:
    docs = documents(300)
    cache = drt.cache(
        docs,
        "tokens-corpus",
        serializer="tokens",
        metadata=lambda d: {"source": "code" if int(d[0]) % 3 == 0 else "web"},
        progress=False,
    )
    return cache, docs


def expected_stream(
    frame: pl.DataFrame,
    docs: dict[tuple[str, int], np.ndarray],
    *,
    seed: int = 0,
    epoch: int = 0,
    separator: int | None = None,
) -> np.ndarray:
    """An epoch's token stream, from the draws alone: the reference the loader must match.

    Twice the frame's draws: an epoch may read past its own when they are short.
    """
    drawn = frame.drt.epoch(seed=seed, epoch=epoch, num_samples=2 * frame.height)
    parts = []
    for cache_id, sample_id in drawn.select("cache_id", "sample_id").iter_rows():
        parts.append(docs[(cache_id, sample_id)])
        if separator is not None:
            parts.append(np.array([separator]))
    return np.concatenate(parts)


def expected_rows(
    frame: pl.DataFrame,
    docs: dict[tuple[str, int], np.ndarray],
    *,
    seq_len: int,
    separator: int | None = None,
    **draws: int,
) -> list[np.ndarray]:
    """Every row (with its target) that an epoch's tokens hold."""
    stream = expected_stream(frame, docs, separator=separator, **draws)
    tokens = int(frame["length"].sum()) + frame.height * (separator is not None)
    count = (tokens - 1) // seq_len
    return [stream[j * seq_len : j * seq_len + seq_len + 1] for j in range(count)]


def by_id(cache: drt.Cache, docs: list[np.ndarray]) -> dict[tuple[str, int], np.ndarray]:
    return {(cache.cache_id, i): d for i, d in enumerate(docs)}


def rows_of(batches: list[dict[str, Any]]) -> list[np.ndarray]:
    """Each row's window: its inputs and the last target."""
    out = []
    for batch in batches:
        ids = np.asarray(batch["input_ids"])
        labels = np.asarray(batch["labels"])
        out.extend(np.concatenate([ids[i], labels[i, -1:]]) for i in range(len(ids)))
    return out


def test_token_records_keep_ids_in_the_narrowest_type_and_record_lengths() -> None:
    docs = [[1, 2, 3], np.array([70_000, 5], dtype=np.int64), np.array([-4, 9], np.int32)]
    cache = drt.cache(docs, "tokens-types", serializer="tokens", progress=False)
    got = [cache.get(i) for i in range(3)]
    assert [g.dtype.name for g in got] == ["uint16", "uint32", "int32"]
    assert [g.tolist() for g in got] == [[1, 2, 3], [70_000, 5], [-4, 9]]
    assert cache.metadata["length"].to_list() == [3, 2, 2]
    assert cache.serializer == "tokens"
    fixed = drt.cache(
        [np.arange(5, dtype=np.uint16)], "tokens-fixed", serializer="tokens:uint32", progress=False
    )
    assert fixed.get(0).dtype.name == "uint32"


@pytest.mark.parametrize(
    ("document", "serializer", "message"),
    [
        (np.array([1.5, 2.0]), "tokens", "must be integers"),
        (np.zeros((2, 3), dtype=np.int64), "tokens", "one-dimensional"),
        (np.array([], dtype=np.int64), "tokens", "empty"),
        (np.array([-1, 2]), "tokens:uint32", "token id -1 does not fit"),
        (np.array([70_000]), "tokens:uint16", "token id 70000 does not fit"),
        ([[1, 2], [3]], "tokens", "integer ids"),
        ("text", "tokens", "NumPy array or a list"),
    ],
)
def test_bad_documents_are_refused_and_leave_no_cache(
    document: Any, serializer: str, message: str
) -> None:
    with pytest.raises(SerializationError, match=message):
        drt.cache([[1, 2], document], "tokens-bad", serializer=serializer, progress=False)
    assert "tokens-bad" not in [c.name for c in drt.list_caches()]


def test_an_unknown_token_type_is_refused() -> None:
    with pytest.raises(ArgumentError, match="token type must be one of"):
        drt.cache([[1]], "tokens-unknown", serializer="tokens:float32", progress=False)


@pytest.mark.parametrize("separator", [None, 50_001])
def test_packed_rows_are_the_drawn_documents_joined_and_cut(
    corpus: tuple[drt.Cache, list[np.ndarray]], separator: int | None
) -> None:
    cache, docs = corpus
    frame = cache.metadata
    loader = frame.drt.loader(4, seq_len=16, seed=3, separator=separator)
    batches = list(loader)
    expected = expected_rows(frame, by_id(cache, docs), seed=3, seq_len=16, separator=separator)
    assert len(batches) == len(loader) == len(expected) // 4
    got = rows_of(batches)
    assert len(got) == len(batches) * 4
    for row, want in zip(got, expected[: len(got)], strict=True):
        np.testing.assert_array_equal(row, want)
    first = batches[0]
    assert first["input_ids"].shape == (4, 16) and first["labels"].shape == (4, 16)
    assert str(first["input_ids"].dtype) == "torch.int64"


def test_ranks_split_the_steps_and_another_epoch_draws_anew(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, docs = corpus
    frame = cache.metadata
    per_rank = [
        rows_of(list(frame.drt.loader(2, seq_len=8, rank=r, world_size=3))) for r in range(3)
    ]
    assert len({len(rows) for rows in per_rank}) == 1  # every rank runs the same steps
    interleaved = [
        row
        for step in range(len(per_rank[0]) // 2)
        for rank in range(3)
        for row in per_rank[rank][2 * step : 2 * step + 2]
    ]
    expected = expected_rows(frame, by_id(cache, docs), seq_len=8)
    for row, want in zip(interleaved, expected, strict=False):
        np.testing.assert_array_equal(row, want)
    loader = frame.drt.loader(2, seq_len=8)
    first, second = rows_of(list(loader)), rows_of(list(loader))
    assert loader.epoch == 1
    for row, want in zip(
        second, expected_rows(frame, by_id(cache, docs), epoch=1, seq_len=8), strict=False
    ):
        np.testing.assert_array_equal(row, want)
    assert not all(np.array_equal(a, b) for a, b in zip(first, second, strict=False))


def test_document_ids_number_the_documents_within_each_row(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, _ = corpus
    batch = next(iter(cache.metadata.drt.loader(3, seq_len=64, separator=0, documents=True)))
    ids, doc_ids = batch["input_ids"].numpy(), batch["document_ids"].numpy()
    for row, numbers in zip(ids, doc_ids, strict=True):
        assert numbers[0] == 0 and (np.diff(numbers) >= 0).all()
        # A new document starts right after each separator (id 0 here).
        ends = np.flatnonzero(row[:-1] == 0)
        assert (numbers[ends + 1] == numbers[ends] + 1).all()


def test_no_targets_gives_plain_rows(corpus: tuple[drt.Cache, list[np.ndarray]]) -> None:
    cache, docs = corpus
    batches = list(cache.metadata.drt.loader(2, seq_len=10, targets=False, shuffle=False))
    assert set(batches[0]) == {"input_ids"}
    stream = np.concatenate(docs)
    got = np.concatenate([b["input_ids"].numpy().reshape(-1) for b in batches])
    np.testing.assert_array_equal(got, stream[: len(got)])
    assert len(stream) - len(got) < 2 * 10  # only the tail that fills no step is left


@pytest.mark.parametrize("seed", range(4))
def test_a_resumed_loader_continues_the_stream_at_any_world_size_and_row_length(
    corpus: tuple[drt.Cache, list[np.ndarray]], seed: int
) -> None:
    cache, docs = corpus
    frame = cache.metadata
    rng = random.Random(seed)
    loader = frame.drt.loader(2, seq_len=8, seed=seed)
    batches = iter(loader)
    taken = rows_of([next(batches) for _ in range(rng.randrange(1, 10))])
    state = loader.state_dict()
    assert state["token"] == len(taken) * 8
    # Another world size and row length continue the same stream from that token.
    resumed = []
    for rank in range(2):
        other = frame.drt.loader(3, seq_len=5, seed=seed, rank=rank, world_size=2)
        other.load_state_dict(state)
        resumed.append(rows_of(list(other)))
    stream = expected_stream(frame, by_id(cache, docs), seed=seed)
    start = len(taken) * 8
    for step in range(len(resumed[0]) // 3):
        for rank in range(2):
            for i in range(3):
                j = (step * 2 + rank) * 3 + i
                np.testing.assert_array_equal(
                    resumed[rank][step * 3 + i], stream[start + 5 * j : start + 5 * j + 6]
                )
    assert len(resumed[0]) == len(resumed[1]) > 0


def test_a_state_at_the_epoch_end_resumes_in_the_next_epoch(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, _ = corpus
    loader = cache.metadata.drt.loader(4, seq_len=16)
    list(loader)
    fresh = cache.metadata.drt.loader(4, seq_len=16)
    fresh.load_state_dict(loader.state_dict())
    resumed = list(fresh)
    assert fresh.epoch == 1 and len(resumed) == len(fresh)
    np.testing.assert_array_equal(resumed[0]["input_ids"], next(iter(loader))["input_ids"])


def test_compressed_token_caches_pack_the_same_rows() -> None:
    docs = documents(120, seed=5)
    plain = drt.cache(docs, "tokens-plain", serializer="tokens", progress=False)
    packed = drt.cache(docs, "tokens-zstd", serializer="tokens", compression="zstd", progress=False)
    a = list(plain.metadata.drt.loader(2, seq_len=12, seed=1, verify=True))
    b = list(packed.metadata.drt.loader(2, seq_len=12, seed=1, verify=True))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])


def test_weights_and_schedules_choose_the_documents(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, _ = corpus
    frame = cache.metadata.with_columns(
        only_code=(pl.col("source") == "code").cast(pl.Float64),
        only_web=(pl.col("source") == "web").cast(pl.Float64),
    )
    loader = frame.drt.loader(
        4,
        seq_len=32,
        separator=60_000,
        schedule=[drt.Phase("only_code", until=150), drt.Phase("only_web")],
    )
    starts = []
    for batch in loader:
        row = batch["input_ids"].numpy().reshape(-1)
        starts.extend(row[np.flatnonzero(row[:-1] == 60_000) + 1].tolist())
    sources = dict(frame.select("sample_id", "source").iter_rows())
    assert {sources[s] for s in starts[:20]} == {"code"}
    assert {sources[s] for s in starts[-20:]} == {"web"}


def test_bad_loader_input_is_refused(corpus: tuple[drt.Cache, list[np.ndarray]]) -> None:
    cache, _ = corpus
    frame = cache.metadata
    with pytest.raises(ArgumentError, match="seq_len must be at least 1"):
        frame.drt.loader(2, seq_len=0)
    with pytest.raises(ArgumentError, match="fewer than one step takes"):
        frame.drt.loader(64, seq_len=4096)
    fixed = drt.cache(
        [np.arange(1, 9, dtype=np.uint16)], "tokens-u16", serializer="tokens:uint16", progress=False
    )
    with pytest.raises(ArgumentError, match="separator 70000 is outside the token type uint16"):
        fixed.metadata.drt.loader(1, seq_len=4, separator=70_000)
    records = drt.cache(range(10), "tokens-not", progress=False)
    with pytest.raises(ArgumentError, match="serializer 'pickle'.*token caches"):
        records.metadata.drt.loader(1, seq_len=4)
    with pytest.raises(MetadataError, match="length column"):
        frame.drop("length").drt.loader(1, seq_len=4)
    with pytest.raises(MetadataError, match="row 3 of the frame has length 0"):
        frame.with_columns(
            length=pl.when(pl.int_range(pl.len()) == 3).then(0).otherwise(pl.col("length"))
        ).drt.loader(1, seq_len=4)
    lying = frame.with_columns(length=pl.col("length") + 1).drt.loader(2, seq_len=8)
    with pytest.raises(DatasetRTError, match="holds .* tokens but the loader's frame gives it"):
        next(iter(lying))
    loader = frame.drt.loader(2, seq_len=8)
    with pytest.raises(LoaderStateError, match="not a dataset_rt packed loader state"):
        loader.load_state_dict(frame.drt.loader(2).state_dict())
    other = frame.drt.loader(2, seq_len=8, separator=1)
    with pytest.raises(LoaderStateError, match="the state's plan"):
        loader.load_state_dict(other.state_dict())


@pytest.mark.parametrize("separator", [None, 50_001])
def test_seen_names_the_documents_behind_every_row(
    corpus: tuple[drt.Cache, list[np.ndarray]], separator: int | None
) -> None:
    cache, docs = corpus
    frame = cache.metadata
    loader = frame.drt.loader(3, seq_len=20, seed=4, separator=separator, rank=1, world_size=2)
    batches = list(loader)
    loader.set_epoch(0)
    seen = loader.seen()
    assert seen["step"].max() == len(batches) - 1 and set(seen["rank"]) == {1}
    for (step, row), pieces in seen.group_by(["step", "row"], maintain_order=True):
        ids = []
        for sample_id, offset, tokens in pieces.select("sample_id", "offset", "tokens").iter_rows():
            doc = docs[sample_id]
            if separator is not None:
                doc = np.append(doc, separator)
            ids.append(doc[offset : offset + tokens])
        np.testing.assert_array_equal(np.concatenate(ids), batches[step]["input_ids"][row])
    everyone = loader.seen(range(2, 4), all_ranks=True)
    assert set(everyone["rank"]) == {0, 1} and set(everyone["step"]) == {2, 3}
    assert everyone.filter(rank=1).equals(loader.seen(range(2, 4)))


def test_workers_pack_the_same_batches_and_resume_alike(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, _ = corpus
    frame = cache.metadata
    alone = list(frame.drt.loader(3, seq_len=16, seed=2, documents=True))
    loader = frame.drt.loader(3, seq_len=16, seed=2, documents=True, num_workers=2)
    batches = iter(loader)
    first = [next(batches) for _ in range(5)]
    state = loader.state_dict()
    del batches
    resumed = frame.drt.loader(3, seq_len=16, seed=2, documents=True, num_workers=1)
    resumed.load_state_dict(state)
    together = first + list(resumed)
    assert len(together) == len(alone)
    for a, b in zip(alone, together, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_parallel_builds_and_appends_write_the_same_token_records() -> None:
    docs = documents(200, seed=8)
    one = drt.cache(docs, "tokens-one", serializer="tokens", progress=False)
    two = drt.cache(docs, "tokens-two", serializer="tokens", num_proc=2, progress=False)
    assert one.metadata.drop("cache_id").equals(two.metadata.drop("cache_id"))
    assert all(np.array_equal(one.get(i), two.get(i)) for i in range(0, 200, 7))
    grown = drt.append("tokens-one", documents(5, seed=9), progress=False)
    assert grown.metadata["length"].to_list()[-5:] == [len(d) for d in documents(5, seed=9)]
    np.testing.assert_array_equal(grown.get(202), documents(5, seed=9)[2])


def test_reweighting_mid_epoch_changes_the_documents_from_that_step_and_resumes(
    corpus: tuple[drt.Cache, list[np.ndarray]], tmp_path: Any
) -> None:
    cache, _ = corpus
    frame = cache.metadata
    code = (frame["source"] == "code").cast(pl.Float64)
    sources = dict(frame.select("sample_id", "source").iter_rows())

    def starts(batch: dict[str, Any]) -> list[str]:
        """The sources of the documents that start in a batch (after a separator)."""
        row = batch["input_ids"].numpy().reshape(-1)
        return [sources[int(s)] for s in row[np.flatnonzero(row[:-1] == 60_000) + 1]]

    options = {"seq_len": 32, "separator": 60_000, "seed": 6, "history": tmp_path}
    loader = frame.drt.loader(4, **options)
    batches = iter(loader)
    before = [next(batches) for _ in range(3)]
    loader.reweight(code, step=5)
    with pytest.raises(ArgumentError, match="consumed already"):
        loader.reweight(code, step=2)
    after = [next(batches) for _ in range(6)]
    assert "web" in {s for b in before for s in starts(b)}
    assert set(starts(after[3])) | set(starts(after[4])) == {"code"}
    state_at_4 = None
    fresh = frame.drt.loader(4, **options)
    it = iter(fresh)
    for _ in range(4):
        next(it)
    fresh.reweight(code, step=5)
    state_at_4 = fresh.state_dict()
    assert "history" in state_at_4
    resumed = frame.drt.loader(4, **options)
    resumed.load_state_dict(state_at_4)
    again = list(zip(range(5), resumed, strict=False))
    for (_, a), b in zip(again, after[1:], strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    seen = resumed.seen(range(5, 7))
    assert set(
        seen.filter(pl.col("offset") == 0)["sample_id"].map_elements(
            sources.get, return_dtype=pl.String
        )
    ) == {"code"}


def test_a_loader_over_an_unchanged_scan_maps_the_saved_plan_and_packs_the_same(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, _ = corpus
    read = list(cache.metadata.drt.loader(4, seq_len=16, seed=7))
    frame = cache.scan()
    # The saved plan holds the documents' lengths and their sum: making the loader reads
    # nothing of the table, so it starts in the same time at any size.
    table = Path(drt._native.metadata_table_file(cache.path, live_version(cache)))
    aside = table.with_suffix(".aside")
    table.rename(aside)
    try:
        scanned = frame.drt.loader(4, seq_len=16, seed=7)
        assert scanned._plan.endswith(".plan")  # the version's own plan, not a copy
        a = list(scanned)
    finally:
        aside.rename(table)
    assert len(a) == len(read) > 0
    for x, y in zip(a, read, strict=True):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])


def test_a_packed_loader_keeps_its_plan_mapped_between_epochs_and_lets_it_go_with_it(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    # The next epoch's stream then shares the mapping and the pages the last one touched.
    cache, _ = corpus
    loader = cache.metadata.drt.loader(4, seq_len=16, seed=7)
    plan = Path(loader._plan)  # its own, in a scratch directory

    def mapped() -> int:
        with open("/proc/self/maps") as maps:
            return sum(line.rstrip("\n").endswith(str(plan)) for line in maps)

    first = [b["input_ids"] for b in loader]
    assert mapped() == 1
    second = [b["input_ids"] for b in loader]
    assert mapped() == 1
    assert len(first) == len(second) > 0
    assert any((a != b).any() for a, b in zip(first, second, strict=True))  # another epoch
    del loader
    gc.collect()
    assert mapped() == 0


def live_version(cache: drt.Cache) -> int:
    return int(cache.metadata_versions().filter(pl.col("live"))["version"][0])


def test_saved_versions_of_a_token_cache_keep_their_lengths_in_the_plan(
    corpus: tuple[drt.Cache, list[np.ndarray]],
) -> None:
    cache, docs = corpus
    edited = cache.metadata.filter(pl.col("source") == "code").with_columns(weight=pl.col("length"))
    cache.save_metadata(edited)
    scanned = cache.scan().drt.loader(2, seq_len=8, seed=3)
    assert scanned._plan.endswith(".plan")
    got = rows_of(list(scanned))
    expected = expected_rows(edited, by_id(cache, docs), seq_len=8, seed=3)
    assert len(got) == len(expected) // 2 * 2 > 0
    for row, want in zip(got, expected[: len(got)], strict=True):
        np.testing.assert_array_equal(row, want)
    # A length the records do not hold is refused when saved, naming the row; the version
    # before stays live.
    with pytest.raises(MetadataError, match="row 2 of the frame has length 0"):
        cache.save_metadata(
            edited.with_columns(
                length=pl.when(pl.int_range(pl.len()) == 2).then(0).otherwise(pl.col("length"))
            )
        )
    assert cache.metadata.height == edited.height
    # A version without the length column has a plan without lengths: a packed loader over
    # it asks for the column.
    cache.save_metadata(edited.drop("length"))
    with pytest.raises(MetadataError, match="length column"):
        cache.scan().drt.loader(2, seq_len=8)
