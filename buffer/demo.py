"""``python -m buffer.demo`` (``make demo``): the product's main job, end to end, on one machine.

::

    writer processes (spawn)            poller process            trainer (this process)
    ┌───────────────────────┐        ┌──────────────────┐       ┌──────────────────────────┐
    │ step g: markers       │        │ kv_list() every  │ zmq   │ ReplayBuffer             │
    │  {global_steps: g,    │──put──▶│ interval, diff   │──────▶│  sample(global_steps=g)  │
    │   status: running}    │  kv.db │                  │       │  remove + kv_clear       │
    │ then results (no      │(SQLite)└──────────────────┘       │  bumps the step          │
    │  global_steps: merged)│◀──────────── shared step counter ─┴──────────────────────────┘
    └───────────────────────┘

Each step, every writer first puts a ``running`` marker for each of its keys,
then, after short random delays, the result: mostly ``success`` (without
``global_steps``: it must come from merging with the marker), a few
``finished`` or ``failure``. The trainer samples the step, checks every tag,
removes the batch from the buffer and clears the step's keys from the store.
At the end it compares what the writers wrote with what it sampled: any row
lost, sampled twice or with wrong tags, or a close that was not graceful,
makes the exit code 1.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn, TextIO

from poller.common.checks import check_count, check_seconds
from poller.sources.contract import load_source

__all__ = ["run_demo"]

PARTITION = "train"
SOURCE_SPEC = "poller.sources.sqlite:SqliteSource"

#: Upper bound of the random delay before each chunk of results.
_MAX_RESULT_DELAY = 0.02
#: Results are written in this many chunks per writer and step.
_RESULT_CHUNKS = 4
#: Share of results that are "finished" / "failure" (the rest is "success").
_FINISHED_SHARE = 0.04
_FAILURE_SHARE = 0.04
#: How long any one wait of a step (markers, visibility, sample, results) may take.
_STEP_TIMEOUT = 30.0
_PROGRESS_EVERY = 0.5
_JOIN_TIMEOUT = 5.0
_TERMINATE_TIMEOUT = 2.0
#: How often the trainer re-checks a counter it waits for (writers do the same for the step).
_WAIT_TICK = 0.001


def step_keys(writer: int, step: int, keys_per_step: int) -> list[str]:
    """The keys writer ``writer`` uses in step ``step``; unique per writer and step."""
    return [f"w{writer}-s{step}-k{i}" for i in range(keys_per_step)]


@dataclass
class _Shared:
    """The counters trainer and writers share (picklable while spawning).

    Attributes:
        step: the step the trainer asks for; writers start it when it grows.
        stop: set by the trainer when writers must exit.
        markers: per writer, the last step whose ``running`` markers are stored.
        done: per writer, the last step whose results are all stored.
        written: per writer, ``success`` rows written so far (updated before ``done``).
    """

    step: Any
    stop: Any
    markers: list[Any]
    done: list[Any]
    written: list[Any]

    @classmethod
    def create(cls, ctx: BaseContext, writers: int) -> _Shared:
        return cls(
            step=ctx.Value("i", 0),
            stop=ctx.Event(),
            markers=[ctx.Value("i", 0) for _ in range(writers)],
            done=[ctx.Value("i", 0) for _ in range(writers)],
            written=[ctx.Value("q", 0) for _ in range(writers)],
        )

    def total_written(self) -> int:
        return sum(value.value for value in self.written)


@dataclass
class _Tally:
    """What the trainer saw."""

    steps: int = 0
    sampled: set[str] = field(default_factory=set)
    duplicates: int = 0
    wrong_tags: int = 0
    short_steps: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    interrupted: bool = False


class _DemoError(Exception):
    """A step could not complete (a writer died, a wait ran out of time)."""


def _open_store(path: str, **kwargs: Any) -> Any:
    """The SQLite store as its writers use it, named by spec like any source (a context manager)."""
    return load_source(SOURCE_SPEC, {"path": path, **kwargs})


# -- writer processes ---------------------------------------------------------------------------

def _writer_main(index: int, path: str, keys_per_step: int, shared: _Shared) -> None:
    """Rollout writer: one step at a time, whenever the trainer asks for it."""
    # Ctrl-C reaches the whole process group; the trainer decides when writers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rng = random.Random()
    with _open_store(path, timeout=_STEP_TIMEOUT) as store:
        finished = 0
        while not shared.stop.is_set():
            step = shared.step.value
            if step <= finished:
                shared.stop.wait(_WAIT_TICK)
                continue
            if not _write_step(store, index, step, keys_per_step, shared, rng):
                return
            finished = step


def _write_step(store: Any, index: int, step: int, keys_per_step: int, shared: _Shared,
                rng: random.Random) -> bool:
    """Write the markers, then the results of one step; False if told to stop half-way."""
    keys = step_keys(index, step, keys_per_step)
    store.kv_batch_put(keys, PARTITION, tags=[{"global_steps": step, "status": "running"} for _ in keys])
    shared.markers[index].value = step
    order = keys[:]
    rng.shuffle(order)
    chunk = max(1, math.ceil(len(order) / _RESULT_CHUNKS))
    successes = 0
    for start in range(0, len(order), chunk):
        if shared.stop.wait(rng.uniform(0.0, _MAX_RESULT_DELAY)):
            return False
        part = order[start:start + chunk]
        now = time.time()
        tags: list[dict[str, Any]] = []
        for _ in part:
            draw = rng.random()
            if draw < _FINISHED_SHARE:
                tags.append({"status": "finished"})
            elif draw < _FINISHED_SHARE + _FAILURE_SHARE:
                tags.append({"status": "failure"})
            else:
                # No global_steps on purpose: only the merge with the marker supplies it.
                tags.append({"status": "success", "written_at": now})
                successes += 1
        store.kv_batch_put(part, PARTITION, tags=tags)
    # written before done: a trainer that sees done == step also sees this step's count.
    with shared.written[index].get_lock():
        shared.written[index].value += successes
    shared.done[index].value = step
    return True


def _stop_writers(shared: _Shared, procs: Sequence[BaseProcess]) -> list[int | None]:
    """Stop, join (bounded), escalate to terminate/kill; return the exit codes."""
    shared.stop.set()
    deadline = time.monotonic() + _JOIN_TIMEOUT
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
            proc.join(_TERMINATE_TIMEOUT)
        if proc.pid is not None and proc.is_alive():
            proc.kill()
            proc.join(_JOIN_TIMEOUT)
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.pid is not None and proc.exitcode is not None:
            proc.close()  # releases the sentinel fd now, not at garbage collection
    return codes


# -- trainer ------------------------------------------------------------------------------------

def _wait_for(done: Callable[[], bool], what: str, procs: Sequence[BaseProcess]) -> None:
    """Wait until ``done()``; raise _DemoError if a writer died or the step timeout passed."""
    deadline = time.monotonic() + _STEP_TIMEOUT
    while not done():
        for proc in procs:
            if proc.exitcode is not None:
                raise _DemoError(f"writer {proc.name} exited with code {proc.exitcode} while waiting to {what}")
        if time.monotonic() > deadline:
            raise _DemoError(f"gave up after {_STEP_TIMEOUT:g}s waiting to {what}")
        time.sleep(_WAIT_TICK)


def _buffer_keys(rb: Any) -> int:
    keys = rb.stats()["keys"]
    if isinstance(keys, Mapping):  # per partition
        return sum(int(n) for n in keys.values())
    return int(keys)


def _percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(pct / 100 * len(ordered)) - 1))]


def _progress(out: TextIO, tally: _Tally, elapsed: float, buffered: int) -> None:
    if tally.latencies:
        latency = (f"latency p50 {_percentile(tally.latencies, 50) * 1000:6.1f} ms"
                   f" p99 {_percentile(tally.latencies, 99) * 1000:6.1f} ms")
    else:
        latency = "latency      - ms     -   ms"
    rate = len(tally.sampled) / elapsed if elapsed > 0 else 0.0
    print(f"step {tally.steps:5d}  sampled {len(tally.sampled):8d}  {rate:9.0f} rows/s  {latency}"
          f"  buffer keys {buffered}", file=out, flush=True)


def _run_step(rb: Any, store: Any, shared: _Shared, procs: Sequence[BaseProcess], tally: _Tally,
              step: int, keys_per_step: int, written_before: int, out: TextIO) -> int:
    """Drive one step from signal to clear; return the writers' total written after it."""
    writers = len(procs)
    shared.step.value = step
    _wait_for(lambda: all(v.value >= step for v in shared.markers), f"see the markers of step {step}", procs)
    # sample() answers from what the buffer has received: with no marker of
    # step g there yet, "nothing is running" holds and it would return at
    # once. All keys of previous steps were removed, so once the buffer holds
    # writers * keys_per_step keys it has seen every marker (each writer's
    # markers are one transaction, and kv_list() is one snapshot).
    expected = writers * keys_per_step
    _wait_for(lambda: _buffer_keys(rb) >= expected, f"let the buffer see the markers of step {step}", procs)

    batch = rb.sample(PARTITION, global_steps=step, timeout=_STEP_TIMEOUT)
    returned = time.time()

    _wait_for(lambda: all(v.value >= step for v in shared.done), f"see the results of step {step}", procs)
    written_after = shared.total_written()
    step_written = written_after - written_before

    latest = 0.0
    for key, tags in zip(batch.keys, batch.tags):
        if key in tally.sampled:
            tally.duplicates += 1
            print(f"  duplicate: {key} sampled again in step {step}", file=out)
            continue
        if tags.get("global_steps") != step or tags.get("status") != "success":
            tally.wrong_tags += 1
            print(f"  wrong tags in step {step}: {key} -> {tags}", file=out)
            continue
        tally.sampled.add(key)
        written_at = tags.get("written_at")
        if isinstance(written_at, (int, float)):
            latest = max(latest, float(written_at))
    if latest:
        tally.latencies.append(max(0.0, returned - latest))
    if len(batch.keys) != step_written:
        tally.short_steps += 1
        print(f"  step {step}: sampled {len(batch.keys)} keys, writers wrote {step_written} successes",
              file=out)
    tally.steps = step

    rb.remove(PARTITION, batch.keys)
    # The finished/failure keys too, so that the next step starts with an
    # empty buffer (the visibility check above counts on that).
    all_keys = [key for w in range(writers) for key in step_keys(w, step, keys_per_step)]
    in_batch = set(batch.keys)
    rb.remove(PARTITION, [key for key in all_keys if key not in in_batch])
    store.kv_clear(all_keys, PARTITION)
    return written_after


