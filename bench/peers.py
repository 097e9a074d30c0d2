"""The systems bench/run.py compares: dataset_rt, two baselines and the peers, one class each.

Every system stores the same records (``{"image": uint8 array, "label": int, "caption": str}``)
in its own recommended format and reads them back as the same Python dictionaries with a
NumPy image. What each class does follows its project's documentation:

- ``mmap``: the simplest honest alternative — one flat file of pickles, a NumPy offsets
  array and a labels array beside it, read by slicing an ``mmap``. The baseline of every ratio.
- ``list``: a plain PyTorch map-style ``Dataset`` over an in-RAM list of pickled bytes, loaded
  from one file at start-up: the decode-bound ceiling.
- ``hf-datasets``: ``Dataset.from_generator`` with ``Array3D`` features, ``save_to_disk``,
  ``load_from_disk`` in NumPy format; batched reads through ``__getitems__``.
- ``litdata``: ``litdata.optimize`` into 64 MB chunks, ``StreamingDataset`` random access.
- ``mosaicml-streaming``: ``MDSWriter`` with an ``ndarray`` column, ``StreamingDataset``
  random access.
- ``lance``: ``lance.write_dataset`` with a fixed-size-list image column, batched ``take``.
- ``dataset-rt-0.4.8``: the original DatasetRT (PyPI ``dataset-rt``,
  github.com/Red-Eyed/DatasetRT), a different project with the same import name, so it runs
  in a virtual environment of its own (``bench/peer-env.sh``; ``System.python``). As its
  quickstart does: a ``CacheSource`` yielding ``CacheInput(pickle.dumps(record, protocol=5),
  {"label": ...})``, written by ``DatasetRuntime.write_cache`` with the default
  ``WriterConfig`` (serial, uncompressed: its default, 64 MiB shards); read by its own
  weighted sampler and ``to_torch_dataloader``.

The peers' loaders stream (LitData, MosaicML: chunk-shuffled iteration; Lance: scans); none
draws weighted samples with replacement. For the weighted random reads every peer is read
through its random-access API behind a map-style ``Dataset``, with the same draws. The
exceptions are the two with a weighted sampler of their own, dataset_rt and
dataset-rt-0.4.8: they read through it, from the same distribution (with replacement,
classes equally likely), and their own DataLoader integration does the "2 workers" pass.
"""

from __future__ import annotations

import abc
import functools
import importlib
import importlib.util
import mmap
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 256
CLASSES = (1, 2)
"""The two classes "filter and re-weight" keeps."""


