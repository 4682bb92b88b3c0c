"""Tag values TransferQueue's codec carries outside plain msgpack, read without numpy or torch.

What the controller sends for each kind of tag value is described in
:mod:`poller.sources.tq_protocol`; this module turns each into a plain value
or an :class:`~poller.sources.UnreadableValue` in its place:

- numpy scalars (pickled, extension type 1) of a bool, int, uint or float
  dtype -> ``bool`` / ``int`` / ``float`` (float16 and float32 widened
  exactly, as ``.item()`` does);
- tensors (type 3) and numpy arrays (type 5) of a bool, int, uint or float
  dtype (torch's bfloat16 too) -> the scalar for a 0-d one, else nested lists
  of those scalars, as ``.tolist()`` gives (numpy itself defines that as an
  array's plain form; verl's sampler, reading in-process, compares tags with
  ``==``, so a list is as close as the wire gets). Arrays over
  :data:`MAX_ELEMENTS` elements, and any other dtype (complex, datetime,
  strings, objects), are unreadable;
- tuples and sets -> lists (msgpack's own form for them, which the
  controller already uses when it does not pickle the reply);
- everything else pickled (object arrays, sparse and nested tensors, tensors
  inside a reply pickled whole, callables, any other class) -> unreadable.

Pickled bytes are read by :func:`restricted_loads`, whose unpickler resolves
no global by import: it knows ``numpy.dtype`` and numpy's scalar
constructor (mapped to functions here), and any other global name becomes a
stand-in that records the name and does nothing, so a pickle naming
``os.system`` never calls it, and only the value that named it is lost.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import struct
import sys
from typing import Any, Callable, Sequence

from . import UnreadableValue

__all__ = ["MAX_ELEMENTS", "Deferred", "UnreadableKey", "decode_ext", "from_buffer", "numpy_scalar", "plain",
           "restricted_loads"]

#: Largest array or tensor turned into a list: the poller's wire refuses maps
#: and lists past ``Limits.max_items`` (1,000,000) anyway, and a list of that
#: many Python numbers already costs ~30 MB in the poller.
MAX_ELEMENTS = 1_000_000

# One element of a dtype: (struct code, size); bfloat16 has no struct code
# ("bf16": read as the high half of a float32).
_Kind = tuple[str, int]
_TORCH_DTYPES: dict[str, _Kind] = {
    "bool": ("?", 1), "uint8": ("B", 1), "int8": ("b", 1), "int16": ("h", 2), "uint16": ("H", 2),
    "int32": ("i", 4), "uint32": ("I", 4), "int64": ("q", 8), "uint64": ("Q", 8),
    "float16": ("e", 2), "bfloat16": ("bf16", 2), "float32": ("f", 4), "float64": ("d", 8),
}
# numpy's typestr kinds and sizes ("i8", "<f4", "|b1"): the byte order is separate.
_NUMPY_CODES: dict[tuple[str, int], str] = {
    ("b", 1): "?", ("u", 1): "B", ("i", 1): "b", ("u", 2): "H", ("i", 2): "h", ("u", 4): "I", ("i", 4): "i",
    ("u", 8): "Q", ("i", 8): "q", ("f", 2): "e", ("f", 4): "f", ("f", 8): "d",
}
_TYPESTR = re.compile(r"([<>|=]?)([a-zA-Z])(\d+)")
_BYTE_ORDERS = {"<": "<", ">": ">", "|": "=", "=": "=", "": "="}


class UnreadableKey:
    """A map key a source could not turn into a plain one (hashable, unlike :class:`UnreadableValue`).

    It stands where the key was; not being a ``str``, the poller's checks
    treat it as any other non-``str`` key or tag name.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unreadable key: {self.reason}>"


# -- reading raw element buffers (tensor and array payload frames) ----------------


