r"""How records become bytes and back: pickle (protocol 5), dill, or your own functions.

The default serializer, ``"pickle"``, keeps large buffers (contiguous NumPy arrays,
``memoryview``, ``pickle.PickleBuffer``) out of the pickle stream; ``bytes`` and
``bytearray`` stay in it, since decoding must give them memory of their own anyway. A
record that holds any large buffer is stored as::

    b"DRTOOB01"  u64 buffer count n  u64 pickle length
    n x (u64 offset, u64 length)           offsets from the record's first byte
    the pickle stream (protocol 5, with NEXT_BUFFER opcodes)
    buffer 0, buffer 1, ...                each at an offset that is a multiple of 64

Records start 64-byte aligned in shards and in loader batches, so every buffer is 64-byte
aligned in memory, and :func:`loads` hands it to the unpickler as a read-only view: a
NumPy array comes back as a view of the record's bytes instead of a copy of them. A record
without large buffers is the plain pickle stream (it starts with ``b"\x80\x05"``).
"""

from __future__ import annotations

import functools
import importlib
import io
import pickle
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from dataset_rt import _native
from dataset_rt.errors import ArgumentError, SerializationError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "Decoder",
    "PickleDecoder",
    "Serializer",
    "SerializerSpec",
    "decoder_for",
    "dumps",
    "loads",
    "resolve_serializer",
    "token_count",
]

Serializer = Callable[[Any], bytes | bytearray | memoryview]
"""A function turning one record into its bytes."""

Decoder = Callable[[bytes], Any]
"""A function turning a record's bytes (a ``bytes`` object) back into the record."""

SerializerSpec = Literal["pickle", "pickle-inband", "dill", "tokens"] | str | Serializer
"""``"pickle"`` (out-of-band buffers), ``"pickle-inband"``, ``"dill"``, ``"tokens"`` (or
``"tokens:<dtype>"``, one-dimensional arrays of token ids), or a function."""

PICKLE_PROTOCOL = 5


# A C-level partial: no Python frame per record.
_pickle_dumps: Serializer = functools.partial(pickle.dumps, protocol=PICKLE_PROTOCOL)

# The record layout belongs to the native format module, which reads what this one writes.
MAGIC = _native.OOB_MAGIC
_HEAD = struct.Struct("<8sQQ")
_SPAN = struct.Struct("<QQ")
_HEAD_SIZE, _SPAN_SIZE = _HEAD.size, _SPAN.size
_unpack_head, _unpack_span = _HEAD.unpack_from, _SPAN.unpack_from
_SHORT = "record is shorter than its out-of-band header says"
ALIGN = _native.RECORD_ALIGN
"""Alignment of out-of-band buffers within a record (and of records in shards and batches)."""
MIN_OUT_OF_BAND = _native.MIN_OUT_OF_BAND
"""Buffers smaller than this stay in the pickle stream. Decoding a record with out-of-band
buffers costs a few microseconds more in Python than plain ``pickle.loads``, the time it
takes to copy about 64 KiB; below that, copying is the cheaper way."""


