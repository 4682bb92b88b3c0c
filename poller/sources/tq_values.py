"""TransferQueue's tag values, turned into plain ones without numpy or torch (poller process).

How the controller's codec (msgspec's msgpack with a hook) carries each kind of value, as found on real
0.1.11 replies (``tests/data/tq_kv_list_replies.msgpack``), and what it becomes:

- plain msgpack (tuples, sets, naive datetimes, UUIDs, Decimals, int keys as msgpack sends them): kept;
  a datetime with a time zone (ext -1): unreadable.
- numpy scalars (ext 1, a pickle of numpy's scalar constructor) -> ``bool``/``int``/``float`` as
  ``.item()`` gives; any other pickled class: unreadable.
- numpy arrays (ext 5) and tensors (ext 3): a pickled ``(dtype, shape, frame index)`` over raw elements ->
  the scalar or nested lists as ``.tolist()`` gives, for bool, int, uint and float dtypes (bfloat16 too), up
  to :data:`MAX_ELEMENTS`. Nested tensors (ext 4) and cloudpickled callables (ext 2): unreadable.
- an int no msgpack int holds makes the controller pickle the whole reply: :func:`restricted_loads` reads
  the same scalars, arrays and dense tensors (torch's legacy storage format) from it.

An unreadable value becomes an :class:`~poller.wire.vocabulary.UnreadableValue` (the poller quarantines that key
alone), an unreadable map key an :class:`UnreadableKey`. The restricted unpickler resolves no global by import.

Sections: :class:`ReplyValues` (a reply read with these rules, whole or one key's tags when the poller decodes a
changed key), plain values, the extension types, raw array elements, the restricted unpickler.
"""

from __future__ import annotations

import datetime
import functools
import io
import math
import pickle
import re
import struct
import sys
from typing import Any, Callable, Sequence

import msgpack

from poller.wire.vocabulary import UnreadableValue

__all__ = ["MAX_ELEMENTS", "ReplyValues", "UnreadableKey", "batch_meta_tags", "plain", "restricted_loads"]

#: Largest array or tensor turned into a list: the wire refuses more (``Limits.max_items``), and they cost ~30 MB.
MAX_ELEMENTS = 1_000_000


class UnreadableKey:
    """A map key a source could not read (hashable, unlike :class:`UnreadableValue`): to the poller, a non-str key."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unreadable key: {self.reason}>"


class _Deferred:
    """An extension value that is no hashable scalar, held until :func:`plain` puts it in place.

    msgpack's extension hook cannot know whether its value is a map key, which a list cannot be.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# -- a reply's msgpack ----------------------------------------------------------------------------

# The heads of msgpack's timestamp extension (type -1): fixext 4, fixext 8, ext 8 of 12 bytes.
_TIMESTAMP_MARKERS = (b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff")


class ReplyValues:
    """Reads msgpack of one reply as the controller's codec wrote it: its extension values and timestamps.

    ``malformed(exc)`` is the error a value that does not read raises from :meth:`decode` (the controller
    client's "malformed reply"), so a listing read packed fails as the same reply read whole would.
    """

    def __init__(self, frames: Sequence[bytes], malformed: Callable[[Exception], Exception]) -> None:
        self.frames = frames
        self.malformed = malformed
        # Pickled numpy scalars repeat (every key of a step holds the same global_steps): read each once per reply.
        self.scalars: dict[bytes, Any] = {}

    def read(self, data: bytes) -> Any:
        """The value packed in ``data`` (the whole message, or one key's tags), its tag values read."""
        deferred = False
        scalars, frames = self.scalars, self.frames

        def ext_hook(code: int, ext: bytes) -> Any:
            nonlocal deferred
            if code == 1 and ext in scalars:
                return scalars[ext]
            value = _ext_value(code, ext, frames)
            if not isinstance(value, (bool, int, float)):  # no hashable scalar
                deferred = True
                return _Deferred(value)
            if code == 1:
                scalars[ext] = value
            return value

        value = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook, timestamp=3)
        # A second walk only for a value held back, or a possible timestamp (ext -1, msgspec's aware
        # datetime), which msgpack reads as a datetime past the hook.
        if deferred or any(marker in data for marker in _TIMESTAMP_MARKERS):
            return plain(value)
        return value

    def decode(self, blobs: list[bytes]) -> list[Any]:
        """Each key's packed tags read (``PackedItems.decode`` of a listing read packed)."""
        try:
            return list(map(self.read, blobs))
        except Exception as exc:
            raise self.malformed(exc) from exc


