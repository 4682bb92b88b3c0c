"""A restricted unpickler for what TransferQueue pickles into a controller reply, without numpy or torch.

Nothing is resolved by import. The few globals TransferQueue's pickles name
for plain data map to functions here that rebuild the plain value:

- ``numpy.dtype`` and numpy's scalar constructor (``numpy._core.multiarray.scalar``):
  numpy scalars;
- numpy's ``_frombuffer`` (``numpy._core.numeric``): arrays pickled with
  protocol 5;
- ``collections.OrderedDict``: a ``dict``;
- ``torch.storage._load_from_bytes``, ``torch.<Type>Storage`` and
  ``torch._utils._rebuild_tensor_v2``: a dense tensor, as ``pickle.dumps``
  writes it (its storage in torch's legacy ``torch.save`` format: a magic
  number, a protocol version, the machine's byte order, the storage's dtype
  and key, then its raw elements).

Any other global becomes a :class:`Refused` stand-in that records the name
and does nothing: a pickle naming ``os.system`` never calls it, and only the
value that named it is lost (:func:`refusal` says why).
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from typing import Any, Callable

from poller.sources.tq_elements import element_size, from_buffer
from poller.wire.sources import UnreadableValue

__all__ = ["Refused", "batch_meta_tags", "refusal", "restricted_loads"]


class Refused:
    """A stand-in for a pickled global this side does not resolve; building one does nothing."""

    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Refused":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    # What pickle may call on an object it built: state, list items, dict items, set items.
    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


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


def refusal(obj: Any) -> str | None:
    """Why ``obj``, a result of :func:`restricted_loads`, is not a plain value (None: it may be one)."""
    if isinstance(obj, Refused):
        return f"a pickled {obj.global_name} object, which this source does not unpickle"
    if isinstance(obj, _DType):
        return f"a numpy dtype ({obj.code})"
    if isinstance(obj, _Storage):
        return "a torch storage"
    return None


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    typestr = dtype.typestr() if isinstance(dtype, _DType) else None
    if typestr is None:
        return UnreadableValue("a numpy scalar of an unknown dtype")
    if not isinstance(data, bytes):
        return UnreadableValue(f"a numpy {dtype.code} scalar, which has no plain form")
    return from_buffer("numpy scalar", typestr, (), data, numpy_names=True)


def _numpy_frombuffer(data: Any, dtype: Any, shape: Any, order: Any = "C") -> Any:
    typestr = dtype.typestr() if isinstance(dtype, _DType) else None
    if (typestr is None or not isinstance(data, (bytes, bytearray)) or not isinstance(shape, tuple)
            or not all(type(n) is int and n >= 0 for n in shape) or order not in ("C", "F")):
        return UnreadableValue("a pickled numpy array this source does not read")
    return from_buffer("numpy array", typestr, shape, data, numpy_names=True, fortran=order == "F")


# -- torch tensors, as pickle.dumps(tensor) writes them -----------------------------------------

_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
_TORCH_PROTOCOL = 1001  # torch.serialization.PROTOCOL_VERSION
_STORAGE_DTYPES = {
    "BoolStorage": "bool", "ByteStorage": "uint8", "CharStorage": "int8", "ShortStorage": "int16",
    "IntStorage": "int32", "LongStorage": "int64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "FloatStorage": "float32", "DoubleStorage": "float64",
    # No plain form, but named so that the reason is the same as for a tensor sent unpickled.
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Storage:
    """A torch storage read from its legacy format: dtype name and raw bytes."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.data = b""


class _StorageUnpickler(pickle.Unpickler):
    """The storage pickle inside torch's legacy format: storage types only, storages as persistent ids."""

    def __init__(self, stream: io.BytesIO, storages: dict[str, _Storage]) -> None:
        super().__init__(stream)
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(f"{module}.{name} in a torch storage")

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, number of elements[, view]).
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)):
            raise pickle.UnpicklingError("a persistent id that is no torch storage")
        return self._storages.setdefault(pid[2], _Storage(pid[1].dtype))


