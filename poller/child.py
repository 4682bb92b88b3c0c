"""Entry point of a poller started by :mod:`buffer.process`.

``python -m poller.child FD NAME``: the lifeline's fd, and the stream's name, which is there
for ``ps`` only. Imports only what the poller itself needs: the parent's modules, its
``__main__`` and ``multiprocessing`` stay out of the child.

The watchdog is forked first, before anything heavy is imported (zmq, msgpack, pickle, the
source). Forked later, from a poller of ~20 MB, the fork copied its page tables, and every page
the poller wrote afterwards was copied on write, each copy flushing the TLB of the other cores
its threads ran on: the fork and those copies were most of the poller's kernel time in an idle
start-and-close (perf, 2-core VM).
"""

from __future__ import annotations

import os
import sys

from poller.watchdog import start_watchdog
from poller.wire.lifeline import CLEANUP_VARIABLE, PATH_VARIABLE
from poller.wire.procfs import set_process_name

__all__ = ["main"]


#: The poller's process name (``/proc/PID/comm``); its watchdog is ``replay-watchdog``.
POLLER_PROCESS_NAME = "replay-poller"

# A pickled WorkerConfig is a few hundred bytes; a callable source can be larger.
_MAX_CONFIG_BYTES = 64 * 1024 * 1024


def _take_parent_path() -> None:
    """The parent's exact sys.path; the environment as the parent had it, for the source's own children."""
    path = os.environ.pop(PATH_VARIABLE, None)
    if path is not None:
        sys.path[:] = path.split(os.pathsep)
        os.environ.pop("PYTHONPATH", None)
    previous = os.environ.pop(PATH_VARIABLE + "_PYTHONPATH", None)
    if previous is not None:
        os.environ["PYTHONPATH"] = previous


def main(lifeline_fd: int) -> None:
    """Fork the watchdog, read the configuration from the lifeline, then run; never returns."""
    set_process_name(POLLER_PROCESS_NAME)  # for ps -e, top, pgrep: not "python3.11"
    # While this process has no threads: the watchdog ends us if the trainer
    # dies while we cannot notice (importing, building, wedged, stopped).
    start_watchdog(lifeline_fd, os.environ.pop(CLEANUP_VARIABLE, None) or None)
    _take_parent_path()

    import pickle

    from poller.wire import lifeline
    from poller.worker import ExitCode, run_embedded

    channel = lifeline.Channel(lifeline_fd)
    try:
        config = pickle.loads(channel.recv_bytes(_MAX_CONFIG_BYTES))
    except BaseException as exc:
        # e.g. a callable source whose module this interpreter cannot import
        lifeline.send(channel, lifeline.failure(exc, lifeline.StartupError))
        os._exit(ExitCode.STARTUP_FAILED)
    run_embedded(config, channel)


if __name__ == "__main__":
    main(int(sys.argv[1]))
