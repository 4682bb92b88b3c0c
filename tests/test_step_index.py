"""The step index against a plain model, through random changes told key by key and in bulk.

The model keeps each key's arrival number and tags; the index must hold
exactly what follows from them: running keys per step, "success" keys with
their arrival numbers (overall and per step), and every other key's arrival
number in ``arrival``. Keys go through every status, step and removal, and
snapshots of new keys are told at once (``on_added``) and a poll's changed keys one by one, as the store
does.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from buffer.steps import StepIndex

STATUSES = ("running", "success", "failure", None)
KEYS = [f"k{i}" for i in range(40)]


def _tags(rng: random.Random) -> dict[str, Any]:
    tags: dict[str, Any] = {}
    if rng.random() < 0.9:
        tags["status"] = rng.choice(STATUSES)
    if rng.random() < 0.9:
        tags["global_steps"] = [1] if rng.random() < 0.05 else rng.randint(1, 3)  # some unhashable
    return tags


def _expected(model: dict[str, tuple[int, dict[str, Any]]]) -> dict[str, dict]:
    running: dict[Any, dict[str, None]] = {}
    success_by_step: dict[Any, dict[str, int]] = {}
    success: dict[str, int] = {}
    arrival: dict[str, int] = {}
    for key, (order, tags) in model.items():
        step = tags.get("global_steps")
        step = None if isinstance(step, list) else step
        status = tags.get("status")
        if status == "success":
            success[key] = order
            if step is not None:
                success_by_step.setdefault(step, {})[key] = order
            continue
        arrival[key] = order
        if status == "running" and step is not None:
            running.setdefault(step, {})[key] = None
    return {"arrival": arrival, "running_by_step": running, "success_by_step": success_by_step,
            "success": success}


@pytest.mark.parametrize("seed", range(12))
def test_the_index_holds_what_the_changes_imply(seed: int) -> None:
    rng = random.Random(seed)
    index = StepIndex()
    model: dict[str, tuple[int, dict[str, Any]]] = {}
    arrivals = 0
    for _ in range(400):
        absent = [key for key in KEYS if key not in model]
        if absent and rng.random() < 0.15:  # a snapshot's new keys, told at once
            keys = rng.sample(absent, rng.randint(1, len(absent)))
            tags = [_tags(rng) for _ in keys]
            index.on_added("train", keys, tags)
            for key, one in zip(keys, tags):
                arrivals += 1
                model[key] = (arrivals, one)
        elif model and rng.random() < 0.2:  # a poll's changed keys, told at once
            keys = rng.sample(sorted(model), rng.randint(1, len(model)))
            news = [_tags(rng) for _ in keys]
            for key, new in zip(keys, news):
                index.on_change("train", key, model[key][1], new)
                model[key] = (model[key][0], new)
        else:
            key = rng.choice(KEYS)
            old = model.get(key)
            new = None if old is not None and rng.random() < 0.25 else _tags(rng)
            index.on_change("train", key, None if old is None else old[1], new)
            if new is None:
                del model[key]
            elif old is None:
                arrivals += 1
                model[key] = (arrivals, new)
            else:
                model[key] = (old[0], new)
        part = index.parts["train"]
        expected = _expected(model)
        assert {name: getattr(part, name) for name in expected} == expected
