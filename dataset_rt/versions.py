"""A cache's metadata versions: the live table, the saved ones, and saving a new one.

Each version has the sampling plan of its weights saved beside it. :class:`MetadataVersions`
is the part of :class:`~dataset_rt.Cache` that reads and writes
them.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from dataset_rt import _native, registry
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
    DatasetRTError,
    MetadataError,
    StaleCacheError,
)
from dataset_rt.metadata import checked_edit, checked_scan, house_ids, token_lengths

VersionSession = _native.CacheBuilder | _native.AppendSession | _native.MetadataSave
"""The engine's transactions that write a metadata version."""

if TYPE_CHECKING:
    from dataset_rt.fetch import LocalCopy

__all__ = [
    "MetadataVersions",
    "local_copy",
    "write_version",
]


def local_copy(path: Path | str) -> LocalCopy | None:
    """The local copy of the remote cache whose directory is ``path``; None for a local cache.

    :mod:`dataset_rt.fetch` holds the copies: until a remote cache is opened it is not even
    imported (it brings sockets, thread pools and obstore), so local work never pays for it.
    """
    fetch = sys.modules.get("dataset_rt.fetch")
    return None if fetch is None else fetch.copy_for(path)


class MetadataVersions:
    """The metadata tables of a cache and the plans saved with them (part of ``Cache``)."""

    _root: Path
    _reader: _native.CacheReader
    _manifest: _native.Manifest
    _metadata: tuple[int, pl.DataFrame] | None
    _plan_held: tuple[int, _native.Opened] | None

    if TYPE_CHECKING:  # what Cache itself provides

        @property
        def name(self) -> str:  # noqa: D102
            ...

        @property
        def path(self) -> Path:  # noqa: D102
            ...

        @property
        def url(self) -> str | None:  # noqa: D102
            ...

        @property
        def cache_id(self) -> str:  # noqa: D102
            ...

        @property
        def serializer(self) -> str:  # noqa: D102
            ...

        def __len__(self) -> int: ...

    # -- metadata ---------------------------------------------------------------------------
    def _live_manifest(self) -> _native.Manifest:
        """The manifest on disk now.

        Records appended since this object was opened become readable through it: its
        reader is replaced by one that sees them.
        """
        manifest = _native.Store(str(self._root)).manifest(self.name)
        if manifest.cache_id != self.cache_id:
            raise StaleCacheError(
                f"cache {self.name!r} was rebuilt since it was opened (cache_id "
                f"{self.cache_id} is now {manifest.cache_id}); open it again"
            )
        if manifest.num_samples != self._manifest.num_samples:
            reader = registry.open_reader(self._root, self.name)
            if reader.manifest.cache_id == self.cache_id:
                self._reader, self._manifest = reader, reader.manifest
        return manifest

    @property
    def metadata_version(self) -> int:
        """The live metadata version: the one :attr:`metadata` returns."""
        return self._live_manifest().metadata_version

    def _metadata_path(self, version: int) -> Path:
        return self.path / _native.metadata_file(version)

    def _checked_metadata_path(self, version: int, manifest: _native.Manifest | None) -> Path:
        """The file of metadata version ``version``, checked against its recorded checksum."""
        expected = (manifest or self._live_manifest()).metadata_checksums.get(version)
        return _native.checked_metadata_table(self.path, version, expected)

    def _read_metadata(
        self, version: int, manifest: _native.Manifest | None = None
    ) -> pl.DataFrame:
        path = self._checked_metadata_path(version, manifest)
        try:
            return house_ids(pl.read_parquet(path))
        except (OSError, pl.exceptions.PolarsError) as exc:
            raise CacheCorruptError(f"{path}: unreadable metadata table: {exc}") from exc

    @property
    def metadata(self) -> pl.DataFrame:
        """The live metadata table: ``cache_id``, ``sample_id``, attributes, ``weight``."""
        manifest = self._live_manifest()
        version = manifest.metadata_version
        if self._metadata is None or self._metadata[0] != version:
            self._metadata = (version, self._read_metadata(version, manifest))
        return self._metadata[1]

    def scan(self) -> pl.LazyFrame:
        """The live metadata table as a LazyFrame (nothing is read until collected).

        A shuffled loader made from this very LazyFrame, unchanged (``cache.scan().drt.
        loader(...)``), reads nothing of the table: it maps the sampling plan saved with the
        version, so it starts in the same time for a billion rows as for a thousand, and
        draws exactly what a loader over :attr:`metadata` draws.

        The table is checked against its checksum before a query first reads it: with
        Polars 2 when that query runs (a damaged table raises :class:`CacheCorruptError`
        from ``collect``), with older Polars here.
        """
        manifest = self._live_manifest()
        version = manifest.metadata_version
        frame = checked_scan(
            _native.metadata_table_file(self.path, version),
            lambda: self._checked_metadata_path(version, manifest),
        )
        registry.remember_version(frame, self, version)
        return frame

    def _version_plan(self, version: int, verify: bool) -> tuple[str, str, int, int | None] | None:
        """The saved plan of metadata ``version`` as (path, digest, rows, tokens), if sound.

        ``tokens`` is the documents' tokens in all, for a plan that holds their lengths (a
        token cache's); None otherwise.

        A plan that is missing, or whose size does not match its header, is passed over (the
        loader then builds its own, and puts it back); so is one whose bytes fail their
        checksum, which is read only with ``verify`` (as records' are), and by :meth:`verify`.
        """
        digest = self._live_manifest().plan_checksums.get(version)
        if digest is None:
            return None
        path = self.path / _native.plan_file(version)
        try:
            copy = local_copy(self.path)
            if copy is not None:  # a remote cache's plan is fetched when a loader needs it
                copy.fetch(_native.plan_file(version))
            held = _native.hold_plan(path)
            if verify and _native.file_checksum(path)[1] != digest:
                return None
        except StaleCacheError:
            raise
        except (CacheCorruptError, CacheIOError, CacheNotFoundError):
            return None
        rows, caches, weighted, tokens = held.plan
        if caches != 1 or not weighted:
            return None
        if self._plan_held is None or self._plan_held[0] != version:
            # Held while this object lives, as its shards are: each new loader over the
            # version finds the plan's pages that earlier ones touched still mapped.
            self._plan_held = (version, held)
        return str(path), digest, rows, tokens

    def _restore_plan(self, version: int, source: str) -> None:
        """Puts back the saved plan of ``version`` from ``source`` if it is the one saved.

        ``source`` is a loader's own plan of the same rows; its checksum says whether it is
        byte for byte the plan that was saved.
        """
        store = _native.Store(str(self._root))
        try:
            with store.lock(self.name) as lock:
                store.restore_plan(lock, self.cache_id, version, source)
        except DatasetRTError as exc:  # the loader has its own plan: nothing is lost
            warnings.warn(
                f"could not put back the sampling plan of metadata version {version} of cache "
                f"{self.name!r}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )

    def metadata_versions(self) -> pl.DataFrame:
        """Every saved metadata version: ``version``, ``rows``, ``columns``, ``saved``, ``live``.

        Versions are never deleted by dataset_rt; :meth:`metadata_at` reads any of them.
        """
        manifest = self._live_manifest()
        rows = []
        for version in manifest.metadata_versions:
            path = self._metadata_path(version)
            schema = pl.read_parquet_schema(path)
            rows.append(
                {
                    "version": version,
                    "rows": pl.scan_parquet(path).select(pl.len()).collect().item(),
                    "columns": list(schema),
                    "saved": datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc),
                    "live": version == manifest.metadata_version,
                }
            )
        return pl.DataFrame(
            rows,
            schema={
                "version": pl.Int64(),
                "rows": pl.Int64(),
                "columns": pl.List(pl.String()),
                "saved": pl.Datetime("us", "UTC"),
                "live": pl.Boolean(),
            },
            orient="row",
        )

    def metadata_at(self, version: int) -> pl.DataFrame:
        """The metadata table as saved in ``version``."""
        versions = self._live_manifest().metadata_versions
        if version not in versions:
            raise MetadataError(
                f"cache {self.name!r} has no metadata version {version!r}; it has {versions}"
            )
        return self._read_metadata(version)

    def save_metadata(self, frame: pl.DataFrame | pl.LazyFrame) -> int:
        """Saves an edited metadata table as the new live version; returns its number.

        Rows may be filtered out (they are then never sampled) and columns added, such as a
        per-sample loss joined on ``sample_id``. Payload shards are not touched. The table
        is checked first and nothing is written if it is rejected; the save itself is
        atomic, and earlier versions stay readable with :meth:`metadata_at`.

        Parameters
        ----------
        frame
            A table with this cache's ``cache_id`` and ``sample_id`` columns and a numeric
            ``weight`` column.

        Raises
        ------
        MetadataError
            Rows of another cache or of no sample of this one, duplicated ``sample_id``, or
            a missing or non-numeric ``weight``.
        WeightError
            Negative, NaN, infinite or null weights, or all weights zero.
        StaleCacheError
            The cache was rebuilt since this object was opened.
        """
        if self.url is not None:
            raise ArgumentError(
                f"cache {self.name!r} was opened from {self.url}, where its metadata lives: "
                "pull it (dataset_rt.remote.pull), save the metadata there and push it back"
            )
        if isinstance(frame, pl.LazyFrame):
            frame = frame.collect()
        if not isinstance(frame, pl.DataFrame):
            raise TypeError(
                f"save_metadata needs a polars DataFrame or LazyFrame, not {type(frame).__name__}"
            )
        self._live_manifest()  # records appended since this object was opened count
        checked = checked_edit(frame, self.cache_id, len(self), self.name)
        store = _native.Store(str(self._root))
        with store.lock(self.name) as lock:
            try:
                save = store.save_metadata(lock, self.cache_id)
            except StaleCacheError as exc:
                raise StaleCacheError(
                    f"cache {self.name!r} was rebuilt since it was opened; nothing was saved"
                ) from exc
            try:
                write_version(save, checked, self.serializer)
            except BaseException as exc:
                save.discard()
                if isinstance(exc, OSError | pl.exceptions.PolarsError):
                    raise _io_error(exc, save.metadata_path) from exc
                raise
            version = save.commit()
        self._metadata = (version, checked)
        return version


