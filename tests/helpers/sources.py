"""Test-only sources, importable by spec from a spawned poller.

Each is a module-level factory so ``spawn`` can rebuild it in the child.
Faults of ``kv_list()`` itself live in :mod:`poller.faults`.
"""

from __future__ import annotations

import os
from typing import Any


def failing_factory(**kwargs: Any) -> Any:
    raise ValueError(f"cannot connect to store with {kwargs}")


class Chatty:
    """Logs a warning (or ``level``) on every kv_list(): it must reach the trainer's logging."""

    def __init__(self, level: str = "WARNING") -> None:
        self.level = level

    def kv_list(self) -> Any:
        import logging

        logging.getLogger("poller.tests.chatty").log(logging.getLevelName(self.level),
                                                     "chatty source says hello from pid %d", os.getpid())
        return {}


def crash_then_hang_on_restart(marker: str) -> Any:
    """First build: a source whose process SIGKILLs itself on its second call.

    Every later build (the buffer's restart) writes its pid to ``marker`` and
    then never returns from the factory: a poller caught mid-restart.
    """
    import threading

    from poller.faults import crash

    first = marker + ".first"
    if os.path.exists(first):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait()
    open(first, "w").close()
    return crash(how="sigkill", after=1)


class ReportsEnvironment:
    """Lists, as tags, the launcher's variables in the poller's environment (none may be left)."""

    def kv_list(self) -> Any:
        names = ("PYTHONPATH", "REPLAY_POLLER_SYS_PATH", "REPLAY_POLLER_SYS_PATH_PYTHONPATH")
        return {"environment": {name: {"value": os.environ.get(name, "")} for name in names}}


class ReportsModules:
    """Lists, as tags, which heavyweight modules the poller process imported."""

    def kv_list(self) -> Any:
        import sys

        watched = ("multiprocessing", "__mp_main__", "dataclasses")
        return {"modules": {name: {"loaded": name in sys.modules} for name in watched}}


class NumericTags:
    """Lists tags holding numpy and torch values, as an in-process store client would hand them over."""

    def kv_list(self) -> Any:
        import numpy as np
        import torch

        return {"train": {
            "np": {"global_steps": np.int64(3), "reward": np.float32(0.5), "ok": np.bool_(True),
                   "mask": np.arange(3), "status": "success"},
            "torch": {"score": torch.tensor(1.0), "ids": torch.tensor([[1, 2], [3, 4]]), "status": "success"},
            "complex": {"z": np.complex64(1 + 2j), "status": "success"},
        }}
