"""Stopped processes: a trainer or its poller SIGSTOPped while the store changes.

    python -m bench.pauses [--seconds 1,5,10,30] [--target trainer,poller] [--trials N]

A trainer process (``python -m bench.pauses trainer``) holds a
:class:`~buffer.ReplayBuffer` on a SQLite store; this process writes to the
store, stops the trainer (or the trainer's poller) with SIGSTOP for a while,
keeps writing, sends SIGCONT and stops writing, then asks the trainer how
long its buffer took to equal the store again. That time, from SIGCONT to
convergence, is the figure; ``None`` means it never converged within the
deadline. ``tests/faults/test_pauses.py`` and ``python -m bench.faults`` use
:func:`run_pause`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from poller.sources.sqlite import SqliteSource

__all__ = ["PauseOutcome", "run_pause", "read_json_line", "main"]

_ROOT = Path(__file__).resolve().parent.parent
SQLITE = "poller.sources.sqlite:SqliteSource"
POLL_INTERVAL = 0.1
# How long the trainer waits for convergence before it reports failure.
CONVERGE_DEADLINE = 30.0
_GENEROUS = 30.0


@dataclass
class PauseOutcome:
    """One stop of a process and what the buffer did afterwards."""

    target: str
    stopped_s: float
    converged_s: float | None = None
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    store_keys: int = 0
    close_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    stage: str = "?"
    drained: bool = False
    problems: list[str] = field(default_factory=list)
    # With sync_after: seconds the sync() called right after SIGCONT took (None: it failed).
    sync_s: float | None = None
    sync_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.converged_s is not None and not self.problems


def _trainer(argv: Sequence[str]) -> int:
    """The trainer process: a buffer on ``--db``; answers ``converge`` and ``close`` on stdin."""
    from buffer import ReplayBuffer

    parser = argparse.ArgumentParser(prog="python -m bench.pauses trainer")
    parser.add_argument("--db", required=True)
    parser.add_argument("--interval", type=float, default=POLL_INTERVAL)
    args = parser.parse_args(argv)
    store = SqliteSource(args.db)
    rb = ReplayBuffer(SQLITE, source_kwargs={"path": args.db}, poll_interval=args.interval, start_timeout=_GENEROUS)
    try:
        print(json.dumps({"poller_pid": rb.stats()["poller_pid"]}), flush=True)
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "converge":
                print(json.dumps(_converge(rb, store, float(rest[0]))), flush=True)
            elif command == "sync":
                print(json.dumps(_sync(rb, float(rest[0]))), flush=True)
            elif command == "close":
                break
    finally:
        report = rb.close()
        store.close()
    print(json.dumps({"stage": report.stage, "drained": report.drained, "seconds": report.seconds}), flush=True)
    return 0


def _sync(rb: Any, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        rb.sync(timeout=timeout)
    except Exception as exc:  # reported, not raised: the trainer must answer the driver
        return {"sync_s": None, "sync_error": f"{type(exc).__name__}: {exc}"}
    return {"sync_s": time.monotonic() - started, "sync_error": None}


def _converge(rb: Any, store: SqliteSource, deadline_s: float) -> dict[str, Any]:
    started = time.monotonic()
    converged: float | None = None
    while True:
        listed = store.kv_list()
        have = rb.snapshot()
        if have == listed:
            converged = time.monotonic() - started
            break
        if time.monotonic() - started > deadline_s:
            break
        time.sleep(0.01)
    want = {f"{p}/{k}": t for p, items in listed.items() for k, t in items.items()}
    got = {f"{p}/{k}": t for p, items in have.items() for k, t in items.items()}
    stats = rb.stats()
    return {"converged_s": converged, "missing": sorted(want.keys() - got.keys()),
            "extra": sorted(got.keys() - want.keys()),
            "wrong": sorted(k for k in want.keys() & got.keys() if want[k] != got[k]), "store_keys": len(want),
            "stats": {k: stats[k] for k in ("messages", "resyncs", "stale_peers", "protocol_errors", "restarts")}}


class _Writer(threading.Thread):
    """Adds, updates and clears keys in the store until stopped."""

    def __init__(self, db: str) -> None:
        super().__init__(name="pause-writer", daemon=True)
        self.store = SqliteSource(db)
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.batches = 0

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                step = self.batches
                keys = [f"s{step}-{i}" for i in range(20)]
                self.store.kv_batch_put(keys, "train", tags=[{"global_steps": step, "status": "running"}] * 20)
                if step >= 1:  # the previous step finishes
                    done = [f"s{step - 1}-{i}" for i in range(20)]
                    self.store.kv_batch_put(done, "train", tags=[{"status": "success"}] * 20)
                if step >= 3:  # and an older one is consumed
                    self.store.kv_clear([f"s{step - 3}-{i}" for i in range(10)], "train")
                self.batches += 1
                self.halt.wait(0.02)
        except BaseException as exc:  # reported by run_pause
            self.error = exc
        finally:
            self.store.close()


def read_json_line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The next line of ``proc``'s stdout as a JSON object, read under a deadline."""
    assert proc.stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()),  # type: ignore[union-attr]
                              name="pause-reader", daemon=True)
    reader.start()
    reader.join(timeout)
    if not result or not result[0]:
        raise RuntimeError(f"the trainer said nothing within {timeout}s (exit code {proc.poll()})")
    return dict(json.loads(result[0]))


