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

import bisect
import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dataset_rt import _native
from dataset_rt.errors import (
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
    DatasetRTError,
    StaleCacheError,
)
from dataset_rt.objects import Cancelled, RemoteDir, StorageOptions, remote_manifest
from dataset_rt.progress import BuildProgress

__all__ = [
    "LocalCopy",
    "RemoteSource",
    "ShardPrefetch",
    "copy_for",
    "evict",
    "in_parallel",
    "on_demand",
    "sync",
]

# Shard downloads in flight at once, per process: object stores serve requests in parallel,
# and each waits on the network far more than on this machine (obstore releases the GIL).
IN_FLIGHT = 8

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
        if host != _HOST or not pid.isdigit() or _alive(int(pid)):
            continue  # another machine's (a shared local_dir), or still running
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
                f"no cache {name!r} under {url} ({remote.where('manifest.json')})"
            )
        raw, cache_id = found
        source = RemoteSource(
            url.rstrip("/"),
            name,
            cache_id,
            dict(storage_options) if storage_options else None,
            local,
            local_limit,
            hashlib.sha256(raw).hexdigest()[:16],
        )
        try:
            _sync_files(remote, source, raw)
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


def _sync_files(remote: RemoteDir, source: RemoteSource, raw: bytes) -> None:
    """Downloads what manifest ``raw`` names besides :func:`on_demand` files, then itself."""
    source.root.mkdir(parents=True, exist_ok=True)
    (source.root / _MARK).touch()
    _remove_dead_partials(source.root)
    manifest_path = source.path / "manifest.json"
    if _same_bytes(manifest_path, raw):
        return
    with _file_lock(source.root / _LOCKS / "manifest.lock"):
        if _same_bytes(manifest_path, raw):
            return
        staging = source.root / _PARTIAL / _partial_name("manifest")
        staging.mkdir(parents=True)
        try:
            (staging / "manifest.json").write_bytes(raw)
            manifest = _native.read_manifest(staging)
            later = on_demand(manifest)
            for file, checksum in manifest.files:
                target = source.path / file
                if file in later or (target.exists() and _matches(target, checksum)):
                    continue
                _download_checked(remote, file, target, source.root / _PARTIAL, None, checksum)
            os.replace(staging / "manifest.json", manifest_path)
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
        cache_id = None if found is None else found[1]
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


T = TypeVar("T")


def in_parallel(
    items: Sequence[T], transfer: Callable[[T], int], label: str, progress: bool
) -> None:
    """Runs ``transfer(item)`` for every item, ``IN_FLIGHT`` at a time, with one progress line.

    ``transfer`` returns the bytes it moved. The first failure cancels what has not started
    and is raised.
    """
    moved = [0]
    bar = BuildProgress(label, nbytes=lambda: moved[0], enabled=progress, total=len(items))
    ok = False
    try:
        with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="drt-transfer") as pool:
            pending = [pool.submit(transfer, item) for item in items]
            try:
                for count, future in enumerate(as_completed(pending), 1):
                    moved[0] += future.result()
                    bar.update(count)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
        bar.settle(len(items))
        ok = True
    finally:
        bar.close(ok=ok)


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
                dirs = [os.path.join(cache.path, "shards")]
                with contextlib.suppress(FileNotFoundError):
                    dirs += [
                        os.path.join(part.path, "shards")
                        for part in os.scandir(os.path.join(cache.path, "parts"))
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


@dataclass
class ShardPrefetch:
    """Fetches the shards a loader's epoch reads ahead of the batches that read them.

    ``order`` lists ``(copy, file, batch)``: each shard once, in the order batches first
    need it. Up to :data:`IN_FLIGHT` downloads run at once; with a ``local_limit``, the
    shards fetched but not yet needed stay within half of it, so that eviction never
    deletes what the next batches read.
    """

    order: list[tuple[LocalCopy, str, int]]
    budget: int | None
    position: int = 0
    """Batches consumed so far; the loader moves it on."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _moved: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    errors: list[Exception] = field(default_factory=list)
    """What failed ahead of the reads; the reader fetched those shards itself."""

    def start(self) -> ShardPrefetch:
        """Starts fetching on a thread of its own; returns itself."""
        self._thread = threading.Thread(target=self._run, name="drt-shard-prefetch", daemon=True)
        self._thread.start()
        return self

    def advance(self, position: int) -> None:
        """Records that ``position`` batches were consumed."""
        with self._moved:
            self.position = position
            self._moved.notify_all()

    def stop(self) -> None:
        """Stops fetching; downloads already running finish."""
        self._stop.set()
        with self._moved:
            self._moved.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        batches = [batch for _, _, batch in self.order]  # non-decreasing
        ends = [0]  # ends[i]: bytes of the first i shards of the order
        for copy, file, _ in self.order:
            ends.append(ends[-1] + copy.shards[file][0])
        running: list[Future[None]] = []
        with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="drt-fetch") as pool:
            for i, (copy, file, _) in enumerate(self.order):
                with self._moved:
                    while not self._stop.is_set() and not self._may_fetch(i, batches, ends):
                        self._moved.wait(0.5)
                while len(running) >= IN_FLIGHT and not self._stop.is_set():
                    futures.wait(running, return_when=futures.FIRST_COMPLETED)
                    running = [f for f in running if not f.done()]
                if self._stop.is_set():
                    break
                if not copy.present(file):
                    running.append(pool.submit(self._fetch, copy, file))
            # Running downloads see the stop flag between chunks; waiting ones never start.
            pool.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, copy: LocalCopy, file: str) -> None:
        try:
            copy.fetch(file, self._stop)
        except Cancelled:
            pass
        except Exception as exc:  # the reader fetches the shard again, and raises
            self.errors.append(exc)

    def _may_fetch(self, i: int, batches: list[int], ends: list[int]) -> bool:
        """Whether shard ``i`` of the order may be fetched now.

        It may if a consumed batch needs it, or if it fits in the budget with the shards
        before it that unconsumed batches need.
        """
        if self.budget is None or batches[i] <= self.position:
            return True
        first_ahead = bisect.bisect_right(batches, self.position)
        return ends[i + 1] - ends[first_ahead] <= self.budget
