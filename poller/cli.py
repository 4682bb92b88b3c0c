"""``python -m poller``: a standalone poller, CURVE key files, and ``doctor``.

Exit codes: 0 done, 1 ``doctor`` found a problem, 2 bad arguments or a source that cannot be built, 3 the source failed
for good. Every error is one line on stderr naming the command as typed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
from typing import NoReturn, Sequence

from poller._version import __version__
from poller.common.checks import DEFAULT_LISTING_SHARE, check_seconds, check_share
from poller.common.config import ExitCode, WorkerConfig
from poller.wire.curve import CurveClient, make_keys
from poller.wire.errors import PollerCrashed, PollerStartupError
from poller.worker import run_standalone

__all__ = ["main", "main_entry"]

# Commands that moved: where each went (the demo runs a trainer, so it lives in the trainer's package).
MOVED = {"demo": "the demo moved to the trainer's package: run 'python -m buffer.demo' (or 'make demo')"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every bad-input path
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Poll a key-value store and stream it to a ReplayBuffer.")
    parser.add_argument("--version", action="version", version=f"zmq-replay-poller {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("run", help="run a standalone poller that connects to a buffer's endpoint",
                              description="Run a standalone poller. SIGTERM or Ctrl-C: drain, BYE, exit 0.")
    run.add_argument("--source", default=None, help="source spec, 'package.module:attr' (required unless --fault)")
    run.add_argument("--source-kwargs", default="{}", help="JSON object of keyword arguments for the source")
    run.add_argument("--connect", required=True, help="the buffer's endpoint, e.g. tcp://trainer:5555")
    run.add_argument("--poll-interval", type=float, default=1.0,
                     help="seconds between kv_list() calls, start to start (default 1)")
    run.add_argument("--listing-share", type=float, default=DEFAULT_LISTING_SHARE,
                     help="the most of the wall clock spent listing a store without a change feed: after a listing "
                          f"of d s the next starts max(poll interval, d/share) after it (0 < share <= 1, 1 = no bound; "
                          f"default {DEFAULT_LISTING_SHARE:g})")
    run.add_argument("--name", default=None, help="stream name; a restarted poller with the same name continues "
                                                   "the same stream (default: derived from host, source and kwargs)")
    run.add_argument("--log-level", default="WARNING", help="logging level on stderr (default WARNING)")
    run.add_argument("--fault", default=None, metavar="NAME[:key=value,...]",
                     help="wrap the source in a fault from poller.faults, e.g. hang:after=3 or crash:how=segfault")
    curve = run.add_argument_group("CURVE authentication and encryption (both or neither; see SECURITY.md)")
    curve.add_argument("--curve-secret", metavar="FILE", default=None,
                       help="this poller's key pair, a NAME.key_secret file from 'python -m poller keys'")
    curve.add_argument("--curve-server-key", metavar="FILE", default=None, help="the buffer's public key, its NAME.key")
    keys = commands.add_parser(
        "keys", help="make a CURVE key pair (NAME.key public, NAME.key_secret private)",
        description="Write NAME.key (public: give it to the other side) and NAME.key_secret (private, 0600) into "
                    "DIR (0700): one pair for the buffer, one per poller host; the buffer allows the pollers' .key.")
    keys.add_argument("--out", required=True, metavar="DIR", help="directory for the key files")
    keys.add_argument("--name", default=socket.gethostname(), help="file name stem (default: this host's name)")
    commands.add_parser("doctor", help="check that poller and buffer are this distribution's installed files",
                        description="Compare the poller and buffer Python would import with this distribution's "
                                    "install record; exit 1 and say how to fix it when they differ.")
    return parser


def _error(args: argparse.Namespace, error: object, code: int = ExitCode.STARTUP_FAILED) -> int:
    print(f"{args.command_name}: error: {error}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        config, level = _config_of(args)
    except ValueError as exc:
        return _error(args, exc)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run_standalone(config)
    except PollerStartupError as exc:
        return _error(args, exc)
    except PollerCrashed as exc:  # the reason was logged at DEBUG only: say it here
        return _error(args, exc, ExitCode.SOURCE_FAILED)


def _config_of(args: argparse.Namespace) -> tuple[WorkerConfig, int]:
    """The poller's configuration and log level; a ValueError names the first bad argument."""
    try:
        kwargs = json.loads(args.source_kwargs)
    except ValueError as exc:
        raise ValueError(f"bad --source-kwargs: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("bad --source-kwargs: --source-kwargs must be a JSON object")
    spec = args.source
    if args.fault is not None:  # wraps --source, if any
        from poller.faults import parse_fault

        spec, kwargs = parse_fault(args.fault, args.source, kwargs if args.source is not None else None)
    elif spec is None:
        raise ValueError("--source is required (or --fault)")
    check_seconds("--poll-interval", args.poll_interval)  # nan, inf, <= 0
    listing_share = check_share("--listing-share", args.listing_share)
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown --log-level {args.log_level!r}")
    curve = None
    if (args.curve_secret is None) != (args.curve_server_key is None):
        raise ValueError("--curve-secret and --curve-server-key go together")
    if args.curve_secret is not None:
        curve = CurveClient.from_files(args.curve_secret, args.curve_server_key)
    name = args.name
    if not name:  # the same source and kwargs on this host continue the same stream
        kwargs_json = json.dumps(kwargs, sort_keys=True) if args.fault else args.source_kwargs
        digest = hashlib.sha256(f"{spec}\0{kwargs_json}".encode()).hexdigest()[:12]
        name = f"{socket.gethostname()}:{digest}"
    return WorkerConfig(source=spec, source_kwargs=kwargs, endpoint=args.connect, name=name,
                        poll_interval=args.poll_interval, curve=curve, listing_share=listing_share), level


def _keys(args: argparse.Namespace) -> int:
    try:
        public, secret = make_keys(args.out, args.name)
    except (OSError, ValueError, RuntimeError) as exc:
        return _error(args, exc)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from poller.doctor import diagnose

    diagnosis = diagnose()
    for line in diagnosis.lines():
        print(line, file=sys.stdout if diagnosis.healthy else sys.stderr)
    return 0 if diagnosis.healthy else 1


def main(argv: Sequence[str] | None = None, prog: str = "python -m poller") -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) as ``prog`` (the command as typed); return the exit code."""
    parser = _build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MOVED:
        print(f"{prog} {argv[0]}: error: {MOVED[argv[0]]}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    args.command_name = f"{prog} {args.command}"
    return {"run": _run, "keys": _keys, "doctor": _doctor}[args.command](args)


def main_entry() -> None:
    """Console-script entry point: errors name the script as it was started (``poller``)."""
    sys.exit(main(prog=os.path.basename(sys.argv[0]) or "poller"))