# -- plain values ---------------------------------------------------------------------------------

_SCALARS = (str, int, float, bool, type(None), bytes)


def plain(obj: Any) -> Any:
    """``obj`` (from msgpack with :class:`_Deferred` values, or the restricted unpickler) made plain.

    Tuples and sets become lists, anything unreadable an :class:`UnreadableValue`. A container held more
    than once is converted once and shared, so a pickle nesting one list twice per level stays linear work.
    """
    return _value(obj, {})


def _value(obj: Any, memo: dict[int, Any]) -> Any:
    try:
        return _plain(obj, memo)
    except RecursionError:  # deep nesting, or a container that holds itself
        return UnreadableValue(f"nested deeper than this interpreter's recursion limit ({sys.getrecursionlimit()})")


def _plain(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, _SCALARS) or isinstance(obj, UnreadableValue):
        return obj
    if isinstance(obj, _Deferred):
        return obj.value
    if id(obj) in memo:
        return memo[id(obj)]
    if type(obj) is dict:
        result: Any = {_plain_key(k, memo): _value(v, memo) for k, v in obj.items()}
    elif isinstance(obj, (list, tuple, set, frozenset)):
        result = [_plain(item, memo) for item in obj]
    elif isinstance(obj, bytearray):
        result = bytes(obj)
    elif isinstance(obj, datetime.datetime):  # msgpack's timestamps
        result = UnreadableValue("a datetime with a time zone, which has no plain form")
    elif isinstance(obj, (_Refused, _DType, _Storage)):  # the restricted unpickler's stand-ins
        result = UnreadableValue(obj.reason)
    else:
        result = UnreadableValue(f"a {type(obj).__name__} value")
    # Keyed by id: ``obj`` stays alive (the input holds it) for as long as ``memo`` does.
    memo[id(obj)] = result
    return result


def _plain_key(key: Any, memo: dict[int, Any]) -> Any:
    if isinstance(key, _SCALARS):
        return key
    if isinstance(key, tuple):
        return tuple(_plain_key(k, memo) for k in key)
    value = key.value if isinstance(key, _Deferred) else _plain(key, memo)
    if isinstance(value, UnreadableValue):
        return UnreadableKey(value.reason)
    return UnreadableKey(f"a {type(value).__name__} as a map key")


# -- TransferQueue's msgpack extension types ------------------------------------------------------

# serial_utils.CUSTOM_TYPE_*
_PICKLE, _CLOUDPICKLE, _TENSOR, _NESTED_TENSOR, _NUMPY = 1, 2, 3, 4, 5


def _ext_value(code: int, data: bytes, frames: Sequence[bytes | memoryview]) -> Any:
    """The value of extension ``code`` in a reply of ``frames``."""
    if code == _PICKLE:
        try:
            return plain(restricted_loads(data))
        except Exception as exc:  # a corrupt pickle: only this value is lost
            return UnreadableValue(f"a pickled value that does not unpickle ({type(exc).__name__}: {exc})")
    if code in (_TENSOR, _NUMPY):
        what = "tensor" if code == _TENSOR else "numpy array"
        try:
            meta = restricted_loads(data, globals_=False)
        except Exception as exc:
            meta = exc
        if not (isinstance(meta, tuple) and len(meta) == 3 and isinstance(meta[0], str)
                and isinstance(meta[1], tuple) and all(type(n) is int and n >= 0 for n in meta[1])
                and type(meta[2]) is int and 0 < meta[2] < len(frames)):
            return UnreadableValue(f"a {what} whose description is not (dtype, shape, frame index): {meta!r:.100}")
        return _from_buffer(what, meta[0], meta[1], frames[meta[2]], numpy_names=code == _NUMPY)
    if code == _CLOUDPICKLE:
        return UnreadableValue("a cloudpickled callable")
    if code == _NESTED_TENSOR:
        return UnreadableValue("a nested tensor")
    return UnreadableValue(f"a value in msgpack extension type {code}, which TransferQueue does not define")


# -- raw elements of an array or tensor, read with struct -----------------------------------------

