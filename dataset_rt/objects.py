"""Object storage: one cache's directory under a URL, reached through obstore.

obstore is the Python binding of the Rust ``object_store`` crate that Polars' own cloud
readers use. ``storage_options`` take the keys Polars takes (``aws_endpoint_url``,
``aws_access_key_id``, ``aws_secret_access_key``, ``aws_region``, ``aws_allow_http``, ...),
and without them the standard environment variables and profiles apply. A request that
fails with a server error, a dropped connection or (when reading) a timeout is retried with
backoff for a few seconds, then raised as :class:`~dataset_rt.errors.CacheIOError` naming
the object.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dataset_rt import _native
from dataset_rt.errors import (
    ArgumentError,
    CacheIOError,
    CacheNotFoundError,
    DatasetRTError,
)
from dataset_rt.roots import is_url

__all__ = ["RemoteDir", "StorageOptions", "list_names", "read_manifest", "remote_manifest"]

StorageOptions = Mapping[str, Any] | None
"""Options for the object store, with the keys Polars' cloud readers take."""

# Keys object_store takes as HTTP client options rather than as the store's configuration,
# with or without a provider prefix (Polars passes both kinds in one dict).
_CLIENT_KEYS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "timeout",
    "user_agent",
}
_PREFIXES = ("aws_", "google_", "azure_")
# Requests that fail with a 5xx, a dropped connection or (reads) a timeout are retried with
# exponential backoff and jitter, then raised: a few seconds of trying, not object_store's
# default of minutes.
_RETRY = {
    "max_retries": 5,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=5),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=60),
}