class _ViewPickler(pickle.Pickler):
    """A pickler that also accepts ``memoryview`` objects, as out-of-band buffers."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is memoryview:
            return memoryview, (pickle.PickleBuffer(obj),)
        return NotImplemented


def dumps(record: Any) -> bytes:
    """Serializes ``record`` with pickle protocol 5, large buffers out of band and aligned.

    Examples
    --------
    >>> import numpy as np
    >>> from dataset_rt.serialize import dumps, loads
    >>> data = dumps({"image": np.arange(32768, dtype=np.float32), "label": 3})
    >>> back = loads(data)
    >>> back["image"].flags.writeable, float(back["image"][-1]), back["label"]
    (False, 32767.0, 3)
    """
    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: stays in band
            return True
        if raw.nbytes < MIN_OUT_OF_BAND:
            return True
        buffers.append(raw)
        return False

    try:
        body = pickle.dumps(record, protocol=PICKLE_PROTOCOL, buffer_callback=out_of_band)
    except TypeError as exc:
        if "memoryview" not in str(exc):
            raise
        # pickle refuses memoryview objects; the slower pickler below stores them as
        # buffers (only records that hold one pay for it).
        buffers.clear()
        stream = io.BytesIO()
        _ViewPickler(stream, protocol=PICKLE_PROTOCOL, buffer_callback=out_of_band).dump(record)
        body = stream.getvalue()
    if not buffers:
        return body
    position = _HEAD.size + _SPAN.size * len(buffers) + len(body)
    spans = []
    tail: list[bytes | memoryview] = []
    for raw in buffers:
        pad = -position % ALIGN
        if pad:
            tail.append(bytes(pad))
            position += pad
        spans.append(_SPAN.pack(position, raw.nbytes))
        tail.append(raw)
        position += raw.nbytes
    return b"".join([_HEAD.pack(MAGIC, len(buffers), len(body)), *spans, body, *tail])


def loads(data: bytes | memoryview, *, copy: bool = False) -> Any:
    """Decodes a record written by :func:`dumps` (or any plain pickle).

    Out-of-band buffers become read-only views of ``data`` (NumPy arrays are views, not
    copies); they keep ``data`` alive for as long as they exist. ``copy=True`` gives each
    buffer its own writable memory instead.
    """
    view = memoryview(data)
    if view[:8] != MAGIC:
        return pickle.loads(data)
    size = view.nbytes
    if size < _HEAD_SIZE:
        raise pickle.UnpicklingError(_SHORT)
    _, count, length = _unpack_head(view)
    start = _HEAD_SIZE + _SPAN_SIZE * count
    if start + length > size:
        raise pickle.UnpicklingError(_SHORT)
    buffers: list[Any] = []
    for at in range(_HEAD_SIZE, start, _SPAN_SIZE):
        offset, nbytes = _unpack_span(view, at)
        if offset + nbytes > size:
            raise pickle.UnpicklingError(_SHORT)
        buffers.append(
            bytearray(view[offset : offset + nbytes]) if copy else view[offset : offset + nbytes]
        )
    return pickle.loads(view[start : start + length], buffers=buffers)


_LOADS = {copy: functools.partial(loads, copy=copy) for copy in (False, True)}
""":func:`loads` with each value of ``copy``, made once."""


class PickleDecoder:
    """The decoder of caches written with ``serializer="pickle"``: :func:`loads`.

    Loaders hand it each record as a ``memoryview`` of the mapped shard or of their batch's
    buffer, so that arrays come back as views of that memory without a copy.
    """

    def __init__(self, *, copy: bool = False) -> None:
        self.copy = copy

    def __call__(self, data: bytes | memoryview) -> Any:
        """Decodes one record with :func:`loads`."""
        return loads(data, copy=self.copy)

    @property
    def function(self) -> Callable[[bytes | memoryview], Any]:
        """The same decoding as a plain function, without this class's ``__call__``.

        Native loops over many records call it.
        """
        return _LOADS[self.copy]

    def __repr__(self) -> str:
        return f"PickleDecoder(copy={self.copy})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickleDecoder) and other.copy == self.copy

    def __hash__(self) -> int:
        return hash((PickleDecoder, self.copy))


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
        ``"pickle"`` (protocol 5, large buffers out of band), ``"pickle-inband"`` (plain
        ``pickle.dumps``), ``"dill"``, or a callable returning bytes.

    Returns
    -------
    tuple
        ``(name, serialize)``; custom callables are recorded as ``custom:<module>.<name>``.
    """
    if spec == "pickle":
        return "pickle", dumps
    if spec == "pickle-inband":
        return "pickle-inband", _pickle_dumps
    if spec == "dill":
        dill = _import_dill()

        def dill_dumps(record: Any) -> bytes:
            # recurse=True stores only the globals a function uses, not its whole module
            # namespace (which may hold unpicklable objects, and would bloat every record).
            return dill.dumps(record, protocol=PICKLE_PROTOCOL, recurse=True)  # type: ignore[no-any-return]

        return "dill", dill_dumps
    if isinstance(spec, str) and (spec == "tokens" or spec.startswith("tokens:")):
        return spec, token_serializer(spec)
    if callable(spec):
        module = getattr(spec, "__module__", None) or "?"
        qualname = getattr(spec, "__qualname__", None) or type(spec).__name__
        return f"custom:{module}.{qualname}", spec
    raise ArgumentError(
        "serializer must be 'pickle', 'pickle-inband', 'dill', 'tokens', 'tokens:<dtype>' or "
        "a callable returning bytes, "
        f"got {spec!r}"
    )


_DESCRIPTIONS = {
    "pickle": "pickle protocol 5; arrays of 64 KiB or more stored apart, read back as views",
    "pickle-inband": "plain pickle protocol 5; arrays read back as copies",
    "dill": "dill, which also pickles lambdas and classes defined in __main__",
    "tokens": "token ids, each document in the narrowest of uint16, uint32, int32, int64",
}


def describe_serializer(name: str) -> str:
    """One line saying what a serializer (by the name users pass) writes."""
    if name.startswith("custom:"):
        return f"{name[len('custom:') :]}, a custom function; pass decode= to read records"
    if name.startswith("tokens:"):
        return f"token ids stored as {name[len('tokens:') :]}"
    return _DESCRIPTIONS.get(name, name)