def _kind(dtype: str, numpy_names: bool) -> tuple[str, str, int] | None:
    """``(byte order, struct code, size)`` of a dtype name, or None when not a plain number or bool."""
    if dtype in _TORCH_DTYPES and (not numpy_names or dtype != "bfloat16"):
        code, size = _TORCH_DTYPES[dtype]
        return "=", code, size  # torch and numpy's named dtypes are in the machine's order
    match = _TYPESTR.fullmatch(dtype) if numpy_names else None
    if match is None:
        return None
    order, kind, size_text = match.groups()
    numpy_code = _NUMPY_CODES.get((kind, int(size_text)))
    return None if numpy_code is None else (_BYTE_ORDERS[order], numpy_code, int(size_text))


def _elements(order: str, code: str, count: int, data: bytes | memoryview) -> list[Any]:
    if code == "bf16":
        # bfloat16 is the top half of a float32: widen each one exactly.
        halves = struct.unpack(f"{order}{count}H", data)
        return list(struct.unpack(f"={count}f", struct.pack(f"={count}I", *(h << 16 for h in halves))))
    return list(struct.unpack(f"{order}{count}{code}", data))


def _nest(flat: list[Any], shape: Sequence[int]) -> Any:
    """Flat C-order elements as nested lists of ``shape`` (a scalar for shape ``()``)."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def from_buffer(what: str, dtype: str, shape: Sequence[int], data: bytes | memoryview,
                *, numpy_names: bool) -> Any:
    """The plain value of a ``what`` (a tensor or array) of ``dtype`` and ``shape`` held in ``data``.

    ``numpy_names``: ``dtype`` is numpy's ``str(dtype)`` (``"int64"``,
    ``">i4"``), else torch's dtype name (``"bfloat16"``).
    """
    kind = _kind(dtype, numpy_names)
    if kind is None:
        return UnreadableValue(f"a {what} of dtype {dtype}, which has no plain form")
    order, code, size = kind
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        return UnreadableValue(f"a {what} of {count} elements (more than {MAX_ELEMENTS} are not listed)")
    if len(data) != count * size:
        return UnreadableValue(f"a {what} of shape {tuple(shape)} and dtype {dtype} with {len(data)} bytes of data")
    return _nest(_elements(order, code, count, data), shape)


# -- restricted unpickling ---------------------------------------------------------------


class _DType:
    """What ``numpy.dtype(...)`` unpickles to here: its type string and byte order."""

    def __init__(self, code: Any = None, align: Any = False, copy: Any = True, *_: Any) -> None:
        self.code = code
        self.order = "="

    def __setstate__(self, state: Any) -> None:
        # numpy's dtype state: (version, byte order, ...).
        if isinstance(state, tuple) and len(state) > 1 and isinstance(state[1], str):
            self.order = state[1]


def numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """numpy's scalar constructor as this side reads it: a plain value, or an :class:`UnreadableValue`."""
    if not isinstance(dtype, _DType) or not isinstance(dtype.code, str):
        return UnreadableValue("a numpy scalar of an unknown dtype")
    if not isinstance(data, bytes):
        return UnreadableValue(f"a numpy {dtype.code} scalar, which has no plain form")
    return from_buffer("numpy scalar", f"{dtype.order}{dtype.code}", (), data, numpy_names=True)


class _Refused:
    """A stand-in for a pickled global this side does not resolve; building one does nothing."""

    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Refused":
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


_NUMPY_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    ("numpy", "dtype"): _DType,
    ("numpy._core.multiarray", "scalar"): numpy_scalar,  # numpy 2
    ("numpy.core.multiarray", "scalar"): numpy_scalar,  # numpy 1
}