def run_pause(target: str, stopped_s: float, workdir: str, *, interval: float = POLL_INTERVAL,
              converge_deadline: float = CONVERGE_DEADLINE, sync_after: float | None = None) -> PauseOutcome:
    """Stop ``target`` (``"trainer"`` or ``"poller"``) for ``stopped_s`` while the store changes.

    With ``sync_after``, the trainer calls ``sync(timeout=sync_after)`` as
    soon as it is resumed (while its stream reconnects), before converging.
    """
    if target not in ("trainer", "poller"):
        raise ValueError(f"target must be 'trainer' or 'poller', got {target!r}")
    out = PauseOutcome(target, stopped_s)
    db = os.path.join(workdir, "kv.db")
    SqliteSource(db).close()  # created before either side opens it
    proc = subprocess.Popen([sys.executable, "-m", "bench.pauses", "trainer", "--db", db, "--interval", str(interval)],
                            cwd=_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer = _Writer(db)
    stopped = False
    try:
        hello = read_json_line(proc, _GENEROUS)
        pid = proc.pid if target == "trainer" else int(hello["poller_pid"])
        writer.start()
        time.sleep(0.5)  # the stream is flowing
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        time.sleep(stopped_s)
        writer.halt.set()
        writer.join(_GENEROUS)
        os.kill(pid, signal.SIGCONT)
        stopped = False
        assert proc.stdin is not None
        if sync_after is not None:
            proc.stdin.write(f"sync {sync_after}\n")
            proc.stdin.flush()
            synced = read_json_line(proc, sync_after + _GENEROUS)
            out.sync_s, out.sync_error = synced["sync_s"], synced["sync_error"]
            if out.sync_error is not None:
                out.problems.append(f"sync after SIGCONT: {out.sync_error}")
        proc.stdin.write(f"converge {converge_deadline}\n")
        proc.stdin.flush()
        result = read_json_line(proc, converge_deadline + _GENEROUS)
        for name in ("converged_s", "missing", "extra", "wrong", "store_keys", "stats"):
            setattr(out, name, result[name])
        proc.stdin.write("close\n")
        proc.stdin.flush()
        report = read_json_line(proc, _GENEROUS)
        out.stage, out.drained, out.close_s = report["stage"], report["drained"], report["seconds"]
        if writer.error is not None:
            out.problems.append(f"writer: {writer.error!r}")
        if out.stage != "graceful" or not out.drained:
            out.problems.append(f"close: {out.stage}, drained={out.drained}")
    finally:
        writer.halt.set()
        if stopped:
            os.kill(pid, signal.SIGCONT)
        if writer.is_alive():
            writer.join(_GENEROUS)
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(_GENEROUS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["trainer"]:
        return _trainer(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.pauses", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", default="1,5,10,30", help="stop lengths, comma-separated")
    parser.add_argument("--target", default="trainer,poller", help="trainer, poller or both")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=CONVERGE_DEADLINE, help="convergence deadline (s)")
    args = parser.parse_args(argv)
    print("| stopped | seconds | trials | converged | after SIGCONT: median / max s | missing/extra/wrong (worst) "
          "| resyncs (max) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed = 0
    for target in args.target.split(","):
        for seconds in (float(s) for s in args.seconds.split(",")):
            outcomes = []
            for _ in range(args.trials):
                with tempfile.TemporaryDirectory(prefix="pause-") as workdir:
                    outcomes.append(run_pause(target, seconds, workdir, converge_deadline=args.deadline))
            ok = [o.converged_s for o in outcomes if o.converged_s is not None]
            failed += sum(not o.ok for o in outcomes)
            worst = max(outcomes, key=lambda o: len(o.missing) + len(o.extra) + len(o.wrong))
            times = f"{statistics.median(ok):.2f} / {max(ok):.2f}" if ok else "-"
            print(f"| {target} | {seconds:g} | {len(outcomes)} | {len(ok)} | {times} "
                  f"| {len(worst.missing)}/{len(worst.extra)}/{len(worst.wrong)} "
                  f"| {max(o.stats.get('resyncs', 0) for o in outcomes)} |", flush=True)
            for o in outcomes:
                if o.problems:
                    print(f"  problems: {o.problems}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
