"""How records become bytes and back: pickle (protocol 5), dill, or your own functions."""

from __future__ import annotations

import functools
import importlib
import pickle
from collections.abc import Callable
from typing import Any, Literal

from dataset_rt.errors import ArgumentError, SerializationError

__all__ = ["Decoder", "Serializer", "SerializerSpec", "decoder_for", "resolve_serializer"]

Serializer = Callable[[Any], bytes | bytearray | memoryview]
"""A function turning one record into its bytes."""

Decoder = Callable[[bytes], Any]
"""A function turning a record's bytes (a ``bytes`` object) back into the record."""

SerializerSpec = Literal["pickle", "dill"] | Serializer
"""``"pickle"``, ``"dill"``, or a function returning bytes."""

PICKLE_PROTOCOL = 5


# A C-level partial: no Python frame per record.
_pickle_dumps: Serializer = functools.partial(pickle.dumps, protocol=PICKLE_PROTOCOL)


def _import_dill() -> Any:
    try:
        return importlib.import_module("dill")
    except ImportError as exc:
        raise SerializationError(
            "serializer='dill' needs the dill package: pip install dill"
        ) from exc


def resolve_serializer(spec: SerializerSpec) -> tuple[str, Serializer]:
    """Returns the name the manifest records for ``spec`` and the function to call.

    Parameters
    ----------
    spec
        ``"pickle"`` (protocol 5), ``"dill"``, or a callable returning bytes.

    Returns
    -------
    tuple
        ``(name, serialize)``; custom callables are recorded as ``custom:<module>.<name>``.
    """
    if spec == "pickle":
        return "pickle", _pickle_dumps
    if spec == "dill":
        dill = _import_dill()

        def dill_dumps(record: Any) -> bytes:
            # recurse=True stores only the globals a function uses, not its whole module
            # namespace (which may hold unpicklable objects, and would bloat every record).
            return dill.dumps(record, protocol=PICKLE_PROTOCOL, recurse=True)  # type: ignore[no-any-return]

        return "dill", dill_dumps
    if callable(spec):
        module = getattr(spec, "__module__", None) or "?"
        qualname = getattr(spec, "__qualname__", None) or type(spec).__name__
        return f"custom:{module}.{qualname}", spec
    raise ArgumentError(
        f"serializer must be 'pickle', 'dill' or a callable returning bytes, got {spec!r}"
    )


def decoder_for(serializer: str) -> Decoder | None:
    """The decoder matching a cache's recorded serializer, or None for custom serializers."""
    if serializer == "pickle":
        return pickle.loads
    if serializer == "dill":
        return _import_dill().loads  # type: ignore[no-any-return]
    return None


def as_bytes(data: object, index: int, serializer: str) -> bytes:
    """Checks a serializer's output and returns it as ``bytes``."""
    if type(data) is bytes:
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise SerializationError(
        f"serializer {serializer} returned {type(data).__name__} for record {index}; "
        "it must return bytes, bytearray or memoryview"
    )
