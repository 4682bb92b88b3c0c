"""What a poller process is told (:class:`WorkerConfig`: pickled to a spawned child over the
lifeline, or built from a standalone poller's command line), and how it ends (:class:`ExitCode`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from poller.common.checks import DEFAULT_LISTING_SHARE
from poller.sources.contract import SourceSpec
from poller.wire.protocol import DEFAULT_LIMITS, Limits

if TYPE_CHECKING:  # poller.wire.curve imports zmq.auth and asyncio (~35 ms): only for CURVE
    from poller.wire.curve import CurveClient

__all__ = ["WorkerConfig", "ExitCode"]


class ExitCode:
    """Exit statuses of the poller process."""

    OK = 0
    CRASHED = 1
    STARTUP_FAILED = 2
    SOURCE_FAILED = 3
    ORPHANED = 4


class WorkerConfig(NamedTuple):
    """Everything the poller process needs; picklable for the child."""

    source: SourceSpec
    endpoint: str
    name: str
    source_kwargs: Mapping[str, Any] = {}  # never mutated
    poll_interval: float = 1.0
    chunk_items: int = 4096
    max_frame_bytes: int = DEFAULT_LIMITS.max_frame_bytes
    # The parent's private ipc directory: an orphaned poller removes it, since the parent cannot.
    orphan_cleanup: str | None = None
    # The parent's choice, so its receiver knows it before the first message and refuses impostors.
    epoch: int | None = None
    curve: CurveClient | None = None  # when the buffer authenticates its peers
    # A kv_list() call running longer is a source stall (None: only SourceStall raised by the source).
    stall_timeout: float | None = 30.0
    # The receiver's decoding bounds: tags it would refuse are one clear source error here (None: defaults).
    limits: Limits | None = None
    log_level: int = logging.WARNING  # records from this level on are sent to the buffer as LOG
    # The listing share of a source without a change feed (poller.duty).
    listing_share: float = DEFAULT_LISTING_SHARE
