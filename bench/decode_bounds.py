"""What the hostile-input bounds cost the receiver, against decoding without them in the same run.

    python -m bench.decode_bounds [--repeat N] [--keys K]

Decodes one DELTA of K keys (default 4096, the poller's chunk size) with
small scalar tags, the common case. Baseline: the same frames through
msgpack and the per-kind schema check only, i.e. :func:`poller.wire.protocol.decode`
without the keys-per-message and nesting bounds. Prints the ratio and the
medians of N repetitions (each the best of 5 runs of 10 decodes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Sequence

from poller.wire import protocol
from poller.wire.protocol import DEFAULT_LIMITS, Kind, check_body, decode, encode_header, iter_encode_delta
from poller.wire.tags import pack_many_tags


def _frames(keys: int) -> list[bytes]:
    items = {"train": {f"key-{i:06d}": {"global_steps": i // 64, "status": "success", "reward": 0.5}
                       for i in range(keys)}}
    pieces = [{p: (list(tags), pack_many_tags(tags.values())) for p, tags in items.items()}]
    body, = iter_encode_delta(pieces, {}, poll=1, started=0.0, full=False, chunk_items=keys + 1,  # type: ignore[arg-type]
                              max_frame_bytes=DEFAULT_LIMITS.max_frame_bytes)
    return [encode_header(Kind.DELTA, 1, 1), body]


def _without_new_bounds(frames: list[bytes]) -> object:
    body = protocol.unpack_bounded(frames[1], DEFAULT_LIMITS, "body")
    check_body(Kind.DELTA, body)
    return body


def _best_per_call(fn: Callable[[], object], calls: int = 10, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bounds", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--keys", type=int, default=4096)
    args = parser.parse_args(argv)
    frames = _frames(args.keys)
    bounded, baseline = [], []
    for _ in range(args.repeat):  # interleaved, so load changes hit both alike
        bounded.append(_best_per_call(lambda: decode(frames)))
        baseline.append(_best_per_call(lambda: _without_new_bounds(frames)))
    b, base = statistics.median(bounded), statistics.median(baseline)
    print(f"load average {os.getloadavg()[0]:.2f}; DELTA of {args.keys} keys, {len(frames[1])} bytes")
    print(f"decode with bounds:    {b * 1e3:.3f} ms")
    print(f"decode without bounds: {base * 1e3:.3f} ms")
    print(f"ratio: {b / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
