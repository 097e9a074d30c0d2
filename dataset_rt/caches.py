"""Open caches: :class:`Cache`, :func:`open` and :func:`list_caches`."""

from __future__ import annotations

import operator
import pickle
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from dataset_rt import _native, registry, roots
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    DatasetRTError,
    SampleIndexError,
    SerializationError,
)
from dataset_rt.progress import format_bytes
from dataset_rt.registry import utc_time
from dataset_rt.roots import PathLike, resolve_root, root_url
from dataset_rt.serialize import Decoder, PickleDecoder, decoder_for
from dataset_rt.verify import VerifyReport, verify
from dataset_rt.versions import MetadataVersions, local_copy

if TYPE_CHECKING:
    pass

__all__ = [
    "Cache",
    "open",
    "open_by_id",
    "restore_saved_plan",
    "saved_plan",
]


class Cache(MetadataVersions):
    """A cache on disk: payload records by ``sample_id`` and their metadata table.

    Get one from :func:`dataset_rt.cache` or :func:`dataset_rt.open`. The index and the
    payload shards are memory-mapped; opening reads no payload bytes.

    Examples
    --------
    >>> import dataset_rt as drt
    >>> c = drt.cache([{"x": i} for i in range(3)], "doc-cache-example", progress=False)
    >>> len(c), c.get(2)
    (3, {'x': 2})
    """

    def __init__(
        self, reader: _native.CacheReader, root: Path, decode: Decoder | None = None
    ) -> None:
        self._reader = reader
        self._root = root
        self._manifest = reader.manifest
        if decode is not None:
            registry.remember_decoder(self._manifest.cache_id, decode)
        self._decode = decode if decode is not None else decoder_for(self._manifest.serializer)
        self._metadata: tuple[int, pl.DataFrame] | None = None
        self._plan_held: tuple[int, _native.Opened] | None = None

    # -- identity -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The cache's name, unique under its root."""
        return self._manifest.name

    @property
    def root(self) -> Path:
        """The root directory holding this cache."""
        return self._root

    @property
    def path(self) -> Path:
        """The cache's directory (for a remote cache, that of its local copy)."""
        return Path(self._reader.path)

    @property
    def url(self) -> str | None:
        """The object-storage URL the cache was opened from; None for a cache on disk."""
        copy = local_copy(self.path)
        return None if copy is None else copy.remote.url

    @property
    def cache_id(self) -> str:
        """Unique per build: a rebuilt cache of the same name has a new id."""
        return self._manifest.cache_id

    @property
    def serializer(self) -> str:
        """How the records were serialized, as ``drt.cache(serializer=...)`` names it.

        ``pickle``, ``pickle-inband``, ``dill`` or ``custom:<module>.<function>``.
        """
        return self._manifest.serializer

    @property
    def decoder(self) -> Decoder | None:
        """The decoder of :meth:`get` and of loaders; None for a custom serializer."""
        return self._decode

    @property
    def created_at(self) -> datetime:
        """When the cache was built (UTC)."""
        return utc_time(self._manifest.created_at)

    @property
    def nbytes(self) -> int:
        """Total size of the serialized records in bytes."""
        return self._manifest.nbytes

    @property
    def compression(self) -> str | tuple[str, int] | None:
        """How records are compressed, as ``drt.cache(compression=...)`` takes it.

        ``None``, ``("zstd", level)`` or ``"lz4"``.
        """
        codec, level = self._manifest.compression, self._manifest.compression_level
        if codec == "none":
            return None
        return (codec, level) if level is not None else codec

    @property
    def nbytes_on_disk(self) -> int:
        """Bytes of the payload shard files: after compression, padding included."""
        return self._manifest.shard_bytes

    @property
    def num_shards(self) -> int:
        """Number of payload shard files."""
        return self._manifest.num_shards

    @property
    def num_parts(self) -> int:
        """Number of parts: 1 for the build, plus 1 per :func:`~dataset_rt.append`."""
        return self._manifest.num_parts

    def __len__(self) -> int:
        return len(self._reader)

    # -- records ----------------------------------------------------------------------------
    def get_bytes(self, sample_id: int, *, verify: bool = False) -> bytes:
        """The serialized bytes of one record.

        Parameters
        ----------
        sample_id
            The record's position in the source, ``0 <= sample_id < len(cache)``.
        verify
            Check the bytes against the checksum stored at build time; a mismatch raises
            :class:`~dataset_rt.errors.CacheCorruptError`.
        """
        return self._reader.get_bytes(_as_sample_id(sample_id), verify)

    def get(
        self,
        sample_id: int,
        *,
        decode: Decoder | None = None,
        verify: bool = False,
        copy: bool = False,
    ) -> Any:
        """One record, decoded.

        Parameters
        ----------
        sample_id
            The record's position in the source, ``0 <= sample_id < len(cache)``.
        decode
            Overrides the decoder; by default the one matching the cache's serializer
            (:func:`dataset_rt.serialize.loads` for pickle), or the ``decode`` given when
            opening.
        verify
            Check the record's checksum before decoding.
        copy
            Give NumPy arrays stored out of band their own writable memory; by default they
            are read-only views of the mapped shard (records of 64 KiB or more) or of an
            aligned copy of the record, which they keep alive.
        """
        # The common call, get(i), costs a few hundred nanoseconds on top of the decoding.
        decoder = self._decode
        if decode is not None or copy or decoder is None:
            decoder = self._decoder(decode, copy)
        sid = sample_id if type(sample_id) is int and sample_id >= 0 else _as_sample_id(sample_id)
        if not isinstance(decoder, PickleDecoder):
            return self._decode_one(decoder, sid, self.get_bytes(sid, verify=verify))
        try:
            return self._reader.get(sid, verify, pickle.loads, decoder.function)
        except DatasetRTError:
            raise
        except Exception as exc:
            raise self._decode_error(sid, exc) from exc

    def get_many(
        self,
        sample_ids: Iterable[int],
        *,
        decode: Decoder | None = None,
        verify: bool = False,
        copy: bool = False,
    ) -> list[Any]:
        """The records at ``sample_ids``, decoded, in order (ids may repeat).

        One native read for all of them, with the GIL released: what a map-style PyTorch
        ``Dataset`` over a cache returns from ``__getitems__``, which ``DataLoader`` calls
        with a whole batch of indices. Options as in :meth:`get`.

        Examples
        --------
        >>> import dataset_rt as drt
        >>> c = drt.cache([{"x": i} for i in range(5)], "doc-get-many", progress=False)
        >>> c.get_many([4, 0, 4])
        [{'x': 4}, {'x': 0}, {'x': 4}]
        """
        decoder = self._decoder(decode, copy)
        ids = sample_ids.tolist() if hasattr(sample_ids, "tolist") else list(sample_ids)
        if not isinstance(decoder, PickleDecoder):
            # One native call copies each record once, from its shard into its bytes.
            try:
                data = self._reader.get_many_bytes(ids, verify)
            except (OverflowError, TypeError):
                _check_ids(ids)
                raise
            return [self._decode_one(decoder, i, b) for i, b in zip(ids, data, strict=True)]
        # Records with large arrays stay in the mapped shard, the others are copied into the
        # batch at aligned addresses: either way their arrays decode as views.
        try:
            batch = self._reader.get_batch(ids, verify, True)
        except (OverflowError, TypeError):
            _check_ids(ids)
            raise
        try:
            records = batch.decode(pickle.loads, decoder.function)
        except Exception:  # decode again one by one, to name the record that fails
            views = batch.views()
            records = [self._decode_one(decoder, i, v) for i, v in zip(ids, views, strict=True)]
        if batch.shrank:  # arrays viewing a shard read zeros where it was truncated
            raise CacheCorruptError(
                f"a shard of cache {self.name!r} shrank while it was mapped (truncated by "
                "another process?); check it with `dataset-rt verify` and open it again"
            )
        return records

    def _decoder(self, decode: Decoder | None, copy: bool) -> Decoder:
        decoder = decode if decode is not None else self._decode
        if copy and isinstance(decoder, PickleDecoder):
            decoder = PickleDecoder(copy=True)
        if decoder is None:
            raise SerializationError(
                f"cache {self.name!r} was written with the serializer {self.serializer}; "
                "pass decode=<function from bytes to record> to get() or to open()"
            )
        return decoder

    def _decode_one(self, decoder: Decoder, sample_id: int, data: bytes | memoryview) -> Any:
        try:
            return decoder(data)  # type: ignore[arg-type]  # PickleDecoder takes views too
        except Exception as exc:
            raise self._decode_error(sample_id, exc) from exc

    def _decode_error(self, sample_id: int, exc: Exception) -> SerializationError:
        return SerializationError(
            f"decoding sample_id {sample_id} of cache {self.name!r} failed: {exc!r}"
        )

    def verify(self, *, progress: bool = True) -> VerifyReport:
        """Reads every byte of the cache and reports what is damaged.

        See :func:`dataset_rt.verify`; damage is listed in the report, not raised. A remote
        cache's shards are fetched first (each checked as it arrives), then its copy is read;
        they must fit in its ``local_limit``.
        """
        copy = local_copy(self.path)
        if copy is not None:
            limit = copy.source.local_limit
            if limit is not None and self.nbytes_on_disk > limit:
                raise ArgumentError(
                    f"verifying cache {self.name!r} reads all {self.nbytes_on_disk:,} bytes of "
                    f"its shards from local disk, more than local_limit={limit:,}; open it with "
                    "a larger local_limit, or none"
                )
            try:
                copy.fetch_all(progress=progress)
                return verify(self.name, root=self._root, progress=progress)
            finally:
                copy.release()
        return verify(self.name, root=self._root, progress=progress)

    # -- display ----------------------------------------------------------------------------
    def _summary(self) -> list[tuple[str, str]]:
        return [
            ("name", self.name),
            ("samples", f"{len(self):,}"),
            ("size", format_bytes(self.nbytes)),
            ("shards", str(self.num_shards)),
            ("parts", str(self.num_parts)),
            ("serializer", self.serializer),
            ("compression", describe_compression(self)),
            ("cache_id", self.cache_id),
            ("created", self.created_at.strftime("%Y-%m-%d %H:%M:%S UTC")),
            ("path", str(self.path)),
        ]

    def __repr__(self) -> str:
        return (
            f"Cache({self.name!r}, samples={len(self):,}, size={format_bytes(self.nbytes)}, "
            f"serializer={self.serializer!r}, cache_id={self.cache_id!r}, path='{self.path}')"
        )

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
            f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
            for k, v in self._summary()
        )
        schema = ", ".join(
            f"{html.escape(name)}: {html.escape(str(dtype))}"
            for name, dtype in self.scan().collect_schema().items()
        )
        return (
            f"<div><b>dataset_rt.Cache</b><table>{rows}"
            f"<tr><th style='text-align:left'>metadata</th><td style='text-align:left'>"
            f"{schema}</td></tr></table></div>"
        )


