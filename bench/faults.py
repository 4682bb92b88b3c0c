"""Reliability report: every row of the fault matrix, N times.

    python -m bench.faults [--trials N] [--only SUBSTRING] [--out PATH]

For each row: the stages ``close()`` reached, close time p50/p99/max against
the row's bound, what the trainer saw, restarts, the processes, threads, file
descriptors and ipc directories left behind (must be 0), keys lost,
resurrected or sampled twice (must be 0), restarts caused by a record, stale
answers and hidden new versions (must be 0; "–" where the row does not
measure one), and how many trials differed from the row in any way. Prints one table and writes it to
``bench/results/faults.md``. Exit status 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tests.helpers import leaks

from .faultmatrix import ROWS, Outcome, Row, close_bound, run_trial
from .streamrows import STREAM_ROWS, run_stream_trial

# Three rounds of the 56 rows took about four minutes on a 2-core machine (bench/results/faults.md: 241 s).
DEFAULT_TRIALS = 3
_SETTLE_S = 5.0
RESULTS = Path(__file__).resolve().parent / "results" / "faults.md"


@dataclass
class Leaks:
    processes: int = 0
    threads: int = 0
    fds: int = 0
    ipc_dirs: int = 0


def _leaks_of(trial: Callable[[], Outcome]) -> tuple[Outcome, Leaks]:
    before = leaks.snapshot()
    outcome = trial()
    left = leaks.left_since(before, _SETTLE_S)  # things that end asynchronously get a moment, as in the tests
    leaks.kill(left.children)  # do not let one leak spoil the next trial
    return outcome, Leaks(len(left.children), len(left.threads), len(left.fds), len(left.ipc_dirs))


@dataclass
class RowStats:
    row: Row
    outcomes: list[Outcome] = field(default_factory=list)
    leaks: Leaks = field(default_factory=Leaks)
    failures: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome, leaks: Leaks) -> None:
        self.outcomes.append(outcome)
        for name in ("processes", "threads", "fds", "ipc_dirs"):
            setattr(self.leaks, name, getattr(self.leaks, name) + getattr(leaks, name))
        problems = outcome.mismatches(self.row)
        if any(vars(leaks).values()):
            problems.append(f"leaked {vars(leaks)}")
        if problems:
            self.failures.append("; ".join(problems))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _counts(values: Sequence[str]) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in collections.Counter(values).most_common())


def _measured(values: Sequence[int | None]) -> str:
    """The sum of a count over the trials, or "–" where the row does not measure it."""
    counted = [v for v in values if v is not None]
    return str(sum(counted)) if counted else "–"


def _table(stats: list[RowStats], trials: int, seconds: float) -> str:
    load = os.getloadavg()[0]
    lines = [
        f"Fault matrix, {trials} trial(s) per row, {len(stats)} rows, {seconds:.0f} s, "
        f"load average {load:.2f} on {os.cpu_count()} cores.",
        "Close times in ms; bound = the most that stage may take with the row's close_timeout.",
        "Restarts by a record: restarts from a bad record on; stale answers: sample() calls answered while the "
        "store did not answer; hidden versions: new versions of removed keys not shown after two sync() calls "
        "(each must be 0; – : the row does not measure it).",
        "",
        "| fault | trials | stage reached | close p50 / p99 / max (bound) ms | trainer saw | restarts "
        "| leaked procs/threads/fds/ipc | lost / resurrected / twice "
        "| restarts by a record / stale answers / hidden versions | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in stats:
        closes = [o.close_s * 1e3 for o in s.outcomes]
        lost = sum(len(o.lost) for o in s.outcomes)
        resurrected = sum(len(o.resurrected) for o in s.outcomes)
        twice = sum(len(o.duplicates) for o in s.outcomes)
        seen = _counts([o.saw + (f" ({o.cause})" if o.cause else "") for o in s.outcomes])
        truth = " / ".join(_measured(values) for values in (
            [o.record_restarts for o in s.outcomes], [o.stale_answers for o in s.outcomes],
            [None if o.hidden_versions is None else len(o.hidden_versions) for o in s.outcomes]))
        lines.append(
            f"| {s.row.name} | {len(s.outcomes)} | {_counts([o.stage for o in s.outcomes])} "
            f"| {statistics.median(closes):.0f} / {_percentile(closes, 0.99):.0f} / {max(closes):.0f} "
            f"({close_bound(s.row) * 1e3:.0f}) | {seen} | {_counts([str(o.restarts) for o in s.outcomes])} "
            f"| {s.leaks.processes}/{s.leaks.threads}/{s.leaks.fds}/{s.leaks.ipc_dirs} "
            f"| {lost} / {resurrected} / {twice} | {truth} | {len(s.failures)} |")
    failures = [(s.row.name, f) for s in stats for f in s.failures]
    lines += ["", f"{sum(len(s.outcomes) for s in stats)} trials, {len(failures)} failed."]
    for name, failure in failures[:50]:
        lines.append(f"- {name}: {failure}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help=f"trials per row (default {DEFAULT_TRIALS})")
    parser.add_argument("--only", default=None, help="run only the rows whose name contains this")
    parser.add_argument("--out", default=str(RESULTS), help="where to write the markdown table")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    logging.basicConfig(level=logging.CRITICAL)  # the faults log loudly, on purpose
    rows = [r for r in ROWS + STREAM_ROWS if args.only is None or args.only in r.name]
    # A private TMPDIR, inherited by the pollers, so ipc directories left
    # behind are ours to count.
    run_tmp = tempfile.mkdtemp(prefix="bench-faults-")
    os.environ["TMPDIR"] = run_tmp
    tempfile.tempdir = None
    stats = [RowStats(row) for row in rows]
    started = time.monotonic()
    try:
        for trial in range(args.trials):
            for s in stats:
                workdir = tempfile.mkdtemp(prefix="trial-", dir=run_tmp)
                try:
                    play = run_stream_trial if s.row in STREAM_ROWS else run_trial
                    outcome, leaks = _leaks_of(lambda: play(s.row, workdir))
                except Exception as exc:  # a trial that broke is a failed trial, not the end of the report
                    outcome, leaks = Outcome(s.row.name, problems=[f"{type(exc).__name__}: {exc}"]), Leaks()
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                s.add(outcome, leaks)
            print(f"round {trial + 1}/{args.trials} done after {time.monotonic() - started:.0f}s", file=sys.stderr)
    finally:
        shutil.rmtree(run_tmp, ignore_errors=True)
    table = _table(stats, args.trials, time.monotonic() - started)
    print(table, end="")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Fault matrix reliability report\n\n`python -m bench.faults --trials {args.trials}`\n\n{table}")
    return 1 if any(s.failures for s in stats) else 0


if __name__ == "__main__":
    sys.exit(main())
