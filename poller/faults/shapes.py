"""What a broken store client can return: each shape wrong in another way (``garbage(kind=...)``).

``not-a-mapping`` is a listing that is garbage as a whole (a source error);
every other kind is one bad record beside good ones, which the poller
quarantines while the rest flows (:class:`poller.quarantine.Quarantine`).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["GARBAGE", "nested"]


def nested(levels: int) -> list[Any]:
    """A list nested ``levels`` deep (``[[[...]]]``)."""
    value: list[Any] = []
    for _ in range(levels):
        value = [value]
    return value


#: Shapes a broken store client can return, each wrong in another way.
GARBAGE: dict[str, Callable[[], Any]] = {
    "not-a-mapping": lambda: ["not", "a", "mapping"],
    "partition-not-a-mapping": lambda: {"garbage": ["k1", "k2"]},
    "non-str-key": lambda: {"garbage": {1: {"status": "success"}}},
    "tags-not-a-mapping": lambda: {"garbage": {"k": "success"}},
    "unencodable": lambda: {"garbage": {"k": {"status": "success", "when": object()}}},
    "non-str-tag-key": lambda: {"garbage": {"k": {"status": "success", 7: "seven"}}},
    "overlong-string": lambda: {"garbage": {"k": {"status": "success", "text": "x" * (2 * 1024 * 1024)}}},
    "deep": lambda: {"garbage": {"k": {"status": "success", "deep": nested(40)}}},
    "big-int": lambda: {"garbage": {"k": {"status": "success", "global_steps": 2**70}}},
    "non-str-partition": lambda: {1: {"k": {"status": "success"}}},
}
