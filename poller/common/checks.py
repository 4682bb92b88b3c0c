"""Checks of the numeric arguments of the public API, and the listing share's values.

Every duration and count is checked where it enters (a ``ValueError`` naming argument and
value), never reaching a wait: ``nan`` makes a deadline that never passes, ``inf`` makes
``Event.wait`` raise ``OverflowError`` in whatever thread waits, and a bool is no count.
"""

from __future__ import annotations

import math
import threading
from typing import Any

__all__ = ["DEFAULT_LISTING_SHARE", "check_count", "check_optional_seconds", "check_seconds", "check_share",
           "check_worker_config"]

#: The share of the wall clock a poller may spend listing a store without a change feed (poller.duty), unless
#: configured: verl's own sampler's at 100k TransferQueue keys.
DEFAULT_LISTING_SHARE = 0.15

# The longest wait the threading primitives accept (OverflowError beyond it).
MAX_SECONDS = float(threading.TIMEOUT_MAX)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_optional_seconds(name: str, value: Any, *, allow_zero: bool = False) -> float | None:
    """:func:`check_seconds`, where ``None`` (no limit) is allowed too."""
    return None if value is None else check_seconds(name, value, allow_zero=allow_zero, or_none=" or None")


def check_seconds(name: str, value: Any, *, allow_zero: bool = False, or_none: str = "") -> float:
    """``value`` as float seconds: a finite number, positive (or >= 0 with ``allow_zero``)."""
    if not _is_number(value) or math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number of seconds {bound}{or_none}, got {value!r}")
    if value > MAX_SECONDS:  # also inf
        hint = " (None means no limit)" if or_none else ""
        raise ValueError(f"{name} must be finite, at most {MAX_SECONDS:.3g} seconds, got {value!r}{hint}")
    return float(value)


def check_count(name: str, value: Any, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (a bool is refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_worker_config(config: Any) -> None:
    """Check the numeric fields of a :class:`~poller.common.config.WorkerConfig` (the first bad one raises)."""
    check_seconds("poll_interval", config.poll_interval)
    check_count("chunk_items", config.chunk_items, minimum=1)
    check_count("max_frame_bytes", config.max_frame_bytes, minimum=1)
    check_optional_seconds("stall_timeout", config.stall_timeout)
    check_share("listing_share", config.listing_share)


def check_share(name: str, value: Any) -> float:
    """``value`` as a listing share: a number in (0, 1] (a bool is refused)."""
    if not _is_number(value) or math.isnan(value) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a share of the wall clock in (0, 1] (1: no bound), got {value!r}")
    return float(value)