# torch's dtype names (numpy's str(dtype) uses the same, bar bfloat16): struct code and size.
# bfloat16 has no struct code ("bf16": the high half of a float32).
_NAMED: dict[str, tuple[str, int]] = {
    "bool": ("?", 1), "uint8": ("B", 1), "int8": ("b", 1), "int16": ("h", 2), "uint16": ("H", 2),
    "int32": ("i", 4), "uint32": ("I", 4), "int64": ("q", 8), "uint64": ("Q", 8),
    "float16": ("e", 2), "bfloat16": ("bf16", 2), "float32": ("f", 4), "float64": ("d", 8),
}
# numpy's type strings ("i8", "<f4", "|b1"): kind (the name's first letter) and size, the byte order apart.
_TYPESTR_CODES = {(name[0], size): code for name, (code, size) in _NAMED.items() if name != "bfloat16"}
_TYPESTR = re.compile(r"([<>|=]?)([a-zA-Z])(\d+)")
_BYTE_ORDERS = {"<": "<", ">": ">", "|": "=", "=": "=", "": "="}


@functools.lru_cache(maxsize=256)  # a listing repeats a few dtypes many times
def _kind(dtype: str, numpy_names: bool) -> tuple[str, str, int] | None:
    """``(byte order, struct code, size)`` of a dtype name, or None when not a plain number or bool."""
    if dtype in _NAMED and (not numpy_names or dtype != "bfloat16"):
        code, size = _NAMED[dtype]
        return "=", code, size  # named dtypes are in the sending machine's order, as TransferQueue reads them
    match = _TYPESTR.fullmatch(dtype) if numpy_names else None
    if match is None:
        return None
    order, kind, size_text = match.groups()
    numpy_code = _TYPESTR_CODES.get((kind, int(size_text)))
    return None if numpy_code is None else (_BYTE_ORDERS[order], numpy_code, int(size_text))


def _elements(order: str, code: str, count: int, data: bytes | bytearray | memoryview) -> list[Any]:
    if code == "bf16":
        halves = struct.unpack(f"{order}{count}H", data)
        return list(struct.unpack(f"={count}f", struct.pack(f"={count}I", *(h << 16 for h in halves))))
    return list(struct.unpack(f"{order}{count}{code}", data))


def _contiguous_strides(shape: Sequence[int], fortran: bool) -> list[int]:
    strides, step = [0] * len(shape), 1
    for dim in (range(len(shape)) if fortran else reversed(range(len(shape)))):
        strides[dim] = step
        step *= shape[dim]
    return strides


def _from_buffer(what: str, dtype: str, shape: Sequence[int], data: bytes | bytearray | memoryview, *,
                 numpy_names: bool, strides: Sequence[int] | None = None, offset: int = 0,
                 fortran: bool = False) -> Any:
    """The plain value of a ``what`` of ``dtype`` (numpy's ``str(dtype)`` or torch's name) and ``shape`` in ``data``.

    ``strides`` and ``offset`` (in elements) place a view in ``data`` (its whole storage); without them the
    elements are contiguous, in C order or ``fortran``.
    """
    kind = _kind(dtype, numpy_names)
    if kind is None:
        return UnreadableValue(f"a {what} of dtype {dtype}, which has no plain form")
    order, code, size = kind
    if not shape and strides is None and code != "bf16":  # a scalar: the common case, kept short
        if len(data) != size:
            return UnreadableValue(f"a {what} of shape () and dtype {dtype} with {len(data)} bytes of data")
        return struct.unpack(order + code, data)[0]
    count = math.prod(shape)
    stored = len(data) // size if strides is not None else count
    if max(count, stored) > MAX_ELEMENTS:
        return UnreadableValue(f"a {what} of {max(count, stored)} elements (more than {MAX_ELEMENTS} are not listed)")
    if strides is None:
        strides = _contiguous_strides(shape, fortran)
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    if (len(data) != stored * size or len(strides) != len(shape) or offset < 0 or min(strides, default=0) < 0
            or (count and last >= stored)):
        return UnreadableValue(f"a {what} of shape {tuple(shape)} and dtype {dtype} with {len(data)} bytes of data")
    flat = _elements(order, code, stored, data)
    if len(shape) == 1 and offset == 0 and strides[0] == 1 and stored == count:
        return flat

    def build(dim: int, base: int) -> Any:
        if dim == len(shape):
            return flat[base]
        return [build(dim + 1, base + i * strides[dim]) for i in range(shape[dim])]

    return build(0, offset)


# -- the restricted unpickler ---------------------------------------------------------------------

def _ignore(*_: Any, **__: Any) -> None:
    pass


class _Refused:
    """A stand-in for a pickled global this side does not resolve: building or filling one does nothing."""

    reason = "a pickled object this source does not unpickle"

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Refused":
        return object.__new__(cls)

    # What pickle may call on an object it built: construction, state, list, dict and set items.
    __init__ = __setstate__ = __setitem__ = append = extend = add = _ignore


