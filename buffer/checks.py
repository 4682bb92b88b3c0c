"""Checks of what a trainer passes to the buffer, made once, where it enters; inner layers trust them.

Bad input gets a clear error and changes nothing. Wrong types raise ``TypeError``, as the SQLite store's
``kv_*`` methods do; numbers out of range ``ValueError`` (:mod:`poller.common.checks`). Options from
config files (Hydra/OmegaConf) arrive as plain values and become what the buffer uses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from poller.common.checks import check_count, check_optional_seconds, check_seconds, check_share
from poller.wire.curve import CurveServer
from poller.wire.protocol import Limits
from poller.wire.vocabulary import Tags

__all__ = ["check_buffer_args", "check_items", "check_keys", "check_partition", "check_sample"]


def check_partition(partition_id: Any) -> str:
    """Raises ``TypeError`` unless ``partition_id`` is a str."""
    if not isinstance(partition_id, str):
        raise TypeError(f"partition_id must be a str, got {type(partition_id).__name__} {partition_id!r}")
    return partition_id


def check_items(items: Any) -> dict[str, Tags]:
    """``items`` as ``{key: tags}`` with str keys and str tag names, copied; ``TypeError`` names the first bad one."""
    if not isinstance(items, Mapping):
        raise TypeError(f"items must be a mapping of key -> tags, got {type(items).__name__}")
    checked: dict[str, Tags] = {}
    for key, tags in items.items():
        if not isinstance(key, str):
            raise TypeError(f"item key {key!r} is {type(key).__name__}, not a str; nothing was added")
        if not isinstance(tags, Mapping):
            raise TypeError(f"tags of {key!r} must be a mapping, got {type(tags).__name__}; nothing was added")
        copied = dict(tags)
        for name in copied:
            if not isinstance(name, str):
                raise TypeError(f"tags of {key!r}: tag name {name!r} is not a str; nothing was added")
        checked[key] = copied
    return checked


def check_keys(keys: Any) -> list[str]:
    """``keys`` as a list of str, else ``TypeError``. A bare string is refused: taken as its characters,
    ``remove("train", "uid1")`` removed the keys ``"u"``, ``"i"``, ``"d"``, ``"1"``."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise TypeError(f"keys must be a list (or other iterable) of keys, not one {type(keys).__name__} "
                        f"{keys!r}: write remove(partition_id, [{keys!r}])")
    try:
        listed = list(keys)
    except TypeError:
        raise TypeError(f"keys must be an iterable of str, got {type(keys).__name__}") from None
    for key in listed:
        if not isinstance(key, str):
            raise TypeError(f"key {key!r} is {type(key).__name__}, not a str; nothing was removed")
    return listed


def check_sample(global_steps: Any, batch_size: Any, timeout: Any) -> float | None:
    """Check ``sample()``'s arguments (``ValueError`` as it says); return ``timeout`` as float seconds or None."""
    if (global_steps is None) == (batch_size is None):
        raise ValueError("pass exactly one of global_steps= or batch_size=")
    if batch_size is not None:
        check_count("batch_size", batch_size, minimum=1)
    return check_optional_seconds("timeout", timeout, allow_zero=True)


def check_buffer_args(poll_interval: Any, start_timeout: Any, close_timeout: Any, max_restarts: Any,
                      restart_window: Any, stale_after: Any, curve: Any, limits: Any, stall_timeout: Any,
                      max_view_age: Any, log_level: Any, listing_share: Any) -> tuple[Limits | None, dict[str, Any]]:
    """Check the ``ReplayBuffer`` constructor's arguments; return its limits and its poller's options.

    Raises:
        ValueError: a number is out of range (``nan``, ``inf``, negative, a bool), an unknown limit or level.
        TypeError: ``curve`` or ``limits`` has the wrong type.
    """
    if isinstance(limits, Mapping):
        fields = {str(name): value for name, value in limits.items()}
        unknown = sorted(set(fields) - set(Limits._fields))
        if unknown:
            raise ValueError(f"unknown limits {unknown}; the fields of poller.Limits are {list(Limits._fields)}")
        limits = Limits(**fields)
    check_seconds("poll_interval", poll_interval)
    check_seconds("start_timeout", start_timeout)
    check_seconds("close_timeout", close_timeout, allow_zero=True)
    check_count("max_restarts", max_restarts)
    check_seconds("restart_window", restart_window)
    check_seconds("stale_after", stale_after)
    if curve is not None and not isinstance(curve, CurveServer):
        raise TypeError(f"curve must be a CurveServer (CurveServer.from_files(...)), got {type(curve).__name__}")
    if limits is not None and not isinstance(limits, Limits):
        raise TypeError(f"limits must be a poller.wire.protocol.Limits or a mapping of its fields, "
                        f"got {type(limits).__name__}")
    stall = check_optional_seconds("stall_timeout", stall_timeout)  # finite: an infinite one is None, said plainly
    level = logging.getLevelName(log_level.upper()) if isinstance(log_level, str) else log_level
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise ValueError(f"poller_log_level must be a logging level name or number, got {log_level!r}")
    share = check_share("listing_share", listing_share)
    check_optional_seconds("max_view_age", max_view_age)
    return limits, {"stall_timeout": stall, "log_level": level, "listing_share": share}
