"""Remote caches read through a local copy: metadata at open, payload shards on first use.

A cache opened from object storage gets a directory of its own on this machine,
``<local_dir>/<cache_id>/<name>/``, laid out like any cache. Opening downloads the
manifest, the indexes, the metadata tables and the loader plans into it (no payload byte),
each checked against the manifest and published with an atomic rename. Shards are fetched
when a reader first needs one: the engine calls :meth:`LocalCopy.fetch` before mapping a
shard (see ``drt_core::fetch``), which downloads it into a hidden file, checks its size and
checksum, and renames it into place; from then on it is mapped like a local shard.

Every process on the machine that opens the same build shares the copy: a lock file per
shard lets one process download it while the others wait. Keyed by ``cache_id``, a copy
never mixes the shards of two builds, and a shard whose download no longer matches the
manifest is checked against the remote manifest: a rebuilt remote cache raises
:class:`~dataset_rt.errors.StaleCacheError`. With a ``local_limit``, the least recently used
shards of every copy under the local directory are deleted once their total passes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataset_rt import _native
from dataset_rt.errors import (
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
    DatasetRTError,
    StaleCacheError,
)
from dataset_rt.objects import RemoteDir, StorageOptions, remote_manifest
from dataset_rt.scratch import process_alive
from dataset_rt.transfers import in_parallel

__all__ = [
    "LocalCopy",
    "RemoteSource",
    "copy_for",
    "evict",
    "on_demand",
    "sync",
]

_PARTIAL = ".partial"  # downloads in progress: <host>-<pid>-<random>-<file>, never trusted
_LOCKS = ".locks"
_MARK = ".dataset_rt-copy"  # in <local>/<cache_id>/: a copy, whose shards eviction may delete
_HOST = socket.gethostname().replace("-", "_")


@dataclass(frozen=True)
class RemoteSource:
    """Where a local copy's files come from; small and picklable, for worker processes."""

    url: str
    """The remote root: the cache lives under ``<url>/<name>/``."""
    name: str
    cache_id: str
    storage_options: dict[str, Any] | None
    local: Path
    """The local directory holding every copy (``<local>/<cache_id>/<name>/``)."""
    local_limit: int | None
    manifest: str
    """A digest of the manifest the copy was synced to: a new one (an append, a metadata
    version) makes a new :class:`LocalCopy`."""

    @property
    def root(self) -> Path:
        """The copy's root directory (the cache is ``name`` under it)."""
        return self.local / self.cache_id

    @property
    def path(self) -> Path:
        """The copy's cache directory."""
        return self.root / self.name

    def attach(self) -> LocalCopy:
        """The :class:`LocalCopy` of the cache in this process, its fetcher registered."""
        with _lock:
            copy = _copies.get(self.path)
            if copy is None or copy.source != self:
                copy = LocalCopy(self)
                _copies[self.path] = copy
                _native.register_fetcher(self.path, copy.fetch)
        return copy


_lock = threading.Lock()
_copies: dict[Path, LocalCopy] = {}


