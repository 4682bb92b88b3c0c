"""Entry point of a poller started by :mod:`buffer.launch`.

``python -m poller.child FD NAME``: the lifeline's fd, and the stream's name (for ``ps`` only).
The parent's modules, its ``__main__`` and ``multiprocessing`` stay out of the child.

The watchdog is forked first, before anything heavy is imported (zmq, msgpack, pickle, the
source): forked from a poller of ~20 MB, copying its page tables and then every page it wrote
was most of an idle poller's kernel time (perf, 2-core VM).
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
    # While this process has no threads (see poller.watchdog).
    start_watchdog(lifeline_fd, os.environ.pop(CLEANUP_VARIABLE, None) or None)
    _take_parent_path()

    import pickle

    from poller.wire import lifeline
    from poller.wire.config import ExitCode
    from poller.worker import run_embedded

    channel = lifeline.Channel(lifeline_fd)
    try:
        config = pickle.loads(channel.recv_bytes(_MAX_CONFIG_BYTES))
    except BaseException as exc:
        # e.g. a callable source whose module this interpreter cannot import
        lifeline.send(channel, lifeline.failure(exc, lifeline.StartFailed))
        os._exit(ExitCode.STARTUP_FAILED)
    run_embedded(config, channel)


if __name__ == "__main__":
    main(int(sys.argv[1]))