def decoder_for(serializer: str, *, copy: bool = False) -> Decoder | None:
    """The decoder matching a cache's recorded serializer, or None for custom serializers.

    The manifest records the names ``serializer=`` takes (the native reader renames those of
    caches written before format version 2). ``copy`` applies to out-of-band buffers
    (``"pickle"``): writable private arrays instead of read-only views.
    """
    if serializer == "pickle":
        return PickleDecoder(copy=copy)
    if serializer == "pickle-inband":
        return pickle.loads
    if serializer == "dill":
        return _import_dill().loads  # type: ignore[no-any-return]
    if serializer == "tokens" or serializer.startswith("tokens:"):
        return decode_tokens
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


# -- token documents --------------------------------------------------------------------------
# A token record is an 8-byte header, b"DRTTOK", the struct code of its ids' type and a zero
# byte, then the ids, little-endian. The native token packer reads the same layout.
TOKEN_MAGIC = _native.TOKEN_MAGIC
TOKEN_DTYPES = {"uint16": "H", "uint32": "I", "int32": "i", "int64": "q"}
"""The token types a token record holds, by NumPy name, with their struct codes."""
_TOKEN_CODES = {code: name for name, code in TOKEN_DTYPES.items()}
_TOKEN_HEADERS = {name: TOKEN_MAGIC + code.encode() + b"\0" for name, code in TOKEN_DTYPES.items()}
TOKEN_RANGES = {
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
}
"""The ids each token type holds: ``(lowest, highest)``."""


def _narrowest(low: int, high: int) -> str:
    if low >= 0:
        return "uint16" if high <= 0xFFFF else "uint32" if high <= 0xFFFF_FFFF else "int64"
    return "int32" if low >= -(2**31) and high < 2**31 else "int64"


def _token_array(document: Any) -> npt.NDArray[Any]:
    """A document's ids as a one-dimensional integer array; refuses anything else."""
    import numpy as np

    if isinstance(document, np.ndarray):
        array = document
    elif isinstance(document, (list, tuple, range)):
        try:
            array = np.asarray(document, dtype=np.int64)
        except (OverflowError, ValueError, TypeError) as exc:
            raise SerializationError(f"a token document must be integer ids: {exc}") from exc
    else:
        raise SerializationError(
            "a token document must be a one-dimensional NumPy array or a list of int ids, "
            f"not {type(document).__name__}"
        )
    if array.ndim != 1:
        raise SerializationError(
            f"a token document must be one-dimensional, got an array of shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise SerializationError(
            f"token ids must be integers, got an array of {array.dtype} (tokenize first, "
            "or cast ids that are whole numbers with .astype)"
        )
    if array.size == 0:
        raise SerializationError("a token document is empty: a document needs one token")
    return array


def token_serializer(spec: str) -> Serializer:
    """The function writing token records for ``serializer=spec`` (``tokens[:<dtype>]``).

    ``"tokens"`` stores each document in the narrowest type that holds its ids; a named
    type stores every document in it and refuses ids it cannot hold.
    """
    fixed = spec.partition(":")[2] or None
    if fixed is not None and fixed not in TOKEN_DTYPES:
        raise ArgumentError(
            f"serializer {spec!r}: the token type must be one of {sorted(TOKEN_DTYPES)}"
        )

    import numpy

    def dump_tokens(document: Any) -> bytes:
        array = _token_array(document)
        low, high = int(array.min()), int(array.max())
        dtype = fixed or _narrowest(low, high)
        floor, ceiling = TOKEN_RANGES[dtype]
        if low < floor or high > ceiling:
            bad = low if low < floor else high
            raise SerializationError(
                f"token id {bad} does not fit the cache's token type {dtype} "
                f"(ids from {floor} to {ceiling}); pass serializer='tokens' to choose per "
                "document, or a wider type"
            )
        ids = array.astype(numpy.dtype(dtype).newbyteorder("<"), copy=False)
        return _TOKEN_HEADERS[dtype] + ids.tobytes()

    return dump_tokens


def token_count(data: bytes | memoryview) -> int:
    """The number of ids in a token record."""
    return (len(data) - len(TOKEN_MAGIC) - 2) // struct.calcsize(_token_code(data))


def _token_code(data: bytes | memoryview) -> str:
    view = memoryview(data)
    if len(view) < 8 or view[:6] != TOKEN_MAGIC or view[7] != 0:
        raise SerializationError("a token record must start with its 8-byte DRTTOK header")
    code = chr(view[6])
    if code not in _TOKEN_CODES:
        raise SerializationError(f"a token record holds ids of an unknown type {code!r}")
    return code


def decode_tokens(data: bytes | memoryview) -> npt.NDArray[Any]:
    """A token record's ids: a read-only NumPy view of the record's bytes, in its type."""
    import numpy

    code = _token_code(data)
    return numpy.frombuffer(data, dtype=numpy.dtype(_TOKEN_CODES[code]).newbyteorder("<"), offset=8)