def describe_compression(cache: Cache) -> str:
    """The codec and what it saved, for ``info`` and the notebook view."""
    spec = cache.compression
    if spec is None:
        return "none"
    codec = f"{spec[0]} level {spec[1]}" if isinstance(spec, tuple) else spec
    ratio = cache.nbytes / max(cache.nbytes_on_disk, 1)
    return f"{codec}: {format_bytes(cache.nbytes_on_disk)} on disk ({ratio:.2f}x smaller)"


def saved_plan(
    frame: object, verify: bool = False
) -> tuple[Cache, str, str, int, int | None] | None:
    """The saved plan of the version ``frame`` scans, if it is an unchanged scan of one.

    Returns (cache, plan path, digest, rows, tokens: see ``_version_plan``), or None:
    ``frame`` is not an unchanged :meth:`Cache.scan`, or its version has no sound plan
    (checked against its checksum with ``verify``).
    """
    found = registry.saved_version(frame)
    if found is None:
        return None
    cache, version = found
    plan = cache._version_plan(version, verify)
    return None if plan is None else (cache, *plan)


def restore_saved_plan(frame: object, plan: str) -> None:
    """Puts back the saved plan of the version ``frame`` scans, from a loader's own ``plan``.

    Only for an unchanged :meth:`Cache.scan` whose version lost its plan (or had it damaged),
    and only if ``plan`` is byte for byte the one that was saved.
    """
    found = registry.saved_version(frame)
    if found is not None:
        cache, version = found
        cache._restore_plan(version, plan)