def _torch_load_from_bytes(data: Any) -> Any:
    if not isinstance(data, bytes):
        return UnreadableValue("a torch storage this source does not read")
    stream = io.BytesIO(data)
    try:
        magic, protocol = (_Unpickler(stream, {}).load() for _ in range(2))
        sys_info = _Unpickler(stream, {}).load()
        storages: dict[str, _Storage] = {}
        storage = _StorageUnpickler(stream, storages).load()
        keys = _Unpickler(stream, {}).load()
        if (magic != _TORCH_MAGIC or protocol != _TORCH_PROTOCOL or not isinstance(sys_info, dict)
                or sys_info.get("little_endian") is not True or not isinstance(storage, _Storage)
                or not isinstance(keys, list) or set(keys) != set(storages)):
            raise ValueError("not torch's legacy storage format of a little-endian machine")
        for key in keys:
            (count,) = struct.unpack("<q", stream.read(8))
            try:
                size = element_size(storages[key].dtype)
            except KeyError:  # no plain form: from_buffer says so
                break
            storages[key].data = stream.read(count * size)
    except Exception as exc:
        return UnreadableValue(f"a pickled torch storage this source does not read ({type(exc).__name__}: {exc})")
    return storage


def _torch_rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if isinstance(storage, UnreadableValue):
        return storage
    if not (isinstance(storage, _Storage) and type(offset) is int and isinstance(size, tuple)
            and isinstance(stride, tuple) and all(type(n) is int for n in size + stride)):
        return UnreadableValue("a pickled tensor this source does not read")
    return from_buffer("tensor", storage.dtype, size, storage.data, numpy_names=False, strides=stride, offset=offset)


_NUMPY_SCALARS: dict[tuple[str, str], Callable[..., Any]] = {
    ("numpy", "dtype"): _DType,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,  # numpy 2
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,  # numpy 1
}
_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    **_NUMPY_SCALARS,
    ("numpy._core.numeric", "_frombuffer"): _numpy_frombuffer,
    ("numpy.core.numeric", "_frombuffer"): _numpy_frombuffer,
    ("torch.storage", "_load_from_bytes"): _torch_load_from_bytes,
    ("torch._utils", "_rebuild_tensor_v2"): _torch_rebuild_tensor,
    # A map, as msgpack sends it when the reply is not pickled whole (and a tensor's empty hooks).
    ("collections", "OrderedDict"): dict,
}


class _Unpickler(pickle.Unpickler):
    """Resolves only the globals of ``allowed``; any other becomes a :class:`Refused` subclass naming it."""

    def __init__(self, stream: io.BytesIO, allowed: dict[tuple[str, str], Callable[..., Any]]) -> None:
        super().__init__(stream)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        # Never super().find_class: that imports ``module``.
        allowed = self._allowed.get((module, name))
        if allowed is not None:
            return allowed
        return type("Refused", (Refused,), {"global_name": f"{module}.{name}"})


# The exact bytes numpy 2 writes for a bool, int, uint or float scalar (pickle protocol 5):
# read without an unpickler (~1 us instead of ~10 us; a listing may hold one per key).
# Anything else, numpy 1's pickles included, takes the unpickler.
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
    return from_buffer("numpy scalar", (match[2] + match[1]).decode(), (), match[4], numpy_names=True)


def restricted_loads(data: bytes | memoryview, *, globals_: bool = True) -> Any:
    """Unpickle ``data`` through the restricted unpickler (``globals_=False``: resolving no global at all).

    The result may hold :class:`Refused` stand-ins and other non-plain objects
    (:func:`refusal` names them); :func:`poller.sources.tq_values.plain` turns
    it into plain values.

    Raises:
        Exception: ``data`` is not a pickle (``pickle.UnpicklingError`` and
            whatever else a truncated or corrupt stream raises).
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
_BATCH_META = ("transfer_queue.metadata", "BatchMeta")
_GLOBAL_INDEXES, _CUSTOM_META = 0, 5
_BATCH_META_GLOBALS = {**_GLOBALS, _BATCH_META: _BatchMetaState}


def batch_meta_tags(data: bytes | memoryview) -> list[Any] | None:
    """The tags of each key a pickled ``BatchMeta`` describes, in its order (None: not a BatchMeta read so).

    The tags are as the restricted unpickler reads them (:func:`restricted_loads`;
    :func:`poller.sources.tq_values.plain` makes them plain). None for a pickle
    that is not a BatchMeta of the known layout, or whose two lists disagree.
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
