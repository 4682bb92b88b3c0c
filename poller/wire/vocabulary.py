"""The words both halves use: what a listing holds, and the statuses the samplers read.

A source lists ``{partition_id: {key: tags}}``, tags a small map of names to plain values. The
statuses are those verl's rollout workers write (``pending`` -> ``running`` -> ``finished`` |
``failure`` on a prompt, ``success`` on a trajectory).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Tags", "Listing", "PENDING", "RUNNING", "SUCCESS", "FINISHED", "FAILURE", "PROMPT_STATUSES"]

Tags = dict[str, Any]
Listing = dict[str, dict[str, Tags]]

PENDING = "pending"
RUNNING = "running"
SUCCESS = "success"
FINISHED = "finished"
FAILURE = "failure"
#: What a prompt's status may be, in the order a prompt goes through them.
PROMPT_STATUSES = (PENDING, RUNNING, FINISHED, FAILURE)
