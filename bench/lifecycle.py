"""Start-up and close of an embedded poller: #5 close, #6 start -> first data.

Floors measured in the same run: SIGKILL-and-reap of a poller of the same
image as the one a case closes (an idle poller, a stuck one), in the same
round, for close (and, for information, of a bare idle child); a bare spawn
of ``python -c "import zmq, msgpack"`` beside start-up, for information.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

from buffer import ReplayBuffer

from .baselines.floors import bare_spawn, kill_floor, poller_kill
from .intervals import ratio_of_medians
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


def _poller_floor(make: Callable[[], ReplayBuffer]) -> float:
    """SIGKILL and reap of the poller of a buffer ``make`` builds: the floor of that process image."""
    rb = make()
    try:
        time.sleep(0.05)
        return poller_kill(rb)
    finally:
        rb.close(timeout=0.05)  # no BYE will come from a killed poller


def _idle(**options: Any) -> ReplayBuffer:
    return ReplayBuffer(source=SOURCE, source_kwargs={"keys": 1000}, poll_interval=1.0, **options)


def _stuck(**options: Any) -> ReplayBuffer:
    return ReplayBuffer(source=STUCK_SOURCE, poll_interval=0.01, **options)


def _mid_stream() -> ReplayBuffer:
    return ReplayBuffer(source=SOURCE, source_kwargs={"keys": 100_000, "changes": 10_000}, poll_interval=0.01,
                        start_timeout=60, listing_share=UNBOUNDED)


def close(progress: Callable[[str], None], quick: bool) -> Table:
    reps = 7 if quick else 21
    idle = "close(), idle poller"
    mid = "close(), mid-stream (K=100k, 10k changes every 10 ms)"
    stuck = "close(), source stuck in kv_list()"
    idle_floor = "SIGKILL + reap of an idle poller"
    stuck_floor = "SIGKILL + reap of a poller stuck in kv_list()"
    bare_floor = "SIGKILL + reap of an idle bare child (information)"
    walls: dict[str, list[float]] = {idle: [], mid: [], stuck: []}
    cases: dict[str, Callable[[], float]] = {
        bare_floor: kill_floor,
        idle_floor: lambda: _poller_floor(lambda: _idle(max_restarts=0)),
        idle: lambda: _close(_idle, walls[idle]),
        stuck_floor: lambda: _poller_floor(lambda: _stuck(max_restarts=0)),
        stuck: lambda: _close(_stuck, walls[stuck]),
        mid: lambda: _close(_mid_stream, walls[mid], settle=0.3),
    }
    # Each case against the SIGKILL and reap of a poller of its own image (same source, same threads) killed
    # in the same round: what no graceful close of that process can beat. The mid-stream case has no floor of
    # its own (a poller busy sending is not one image) and is shown against the idle poller's.
    floor_of = {bare_floor: idle_floor, idle_floor: idle_floor, idle: idle_floor, stuck_floor: stuck_floor,
                stuck: stuck_floor, mid: idle_floor}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(reps):
        # Round-robin, so a change in the machine's load hits every case and its floor alike.
        progress(f"close: round {r + 1}/{reps}")
        for name, case in cases.items():
            samples[name].append(case())
    table = Table("5", "close(): graceful stages against SIGKILL and reap of the same poller image",
                  ["case", "median ms", "× its poller floor (95% interval)", "× bare child's kill",
                   "close() wall ms"])
    estimates = {name: ratio_of_medians(values, samples[floor_of[name]]) for name, values in samples.items()}
    for name, values in samples.items():
        estimate = estimates[name]
        table.add(name, median(values) * 1e3,
                  f"{estimate.value:.3g} ({estimate.low:.3g}–{estimate.high:.3g})" if floor_of[name] != name else 1.0,
                  median(values) / median(samples[bare_floor]), median(walls[name]) * 1e3 if name in walls else "-")
    table.goals.append(Goal.estimated("idle close / its poller's SIGKILL + reap", estimates[idle], 2.0))
    table.goals.append(Goal.estimated("stuck close / its poller's SIGKILL + reap", estimates[stuck], 3.0))
    table.notes.append(f"{reps} rounds, each case once per round; a ratio is the median of a case over the median "
                       "of its floor, with a 95% interval from a percentile bootstrap over rounds (each round's "
                       "case and floor kept together, fixed seed, bench/intervals.py); every close reached the "
                       "'graceful' stage with drained=True")
    table.notes.append("a poller floor: a buffer of the same source is built, its poller SIGKILLed and reaped "
                       "once it runs: the floor of the same process image, its size and threads; the bare "
                       "child (a spawned interpreter that sleeps) is the floor of any process, for information")
    table.notes.append("median ms of a close is its ladder (ShutdownReport.seconds): STOP sent to the poller reaped, "
                       "with its BYE applied, the span a floor's SIGKILL-and-reap compares to; close() wall "
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
    table.notes.append("the constructor returns once the first complete listing is applied")
    table.notes.append("information, no longer a goal (was ≤ 1.5× the bare spawn): a start of ~0.1 s once per "
                       "run matters to no trainer")
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