def copy_for(path: Path | str) -> LocalCopy | None:
    """The local copy of a remote cache whose directory is ``path``; None for a local cache."""
    with _lock:
        return _copies.get(Path(path))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` shared by every process of the machine (flock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits with the GIL released
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _flat(file: str) -> str:
    return file.replace("/", "--")


def _partial_name(what: str) -> str:
    return f"{_HOST}-{os.getpid()}-{secrets.token_hex(4)}-{what}"


def _remove_dead_partials(root: Path) -> None:
    """Deletes what processes of this machine that no longer run left in ``.partial``."""
    try:
        entries = list(os.scandir(root / _PARTIAL))
    except FileNotFoundError:
        return
    for entry in entries:
        host, _, rest = entry.name.partition("-")
        pid = rest.split("-", 1)[0]
        if host != _HOST or not pid.isdigit() or process_alive(int(pid)):
            continue  # another machine's (a shared local_dir), or still running
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _download_checked(
    remote: RemoteDir,
    file: str,
    target: Path,
    partial: Path,
    size: int | None,
    checksum: str | None,
    stop: threading.Event | None = None,
) -> None:
    """Downloads object ``file`` to ``target`` through a hidden file in ``partial``.

    The file is renamed into place only once its size and checksum match the manifest's.
    """
    partial.mkdir(parents=True, exist_ok=True)
    temp = partial / _partial_name(_flat(file))
    try:
        remote.download(file, temp, stop)
        found_size, found = _native.file_checksum(temp)
        if (size is not None and found_size != size) or (
            checksum is not None and found != checksum
        ):
            raise CacheCorruptError(
                f"{remote.where(file)} does not match its manifest ({found_size} bytes, "
                f"checksum {found}; recorded {size} bytes, checksum {checksum})"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def sync(
    url: str,
    name: str,
    storage_options: StorageOptions,
    local: Path,
    local_limit: int | None,
) -> RemoteSource:
    """Brings the local copy of remote cache ``name`` up to date; returns its source.

    Downloads the metadata tables the remote manifest names, each checked, and the manifest
    last (the rest is fetched on first use, see :func:`on_demand`).

    Raises
    ------
    CacheNotFoundError
        No cache ``name`` under ``url``.
    CacheCorruptError
        A downloaded file does not match the manifest; the copy's manifest is not updated.
    StaleCacheError
        The remote cache was replaced while its files were downloaded, twice in a row.
    """
    _native.validate_name(name)
    remote = RemoteDir(url, name, storage_options)
    for attempt in range(2):
        found = remote_manifest(remote)
        if found is None:
            raise CacheNotFoundError(
                f"no cache {name!r} under {url} ({remote.where(_native.MANIFEST_FILE)})"
            )
        raw, manifest = found
        source = RemoteSource(
            url.rstrip("/"),
            name,
            manifest.cache_id,
            dict(storage_options) if storage_options else None,
            local,
            local_limit,
            hashlib.sha256(raw).hexdigest()[:16],
        )
        try:
            _sync_files(remote, source, raw, manifest)
            return source
        except (CacheCorruptError, CacheNotFoundError):
            now = remote_manifest(remote)
            if now is not None and now[0] == raw:
                raise  # the same manifest: the damage is real
            if attempt:
                raise StaleCacheError(
                    f"cache {name!r} at {remote.url} was replaced twice while it was opened; "
                    "open it again once it is published"
                ) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _sync_files(
    remote: RemoteDir, source: RemoteSource, raw: bytes, manifest: _native.Manifest
) -> None:
    """Downloads what ``manifest`` names besides :func:`on_demand` files, then its ``raw`` bytes."""
    source.root.mkdir(parents=True, exist_ok=True)
    (source.root / _MARK).touch()
    _remove_dead_partials(source.root)
    manifest_path = source.path / _native.MANIFEST_FILE
    if _same_bytes(manifest_path, raw):
        return
    with _file_lock(source.root / _LOCKS / "manifest.lock"):
        if _same_bytes(manifest_path, raw):
            return
        staging = source.root / _PARTIAL / _partial_name("manifest")
        staging.mkdir(parents=True)
        try:
            (staging / _native.MANIFEST_FILE).write_bytes(raw)
            later = on_demand(manifest)
            for file, checksum in manifest.files:
                target = source.path / file
                if file in later or (target.exists() and _matches(target, checksum)):
                    continue
                _download_checked(remote, file, target, source.root / _PARTIAL, None, checksum)
            os.replace(staging / _native.MANIFEST_FILE, manifest_path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def on_demand(manifest: _native.Manifest) -> dict[str, tuple[int | None, str]]:
    """The files of a copy fetched when first used, with their size (if recorded) and checksum.

    These are shards, indexes and loader plans. Opening fetches the rest: the metadata
    tables, which is all that analysing the metadata reads.
    """
    files: dict[str, tuple[int | None, str]] = {
        file: (size, checksum) for file, size, checksum in manifest.shards + manifest.indexes
    }
    for version, checksum in manifest.plan_checksums.items():
        files[_native.plan_file(version)] = (None, checksum)
    return files


def _same_bytes(path: Path, raw: bytes) -> bool:
    try:
        return path.read_bytes() == raw
    except FileNotFoundError:
        return False


def _matches(path: Path, checksum: str | None) -> bool:
    return checksum is None or _native.file_checksum(path)[1] == checksum


class LocalCopy:
    """A remote cache's local copy, as this process uses it: fetches and evicts its shards."""

    def __init__(self, source: RemoteSource) -> None:
        self.source = source
        self.remote = RemoteDir(source.url, source.name, source.storage_options)
        manifest = _native.read_manifest(source.path)
        self.shards: dict[str, tuple[int, str]] = {
            file: (size, checksum) for file, size, checksum in manifest.shards
        }
        self.files = on_demand(manifest)
        """What :meth:`fetch` fetches: shards, indexes and plans."""
        self._busy: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._fetched = 0

    @property
    def fetched(self) -> int:
        """Bytes this process downloaded into the copy on demand (shards, indexes, plans)."""
        return self._fetched

    def fetch(self, file: str, stop: threading.Event | None = None) -> None:
        """Makes ``file`` present in the copy, downloading and checking it if needed.

        Called by the engine before a reader first maps a shard or an index, by
        :class:`ShardPrefetch` ahead of the reads (which may ``stop`` it), and for a loader
        plan. A present file is marked as just used, for the least-recently-used eviction
        of shards.

        Raises
        ------
        CacheCorruptError
            The remote shard does not match the manifest, or the manifest names no such
            shard; nothing is published.
        StaleCacheError
            The remote cache is no longer this build.
        CacheIOError
            Object storage or the local disk failed.
        """
        path = self.source.path / file
        try:
            os.utime(path)
            return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CacheIOError(f"cannot use {path}: {exc}") from exc
        if file not in self.files:
            raise CacheCorruptError(f"{self.source.path}: the manifest names no file {file}")
        with self._lock:
            busy = self._busy.setdefault(file, threading.Lock())
        try:
            with busy, _file_lock(self.source.root / _LOCKS / f"{_flat(file)}.lock"):
                if path.exists():
                    return
                size, checksum = self.files[file]
                try:
                    _download_checked(
                        self.remote, file, path, self.source.root / _PARTIAL, size, checksum, stop
                    )
                except (CacheCorruptError, CacheNotFoundError):
                    self._check_not_rebuilt()
                    raise
                with self._lock:
                    self._fetched += path.stat().st_size
        except DatasetRTError:
            raise
        except OSError as exc:  # the local disk: full, read-only, permissions
            raise CacheIOError(
                f"fetching {self.remote.where(file)} into {path} failed: {exc}"
            ) from exc
        if self.source.local_limit is not None:
            evict(self.source.local, self.source.local_limit, keep={path})

    def _check_not_rebuilt(self) -> None:
        """Raises StaleCacheError if the remote cache is another build than this copy's."""
        try:
            found = remote_manifest(self.remote)
        except CacheCorruptError:
            return
        cache_id = None if found is None else found[1].cache_id
        if cache_id != self.source.cache_id:
            now = "was deleted" if cache_id is None else f"was rebuilt (cache_id {cache_id})"
            raise StaleCacheError(
                f"cache {self.source.name!r} at {self.remote.url} {now} since build "
                f"{self.source.cache_id} was opened; its shards are not mixed with this "
                "build's: open it again"
            )

    def present(self, file: str) -> bool:
        """Whether shard ``file`` is in the copy now."""
        return (self.source.path / file).exists()

    def fetch_all(self, progress: bool = False) -> None:
        """Fetches every file not in the copy, ``IN_FLIGHT`` at a time.

        This process keeps the shards from eviction until :meth:`release`.
        """
        with _lock:
            _pinned.update(self.source.path / file for file in self.shards)

        def one(file: str) -> int:
            self.fetch(file)
            return (self.source.path / file).stat().st_size

        missing = [file for file in self.files if not self.present(file)]
        in_parallel(missing, one, f"fetch {self.source.name}", progress)

    def release(self) -> None:
        """Lets eviction delete the shards :meth:`fetch_all` kept."""
        with _lock:
            _pinned.difference_update(self.source.path / file for file in self.shards)


_pinned: set[Path] = set()  # shards this process keeps from eviction (a verify's)


def _shard_files(local: Path) -> list[os.DirEntry[str]]:
    """Every shard file of every copy under ``local``.

    Only directories marked as copies count: a local root under it is never touched.
    """
    found: list[os.DirEntry[str]] = []
    with contextlib.suppress(FileNotFoundError):
        for copy in os.scandir(local):
            if not (
                copy.is_dir(follow_symlinks=False)
                and os.path.exists(os.path.join(copy.path, _MARK))
            ):
                continue
            for cache in os.scandir(copy.path):
                if cache.name.startswith(".") or not cache.is_dir(follow_symlinks=False):
                    continue
                dirs = [os.path.join(cache.path, _native.SHARDS_DIR)]
                with contextlib.suppress(FileNotFoundError):
                    dirs += [
                        os.path.join(part.path, _native.SHARDS_DIR)
                        for part in os.scandir(os.path.join(cache.path, _native.PARTS_DIR))
                    ]
                for shards in dirs:
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        found.extend(
                            e for e in os.scandir(shards) if e.is_file(follow_symlinks=False)
                        )
    return found


def evict(local: Path, limit: int, keep: AbstractSet[Path] = frozenset()) -> int:
    """Deletes least recently used shards under ``local`` until at most ``limit`` bytes remain.

    Spares ``keep`` and what this process pinned; returns the bytes deleted. A reader that
    has a deleted shard mapped keeps reading it (its space is freed when the last mapping
    goes); a reader that needs it later fetches it again.
    """
    entries = []
    for entry in _shard_files(local):
        with contextlib.suppress(FileNotFoundError):
            stat = entry.stat(follow_symlinks=False)
            entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    with _lock:
        spared = set(keep) | _pinned
    freed = 0
    for _, size, path in sorted(entries):
        if total - freed <= limit:
            break
        if Path(path) in spared:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            freed += size
    return freed