class _DType:
    """What ``numpy.dtype(...)`` unpickles to here: its type string and byte order."""

    def __init__(self, code: Any = None, align: Any = False, copy: Any = True, *_: Any) -> None:
        self.code = code
        self.order = "="

    def __setstate__(self, state: Any) -> None:
        # numpy's dtype state: (version, byte order, ...).
        if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "="):
            self.order = state[1]

    def typestr(self) -> str | None:
        return f"{self.order}{self.code}" if isinstance(self.code, str) else None

    @property
    def reason(self) -> str:
        return f"a numpy dtype ({self.code})"


class _Storage:
    """A torch storage read from its legacy format: dtype name and raw bytes."""

    reason = "a torch storage"

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.data = b""


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    typestr = dtype.typestr() if isinstance(dtype, _DType) else None
    if typestr is None:
        return UnreadableValue("a numpy scalar of an unknown dtype")
    if not isinstance(data, bytes):
        return UnreadableValue(f"a numpy {dtype.code} scalar, which has no plain form")
    return _from_buffer("numpy scalar", typestr, (), data, numpy_names=True)


def _numpy_frombuffer(data: Any, dtype: Any, shape: Any, order: Any = "C") -> Any:
    typestr = dtype.typestr() if isinstance(dtype, _DType) else None
    if (typestr is None or not isinstance(data, (bytes, bytearray)) or not isinstance(shape, tuple)
            or not all(type(n) is int and n >= 0 for n in shape) or order not in ("C", "F")):
        return UnreadableValue("a pickled numpy array this source does not read")
    return _from_buffer("numpy array", typestr, shape, data, numpy_names=True, fortran=order == "F")


# A tensor as pickle.dumps writes it: torch.storage._load_from_bytes of the legacy torch.save format
# (magic number, protocol, the machine's byte order, the storage pickle, its keys, then raw elements).
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
_TORCH_PROTOCOL = 1001  # torch.serialization.PROTOCOL_VERSION
_STORAGE_DTYPES = {
    "BoolStorage": "bool", "ByteStorage": "uint8", "CharStorage": "int8", "ShortStorage": "int16",
    "IntStorage": "int32", "LongStorage": "int64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "FloatStorage": "float32", "DoubleStorage": "float64",
    # No plain form, but named so that the reason is the same as for a tensor sent unpickled.
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}


class _StorageUnpickler(pickle.Unpickler):
    """The storage pickle inside torch's legacy format: storage types (as dtype names), storages as persistent ids."""

    def __init__(self, stream: io.BytesIO, storages: dict[str, _Storage]) -> None:
        super().__init__(stream)
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} in a torch storage")

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, number of elements[, view]).
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and pid[1] in _STORAGE_DTYPES.values() and isinstance(pid[2], str)):
            raise pickle.UnpicklingError("a persistent id that is no torch storage")
        return self._storages.setdefault(pid[2], _Storage(pid[1]))


def _torch_load_from_bytes(data: Any) -> Any:
    if not isinstance(data, bytes):
        return UnreadableValue("a torch storage this source does not read")
    stream = io.BytesIO(data)
    try:
        magic, protocol, sys_info = (_Unpickler(stream, {}).load() for _ in range(3))
        storages: dict[str, _Storage] = {}
        storage = _StorageUnpickler(stream, storages).load()
        keys = _Unpickler(stream, {}).load()
        if (magic != _TORCH_MAGIC or protocol != _TORCH_PROTOCOL or not isinstance(sys_info, dict)
                or sys_info.get("little_endian") is not True or not isinstance(storage, _Storage)
                or not isinstance(keys, list) or set(keys) != set(storages)):
            raise ValueError("not torch's legacy storage format of a little-endian machine")
        for key in keys:
            (count,) = struct.unpack("<q", stream.read(8))
            if storages[key].dtype not in _NAMED:  # no plain form: _from_buffer says so
                break
            storages[key].data = stream.read(count * _NAMED[storages[key].dtype][1])
    except Exception as exc:
        return UnreadableValue(f"a pickled torch storage this source does not read ({type(exc).__name__}: {exc})")
    return storage


def _torch_rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if isinstance(storage, UnreadableValue):
        return storage
    if not (isinstance(storage, _Storage) and type(offset) is int and isinstance(size, tuple)
            and isinstance(stride, tuple) and all(type(n) is int for n in size + stride)):
        return UnreadableValue("a pickled tensor this source does not read")
    return _from_buffer("tensor", storage.dtype, size, storage.data, numpy_names=False, strides=stride, offset=offset)