def _train(rb: Any, store: Any, shared: _Shared, procs: Sequence[BaseProcess], tally: _Tally,
           seconds: float, keys_per_step: int, out: TextIO) -> None:
    """Run steps until ``seconds`` have passed (at least one); record failures in ``tally``."""
    start = time.monotonic()
    deadline = start + seconds
    last_print = start
    written = 0
    step = 0
    try:
        # The deadline is checked only between steps: every step the writers
        # started is sampled, so written and sampled must match exactly.
        while step == 0 or time.monotonic() < deadline:
            step += 1
            written = _run_step(rb, store, shared, procs, tally, step, keys_per_step, written, out)
            now = time.monotonic()
            if now - last_print >= _PROGRESS_EVERY:
                last_print = now
                _progress(out, tally, now - start, _buffer_keys(rb))
        _progress(out, tally, time.monotonic() - start, _buffer_keys(rb))
    except KeyboardInterrupt:
        tally.interrupted = True
    except _DemoError as exc:
        tally.errors.append(str(exc))
    except Exception as exc:  # sample() timing out or the poller crashing: report, then shut down cleanly
        tally.errors.append(f"step {step}: {type(exc).__name__}: {exc}")
        print(traceback.format_exc().rstrip(), file=out)


def run_demo(seconds: float = 10.0, *, writers: int = 2, keys_per_step: int = 64, poll_interval: float = 0.05,
             out: TextIO = sys.stdout) -> int:
    """Run writers, a poller and a trainer against a fresh SQLite store; print progress.

    Args:
        seconds: how long to start new steps (the last one is always finished).
        writers: number of rollout-writer processes.
        keys_per_step: keys each writer writes per step.
        poll_interval: the poller's ``kv_list()`` interval in seconds.
        out: where progress and the report go.

    Returns:
        0 when every success row written was sampled exactly once with the
        right tags and the buffer closed gracefully; 130 when Ctrl-C ended
        it early; 1 otherwise.

    Raises:
        ValueError: an argument is out of range.
    """
    check_seconds("seconds", seconds, allow_zero=True)
    check_count("writers", writers, minimum=1)
    check_count("keys_per_step", keys_per_step, minimum=1)
    check_seconds("poll_interval", poll_interval)
    from buffer import ReplayBuffer  # here: buffer imports this module only when asked

    ctx = multiprocessing.get_context("spawn")
    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix="poller-demo-") as tmp:
        db = Path(tmp) / "kv.db"
        with _open_store(str(db)) as store:
            store.kv_list()  # creates the file and its schema before writers and poller open it
            shared = _Shared.create(ctx, writers)
            procs = [ctx.Process(target=_writer_main, args=(w, str(db), keys_per_step, shared),
                                 name=f"demo-writer-{w}") for w in range(writers)]
            print(f"demo: {writers} writer(s) x {keys_per_step} keys per step, poll interval "
                  f"{poll_interval * 1000:g} ms, {seconds:g} s, store {db}", file=out, flush=True)
            try:
                for proc in procs:
                    proc.start()
                with ReplayBuffer(source=SOURCE_SPEC, source_kwargs={"path": str(db)},
                                  poll_interval=poll_interval) as rb:
                    _train(rb, store, shared, procs, tally, seconds, keys_per_step, out)
                report = rb.close()  # the same report the with block produced
            finally:
                exitcodes = _stop_writers(shared, procs)
            written = shared.total_written()

    for proc, code in zip(procs, exitcodes):
        if code != 0:
            tally.errors.append(f"writer {proc.name} exit code {code}")
    stage = getattr(report.stage, "value", report.stage)
    sampled = len(tally.sampled)
    unsampled = max(0, written - sampled)
    # Ctrl-C ends the demo mid-step: rows written but not sampled yet are not lost.
    missing = f"not sampled (interrupted) {unsampled}" if tally.interrupted else f"lost {unsampled}"
    print(f"shutdown: stage {stage}, {report.seconds * 1000:.1f} ms, poller exit code {report.exitcode}, "
          f"drained {report.drained}", file=out)
    print(f"totals: {tally.steps} step(s), success rows written {written}, sampled {sampled}, "
          f"duplicates {tally.duplicates}, {missing}, wrong tags {tally.wrong_tags}, "
          f"steps with a count mismatch {tally.short_steps}", file=out)
    for error in tally.errors:
        print(f"error: {error}", file=out)
    ok = (written == sampled and tally.duplicates == 0 and tally.wrong_tags == 0 and tally.short_steps == 0
          and not tally.errors and stage == "graceful" and not tally.interrupted)
    result = "OK" if ok else "INTERRUPTED" if tally.interrupted else "FAILED"
    print(f"result: {result}", file=out, flush=True)
    return 0 if ok else 130 if tally.interrupted else 1


