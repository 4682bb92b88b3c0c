"""``python -m bench [--quick] [--only NAME[,NAME]]``: run, print, write results.

Each benchmark measures the product and its baselines in the same run and
returns tables of ratios; the runner prints them as they finish and writes
``bench/results/latest.md`` (plots beside it as PNG) for a whole run.
"""

from __future__ import annotations

import argparse
import compileall
import logging
import os
import sys
import time
from typing import Callable, Sequence

from . import latency, lifecycle, memory, million, overhead, throughput, tq, verl, verl_loop, wake_family
from .report import LoadMonitor, Table, environment_lines, write_markdown

Benchmark = Callable[[Callable[[str], None], bool], "Table | list[Table]"]

BENCHMARKS: dict[str, Benchmark] = {
    "slowdown": overhead.slowdown,
    "cpu": overhead.cpu_per_poll,
    "visible": latency.change_to_visible,
    "visible-default": latency.change_to_visible_by_default,
    "wakeup": latency.sample_wakeup,
    "close": lifecycle.close,
    "start": lifecycle.start,
    "snapshot": throughput.snapshot,
    "memory": memory.gc_and_rss,
    "million": million.benchmark,
    "verl": verl.run,
    "tq": tq.run,
    "verl-loop": verl_loop.run,
    "wake-family": wake_family.run,
}

# Left out of a whole `--quick` run (named with --only, they run in their short form), to keep it
# under 3 minutes: Ray and TransferQueue take ~25 s to start and verl ~10 s to import on a 2-core
# machine; filling a store for `million` takes ~20 s even at its quick size, and its goals are
# set at 1M keys, where start-up costs no longer weigh. verl-loop starts verl's TaskRunner and agent loop worker
# (~25 s) for each of its runs; wake-family times hundreds of wake-ups of seconds each (~10 min even quick).
NOT_QUICK = {"tq", "million", "verl-loop", "wake-family"}

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and smaller K (about two minutes); "
                        f"leaves out {', '.join(sorted(NOT_QUICK))} unless named with --only")
    parser.add_argument("--only", metavar="NAME", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", help="markdown file to write (default: bench/results/latest.md for a whole "
                                      "run, bench/results/partial.md with --only)")
    args = parser.parse_args(argv)
    names = list(BENCHMARKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    if args.quick and not args.only:
        names = [n for n in names if n not in NOT_QUICK]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    out = args.out or os.path.join(RESULTS, "partial.md" if args.only else "latest.md")
    # The product logs restarts and escalations at WARNING; here they are expected noise.
    for name in ("buffer", "poller"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    _compile_bytecode()
    load = LoadMonitor()
    started = time.monotonic()

    def progress(message: str) -> None:
        # Every progress line is a load sample: the range in the results is the one the log shows.
        print(f"[{time.monotonic() - started:6.1f}s load {load.sample(message):4.2f}] {message}", file=sys.stderr,
              flush=True)

    tables: list[Table] = []
    for i, name in enumerate(names, 1):
        progress(f"({i}/{len(names)}) {name}")
        load.sample(name)
        result = BENCHMARKS[name](progress, args.quick)
        load.sample(name)
        for table in result if isinstance(result, list) else [result]:
            tables.append(table)
            print(table.text() + "\n", flush=True)
    elapsed = time.monotonic() - started
    write_markdown(out, tables, environment_lines(args.quick, elapsed, load, args.only))
    progress(f"done in {elapsed:.0f}s; wrote {os.path.relpath(out)}")
    missed = [f"#{t.number} {g.text}" for t in tables for g in t.goals if not g.met]
    print("goals missed: " + ("; ".join(missed) if missed else "none"))
    return 0


def _compile_bytecode() -> None:
    # An installed package ships compiled bytecode; a source checkout run with
    # PYTHONDONTWRITEBYTECODE would recompile every module in every poller
    # start and bias the start-up figure against the product.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("poller", "buffer", "bench"):
        compileall.compile_dir(os.path.join(root, package), quiet=2)
