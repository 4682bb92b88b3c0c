"""Options of :class:`~buffer.ReplayBuffer` that arrive from config files as plain values.

A buffer built through Hydra/OmegaConf (``_target_: buffer.ReplayBuffer``) gets mappings, strings
and numbers; these turn them into what the buffer and its poller use, or say clearly what is wrong.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from poller.arguments import check_optional_seconds
from poller.protocol import Limits

__all__ = ["as_limits", "check_stall_timeout", "check_log_level", "poller_limits"]


def as_limits(limits: Any) -> Any:
    """A :class:`Limits` from a mapping of its fields (Hydra/OmegaConf ``_target_`` configs pass mappings)."""
    if limits is None or isinstance(limits, Limits) or not isinstance(limits, Mapping):
        return limits  # the type check follows in validate.check_buffer_args
    fields = {str(name): value for name, value in limits.items()}
    unknown = sorted(set(fields) - set(Limits._fields))
    if unknown:
        raise ValueError(f"unknown limits {unknown}; the fields of poller.protocol.Limits are {list(Limits._fields)}")
    return Limits(**fields)


def check_stall_timeout(stall_timeout: Any) -> float | None:
    # Finite too: an infinite stall timeout is None, said plainly.
    return check_optional_seconds("stall_timeout", stall_timeout)


def check_log_level(level: Any) -> int:
    number = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise ValueError(f"poller_log_level must be a logging level name or number, got {level!r}")
    return number


def poller_limits(limits: Limits) -> dict[str, Any]:
    """Message sizes and bounds for the buffer's own poller that its receiver accepts.

    A chunk of n keys spans at most n partitions, so 2n stays within the
    keys-per-message bound. The whole ``limits`` go along too: the poller
    checks tags against the receiver's string, item and depth bounds, or a
    tag the receiver refuses would fail every resync, for good.
    """
    return {"max_frame_bytes": limits.max_frame_bytes, "limits": limits,
            "chunk_items": max(1, min(4096, limits.max_keys_per_message // 2))}
