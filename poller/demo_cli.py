"""The ``demo`` sub-command's options and entry (the demo itself is :mod:`poller.demo`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_arguments", "main_from_args"]


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
    parser.add_argument("--interval", type=_number(float, 0, True), default=0.05,
                        help="poll interval in seconds (default: %(default)s)")


def main_from_args(args: argparse.Namespace) -> int:
    """Run the demo with parsed arguments; return the exit code."""
    # sys.stdout looked up now, not at import: callers (and tests) may have replaced it.
    try:
        from .demo import run_demo  # here: the parser is built for every command, the demo runs rarely

        return run_demo(args.seconds, writers=args.writers, keys_per_step=args.keys_per_step,
                        interval=args.interval, out=sys.stdout)
    except KeyboardInterrupt:  # before or after the steps: nothing to report but that
        print(f"{args.command_name}: interrupted", file=sys.stderr)
        return 130
