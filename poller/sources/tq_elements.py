"""The elements of a numpy array or torch tensor as plain Python values, from their raw bytes.

TransferQueue sends an array's or tensor's elements as raw memory (an extra
reply frame, or bytes inside a pickle) with a dtype name and a shape; this
module reads them with :mod:`struct`, without numpy or torch. Bool, int,
uint and float dtypes (float16, and torch's bfloat16, widened exactly to
``float``) have a plain form; any other dtype (complex, datetime, strings,
objects) does not and is an :class:`~poller.wire.sources.UnreadableValue`.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from typing import Any, Sequence

from poller.wire.sources import UnreadableValue

__all__ = ["MAX_ELEMENTS", "element_size", "from_buffer"]

#: Largest array or tensor turned into a list: the poller's wire refuses maps
#: and lists past ``Limits.max_items`` (1,000,000) anyway, and a list of that
#: many Python numbers already costs ~30 MB in the poller.
MAX_ELEMENTS = 1_000_000

# torch's dtype names (numpy's str(dtype) uses the same for these, bar bfloat16):
# struct code and size. bfloat16 has no struct code ("bf16": the high half of a float32).
_NAMED: dict[str, tuple[str, int]] = {
    "bool": ("?", 1), "uint8": ("B", 1), "int8": ("b", 1), "int16": ("h", 2), "uint16": ("H", 2),
    "int32": ("i", 4), "uint32": ("I", 4), "int64": ("q", 8), "uint64": ("Q", 8),
    "float16": ("e", 2), "bfloat16": ("bf16", 2), "float32": ("f", 4), "float64": ("d", 8),
}
# numpy's type strings ("i8", "<f4", "|b1"): kind and size, the byte order apart.
_TYPESTR_CODES: dict[tuple[str, int], str] = {
    ("b", 1): "?", ("u", 1): "B", ("i", 1): "b", ("u", 2): "H", ("i", 2): "h", ("u", 4): "I", ("i", 4): "i",
    ("u", 8): "Q", ("i", 8): "q", ("f", 2): "e", ("f", 4): "f", ("f", 8): "d",
}
_TYPESTR = re.compile(r"([<>|=]?)([a-zA-Z])(\d+)")
_BYTE_ORDERS = {"<": "<", ">": ">", "|": "=", "=": "=", "": "="}


def element_size(dtype: str) -> int:
    """Bytes per element of a plain torch dtype name (``"float32"``: 4).

    Raises:
        KeyError: not a dtype with a plain form.
    """
    return _NAMED[dtype][1]


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


def from_buffer(what: str, dtype: str, shape: Sequence[int], data: bytes | bytearray | memoryview, *,
                numpy_names: bool, strides: Sequence[int] | None = None, offset: int = 0,
                fortran: bool = False) -> Any:
    """The plain value of a ``what`` (a tensor, an array) of ``dtype`` and ``shape`` whose elements are ``data``.

    The scalar itself for shape ``()``, else nested lists (what ``.tolist()``
    gives). ``numpy_names``: ``dtype`` is numpy's ``str(dtype)`` (``"int64"``,
    ``">i4"``), else torch's dtype name. ``strides`` and ``offset`` (in
    elements) place a view in ``data``, which then holds its whole storage;
    without them the elements are contiguous, in C order or ``fortran``.
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