# -- command line: python -m buffer.demo -------------------------------------------------------

def _number(kind: Callable[[str], float], low: float, strict: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):  # nan slips past every comparison below; inf never ends
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the ``demo`` sub-command)."""
    parser.add_argument("--seconds", type=_number(float, 0, False), default=10.0,
                        help="how long to keep starting steps (default: %(default)s)")
    parser.add_argument("--writers", type=_number(int, 1, False), default=2,
                        help="rollout-writer processes (default: %(default)s)")
    parser.add_argument("--keys-per-step", type=_number(int, 1, False), default=64,
                        help="keys per writer and step (default: %(default)s)")
    parser.add_argument("--poll-interval", type=_number(float, 0, True), default=0.05,
                        help="poll interval in seconds (default: %(default)s)")


def main_from_args(args: argparse.Namespace) -> int:
    """Run the demo with parsed arguments; return the exit code."""
    # sys.stdout looked up now, not at import: callers (and tests) may have replaced it.
    try:
        return run_demo(args.seconds, writers=args.writers, keys_per_step=args.keys_per_step,
                        poll_interval=args.poll_interval, out=sys.stdout)
    except KeyboardInterrupt:  # before or after the steps: nothing to report but that
        print("demo: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line on stderr, exit 2, as `python -m poller` does
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m buffer.demo [options]``: run the demo; return its exit code (2: bad arguments)."""
    parser = _Parser(prog="python -m buffer.demo",
                                     description="Rollout writers, a SQLite store, a ReplayBuffer and a trainer loop.")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return main_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
