"""The trainer side: an in-process replay buffer fed by an isolated poller.

Public surface: :class:`ReplayBuffer`, :class:`BatchMeta`,
:class:`ShutdownReport`, :class:`BufferClosed`.
"""

from __future__ import annotations

import logging

from poller.process import ShutdownReport

from .errors import BufferClosed
from .replay import ReplayBuffer
from .steps import BatchMeta

__all__ = ["ReplayBuffer", "BatchMeta", "ShutdownReport", "BufferClosed"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