@dataclass
class Workload:
    """Synthetic records, the same for every system: each is a function of its index."""

    name: str
    records: int
    shape: tuple[int, ...]
    draws: int
    seed: int = 0
    _pool: np.ndarray = field(init=False, repr=False)
    labels: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        size = int(np.prod(self.shape))
        self._pool = rng.integers(0, 256, size=(8 << 20) + size, dtype=np.uint8)
        skew = np.array([0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
        self.labels = rng.choice(10, size=self.records, p=skew).astype(np.int64)

    def record(self, i: int) -> dict[str, Any]:
        size = int(np.prod(self.shape))
        start = (i * 4099) % (len(self._pool) - size)
        image = self._pool[start : start + size].reshape(self.shape).copy()
        return {"image": image, "label": int(self.labels[i]), "caption": f"sample {i}"}

    def record_bytes(self) -> int:
        """The size of one record as a pickle: what MB/s figures count."""
        return len(pickle.dumps(self.record(0), protocol=5))

    def weighted_draws(
        self, count: int, seed: int = 1, classes: tuple[int, ...] = ()
    ) -> np.ndarray:
        """``count`` indices drawn with replacement, every class equally likely (restricted to
        ``classes`` if given): the draws every system reads."""
        return balanced_draws(self.labels, count, seed, classes)


def balanced_draws(
    labels: np.ndarray, count: int, seed: int, classes: tuple[int, ...] = ()
) -> np.ndarray:
    """Indices drawn with replacement, weights ``1 / class size`` (0 outside ``classes``)."""
    keep = np.isin(labels, classes) if classes else np.ones(len(labels), dtype=bool)
    rows = np.flatnonzero(keep)
    _, inverse, counts = np.unique(labels[rows], return_inverse=True, return_counts=True)
    weights = 1.0 / counts[inverse]
    rng = np.random.default_rng(seed)
    return rows[rng.choice(len(rows), size=count, p=weights / weights.sum())]


def chunks(draws: np.ndarray, size: int = BATCH) -> Iterator[np.ndarray]:
    for start in range(0, len(draws), size):
        yield draws[start : start + size]


class System(abc.ABC):
    """One way of storing and reading the workload."""

    name = ""
    module = ""
    """The module the system needs; the runner skips systems whose module is missing."""
    filter_how = "labels from a NumPy side array"
    """How "filter to two classes and re-weight" gets the labels."""
    start_method: str | None = None
    """The multiprocessing start method its DataLoader workers need (None: the default)."""
    fork_handle = False
    """Workers use the handle the parent opened (inherited by fork) instead of their own."""

    @classmethod
    def installed(cls) -> bool:
        return importlib.util.find_spec(cls.module) is not None

    @classmethod
    def python(cls) -> str:
        """The interpreter the runner's child processes for this system run with."""
        return sys.executable

    @abc.abstractmethod
    def build(self, wl: Workload, path: Path) -> None:
        """Writes every record of ``wl`` under ``path``."""

    @abc.abstractmethod
    def open(self, path: Path) -> Any:
        """What reads need: a handle on the data built at ``path``."""

    @abc.abstractmethod
    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        """The decoded records at ``indices``, in order (the system's fastest random access)."""

    @abc.abstractmethod
    def labels(self, handle: Any) -> np.ndarray:
        """Every record's label, the way the system offers them."""

    # -- what every system does the same way -------------------------------------------------
    def read(self, handle: Any, draws: np.ndarray) -> Iterator[list[Any]]:
        """Batches of decoded records at ``draws``, in one process."""
        for part in chunks(draws):
            yield self.get_many(handle, part)

    def loader(self, path: Path, draws: np.ndarray, workers: int) -> Any:
        """A PyTorch DataLoader over the same draws, default collate, ``workers`` processes."""
        from torch.utils.data import DataLoader

        return DataLoader(
            _MapDataset(self, path),
            batch_size=BATCH,
            sampler=draws.tolist(),
            num_workers=workers,
            multiprocessing_context=self.start_method if workers else None,
        )

    def refilter(self, handle: Any, count: int) -> Any:
        """Filter to two classes, re-weight them equally, get a new iterator of ``count``
        draws: its first batch."""
        labels = self.labels(handle)
        draws = balanced_draws(labels, count, seed=2, classes=CLASSES)
        return next(iter(self.read(handle, draws)))


class _MapDataset:
    """A map-style Dataset over a system's random access; each process opens its own handle."""

    def __init__(self, system: System, path: Path) -> None:
        self.system, self.path, self._handle, self._pid = system, path, None, -1
        if system.fork_handle:
            self._open()

    def _open(self) -> Any:
        if self._pid != os.getpid() and not (self.system.fork_handle and self._handle):
            self._handle, self._pid = self.system.open(self.path), os.getpid()
        return self._handle

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.system.get_many(self._open(), np.array([index]))[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return self.system.get_many(self._open(), np.asarray(indices))

    def __getstate__(self) -> dict[str, Any]:
        return {"system": self.system, "path": self.path, "_handle": None, "_pid": -1}


# -- dataset_rt -----------------------------------------------------------------------------
class DatasetRT(System):
    name = "dataset_rt"
    module = "dataset_rt"
    filter_how = "Polars filter on the metadata table, balance(), new loader"

    def build(self, wl: Workload, path: Path) -> None:
        import dataset_rt as drt

        drt.cache(
            (wl.record(i) for i in range(wl.records)),
            "bench",
            root=path,
            progress=False,
            metadata=lambda r: {"label": r["label"]},
        )

    def open(self, path: Path) -> Any:
        import dataset_rt as drt

        return drt.open("bench", root=path)

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        return handle.get_many(indices)  # type: ignore[no-any-return]

    def labels(self, handle: Any) -> np.ndarray:
        return handle.metadata["label"].to_numpy()  # type: ignore[no-any-return]

    def _frame(self, handle: Any) -> Any:
        import polars as pl

        return handle.metadata.with_columns(weight=pl.col("label").drt.balance())

    def read(self, handle: Any, draws: np.ndarray) -> Iterator[list[Any]]:
        # Its own weighted sampler draws from the same distribution as ``draws``.
        loader = self._frame(handle).drt.loader(
            batch_size=BATCH, seed=1, num_samples=len(draws), collate=list
        )
        return iter(loader)

    def loader(self, path: Path, draws: np.ndarray, workers: int) -> Any:
        return self._frame(self.open(path)).drt.loader(
            batch_size=BATCH, seed=1, num_samples=len(draws), num_workers=workers
        )

    def refilter(self, handle: Any, count: int) -> Any:
        import polars as pl

        frame = handle.metadata.filter(pl.col("label").is_in(list(CLASSES))).with_columns(
            weight=pl.col("label").drt.balance()
        )
        loader = frame.drt.loader(batch_size=BATCH, seed=2, num_samples=count, collate=list)
        return next(iter(loader))


# -- the two baselines ----------------------------------------------------------------------
class MmapOffsets(System):
    name = "mmap"
    module = "numpy"

    def build(self, wl: Workload, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        offsets = np.zeros(wl.records + 1, dtype=np.int64)
        with open(path / "records.bin", "wb") as f:
            for i in range(wl.records):
                data = pickle.dumps(wl.record(i), protocol=5)
                f.write(data)
                offsets[i + 1] = offsets[i] + len(data)
        np.save(path / "offsets.npy", offsets)
        np.save(path / "labels.npy", wl.labels)

    def open(self, path: Path) -> Any:
        with open(path / "records.bin", "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return mm, np.load(path / "offsets.npy"), np.load(path / "labels.npy", mmap_mode="r")

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        mm, offsets, _ = handle
        starts, ends = offsets[indices].tolist(), offsets[indices + 1].tolist()
        return [pickle.loads(mm[s:e]) for s, e in zip(starts, ends, strict=True)]

    def labels(self, handle: Any) -> np.ndarray:
        return np.asarray(handle[2])


class InRamList(System):
    name = "list"
    module = "numpy"
    filter_how = "labels from a NumPy array in RAM"

    def build(self, wl: Workload, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        payloads = [pickle.dumps(wl.record(i), protocol=5) for i in range(wl.records)]
        with open(path / "records.pkl", "wb") as f:
            pickle.dump((payloads, wl.labels), f, protocol=5)

    def open(self, path: Path) -> Any:
        with open(path / "records.pkl", "rb") as f:
            return pickle.load(f)

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        payloads = handle[0]
        return [pickle.loads(payloads[i]) for i in indices.tolist()]

    def labels(self, handle: Any) -> np.ndarray:
        return np.asarray(handle[1])


# -- the peers ------------------------------------------------------------------------------
class HFDatasets(System):
    name = "hf-datasets"
    module = "datasets"
    filter_how = "the label column (Arrow) to NumPy"

    def build(self, wl: Workload, path: Path) -> None:
        import datasets

        features = datasets.Features(
            {
                "image": datasets.Array3D(shape=wl.shape, dtype="uint8"),
                "label": datasets.Value("int64"),
                "caption": datasets.Value("string"),
            }
        )

        def generate() -> Iterator[dict[str, Any]]:
            for i in range(wl.records):
                yield wl.record(i)

        datasets.disable_progress_bars()
        ds = datasets.Dataset.from_generator(
            generate, features=features, cache_dir=str(path / "gen")
        )
        ds.save_to_disk(str(path / "ds"))
        del ds
        shutil.rmtree(path / "gen")

    def open(self, path: Path) -> Any:
        import datasets

        return datasets.load_from_disk(str(path / "ds")).with_format("numpy")

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        return handle.__getitems__(indices.tolist())  # type: ignore[no-any-return]

    def labels(self, handle: Any) -> np.ndarray:
        # The Arrow column itself: indexing a NumPy-formatted dataset by column name gives a
        # lazy column that converts row by row.
        return handle.with_format("arrow")["label"].to_numpy()


class LitData(System):
    name = "litdata"
    module = "litdata"
    filter_how = "no metadata: a full pass reading every record's label"

    def build(self, wl: Workload, path: Path) -> None:
        import litdata

        litdata.optimize(
            fn=wl.record,
            inputs=list(range(wl.records)),
            output_dir=str(path),
            chunk_bytes="64MB",
            num_workers=2,
            verbose=False,
        )

    def open(self, path: Path) -> Any:
        import litdata

        return litdata.StreamingDataset(str(path))

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        return [handle[i] for i in indices.tolist()]

    def labels(self, handle: Any) -> np.ndarray:
        return np.array([int(r["label"]) for r in handle])


class Mosaic(System):
    name = "mosaicml-streaming"
    module = "streaming"
    filter_how = "no metadata: a full pass reading every record's label"
    # A second StreamingDataset over the same directory in a worker is refused ("shared
    # memory prefix was not registered by local leader"); forked workers share the parent's.
    fork_handle = True

    def build(self, wl: Workload, path: Path) -> None:
        from streaming import MDSWriter

        shape = ",".join(str(s) for s in wl.shape)
        columns = {"image": f"ndarray:uint8:{shape}", "label": "int", "caption": "str"}
        with MDSWriter(out=str(path), columns=columns, size_limit=64 << 20) as writer:
            for i in range(wl.records):
                writer.write(wl.record(i))

    def open(self, path: Path) -> Any:
        from streaming import StreamingDataset

        return StreamingDataset(local=str(path), batch_size=BATCH)

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        return [handle.get_item(i) for i in indices.tolist()]

    def labels(self, handle: Any) -> np.ndarray:
        return np.array([int(handle.get_item(i)["label"]) for i in range(handle.num_samples)])


class Lance(System):
    name = "lance"
    module = "lance"
    filter_how = "filter pushed down to a scan of the label column"
    # Forked DataLoader workers hang in Lance's runtime (seen: one worker stuck > 7 min).
    start_method = "spawn"

    def build(self, wl: Workload, path: Path) -> None:
        import lance
        import pyarrow as pa

        size = int(np.prod(wl.shape))
        schema = pa.schema(
            [
                ("image", pa.list_(pa.uint8(), size)),
                ("label", pa.int64()),
                ("caption", pa.string()),
            ]
        )

        def batches() -> Iterator[pa.RecordBatch]:
            step = max(1, (64 << 20) // size)
            for start in range(0, wl.records, step):
                recs = [wl.record(i) for i in range(start, min(start + step, wl.records))]
                images = np.stack([r["image"] for r in recs]).reshape(-1)
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.FixedSizeListArray.from_arrays(pa.array(images), size),
                        pa.array([r["label"] for r in recs], pa.int64()),
                        pa.array([r["caption"] for r in recs]),
                    ],
                    schema=schema,
                )

        lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), str(path))
        np.save(path / "shape.npy", np.array(wl.shape))

    def open(self, path: Path) -> Any:
        import lance

        return lance.dataset(str(path)), tuple(np.load(path / "shape.npy").tolist())

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        ds, shape = handle
        table = ds.take(indices.tolist())
        images = table["image"].combine_chunks().flatten().to_numpy().reshape(-1, *shape)
        labels = table["label"].to_numpy().tolist()
        captions = table["caption"].to_pylist()
        return [
            {"image": images[j], "label": labels[j], "caption": captions[j]}
            for j in range(len(labels))
        ]

    def labels(self, handle: Any) -> np.ndarray:
        return handle[0].to_table(columns=["label"])["label"].to_numpy()

    def refilter(self, handle: Any, count: int) -> Any:
        classes = ", ".join(str(c) for c in CLASSES)
        table = handle[0].to_table(
            columns=["label"], filter=f"label IN ({classes})", with_row_id=True
        )
        labels = table["label"].to_numpy()
        # Row ids are (fragment << 32) | offset: positions while there is one fragment.
        assert len(handle[0].get_fragments()) == 1, "lance wrote several fragments"
        rows = table["_rowid"].to_numpy().astype(np.int64)
        draws = rows[balanced_draws(labels, count, seed=2)]
        return next(iter(self.read(handle, draws)))


# -- the original DatasetRT, in a virtual environment of its own ----------------------------
PEER_VERSION = "0.4.8"
PEER_PYTHON_ENV = "DATASET_RT_PEER_PYTHON"
"""The variable naming the peer's interpreter; unset: ``peer_venv() / "bin" / "python"``."""


def peer_venv() -> Path:
    """Where ``bench/peer-env.sh`` creates the peer's virtual environment by default."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / f"drt-peer-{PEER_VERSION}"


def foreign_env() -> dict[str, str]:
    """The environment of a process running another interpreter: no ``PYTHONPATH``, which
    could put this checkout's ``dataset_rt`` ahead of the one installed there."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@functools.cache
def _imports_peer(python: str) -> bool:
    """Whether ``python`` imports a ``dataset_rt`` with ``DatasetRuntime``, at PEER_VERSION.

    Asked in a subprocess: the runner's own process never imports that package.
    """
    check = (
        "import importlib.metadata, sys, dataset_rt; "
        "ok = hasattr(dataset_rt, 'DatasetRuntime') "
        f"and importlib.metadata.version('dataset-rt') == {PEER_VERSION!r}; "
        "sys.exit(0 if ok else 1)"
    )
    if not Path(python).is_file():
        return False
    try:
        done = subprocess.run(
            [python, "-c", check],
            capture_output=True,
            timeout=120,
            env=foreign_env(),
            cwd=Path(__file__).parent,  # the children's sys.path[0]
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _peer() -> Any:
    """The peer's ``dataset_rt``: imported by name, in its own interpreter only (its API is not
    ours, so it is typed as Any)."""
    return importlib.import_module("dataset_rt")


def _unpickle(sample: Any) -> Any:
    """The peer's ``sample_transform_fn``: its payloads are pickled records."""
    return pickle.loads(sample.data)


class _PeerSource:
    """A ``CacheSource`` of the workload: a ``name`` and ``CacheInput`` values."""

    name = "bench"

    def __init__(self, wl: Workload) -> None:
        self.wl = wl

    def __iter__(self) -> Iterator[Any]:
        peer = _peer()
        for i in range(self.wl.records):
            record = self.wl.record(i)
            yield peer.CacheInput(
                data=pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL),
                metadata={"label": record["label"]},
            )


class DatasetRTPeer(System):
    """The original DatasetRT (PyPI ``dataset-rt`` 0.4.8), used the way its README shows.

    - build: ``DatasetRuntime(num_workers=N).write_cache(source, path, writer_config=
      WriterConfig(show_progress=False))``, every other writer setting at its default:
      ``num_processes=0`` (written in the calling process; its processes parallelize across
      sources, and the workload is one source), ``shard_compression`` ``"none"`` (its only
      other choice is per-record LZ4), 64 MiB shards. Payloads are the records pickled with
      protocol 5 (it stores bytes, serialization is the caller's); ``label`` is a metadata
      column.
    - reads: its weighted sampler, ``update_metadata`` with ``weight = 1 / class size`` then
      iteration (``ReaderConfig(shuffle=True)``: multinomial draws with replacement, Rust
      reader threads prefetching); the same distribution as everyone's draws, not the same
      indices. Random access by index is ``CachedDataset.get_item(cache_id, sample_id)``,
      one sample a call (no batched form): that is ``get_many``.
    - 2 workers: its ``to_torch_dataloader`` (spawned workers, default collate), the
      counterpart of dataset_rt's own loader.
    - N, its Rust worker threads: min(4, cores), 4 being its README's and its loader's cap.
    """

    name = f"dataset-rt-{PEER_VERSION}"
    module = "dataset_rt"
    filter_how = "Polars filter of its metadata table, update_metadata with weights, iterate"

    @classmethod
    def python(cls) -> str:
        return os.environ.get(PEER_PYTHON_ENV) or str(peer_venv() / "bin" / "python")

    @classmethod
    def installed(cls) -> bool:
        return _imports_peer(cls.python())

    @staticmethod
    def _runtime() -> Any:
        peer = _peer()
        return peer.DatasetRuntime(num_workers=min(4, len(os.sched_getaffinity(0))))

    def build(self, wl: Workload, path: Path) -> None:
        peer = _peer()
        results = self._runtime().write_cache(
            _PeerSource(wl), path, writer_config=peer.WriterConfig(show_progress=False)
        )
        failed = [r for r in results if not isinstance(r, peer.CacheWriteSuccess)]
        if failed:
            raise RuntimeError(f"write_cache failed: {failed}")

    def open(self, path: Path) -> Any:
        peer = _peer()
        reader = peer.ReaderConfig(seed=1, shuffle=True)
        return self._runtime().cached_dataset([path / _PeerSource.name], reader_config=reader)

    @staticmethod
    def _balanced(metadata: Any) -> Any:
        import polars as pl

        return metadata.with_columns(weight=1.0 / pl.len().over("label"))

    def get_many(self, handle: Any, indices: np.ndarray) -> list[dict[str, Any]]:
        # One cache, written in index order: sample_id is the index.
        cache_id = int(handle.get_metadata()["cache_id"][0])
        return [pickle.loads(handle.get_item(cache_id, i).data) for i in indices.tolist()]

    def labels(self, handle: Any) -> np.ndarray:
        return handle.get_metadata()["label"].to_numpy()  # type: ignore[no-any-return]

    def _batches(self, handle: Any, count: int) -> Iterator[list[Any]]:
        handle.set_epoch_len(count)
        batch = []
        for sample in handle:
            batch.append(pickle.loads(sample.data))
            if len(batch) == BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def read(self, handle: Any, draws: np.ndarray) -> Iterator[list[Any]]:
        # Its own weighted sampler draws from the same distribution as ``draws``.
        handle.update_metadata(self._balanced(handle.get_metadata()))
        return self._batches(handle, len(draws))

    def loader(self, path: Path, draws: np.ndarray, workers: int) -> Any:
        handle = self.open(path)
        handle.update_metadata(self._balanced(handle.get_metadata()))
        return handle.to_torch_dataloader(
            batch_size=BATCH,
            seed=1,
            samples_per_epoch=len(draws),
            num_workers=workers,
            sample_transform_fn=_unpickle,
            verbose=False,
        )

    def refilter(self, handle: Any, count: int) -> Any:
        import polars as pl

        metadata = handle.get_metadata().filter(pl.col("label").is_in(list(CLASSES)))
        handle.update_metadata(self._balanced(metadata))
        return next(self._batches(handle, count))


SYSTEMS: dict[str, type[System]] = {
    s.name: s
    for s in (
        DatasetRT,
        MmapOffsets,
        InRamList,
        HFDatasets,
        LitData,
        Mosaic,
        Lance,
        DatasetRTPeer,
    )
}
BASELINE = "mmap"