def write_version(session: VersionSession, frame: pl.DataFrame, serializer: str) -> None:
    """Writes a metadata version about to be committed: its table, and the plan saved with it.

    ``session`` is the engine's transaction (a build, an append or a metadata save), which
    names the table's file and writes the plan, hashing it as it goes. The plan (none for an
    empty table) is the one a shuffled loader over the table would write for itself, byte
    for byte: a loader made from :meth:`Cache.scan` maps it instead. A token cache's plan
    (``serializer`` ``tokens...``) holds the documents' lengths too, when the table has them,
    for a packed loader.
    """
    path = session.metadata_path
    if not frame.height:
        frame.write_parquet(path)
        return
    columns = frame.select(pl.col("sample_id").cast(pl.Int64), pl.col("weight").cast(pl.Float64))
    if serializer.startswith("tokens") and "length" in frame.columns:
        columns = columns.with_columns(token_lengths(frame))
    # Both writes release the GIL: the plan (its alias table, its hash and its flush to
    # disk) is written on a thread while Polars writes the table.
    with ThreadPoolExecutor(1, thread_name_prefix="drt-plan") as pool:
        plan = pool.submit(session.write_plan, columns)
        try:
            frame.write_parquet(path, row_group_size=_rows_per_group(frame.height))
        except BaseException:
            plan.exception()  # the session is not left mid-write; the table's error counts
            raise
        plan.result()


_MAX_ROW_GROUPS = 64
"""Row groups a metadata table is written in, at most: its Parquet footer, which describes
each group and which ``cache.scan()`` reads for the schema, stays the same size from a
million rows to a billion (about 20 KB for four columns; 230 KB at 100M rows in groups of
Polars' default 262,144, 1.5 ms to read)."""


def _rows_per_group(rows: int) -> int:
    """The Parquet row group size for a table of ``rows`` rows.

    262,144 rows (Polars' default), or more where that would make over
    :data:`_MAX_ROW_GROUPS` groups.
    """
    return max(1 << 18, -(-rows // _MAX_ROW_GROUPS))


def _io_error(exc: BaseException, path: Path) -> CacheIOError:
    """An error of writing ``path`` as a :class:`CacheIOError`, keeping its errno."""
    code = getattr(exc, "errno", None)
    if code is None:
        # Polars reports OS errors inside its own messages: "... (os error 28)".
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else 0
    reason = os.strerror(code) if code else str(exc)
    return CacheIOError(code, f"writing the metadata table failed: {reason}", str(path))
