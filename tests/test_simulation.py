"""The simulation of what decides the view (tests/simulation), within the suite's budget.

``make simulate SEEDS=N`` explores further. Here: a fixed list of seeds at both schedules, and the schedules the
explorer found on the code before it held (each shrunk to the few operations that broke a guarantee), replayed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from tests.simulation.explore import config_for, explore, replay, report, shrink
from tests.simulation.world import Op, quiet_logs

#: Seeds run by every ``make test``, and the seconds they may take before the rest are left to ``make simulate``.
SEEDS = range(150)
BUDGET_S = 80.0


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """The simulation's thousands of resyncs unlogged, and the loggers' levels as they were afterwards."""
    levels = {name: logging.getLogger(name).level for name in ("buffer", "poller")}
    quiet_logs()
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.timeout(150)
def test_the_explorer_finds_no_broken_guarantee_in_its_seeds() -> None:
    started = time.monotonic()
    ran = steps = 0
    for seed in SEEDS:
        if time.monotonic() - started > BUDGET_S:
            break
        outcome = explore(seed, steps=300)
        ran += 1
        steps += len(outcome.ops)
        if outcome.violation is not None:
            pytest.fail(report(outcome, shrink(outcome, budget=20.0)))
    assert ran >= 20 and steps > ran * 100, (ran, steps)


# What the explorer found by itself on the code before (the seams commit, with 11ec0f5's behaviour), each shrunk:
# the seed (its deployment) and the operations. Every one of them broke a guarantee then; none may now.
FOUND: dict[str, tuple[int, list[Op]]] = {
    'a sync() no poller answered does not return': (52, [
        ('put', 'val', ('k5', 'k1'), 'failure', 2),
        ('deliver', 'solo0', 2),
        ('advance', 1.2265211881918967),
        ('advance', 1.0302851842163803),
        ('advance', 0.542242398971483),
        ('advance', 0.9835843682277945),
        ('sync',),
        ('advance', 0.7528856794382832),
    ]),
    'a sync() after a removal shows a new version put before it': (36, [
        ('put', 'val', ('k5', 'k2', 'k4'), 'success', 1),
        ('remove', 'val', ('k2',)),
        ('sync',),
    ]),
    'a sync() whose only poller fell silent does not return with nothing read back': (3, [
        ('put', 'p2', ('k5', 'k3'), 'failure', 1),
        ('poll', 'solo1'),
        ('clear', 'p2', ('k4', 'k3')),
        ('tool_log', 'forget-deletes'),
    ]),
    'deletes another tool erased from the log still drop the keys': (11, [
        ('put', 'train', ('k3', 'k2'), 'success', 1),
        ('poll', 'solo0'),
        ('deliver', 'solo0', 2),
        ('tool_poison', 'train', 'k3', 'array'),
        ('sync',),
        ('advance', 7.887148569872812),
    ]),
    'a row another tool renamed is dropped under its old name': (25, [
        ('put', 'train', ('k0', 'k3', 'k1'), 'running', 2),
        ('poll', 'own'),
        ('tool_rename', 'train', 'k3', 'train', 'k4'),
    ]),
    'a tag the store dropped is no longer shown': (17, [
        ('put', 'p2', ('k0', 'k1'), 'failure', 2),
        ('poll', 'own'),
        ('tool_set', 'p2', 'k1', 'running', 1, True),
    ]),
    'a lagging poller does not bring back a removed version': (18, [
        ('put', 'val', ('k4',), 'failure', 3),
        ('poll', 'solo0'),
        ('deliver', 'solo0', 3),
        ('remove', 'val', ('k5', 'k4')),
        ('advance', 8.556136556564315),
        ('deliver', 'solo0', 1000),
        ('poll', 'own'),
        ('put', 'val', ('k1', 'k4'), 'running', 2),
    ]),
    'a killed standalone poller does not vouch for a fresh view': (6, [
        ('put', 'train', ('k0',), 'running', 1),
        ('poll', 'solo1'),
        ('deliver', 'solo1', 1000),
        ('kill', 'solo1', 0),
        ('advance', 8.060179950369484),
    ]),
    'a dropped version log does not fail a put': (0, [
        ('tool_log', 'drop'),
        ('put', 'p2', ('k0', 'k4', 'k3'), 'running', 1),
    ]),
    'tags nested past the decoder are quarantined': (8, [
        ('tool_poison', 'val', 'k5', 'deep2000'),
    ]),
    'an emptied version log costs a full listing': (46, [
        ('tool_log', 'empty'),
    ]),
    'removals leave nothing behind while no poller answers': (74, [
        ('stop', 'solo0'),
        ('remove', 'train', ('k2',)),
        ('remove', 'train', ('k0',)),
        ('remove', 'p2', ('k3',)),
        ('remove', 'train', ('k4',)),
        ('remove', 'p2', ('k5',)),
        ('remove', 'p2', ('k0',)),
        ('remove', 'train', ('k1',)),
        ('remove', 'p2', ('k1',)),
        ('remove', 'val', ('k5',)),
    ]),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_a_schedule_the_explorer_found_keeps_every_guarantee(name: str) -> None:
    seed, ops = FOUND[name]
    outcome = replay(config_for(seed), ops)
    assert outcome.violation is None, str(outcome.violation)
