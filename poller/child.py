"""Entry point of a poller started by :mod:`poller.launch`.

``python -m poller.child FD NAME``: the lifeline's fd, and the stream's name, which is there
for ``ps`` only. Imports only what the poller itself needs: the parent's modules, its
``__main__`` and ``multiprocessing`` stay out of the child.
"""

from __future__ import annotations

import os
import pickle
import sys

from . import lifeline
from .launch import PATH_VARIABLE
from .worker import ExitCode, run_embedded

__all__ = ["main"]

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
    """Read the configuration from the lifeline, then run; never returns."""
    _take_parent_path()
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
