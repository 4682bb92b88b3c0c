"""Misbehaving and scripted sources, importable by spec from a spawned poller.

Each is a module-level factory so ``spawn`` can rebuild it in the child.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from poller.sources.sqlite import SqliteSource


class Hanging:
    """kv_list() blocks forever after ``after`` successful calls."""

    def __init__(self, path: str | None = None, after: int = 0) -> None:
        self._inner = SqliteSource(path) if path else None
        self._after = after
        self._calls = 0

    def kv_list(self) -> Any:
        self._calls += 1
        if self._calls > self._after:
            threading.Event().wait()
        return self._inner.kv_list() if self._inner else {}


class Raising:
    """kv_list() raises every call."""

    def kv_list(self) -> Any:
        raise RuntimeError("store is on fire")


class Garbage:
    def kv_list(self) -> Any:
        return {"train": ["not", "a", "mapping"]}


def failing_factory(**kwargs: Any) -> Any:
    raise ValueError(f"cannot connect to store with {kwargs}")


def slow_factory(seconds: float = 60.0) -> Any:
    time.sleep(seconds)
    return Raising()


class StuckControlLoop:
    """On its second kv_list(), wedges the poller's control loop.

    It signals its own process; the handler runs in the main thread (the
    control loop) and never returns, so STOP is never read. ``sigterm``
    chooses what SIGTERM then does: ``"default"`` (dies: the close ladder
    reaches "terminated") or ``"ignore"`` (only SIGKILL works: "killed").
    ``marker`` is a file created once the loop is stuck.
    """

    def __init__(self, marker: str, sigterm: str = "default") -> None:
        self._marker = marker
        self._sigterm = signal.SIG_IGN if sigterm == "ignore" else signal.SIG_DFL
        self._calls = 0

    def _stuck(self, signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, self._sigterm)
        with open(self._marker, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(3600)

    def kv_list(self) -> Any:
        self._calls += 1
        if self._calls == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return {"train": {"k": {"status": "running"}}}


def stuck_control_loop(marker: str, sigterm: str = "default") -> StuckControlLoop:
    # The handler must be installed from the main thread: the factory runs there.
    source = StuckControlLoop(marker, sigterm)
    signal.signal(signal.SIGUSR1, source._stuck)
    return source


class CrashAfter:
    """Lists the store, then the whole process dies with os._exit(code)."""

    def __init__(self, path: str, polls: int = 3, code: int = 9) -> None:
        self._inner = SqliteSource(path)
        self._polls = polls
        self._code = code

    def kv_list(self) -> Any:
        self._polls -= 1
        if self._polls < 0:
            os._exit(self._code)
        return self._inner.kv_list()


class Chatty:
    """Logs a warning on every kv_list(): it must reach the trainer's logging."""

    def kv_list(self) -> Any:
        import logging

        logging.getLogger("poller.tests.chatty").warning("chatty source says hello from pid %d", os.getpid())
        return {}


class ReportsModules:
    """Lists, as tags, which heavyweight modules the poller process imported."""

    def kv_list(self) -> Any:
        import sys

        watched = ("multiprocessing", "__mp_main__", "dataclasses")
        return {"modules": {name: {"loaded": name in sys.modules} for name in watched}}
