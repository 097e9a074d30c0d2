"""Exceptions raised by dataset_rt.

Every exception is a :class:`DatasetRTError` and also an instance of the builtin exception a
caller would catch for the same problem, so ``except FileNotFoundError`` keeps working around
:func:`dataset_rt.open`, for example.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "CacheCorruptError",
    "CacheIOError",
    "CacheNameError",
    "CacheNotFoundError",
    "CacheVersionError",
    "DatasetRTError",
    "InternalError",
    "LoaderStateError",
    "MetadataError",
    "SampleIndexError",
    "SerializationError",
    "StaleCacheError",
    "TransformError",
    "WeightError",
    "WorkerError",
]


class DatasetRTError(Exception):
    """Base class of every error raised by dataset_rt."""


class CacheNotFoundError(DatasetRTError, FileNotFoundError):
    """No cache of that name exists under the root."""


class StaleCacheError(CacheNotFoundError):
    """The cache was rebuilt (it has a new ``cache_id``) since this object was created."""


class CacheCorruptError(DatasetRTError, OSError):
    """A file of the cache is missing, truncated or does not hold what it should."""


class CacheVersionError(CacheCorruptError):
    """The cache was written by a newer dataset_rt whose format this one cannot read."""


class CacheIOError(DatasetRTError, OSError):
    """The operating system refused a file operation (disk full, permissions, ...).

    ``errno`` and ``filename`` are set as on any :class:`OSError`.
    """


class SerializationError(DatasetRTError, ValueError):
    """A record could not be serialized, or its bytes could not be decoded."""


class MetadataError(DatasetRTError, ValueError):
    """Metadata values or a metadata table that dataset_rt cannot store."""


class WeightError(DatasetRTError, ValueError):
    """Sampling weights that are negative, NaN, infinite, missing or all zero."""


class CacheNameError(DatasetRTError, ValueError):
    """A cache name that cannot be used as a directory under the root."""


class SampleIndexError(DatasetRTError, IndexError):
    """A ``sample_id`` outside ``0 .. len(cache) - 1``."""


class ArgumentError(DatasetRTError, ValueError):
    """An argument outside its allowed values."""


class TransformError(DatasetRTError, RuntimeError):
    """A loader's ``transform`` raised on a sample; the message names the sample."""


class WorkerError(DatasetRTError, RuntimeError):
    """A loader's worker process did not start in time, or died while sending a batch."""


class InternalError(DatasetRTError, RuntimeError):
    """A broken invariant of dataset_rt itself: a bug, not something the caller did.

    The message asks for a report at the project's issue tracker.
    """


class LoaderStateError(DatasetRTError, ValueError):
    """A loader state that does not belong to this loader (other rows, weights or seed)."""
