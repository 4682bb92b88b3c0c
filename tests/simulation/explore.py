"""The seeded scheduler: it picks each next operation of a world, runs seeds within a budget, and shrinks a
failing schedule to the few operations that still break the same guarantee.

A seed decides everything: the deployment (:func:`config_for`) and every operation. A failure prints its seed,
the deployment and the shrunk schedule, which :func:`replay` carries out again.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from tests.simulation.world import (
    KEYS,
    LOG_EDITS,
    PARTITIONS,
    POISONS,
    STATUSES,
    Config,
    Op,
    Violation,
    World,
    quiet_logs,
)

__all__ = ["Outcome", "config_for", "explore", "main", "replay", "shrink"]

#: Each operation's weight, per schedule (a weight per poller for the poller's operations).
WEIGHTS: dict[str, dict[str, float]] = {
    # Polls and deliveries after nearly every write: the fastest schedule a user can configure.
    "fast": {"put": 8, "clear": 3, "tool_set": 1, "tool_reput": 0.6, "tool_rename": 0.6, "tool_poison": 0.5,
             "tool_unpoison": 0.5, "tool_log": 0.4, "backup": 0.2, "restore": 0.2, "poll": 9, "control": 8,
             "deliver": 12, "lose": 0.2, "cut": 0.3, "stop": 0.3, "resume": 1.5, "kill": 0.2, "start": 2,
             "advance": 5, "add": 1.5, "remove": 4, "sync": 2.5, "sample": 2.5},
    # Many writes and trainer calls between two polls: the slowest.
    "slow": {"put": 10, "clear": 4, "tool_set": 1.5, "tool_reput": 1, "tool_rename": 1, "tool_poison": 0.6,
             "tool_unpoison": 0.6, "tool_log": 0.5, "backup": 0.3, "restore": 0.3, "poll": 1.5, "control": 2,
             "deliver": 3, "lose": 0.1, "cut": 0.2, "stop": 0.4, "resume": 0.8, "kill": 0.2, "start": 1,
             "advance": 8, "add": 2, "remove": 5, "sync": 2, "sample": 3},
}


def config_for(seed: int) -> Config:
    """The deployment seed ``seed`` simulates."""
    rng = random.Random(f"config-{seed}")
    own = rng.choice(("feed", "listing", "feed", "listing", None))
    count = rng.choice((0, 0, 1, 2)) if own is not None else rng.choice((1, 2))
    return Config(own, tuple(rng.choice(("feed", "listing")) for _ in range(count)), rng.choice(("fast", "slow")))


def next_op(world: World, rng: random.Random, skip: frozenset[str] = frozenset()) -> Op:
    """An operation for ``world`` now (it may still not apply: :meth:`World.do` then declines it); none of the
    kinds in ``skip`` (``tool_log:drop`` names one edit of the change log)."""
    weights = {kind: weight for kind, weight in WEIGHTS[world.config.schedule].items() if kind not in skip}
    names = list(world.pollers)
    kinds = list(weights)
    kind = rng.choices(kinds, [weights[k] * (len(names) if k in _PER_POLLER else 1) for k in kinds])[0]
    partition = rng.choice(PARTITIONS)
    key = rng.choice(KEYS)
    if kind in _PER_POLLER:
        if not names:
            return ("advance", 0.1)
        name = rng.choice(names)
        poller = world.pollers[name]
        if kind == "deliver":
            return ("deliver", name, rng.choice((1, 1, 2, 3, 1000)))
        if kind == "kill":
            return ("kill", name, rng.randrange(len(poller.outq) + 1))
        if kind == "start" and not poller.own and rng.random() < 0.7:
            return ("advance", 0.1)  # an operator restarts a standalone poller less eagerly
        return (kind, name)
    if kind == "put":
        return ("put", partition, tuple(rng.sample(KEYS, rng.randint(1, 3))), rng.choice(STATUSES),
                rng.randint(1, 3))
    if kind == "clear":
        return ("clear", partition, tuple(rng.sample(KEYS, rng.randint(1, 2))))
    if kind == "tool_set":
        return ("tool_set", partition, key, rng.choice(STATUSES), rng.randint(1, 3), rng.random() < 0.3)
    if kind == "tool_reput":
        return ("tool_reput", partition, key)
    if kind == "tool_rename":
        if rng.random() < 0.5:
            return ("tool_rename", partition, key, partition, rng.choice(KEYS))
        return ("tool_rename", partition, key, rng.choice(PARTITIONS), rng.choice((key, rng.choice(KEYS))))
    if kind == "tool_poison":
        return ("tool_poison", partition, key, rng.choice(POISONS))
    if kind == "tool_unpoison":
        return ("tool_unpoison", partition, key)
    if kind == "tool_log":
        edits = [edit for edit in LOG_EDITS if f"tool_log:{edit}" not in skip]
        return ("tool_log", rng.choice(edits)) if edits else ("advance", 0.1)
    if kind == "advance":
        if rng.random() < 0.03:
            return ("advance", rng.uniform(4.0, 9.0))  # the trainer paused (a GC, SIGSTOP): peers go stale
        return ("advance", rng.uniform(0.05, 0.5) if world.config.schedule == "fast" else rng.uniform(0.2, 1.5))
    if kind in ("add", "remove"):
        held = [name for name in world.buffer.snapshot().get(partition, {})]
        if kind == "add":
            return ("add", partition, rng.choice(held) if held else key, rng.randint(1, 99))
        keys = rng.sample(held, min(len(held), rng.randint(1, 2))) if held and rng.random() < 0.85 else [key]
        return ("remove", partition, tuple(keys))
    if kind == "sample":
        return ("sample", partition, rng.randint(1, 3))
    return (kind,)


_PER_POLLER = frozenset({"poll", "control", "deliver", "lose", "cut", "stop", "resume", "kill", "start"})


@dataclass
class Outcome:
    """What one seed did: its deployment, the operations carried out, and the first violation (if any)."""

    seed: int
    config: Config
    ops: list[Op]
    violation: Violation | None
    counts: Counter[str] = field(default_factory=Counter)
    answered_syncs: int = 0
    decisions: int = 0


def _run(config: Config, ops: Sequence[Op] | None, seed: int, steps: int,
         skip: frozenset[str] = frozenset()) -> Outcome:
    """Carry out ``ops`` (or ``steps`` chosen ones), then settle; stop at the first violation."""
    rng = random.Random(f"ops-{seed}")
    done: list[Op] = []
    with tempfile.TemporaryDirectory(prefix="replay-sim-") as directory:
        world = World(config, directory)
        try:
            planned = iter(ops) if ops is not None else (next_op(world, rng, skip) for _ in range(steps))
            for op in planned:
                if world.do(op):
                    done.append(op)
                if world.violations:
                    break
            if not world.violations:
                for op in world.settle():
                    if world.do(op):
                        done.append(op)
                    if world.violations:
                        break
            if not world.violations and world.syncs:
                unanswered = [pending.request.describe(None) for pending in world.syncs]
                world.violation("a:never-answered", f"{len(unanswered)} sync() call(s) never answered, every poller "
                                                    f"back and polled: {unanswered}")
        finally:
            world.close()
        first = world.violations[0] if world.violations else None
        return Outcome(seed, config, done, first, Counter(world.counts), world.answered_syncs, world.decisions)


def explore(seed: int, steps: int = 300, skip: frozenset[str] = frozenset()) -> Outcome:
    """Run seed ``seed`` for ``steps`` operations (none of the kinds in ``skip``) and a settling."""
    return _run(config_for(seed), None, seed, steps, skip)


def replay(config: Config, ops: Sequence[Op]) -> Outcome:
    """Carry out ``ops`` again (skipping those that no longer apply), then settle."""
    return _run(config, ops, -1, 0)


def shrink(outcome: Outcome, budget: float = 60.0) -> list[Op]:
    """The fewest operations of ``outcome`` that still break the same guarantee the same way (delta debugging,
    bounded in time)."""
    assert outcome.violation is not None
    kind = outcome.violation.kind
    ops = list(outcome.ops)
    deadline = time.monotonic() + budget

    def fails(candidate: list[Op]) -> bool:
        violation = replay(outcome.config, candidate).violation
        return violation is not None and violation.kind == kind

    parts = 2
    while len(ops) >= 2 and time.monotonic() < deadline:
        size = math.ceil(len(ops) / parts)
        for start in range(0, len(ops), size):
            candidate = ops[:start] + ops[start + size:]
            if fails(candidate):
                ops = candidate
                parts = max(parts - 1, 2)
                break
        else:
            if parts >= len(ops):
                break
            parts = min(len(ops), parts * 2)
    return ops


def report(outcome: Outcome, shrunk: list[Op] | None) -> str:
    assert outcome.violation is not None
    lines = [f"seed {outcome.seed}: {outcome.violation}", f"  deployment: {outcome.config.describe()}",
             f"  after {len(outcome.ops)} operations"]
    if shrunk is not None:
        again = replay(outcome.config, shrunk).violation
        lines.append(f"  shrunk to {len(shrunk)} operations (tests.simulation.explore.replay(config, ops)), "
                     f"then the settling: {again}")
        lines += [f"    {op!r}," for op in shrunk]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50, help="how many seeds to run (from --first)")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, help="run this one seed only")
    parser.add_argument("--steps", type=int, default=300, help="operations per seed before settling")
    parser.add_argument("--budget", type=float, default=None, help="stop starting seeds after this many seconds")
    parser.add_argument("--skip", default="", help="operation kinds to leave out, comma-separated (e.g. "
                        "tool_log:drop,restore): to look past a violation already known")
    parser.add_argument("--shrink", type=float, default=60.0, help="seconds to shrink each failure for (0: none)")
    args = parser.parse_args(argv)
    quiet_logs()
    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    started = time.monotonic()
    counts: Counter[str] = Counter()
    rules: Counter[str] = Counter()
    ran = syncs = decisions = 0
    for seed in seeds:
        if args.budget is not None and time.monotonic() - started > args.budget:
            break
        outcome = explore(seed, args.steps, frozenset(filter(None, args.skip.split(","))))
        ran += 1
        counts.update(outcome.counts)
        syncs += outcome.answered_syncs
        decisions += outcome.decisions
        if outcome.violation is not None:
            rules[outcome.violation.kind] += 1
            shrunk = shrink(outcome, args.shrink) if args.shrink > 0 else None
            print(report(outcome, shrunk), flush=True)
    elapsed = time.monotonic() - started
    print(f"{ran} seed(s), {sum(counts.values())} operations, {syncs} sync() answered, {decisions} decisions, "
          f"in {elapsed:.0f}s; violations by kind: {dict(sorted(rules.items())) or 'none'}")
    print("operations by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if rules else 0


if __name__ == "__main__":
    sys.exit(main())
