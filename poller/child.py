"""Entry point of a poller started by :mod:`poller.launch`.

Imports only what the poller itself needs: the parent's modules, its
``__main__`` and ``multiprocessing`` stay out of the child.
"""

from __future__ import annotations

import os
import pickle

from . import lifeline
from .worker import ExitCode, run_embedded

__all__ = ["main"]

# A pickled WorkerConfig is a few hundred bytes; a callable source can be larger.
_MAX_CONFIG_BYTES = 64 * 1024 * 1024


def main(lifeline_fd: int) -> None:
    """Read the configuration from the lifeline, then run; never returns."""
    channel = lifeline.Channel(lifeline_fd)
    try:
        config = pickle.loads(channel.recv_bytes(_MAX_CONFIG_BYTES))
    except BaseException as exc:
        # e.g. a callable source whose module this interpreter cannot import
        lifeline.send(channel, "startup_error", **lifeline.exception_fields(exc))
        os._exit(ExitCode.STARTUP_FAILED)
    run_embedded(config, channel)
