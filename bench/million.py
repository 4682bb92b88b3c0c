"""A store of a million keys: start, first answer, memory, and a 6 s stop of the trainer.

    python -m bench.million [--keys 1000000] [--per-step 10000] [--stop 6]

One SQLite store, one partition ``train``, ``--per-step`` keys per
``global_steps`` (all ``"success"``). A trainer process (``python -m
bench.million trainer``) builds a :class:`~buffer.ReplayBuffer` on it and
reports: the constructor's time, the time until ``sample(global_steps=g)``
first answers and how many keys it answered (it must be the whole step: no
answer from a partial view), when every key was visible, and its own RSS and
its poller's. Then this process SIGSTOPs the trainer for ``--stop`` seconds
while it writes a new step and clears part of an old one, resumes it, and
the trainer reports how long after SIGCONT its buffer equalled the store.
One ``kv_list()`` of the store, timed in this process, is the yardstick.
Prints a table and writes ``bench/results/million.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .pauses import read_json_line
from .report import Goal, Table

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "million.md"
SQLITE = "poller.sources.sqlite:SqliteSource"
PARTITION = "train"
_GENEROUS = 600.0


def _fill(db: str, keys: int, per_step: int) -> None:
    from poller.sources.sqlite import SqliteSource

    with SqliteSource(db) as store:
        for start in range(0, keys, per_step):
            step = start // per_step
            names = [f"s{step:05d}-{i:05d}" for i in range(min(per_step, keys - start))]
            store.kv_batch_put(names, PARTITION, tags=[{"global_steps": step, "status": "success"}] * len(names))


def _trainer(argv: Sequence[str]) -> int:
    """The trainer process: prints one JSON line per stage; waits for ``converge`` on stdin."""
    from buffer import ReplayBuffer

    from .workload import rss_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.million trainer")
    parser.add_argument("--db", required=True)
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--per-step", type=int, required=True)
    args = parser.parse_args(argv)
    started = time.monotonic()
    rb = ReplayBuffer(SQLITE, source_kwargs={"path": args.db}, poll_interval=1.0, start_timeout=_GENEROUS)
    try:
        constructed = time.monotonic() - started
        batch = rb.sample(PARTITION, global_steps=args.step, timeout=_GENEROUS)
        answered = time.monotonic() - started
        while rb.stats()["keys"] < args.keys and time.monotonic() - started < _GENEROUS:
            time.sleep(0.01)
        visible = time.monotonic() - started
        stats = rb.stats()
        print(json.dumps({"constructor_s": constructed, "first_answer_s": answered, "answered": len(batch.keys),
                          "all_visible_s": visible, "keys": stats["keys"], "trainer_rss": rss_bytes(),
                          "poller_rss": stats["poller_rss"]}), flush=True)
        for line in sys.stdin:
            command, *rest = line.split()
            if command != "converge":
                break
            new_step, want_keys = int(rest[0]), int(rest[1])
            print(json.dumps(_converge(rb, args.db, new_step, want_keys, args.per_step)), flush=True)
    finally:
        report = rb.close()
    print(json.dumps({"close": report.stage, "close_s": report.seconds}), flush=True)
    return 0


def _converge(rb: Any, db: str, new_step: int, want_keys: int, per_step: int) -> dict[str, Any]:
    """Seconds until the buffer holds the new step whole and ``want_keys`` keys; then a full comparison."""
    from poller.sources.sqlite import SqliteSource

    from .workload import rss_bytes

    started = time.monotonic()
    converged = None
    while time.monotonic() - started < _GENEROUS:
        try:
            fresh = rb.sample(PARTITION, global_steps=new_step, timeout=0)
        except TimeoutError:  # the view is not whole yet (a resync under way)
            fresh = None
        # The new step whole and the count right: the cleared keys are gone too.
        if fresh is not None and len(fresh.keys) == per_step and rb.stats()["keys"] == want_keys:
            converged = time.monotonic() - started
            break
        time.sleep(0.02)
    with SqliteSource(db) as store:
        equal = rb.snapshot() == store.kv_list()
    # Settled: two heartbeats later the poller's RSS is its own after the polls, not a listing in flight.
    time.sleep(2.5)
    return {"converged_s": converged, "equal": equal, "resyncs": rb.stats()["resyncs"],
            "settled_trainer_rss": rss_bytes(), "settled_poller_rss": rb.stats()["poller_rss"]}


def run(keys: int, per_step: int, stop_s: float, workdir: str) -> dict[str, Any]:
    from poller.sources.sqlite import SqliteSource

    db = os.path.join(workdir, "kv.db")
    filled = time.monotonic()
    _fill(db, keys, per_step)
    out: dict[str, Any] = {"fill_s": time.monotonic() - filled}
    with SqliteSource(db) as store:
        listed = time.monotonic()
        store.kv_list()
        out["kv_list_s"] = time.monotonic() - listed
    step = (keys // per_step) // 2
    proc = subprocess.Popen([sys.executable, "-m", "bench.million", "trainer", "--db", db, "--keys", str(keys),
                             "--step", str(step), "--per-step", str(per_step)],
                            cwd=_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stopped = False
    try:
        out.update(read_json_line(proc, _GENEROUS))
        new_step = keys // per_step + 1
        cleared = "s00000-"
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        paused = time.monotonic()
        with SqliteSource(db) as store:
            names = [f"s{new_step:05d}-{i:05d}" for i in range(per_step)]
            store.kv_batch_put(names, PARTITION, tags=[{"global_steps": new_step, "status": "success"}] * per_step)
            store.kv_clear([f"{cleared}{i:05d}" for i in range(per_step // 2)], PARTITION)
            want = sum(map(len, store.kv_list().values()))
        time.sleep(max(0.0, stop_s - (time.monotonic() - paused)))
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        assert proc.stdin is not None
        proc.stdin.write(f"converge {new_step} {want}\n")
        proc.stdin.flush()
        out.update(read_json_line(proc, _GENEROUS))
        proc.stdin.write("close\n")
        proc.stdin.flush()
        out.update(read_json_line(proc, 60))
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return out


def _table(r: dict[str, Any], keys: int, per_step: int, stop_s: float, load: str) -> str:
    mb = 1024 * 1024
    converged = "never" if r.get("converged_s") is None else f"{r['converged_s']:.2f} s"
    rows = [
        ("one `kv_list()` of the store (yardstick)", f"{r['kv_list_s']:.2f} s"),
        ("constructor returns", f"{r['constructor_s']:.2f} s"),
        ("`sample(global_steps=g)` first answers, from the constructor's start", f"{r['first_answer_s']:.2f} s"),
        ("keys in that answer", f"{r['answered']:,} of {per_step:,}"),
        ("every key visible, from the constructor's start", f"{r['all_visible_s']:.2f} s"),
        ("trainer RSS / poller RSS", f"{r['trainer_rss'] / mb:.0f} MB / {(r['poller_rss'] or 0) / mb:.0f} MB"),
        (f"trainer SIGSTOPped {stop_s:g} s (a new step written, half a step cleared) → buffer equals the store, "
         f"after SIGCONT", f"{converged} ({r.get('resyncs', '?')} resync(s); equal in full: {r.get('equal')})"),
        ("close", f"{r.get('close', '?')} in {1000 * r.get('close_s', 0):.0f} ms"),
    ]
    lines = [f"# A million keys\n\n`python -m bench.million --keys {keys} --per-step {per_step} --stop {stop_s:g}`\n",
             f"SQLite, one partition, {keys:,} keys, {per_step:,} per `global_steps`; load average {load} on "
             f"{os.cpu_count()} cores. Filling the store took {r['fill_s']:.0f} s (not a product figure).\n",
             "| figure | value |", "| --- | --- |"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def benchmark(progress: Callable[[str], None], quick: bool) -> Table:
    """The runner's ``million``: the figures above as a table with the goals, at 1M keys (100k with --quick)."""
    keys = 100_000 if quick else 1_000_000
    per_step = 10_000
    stop_s = 6.0
    progress(f"million: {keys:,} SQLite keys, start, then the trainer SIGSTOPped {stop_s:g} s")
    with tempfile.TemporaryDirectory(prefix="million-") as workdir:
        r = run(keys, per_step, stop_s, workdir)
    mb = 1024 * 1024
    table = Table("10", f"a store of {keys:,} keys (SQLite): start, a {stop_s:g} s stop of the trainer, memory",
                  ["figure", "value", "÷ one kv_list()"])
    listing = r["kv_list_s"]
    table.add("one kv_list() of the store (yardstick), s", listing, 1.0)
    table.add("constructor returns, s", r["constructor_s"], r["constructor_s"] / listing)
    table.add("every key visible, from the constructor's start, s", r["all_visible_s"], r["all_visible_s"] / listing)
    table.add("sample(global_steps=g) first answers, s", r["first_answer_s"], r["first_answer_s"] / listing)
    converged = r.get("converged_s")
    table.add(f"SIGSTOP {stop_s:g} s -> buffer equals the store, s after SIGCONT",
              "never" if converged is None else converged, "-" if converged is None else converged / listing)
    table.add("trainer RSS / poller RSS after the first answer, MB",
              f"{r['trainer_rss'] / mb:.0f} / {(r['poller_rss'] or 0) / mb:.0f}", "-")
    trainer_rss, poller_rss = r.get("settled_trainer_rss") or 0, r.get("settled_poller_rss") or 0
    table.add("trainer RSS / poller RSS settled (after the stop, 2.5 s later), MB",
              f"{trainer_rss / mb:.0f} / {poller_rss / mb:.0f}", "-")
    table.goals.append(Goal("every key visible / one kv_list()", r["all_visible_s"] / listing, 2.0))
    table.goals.append(Goal("after SIGCONT, seconds to equal the store beyond one kv_list()",
                            float("inf") if converged is None else converged - listing, 3.0))
    table.goals.append(Goal("poller RSS / trainer RSS, settled", poller_rss / trainer_rss if trainer_rss else
                            float("inf"), 1.0))
    table.notes.append(f"{per_step:,} keys per global_steps, all 'success'; the first answer held "
                       f"{r['answered']:,} of {per_step:,} keys; {r.get('resyncs', '?')} resync(s) after the stop, "
                       f"equal in full: {r.get('equal')}; close {r.get('close', '?')} in "
                       f"{1000 * r.get('close_s', 0):.0f} ms")
    table.notes.append("the trainer holds every key packed plus its step index; the poller what it sent, packed; "
                       "the store is read in pieces for a snapshot (kv_snapshot_pieces), each sent while the next "
                       "is read, so the trainer applies the keys as they are read")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["trainer"]:
        return _trainer(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.million", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--per-step", type=int, default=10_000)
    parser.add_argument("--stop", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load = "{:.2f} / {:.2f}".format(*os.getloadavg()[:2])
    with tempfile.TemporaryDirectory(prefix="million-") as workdir:
        result = run(args.keys, args.per_step, args.stop, workdir)
    text = _table(result, args.keys, args.per_step, args.stop, load)
    print(text)
    args.out.write_text(text)
    ok = result["answered"] == args.per_step and result.get("converged_s") is not None and result.get("equal")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