def _as_sample_id(sample_id: int) -> int:
    try:
        value = operator.index(sample_id)
    except TypeError:
        raise TypeError(f"sample_id must be an int, not {type(sample_id).__name__}") from None
    if value < 0:
        raise SampleIndexError(f"sample_id {value} is negative; ids start at 0")
    return value


def _check_ids(ids: list[Any]) -> None:
    """Raises the error that names the first id of ``ids`` that is negative or not an int."""
    for i in ids:
        _as_sample_id(i)


def open(  # noqa: A001 - mirrors the builtin on purpose: drt.open(name)
    name: str,
    *,
    root: PathLike | None = None,
    decode: Decoder | None = None,
    storage_options: Mapping[str, Any] | None = None,
    local_dir: PathLike | None = None,
    local_limit: int | None = None,
) -> Cache:
    """Opens an existing cache by name, on disk or in object storage.

    Parameters
    ----------
    name
        The name the cache was built under.
    root
        The directory holding the caches, or an object-storage URL (``s3://bucket/prefix``,
        ``gs://``, ``az://``, ``file://``); default ``$DATASET_RT_HOME`` (either kind) or
        ``~/.cache/dataset_rt``.
    decode
        Decoder for :meth:`Cache.get`; needed only for caches written with a custom
        serializer.
    storage_options
        For a URL: credentials and settings with the keys Polars' cloud readers take
        (``aws_endpoint_url``, ``aws_access_key_id``, ``aws_region``, ``aws_allow_http``,
        ...); without them, the standard environment variables and profiles apply.
    local_dir
        For a URL: where the remote cache's files are kept on this machine; default
        ``$DATASET_RT_LOCAL_DIR``, else ``.remote`` under the local root. Opening fetches
        its metadata only; each payload shard is fetched when first read.
    local_limit
        For a URL: at most this many bytes of shards are kept under ``local_dir`` (every
        cache's together); the least recently used are deleted first. Default: no limit.

    Raises
    ------
    CacheNotFoundError
        No cache of that name exists under the root.
    CacheCorruptError
        The cache's files are damaged; :class:`~dataset_rt.errors.CacheVersionError` if a
        newer dataset_rt wrote it.
    CacheIOError
        Object storage failed: the message names the object (and a missing bucket, or
        refused credentials).
    """
    url = root_url(root)
    if url is not None:
        if local_limit is not None and (
            isinstance(local_limit, bool) or not isinstance(local_limit, int) or local_limit < 0
        ):
            raise ArgumentError(f"local_limit must be a number of bytes >= 0, got {local_limit!r}")
        local = roots.local_dir(local_dir)
        from dataset_rt import fetch

        source = fetch.sync(url, name, storage_options, local, local_limit)
        source.attach()  # before the reader opens: it fetches its shards through it
        return Cache(registry.open_reader(source.root, name), source.root, decode)
    if local_dir is not None or local_limit is not None:
        raise ArgumentError(
            "local_dir and local_limit apply to caches in object storage; this root is a directory"
        )
    root_path = resolve_root(root)
    return Cache(registry.open_reader(root_path, name), root_path, decode)


def open_by_id(cache_id: str, root: PathLike | None = None) -> Cache:
    """Opens the cache whose build has id ``cache_id`` (see :func:`registry.locate`).

    It decodes with the ``decode=`` this process last opened or built that cache with.

    Raises
    ------
    CacheNotFoundError
        No cache with this id where it was seen, nor under ``root``, the roots used so far in
        this process, or the default root.
    """
    reader, root_path = registry.locate(cache_id, root)
    return Cache(reader, root_path, registry.decoder_of(cache_id))
