"""Start-up and close of an embedded poller: #5 close, #6 start -> first data.

Floors measured in the same run: a bare spawn of ``python -c "import zmq,
msgpack"`` for start-up, SIGKILL-and-reap of an idle child for close (and,
for reference, of an idle poller: a process of the poller's own size).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

from buffer import ReplayBuffer

from .baselines.floors import bare_spawn, kill_floor, poller_kill
from .overhead import SOURCE, UNBOUNDED
from .report import Goal, Table, median
from .workload import fill_sqlite

# In bench.workload, as the idle case's source is: this module imports the
# buffer and the bench, and a poller that loaded them was 10 MB bigger (31 vs
# 21 MB RSS) and took ~2 ms longer to exit, which the stuck case then
# measured instead of the stuck path.
STUCK_SOURCE = "bench.workload:StuckAfterFirstPoll"


def _close(make: Callable[[], ReplayBuffer], walls: list[float], settle: float = 0.05) -> float:
    """The close ladder's own time (what the kill floor compares to); close()'s wall time goes to ``walls``."""
    rb = make()
    time.sleep(settle)
    started = time.perf_counter()
    report = rb.close()
    walls.append(time.perf_counter() - started)
    if report.stage != "graceful":
        raise RuntimeError(f"close was not graceful: {report}")
    return report.seconds


def _poller_floor() -> float:
    rb = ReplayBuffer(source=SOURCE, source_kwargs={"keys": 1000}, poll_interval=1.0, max_restarts=0)
    try:
        time.sleep(0.05)
        return poller_kill(rb)
    finally:
        rb.close(timeout=0.05)  # no BYE will come from a killed poller


def close(progress: Callable[[str], None], quick: bool) -> Table:
    reps = 7 if quick else 21
    idle = "close(), idle poller"
    mid = "close(), mid-stream (K=100k, 10k changes every 10 ms)"
    stuck = "close(), source stuck in kv_list()"
    walls: dict[str, list[float]] = {idle: [], mid: [], stuck: []}
    cases: dict[str, Callable[[], float]] = {
        "kill floor: SIGKILL + reap of an idle child": kill_floor,
        "SIGKILL + reap of an idle poller (reference)": _poller_floor,
        idle: lambda: _close(lambda: ReplayBuffer(
            source=SOURCE, source_kwargs={"keys": 1000}, poll_interval=1.0), walls[idle]),
        mid: lambda: _close(lambda: ReplayBuffer(
            source=SOURCE, source_kwargs={"keys": 100_000, "changes": 10_000}, poll_interval=0.01,
            start_timeout=60, listing_share=UNBOUNDED), walls[mid], settle=0.3),
        stuck: lambda: _close(lambda: ReplayBuffer(source=STUCK_SOURCE, poll_interval=0.01), walls[stuck]),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(reps):
        # Round-robin, so a change in the machine's load hits every case and
        # its floor alike (one case after the other, the floor was measured a
        # minute before the stuck case it divided).
        progress(f"close: round {r + 1}/{reps}")
        for name, case in cases.items():
            samples[name].append(case())
    names = list(cases)
    floors = samples[names[0]]
    table = Table("5", "close(): graceful stages against the kill floor",
                  ["case", "median ms", "× kill floor (median of rounds)", "close() wall ms"])
    ratios = {name: median([value / floor for value, floor in zip(values, floors, strict=True)])
              for name, values in samples.items()}
    for name, values in samples.items():
        table.add(name, median(values) * 1e3, ratios[name], median(walls[name]) * 1e3 if name in walls else "-")
    table.goals.append(Goal("idle close / kill floor", ratios[idle], 3.0))
    table.goals.append(Goal("stuck close / kill floor", ratios[stuck], 5.0))
    table.notes.append(f"{reps} rounds, each case once per round; the ratio is the median of each round's case / "
                       "floor; every close reached the 'graceful' stage with drained=True")
    table.notes.append("median ms of a close is its ladder (ShutdownReport.seconds): STOP sent to the poller reaped, "
                       "with its BYE applied, the span the kill floor's SIGKILL-and-reap compares to; close() wall "
                       "ms adds the rest of the call: the buffer's receiver and supervisor threads ending")
    return table


def start(progress: Callable[[str], None], quick: bool) -> Table:
    reps = 7 if quick else 21
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "kv.db")
        fill_sqlite(db, 1000)
        spawn, first = [], []
        progress(f"start: {reps} × (bare spawn, constructor -> 1000 keys visible)")
        for _ in range(reps):  # interleaved, so load drift hits both alike
            spawn.append(bare_spawn())
            first.append(_start_to_first_data(db))
    table = Table("6", "constructor start -> first data visible", ["case", "median ms", "× bare spawn"])
    table.add('bare spawn: python -c "import zmq, msgpack"', median(spawn) * 1e3, 1.0)
    ratio = median(first) / median(spawn)
    table.add("ReplayBuffer(...) -> 1000 keys visible (SQLite)", median(first) * 1e3, ratio)
    table.goals.append(Goal("start / bare spawn", ratio, 1.5))
    table.notes.append("the constructor returns once the first complete listing is applied")
    return table


def _start_to_first_data(db: str) -> float:
    started = time.perf_counter()
    rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db}, poll_interval=1.0)
    elapsed = time.perf_counter() - started
    try:
        if len(rb.snapshot("train")) != 900:
            raise RuntimeError("the first listing was not applied")
        return elapsed
    finally:
        rb.close()
