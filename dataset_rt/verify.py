"""Full verification of a cache: :func:`verify` and :class:`VerifyReport`."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from dataset_rt import _native
from dataset_rt.errors import CacheCorruptError, DatasetRTError
from dataset_rt.metadata import checked_edit
from dataset_rt.progress import format_bytes
from dataset_rt.roots import PathLike, resolve_root

__all__ = ["Problem", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Problem:
    """One thing found wrong with a cache."""

    file: str
    """The damaged file, relative to the cache's directory."""
    message: str
    """What is wrong with it."""
    sample_ids: list[int] = field(default_factory=list)
    """The samples whose records are affected; empty when the problem is not per record."""

    def __str__(self) -> str:
        text = f"{self.file}: {self.message}"
        if self.sample_ids:
            shown = ", ".join(map(str, self.sample_ids[:10]))
            more = f", … ({len(self.sample_ids) - 10} more)" if len(self.sample_ids) > 10 else ""
            text += f" (sample_id {shown}{more})"
        return text


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked and what it found; ``ok`` is true for an intact cache."""

    name: str
    path: Path
    files_checked: int
    samples_checked: int
    bytes_read: int
    seconds: float
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        """Whether nothing was found wrong."""
        return not self.problems

    @property
    def damaged_sample_ids(self) -> list[int]:
        """Every sample whose record is damaged or unreadable, sorted."""
        return sorted({i for p in self.problems for i in p.sample_ids})

    def raise_if_damaged(self) -> None:
        """Raises :class:`~dataset_rt.errors.CacheCorruptError` listing the problems."""
        if self.problems:
            lines = "\n".join(f"  {p}" for p in self.problems)
            raise CacheCorruptError(
                f"cache {self.name!r} at {self.path} is damaged:\n{lines}\n"
                f"rebuild it with overwrite=True"
            )

    def __str__(self) -> str:
        head = (
            f"cache {self.name!r}: {self.files_checked} files, {self.samples_checked:,} "
            f"samples, {format_bytes(self.bytes_read)} read in {self.seconds:.1f} s"
        )
        if self.ok:
            return f"{head}: intact"
        lines = "\n".join(f"  {p}" for p in self.problems)
        return f"{head}: {len(self.problems)} problem(s)\n{lines}"


def _check_metadata(path: Path, manifest: _native.Manifest, known_bad: set[str]) -> list[Problem]:
    """Parses every metadata version and checks its rows against the cache."""
    problems = []
    for version in manifest.metadata_versions:
        file = _native.metadata_file(version)
        if file in known_bad:
            continue
        try:
            frame = pl.read_parquet(path / file)
            checked_edit(frame, manifest.cache_id, manifest.num_samples, path.name)
        except (OSError, pl.exceptions.PolarsError) as exc:
            problems.append(Problem(file, f"unreadable metadata table: {exc}"))
        except DatasetRTError as exc:
            problems.append(Problem(file, f"invalid metadata table: {exc}"))
    return problems


def verify(name: str, *, root: PathLike | None = None, progress: bool = True) -> VerifyReport:
    """Checks every file and record of cache ``name`` and reports what is damaged.

    Reads every byte once: each shard's and the index's size and checksum against the
    manifest, each record's bounds and checksum against the index, and each metadata
    version's checksum and rows. Damage does not raise; it is listed in the report, by file
    and sample id. Call :meth:`VerifyReport.raise_if_damaged` to turn it into an exception.

    Parameters
    ----------
    name
        The cache's name.
    root
        The directory holding the caches; default ``$DATASET_RT_HOME`` or
        ``~/.cache/dataset_rt``.
    progress
        Show the bytes read so far on a terminal.

    Raises
    ------
    CacheNotFoundError
        No cache of that name exists under the root.

    Examples
    --------
    >>> import dataset_rt as drt
    >>> _ = drt.cache(range(10), "doc-verify-example", progress=False)
    >>> report = drt.verify("doc-verify-example", progress=False)
    >>> report.ok, report.samples_checked
    (True, 10)
    """
    root_path = resolve_root(root)
    store = _native.Store(str(root_path))
    start = time.perf_counter()
    live = progress and sys.stderr.isatty()

    def show(nbytes: int) -> None:
        sys.stderr.write(f"\rverifying {name!r}: {format_bytes(nbytes)} read")
        sys.stderr.flush()

    try:
        files, samples, nbytes, found = store.verify(name, show if live else None)
    finally:
        if live:
            sys.stderr.write("\n")
    problems = [Problem(file, message, list(ids)) for file, message, ids in found]
    path = root_path / name
    if not any(p.file == _native.MANIFEST_FILE for p in problems):
        manifest = store.manifest(name)
        problems += _check_metadata(path, manifest, {p.file for p in problems})
    return VerifyReport(
        name=name,
        path=path,
        files_checked=files,
        samples_checked=samples,
        bytes_read=nbytes,
        seconds=time.perf_counter() - start,
        problems=problems,
    )