_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    ("numpy", "dtype"): _DType,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,  # numpy 2
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,  # numpy 1
    ("numpy._core.numeric", "_frombuffer"): _numpy_frombuffer,
    ("numpy.core.numeric", "_frombuffer"): _numpy_frombuffer,
    ("torch.storage", "_load_from_bytes"): _torch_load_from_bytes,
    ("torch._utils", "_rebuild_tensor_v2"): _torch_rebuild_tensor,
    # A map, as msgpack sends it when the reply is not pickled whole (and a tensor's empty hooks).
    ("collections", "OrderedDict"): dict,
}


class _Unpickler(pickle.Unpickler):
    """Resolves only the globals of ``allowed``; any other becomes a :class:`_Refused` subclass naming it."""

    def __init__(self, stream: io.BytesIO, allowed: dict[tuple[str, str], Callable[..., Any]]) -> None:
        super().__init__(stream)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        # Never super().find_class: that imports ``module``.
        allowed = self._allowed.get((module, name))
        if allowed is not None:
            return allowed
        reason = f"a pickled {module}.{name} object, which this source does not unpickle"
        return type("Refused", (_Refused,), {"reason": reason})


# The exact bytes numpy 2 writes for a bool, int, uint or float scalar, read without an unpickler (~10x
# faster; a listing may hold one per key). Anything else, numpy 1's pickles included, takes the unpickler.
_NUMPY_SCALAR_PICKLE = re.compile(
    rb"\x80\x05\x95.{8}\x8c\x16numpy\._core\.multiarray\x94\x8c\x06scalar\x94\x93\x94"
    rb"\x8c\x05numpy\x94\x8c\x05dtype\x94\x93\x94\x8c\x02([biuf][1248])\x94\x89\x88\x87\x94R\x94"
    rb"\(K\x03\x8c\x01([<>|])\x94NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t\x94bC(.)(.*)\x94\x86\x94R\x94\.",
    re.DOTALL)


def _fast_numpy_scalar(data: bytes | memoryview) -> Any:
    """The value of a numpy scalar pickle in :data:`_NUMPY_SCALAR_PICKLE`'s layout, else None."""
    match = _NUMPY_SCALAR_PICKLE.fullmatch(data)
    if match is None or len(match[4]) != match[3][0]:
        return None
    return _from_buffer("numpy scalar", (match[2] + match[1]).decode(), (), match[4], numpy_names=True)


def restricted_loads(data: bytes | memoryview, *, globals_: bool = True) -> Any:
    """Unpickle ``data`` resolving only the globals above (``globals_=False``: none at all); :func:`plain` it next.

    Raises:
        Exception: ``data`` is not a pickle (``pickle.UnpicklingError``, or what a corrupt stream raises).
    """
    if globals_:
        value = _fast_numpy_scalar(data)
        if value is not None:
            return value
    return _Unpickler(io.BytesIO(data), _GLOBALS if globals_ else {}).load()


class _BatchMetaState:
    """What a pickled ``transfer_queue.metadata.BatchMeta`` unpickles to here: its state, kept as it came."""

    def __init__(self, *_: Any) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


# BatchMeta.__getstate__ (0.1.8-0.1.11) is the tuple of its __slots__ in order: global_indexes, partition_ids,
# field_schema, production_status, extra_info, custom_meta, ... (the tags of each key, aligned with the indexes).
_GLOBAL_INDEXES, _CUSTOM_META = 0, 5
_BATCH_META_GLOBALS = {**_GLOBALS, ("transfer_queue.metadata", "BatchMeta"): _BatchMetaState}


def batch_meta_tags(data: bytes | memoryview) -> list[Any] | None:
    """The tags of each key a pickled ``BatchMeta`` describes, in order, not yet :func:`plain`.

    None: not a BatchMeta of the known layout, or its two lists disagree.
    """
    try:
        meta = _Unpickler(io.BytesIO(data), _BATCH_META_GLOBALS).load()
    except Exception:  # not a pickle this side reads: no tags, the fingerprint alone serves
        return None
    state = meta.state if isinstance(meta, _BatchMetaState) else None
    if not isinstance(state, tuple) or len(state) <= _CUSTOM_META:
        return None
    indexes, tags = state[_GLOBAL_INDEXES], state[_CUSTOM_META]
    if not isinstance(indexes, list) or not isinstance(tags, list) or len(indexes) != len(tags):
        return None
    return tags
