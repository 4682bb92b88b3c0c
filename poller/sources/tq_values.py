"""Tag values TransferQueue's codec carries outside plain msgpack, read without numpy or torch.

What the controller sends for each kind of tag value is described in
:mod:`poller.sources.tq_protocol`. This module turns each into a plain value,
or an :class:`~poller.wire.sources.UnreadableValue` in its place:

- numpy scalars (pickled, extension type 1) of a bool, int, uint or float
  dtype -> ``bool`` / ``int`` / ``float`` (float16 and float32 widened
  exactly, as ``.item()`` does);
- tensors (type 3) and numpy arrays (type 5) of such a dtype (torch's
  bfloat16 too) -> the scalar for a 0-d one (``torch.tensor(1.0)`` -> ``1.0``),
  else nested lists of those scalars, as ``.tolist()`` gives: numpy and torch
  define that as their plain form, and the dtype is all that is lost, as for
  scalars. Arrays over :data:`~poller.sources.tq_elements.MAX_ELEMENTS`
  elements, and any other dtype (complex, datetime, strings, objects), are
  unreadable;
- the same scalars, arrays and (dense) tensors in a reply pickled whole, which
  TransferQueue sends when some value breaks msgpack (an int over 64 bits):
  read by the restricted unpickler of :mod:`poller.sources.tq_pickles`, so
  that such a record does not make every array elsewhere in the listing
  unreadable;
- datetimes with a time zone (msgpack timestamps) -> unreadable (a naive one
  arrives as the string msgspec makes of it);
- tuples and sets -> lists (msgpack's own form for them, which the
  controller uses whenever it does not pickle the reply);
- everything else (object arrays, sparse and nested tensors, callables, any
  other pickled class, a corrupt pickle, a tensor whose data frame is
  missing) -> unreadable, each value apart.

Map keys are left as they come when they are hashable plain values (int tag
names and partition ids, tuples); a key that cannot be read becomes an
:class:`UnreadableKey`. Ints of any size stay ints.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any, Sequence

from poller.sources.tq_elements import from_buffer
from poller.sources.tq_pickles import refusal, restricted_loads
from poller.wire.sources import UnreadableValue

__all__ = ["Deferred", "UnreadableKey", "decode_ext", "plain"]


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

    ``obj`` is what msgpack (with :class:`Deferred` values) or the restricted
    unpickler gave. A container the input holds more than once is converted
    once and shared, as unpickling shares it: a pickle that nests one list
    in itself twice per level, 100 levels deep, stays linear work.
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
    if isinstance(obj, Deferred):
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
    else:
        result = UnreadableValue(refusal(obj) or f"a {type(obj).__name__} value")
    # Keyed by id: ``obj`` stays alive (the input holds it) for as long as ``memo`` does.
    memo[id(obj)] = result
    return result


def _plain_key(key: Any, memo: dict[int, Any]) -> Any:
    if isinstance(key, _SCALARS):
        return key
    if isinstance(key, tuple):
        return tuple(_plain_key(k, memo) for k in key)
    value = key.value if isinstance(key, Deferred) else _plain(key, memo)
    if isinstance(value, UnreadableValue):
        return UnreadableKey(value.reason)
    return UnreadableKey(f"a {type(value).__name__} as a map key")


# -- TransferQueue's msgpack extension types ---------------------------------------------

# TransferQueue's codes (serial_utils.CUSTOM_TYPE_*).
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
            meta = restricted_loads(data, globals_=False)
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