class _Unpickler(pickle.Unpickler):
    """Resolves only the globals of ``allowed``; any other becomes a :class:`_Refused` subclass naming it."""

    def __init__(self, data: bytes | memoryview, allowed: dict[tuple[str, str], Callable[..., Any]]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        # Never super().find_class: that imports ``module``.
        allowed = self._allowed.get((module, name))
        if allowed is not None:
            return allowed
        return type("Refused", (_Refused,), {"global_name": f"{module}.{name}"})


def restricted_loads(data: bytes | memoryview, *, numpy: bool = True) -> Any:
    """Unpickle ``data`` resolving no global but numpy's dtype and scalar (with ``numpy``); read :func:`plain`.

    Raises:
        Exception: ``data`` is not a pickle (``pickle.UnpicklingError`` and
            whatever else a truncated or corrupt stream raises).
    """
    return _Unpickler(data, _NUMPY_GLOBALS if numpy else {}).load()


# -- plain values -----------------------------------------------------------------------


class Deferred:
    """A decoded extension value that is not a hashable scalar, held until :func:`plain` puts it in place.

    msgpack's extension hook cannot know whether its value is a map key, and a
    list or an :class:`UnreadableValue` cannot be one.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_SCALARS = (str, int, float, bool, type(None), bytes)


def plain(obj: Any) -> Any:
    """``obj`` with tuples and sets as lists and everything unreadable as :class:`UnreadableValue`.

    Map keys stay as they are when hashable plain values (ints, tuples, ...);
    one that cannot be read becomes an :class:`UnreadableKey`.
    """
    try:
        return _plain(obj)
    except RecursionError:
        return UnreadableValue(f"nested deeper than this interpreter's recursion limit ({sys.getrecursionlimit()})")


def _plain(obj: Any) -> Any:
    if isinstance(obj, _SCALARS) or isinstance(obj, UnreadableValue):
        return obj
    if type(obj) is dict:
        return {_plain_key(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(item) for item in obj]
    if isinstance(obj, Deferred):
        return obj.value
    return UnreadableValue(_describe(obj))


def _plain_key(key: Any) -> Any:
    if isinstance(key, _SCALARS):
        return key
    if isinstance(key, tuple):
        return tuple(_plain_key(k) for k in key)
    value = key.value if isinstance(key, Deferred) else _plain(key)
    if isinstance(value, UnreadableValue):
        return UnreadableKey(value.reason)
    return UnreadableKey(f"a {type(value).__name__} as a map key")


def _describe(obj: Any) -> str:
    if isinstance(obj, _Refused):
        return f"a pickled {obj.global_name} object, which this source does not unpickle"
    if isinstance(obj, _DType):
        return f"a numpy dtype ({obj.code})"
    return f"a {type(obj).__name__} value"


# -- TransferQueue's msgpack extension types ---------------------------------------------

# TransferQueue's codes (serial_utils.CUSTOM_TYPE_*), with what each holds.
_PICKLE, _CLOUDPICKLE, _TENSOR, _NESTED_TENSOR, _NUMPY = 1, 2, 3, 4, 5


def decode_ext(code: int, data: bytes, frames: Sequence[bytes | memoryview]) -> Any:
    """The value of one msgpack extension ``code`` in a reply whose frames are ``frames``.

    A hashable scalar comes back as itself; anything else (a list, an
    :class:`UnreadableValue`) as a :class:`Deferred` for :func:`plain`.
    """
    value = _ext_value(code, data, frames)
    return value if isinstance(value, (bool, int, float)) else Deferred(value)


def _ext_value(code: int, data: bytes, frames: Sequence[bytes | memoryview]) -> Any:
    if code == _PICKLE:
        try:
            return plain(restricted_loads(data))
        except Exception as exc:  # a corrupt pickle: only this value is lost
            return UnreadableValue(f"a pickled value that does not unpickle ({type(exc).__name__}: {exc})")
    if code in (_TENSOR, _NUMPY):
        what = "tensor" if code == _TENSOR else "numpy array"
        try:
            meta = restricted_loads(data, numpy=False)
        except Exception as exc:
            meta = exc
        # TransferQueue sends (dtype name, shape, index of the frame with the elements).
        if not (isinstance(meta, tuple) and len(meta) == 3 and isinstance(meta[0], str)
                and isinstance(meta[1], tuple) and all(type(n) is int and n >= 0 for n in meta[1])
                and type(meta[2]) is int and 0 < meta[2] < len(frames)):
            return UnreadableValue(f"a {what} whose description is not (dtype, shape, frame index): {meta!r:.100}")
        return from_buffer(what, meta[0], meta[1], frames[meta[2]], numpy_names=code == _NUMPY)
    if code == _CLOUDPICKLE:
        return UnreadableValue("a cloudpickled callable")
    if code == _NESTED_TENSOR:
        return UnreadableValue("a nested tensor")
    return UnreadableValue(f"a value in msgpack extension type {code}, which TransferQueue does not define")
