"""The trainer side: an in-process replay buffer fed by an isolated poller.

Public surface: :class:`ReplayBuffer`, :class:`BatchMeta`,
:class:`ShutdownReport`, :class:`BufferClosed`, and the errors a ``bind``
can raise, :class:`InsecureBindError` and :class:`EndpointInUseError`.
"""

from __future__ import annotations

import logging

from poller.process import ShutdownReport

from .access import EndpointInUseError, InsecureBindError
from .errors import BufferClosed
from .replay import ReplayBuffer
from .store import BatchMeta

__all__ = ["ReplayBuffer", "BatchMeta", "ShutdownReport", "BufferClosed", "InsecureBindError", "EndpointInUseError"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
