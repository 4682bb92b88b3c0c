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
    """Logs a warning on every kv_list(): it must reach the trainer's logging."""

    def kv_list(self) -> Any:
        import logging

        logging.getLogger("poller.tests.chatty").warning("chatty source says hello from pid %d", os.getpid())
        return {}
