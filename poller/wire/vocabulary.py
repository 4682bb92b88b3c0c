"""The words both halves use: what a listing holds, and the statuses the samplers read.

A source lists ``{partition_id: {key: tags}}``, tags a small map of names to plain values. The
statuses are those verl's rollout workers write (``pending`` -> ``running`` -> ``finished`` |
``failure`` on a prompt, ``success`` on a trajectory).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Tags", "Listing", "PENDING", "RUNNING", "SUCCESS", "FINISHED", "FAILURE", "PROMPT_STATUSES",
           "UnreadableValue"]

Tags = dict[str, Any]
Listing = dict[str, dict[str, Tags]]

PENDING = "pending"
RUNNING = "running"
SUCCESS = "success"
FINISHED = "finished"
FAILURE = "failure"
#: What a prompt's status may be, in the order a prompt goes through them.
PROMPT_STATUSES = (PENDING, RUNNING, FINISHED, FAILURE)


class UnreadableValue:
    """A tag value a source could not turn into a plain one, standing in the listing in its place.

    The poller quarantines every key whose tags hold one (named with ``reason``): the listing still serves.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unreadable value: {self.reason}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnreadableValue) and other.reason == self.reason

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed
