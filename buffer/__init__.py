"""The trainer side: an in-process replay buffer fed by an isolated poller, what it returns, and the errors
a trainer catches."""

from __future__ import annotations

import logging

from buffer.access import EndpointInUseError, InsecureBindError
from buffer.errors import BufferClosed
from buffer.process import ShutdownReport
from buffer.replay import ReplayBuffer
from buffer.steps import BatchMeta
from poller._version import __version__ as __version__  # the same release as poller
from poller.wire.errors import PollerCrashed, PollerStartupError

__all__ = [
    "ReplayBuffer",
    "BatchMeta",
    "ShutdownReport",
    "BufferClosed",
    "InsecureBindError",
    "EndpointInUseError",
    "PollerCrashed",
    "PollerStartupError",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
