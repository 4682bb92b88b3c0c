"""The buffer on a real TransferQueue: put -> visible latency and close(), against
baselines measured in the same run.

    python -m bench.transferqueue [--puts N] [--repeat N]

Needs the ``transferqueue`` extra (``make test-integration`` installs it).
This process is the trainer: it starts Ray and TransferQueue as the example
trainer does, and writes with ``tq.kv_put``. Baselines: the ``kv_put`` call
alone and one ``kv_list()`` round trip of the source (the floors under any
put -> visible), the same put -> visible on the embedded SQLite store, and
SIGKILL-and-reap of an idle child (the floor under any close).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from bench.lifecycle import kill_floor
from buffer import ReplayBuffer
from examples.verl_style_trainer import start_store, stop_store
from poller.sources import transferqueue as tq_source
from poller.sources.sqlite import SqliteSource


def put_to_visible(rb: ReplayBuffer, put: Callable[[str], None], puts: int, tag: str,
                   interval: float) -> list[float]:
    """Seconds from just before each put until ``sample()`` returns with that key.

    Each put waits a random part of the poll interval first: put right after
    the previous key showed up, it would always land just after a poll and
    always wait a whole interval.
    """
    rng = random.Random(puts)
    latencies = []
    for i in range(puts):
        time.sleep(rng.uniform(0, interval))
        started = time.perf_counter()
        put(f"{tag}-{i}")
        rb.sample(tag, batch_size=i + 1, timeout=30)  # wakes on the change itself
        latencies.append(time.perf_counter() - started)
    return latencies


def timed(fn: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transferqueue", description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    import transfer_queue as tq

    rows = []
    ray_tmp = tempfile.mkdtemp(prefix="tq-bench-", dir="/tmp")
    conf = start_store(temp_dir=ray_tmp)
    try:
        kwargs = tq_source.source_kwargs(conf)
        put = timed(lambda: tq.kv_put(f"floor-{time.monotonic_ns()}", "floor", tag={"status": "success"}),
                    args.repeat * 5)
        source = tq_source.TransferQueueSource(**kwargs)
        round_trip = timed(source.kv_list, args.repeat * 5)
        source.close()
        rows.append(("floor: tq.kv_put() call", put, None))
        rows.append(("floor: source kv_list() round trip", round_trip, None))
        with tempfile.TemporaryDirectory() as tmp, SqliteSource(os.path.join(tmp, "kv.db")) as sqlite:
            db = os.path.join(tmp, "kv.db")
            for interval in (0.01, 0.1, 0.5):
                with ReplayBuffer(tq_source.SPEC, source_kwargs=kwargs, poll_interval=interval) as rb:
                    tq_lat = put_to_visible(rb, lambda k: tq.kv_put(k, f"tq{interval}", tag={"status": "success"}),
                                            args.puts, f"tq{interval}", interval)
                with ReplayBuffer("poller.sources.sqlite:SqliteSource", source_kwargs={"path": db},
                                  poll_interval=interval) as rb:
                    sq_lat = put_to_visible(rb, lambda k: sqlite.kv_put(k, f"sq{interval}", tag={"status": "success"}),
                                            args.puts, f"sq{interval}", interval)
                tq_med, sq_med = statistics.median(tq_lat), statistics.median(sq_lat)
                rows.append((f"put -> visible, TQ, poll {interval:g}s (median)", tq_med, sq_med))
                rows.append((f"put -> visible, TQ, poll {interval:g}s (max)", max(tq_lat), max(sq_lat)))

            def close_tq_buffer() -> float:
                rb = ReplayBuffer(tq_source.SPEC, source_kwargs=kwargs, poll_interval=1.0)
                report = rb.close()
                assert report.stage == "graceful", report
                return report.seconds

            def close_sqlite_buffer() -> float:
                rb = ReplayBuffer("poller.sources.sqlite:SqliteSource", source_kwargs={"path": db},
                                  poll_interval=1.0)
                return rb.close().seconds

            closes = statistics.median(close_tq_buffer() for _ in range(args.repeat))
            sq_closes = statistics.median(close_sqlite_buffer() for _ in range(args.repeat))
            floor = statistics.median(kill_floor() for _ in range(args.repeat))
            rows.append(("close(), TQ source, idle (graceful)", closes, sq_closes))
            rows.append(("floor: SIGKILL + reap idle child", floor, None))
            # The wrong order: the controller is gone and kv_list() gets no answer.
            stalled = ReplayBuffer(tq_source.SPEC, source_kwargs=dict(kwargs, call_timeout=60.0), poll_interval=0.05)
            tq.close()
            time.sleep(2.0)  # the poller's kv_list() is now waiting on a dead controller
            report = stalled.close()
            rows.append((f"close(), TQ closed first ({report.stage})", report.seconds, sq_closes))
    finally:
        stop_store()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores; {args.puts} puts per interval, "
          f"medians of {args.repeat} closes")
    print(f"{'figure':46} {'ms':>9} {'vs SQLite':>10}")
    for name, seconds, baseline in rows:
        ratio = f"{seconds / baseline:9.2f}x" if baseline else ""
        print(f"{name:46} {seconds * 1e3:9.2f} {ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