def _split_options(options: StorageOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in (options or {}).items():
        bare = key.lower()
        for prefix in _PREFIXES:
            bare = bare.removeprefix(prefix)
        if bare in _CLIENT_KEYS:
            client[bare] = value
        else:
            config[key] = value
    return config, client


class Cancelled(Exception):
    """A download stopped because its reader no longer needs it."""


def _store(url: str, options: StorageOptions) -> Any:
    """An obstore store rooted at ``url``."""
    import obstore.store

    config, client = _split_options(options)
    # Typed per provider by obstore; the keys are the user's, checked by object_store.
    from_url: Any = obstore.store.from_url
    try:
        if urlparse(url).scheme == "file":  # a directory: no client, nothing to retry
            return from_url(url, mkdir=True)
        return from_url(url, config=config, client_options=client, retry_config=_RETRY)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # obstore panics (a BaseException) on some bad options
        raise ArgumentError(f"cannot reach {url} with these options: {exc}") from None


class RemoteDir:
    """A directory in object storage, ``<url>/<name>/``: a cache's, or with ``name=""`` a root."""

    def __init__(self, url: str, name: str, options: StorageOptions) -> None:
        if not is_url(url):
            raise ArgumentError(
                f"{url!r} is not an object-storage URL; use s3://bucket/prefix, gs://, az:// "
                "or file://"
            )
        self.url = f"{url.rstrip('/')}/{name}" if name else url.rstrip("/")
        self.store = _store(self.url, options)

    def where(self, path: str) -> str:
        """The URL of object ``path``, for messages."""
        return f"{self.url}/{path}"

    def error(self, path: str, exc: BaseException) -> Exception:
        """``exc`` from the object store, as the error of dataset_rt that says what failed."""
        import obstore.exceptions as oe

        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        where = self.where(path)
        if "NoSuchBucket" in str(exc) or "bucket does not exist" in str(exc).lower():
            bucket = urlparse(self.url).netloc
            return CacheIOError(f"bucket {bucket!r} does not exist (at {where})")
        if isinstance(exc, FileNotFoundError | oe.NotFoundError):
            return CacheNotFoundError(f"no object at {where}")
        refused = re.search(r"\b(401 Unauthorized|403 Forbidden)\b", str(exc))
        if refused or isinstance(exc, oe.UnauthenticatedError | oe.PermissionDeniedError):
            code = re.search(r"<Code>(\w+)</Code>", str(exc))
            why = code.group(1) if code else text
            return CacheIOError(
                f"access to {where} was refused ({why}): check the credentials in "
                "storage_options or the environment"
            )
        return CacheIOError(f"object storage failed on {where}: {text}")

    def get(self, path: str) -> bytes:
        """Object ``path``'s bytes."""
        import obstore

        try:
            return bytes(obstore.get(self.store, path).bytes())
        except Exception as exc:
            raise self.error(path, exc) from exc

    def exists(self, path: str) -> bool:
        """Whether object ``path`` exists."""
        import obstore

        try:
            obstore.head(self.store, path)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if isinstance(self.error(path, exc), CacheNotFoundError):
                return False
            raise self.error(path, exc) from exc
        return True

    def download(self, path: str, target: Path, stop: threading.Event | None = None) -> int:
        """Writes object ``path`` to file ``target``; returns its size.

        With ``stop``, a download stops between chunks once it is set (raising
        :class:`Cancelled`), leaving ``target`` incomplete.
        """
        import obstore

        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = target.open("wb")
        except OSError as exc:
            raise CacheIOError(f"cannot write {target}: {exc}") from exc
        written = 0
        with out:
            try:
                for chunk in obstore.get(self.store, path).stream(min_chunk_size=8 << 20):
                    if stop is not None and stop.is_set():
                        raise Cancelled(self.where(path))
                    try:
                        out.write(chunk)
                    except OSError as exc:  # the local disk: full, say
                        raise CacheIOError(f"writing {target} failed: {exc}") from exc
                    written += len(chunk)
            except (Cancelled, DatasetRTError):
                raise
            except Exception as exc:
                raise self.error(path, exc) from exc
        return written

    def paths(self) -> list[str]:
        """The paths of every object under this directory, relative to it."""
        import obstore

        try:
            return [meta["path"] for batch in obstore.list(self.store) for meta in batch]
        except Exception as exc:
            raise self.error("", exc) from exc

    def delete(self, path: str) -> None:
        """Deletes object ``path``."""
        import obstore

        try:
            obstore.delete(self.store, path)
        except Exception as exc:
            raise self.error(path, exc) from exc

    def upload(self, path: str, source: Path) -> None:
        """Uploads file ``source`` as object ``path``."""
        import obstore

        try:
            obstore.put(self.store, path, source)
        except Exception as exc:
            raise self.error(path, exc) from exc


def list_names(url: str, options: StorageOptions) -> list[str]:
    """The names of the caches directly under ``url``: directories holding a manifest."""
    import obstore

    where = RemoteDir(url, "", options)
    try:
        listed = obstore.list_with_delimiter(where.store)
    except Exception as exc:
        raise where.error("", exc) from exc
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in listed["common_prefixes"])
    return [
        n for n in names if not n.startswith(".") and where.exists(f"{n}/{_native.MANIFEST_FILE}")
    ]


def remote_manifest(remote: RemoteDir) -> tuple[bytes, _native.Manifest] | None:
    """The manifest of the cache in ``remote``: as stored, and as the engine reads it.

    None if there is none.

    Raises
    ------
    CacheCorruptError
        The object is not a manifest this dataset_rt reads (:class:`CacheVersionError`:
        one of a newer format).
    """
    try:
        raw = remote.get(_native.MANIFEST_FILE)
    except CacheNotFoundError:
        return None
    return raw, _native.parse_manifest(raw, remote.where(_native.MANIFEST_FILE))


def read_manifest(remote: RemoteDir) -> _native.Manifest:
    """The manifest of the cache in ``remote``, read and checked by the engine.

    Raises
    ------
    CacheNotFoundError
        There is none.
    CacheCorruptError
        It is not a manifest this dataset_rt reads.
    """
    found = remote_manifest(remote)
    if found is None:
        raise CacheNotFoundError(f"no object at {remote.where(_native.MANIFEST_FILE)}")
    return found[1]
