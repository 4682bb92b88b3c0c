"""Checking and encoding what :class:`~poller.sources.sqlite.SqliteSource` stores.

Tags are stored as JSON text; only what comes back from JSON unchanged is
accepted, so a stored tag never differs from the one put.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Tags", "check_str", "check_keys", "check_tags", "dump_tags", "load_tags"]

Tags = dict[str, Any]


def check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r}")


def check_keys(keys: Any) -> list[str]:
    # A bare str is iterable too; kv_clear("k1", ...) would clear "k" and "1".
    if isinstance(keys, (str, bytes, Mapping)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
    key_list = list(keys)
    for index, key in enumerate(key_list):
        if not isinstance(key, str):
            raise TypeError(f"keys[{index}] must be a str, got {type(key).__name__}: {key!r}")
    return key_list


def check_tags(key: str, tags: Any) -> None:
    if not isinstance(tags, dict):
        raise TypeError(f"tags of key {key!r} must be a dict, got {type(tags).__name__}")
    _check_json(tags, f"tags of key {key!r}")


def _check_json(value: Any, where: str) -> None:
    """Refuse what would not come back from JSON unchanged.

    ``json.dumps`` silently turns tuples into lists and int dict keys into
    strings, and writes NaN, which is not JSON; each would make a stored tag
    differ from the one put.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} cannot be stored as JSON")
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: dict key {name!r} is {type(name).__name__}, not str")
            _check_json(item, f"{where}[{name!r}]")
        return
    raise TypeError(f"{where}: {type(value).__name__} {value!r} is not JSON-encodable")


def dump_tags(tags: Tags) -> str:
    return json.dumps(tags, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def load_tags(partition_id: str, key: str, text: str) -> Tags:
    try:
        tags = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"stored tags of {partition_id!r}/{key!r} are not JSON: {exc}") from None
    if not isinstance(tags, dict):
        raise ValueError(f"stored tags of {partition_id!r}/{key!r} are {type(tags).__name__}, not an object")
    return tags
