"""What a poller process is told, and how it ends: :class:`WorkerConfig` and :class:`ExitCode`.

The parent pickles a :class:`WorkerConfig` to the child it launches (the
lifeline); a standalone poller builds one from its command line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from poller.wire.arguments import DEFAULT_LISTING_SHARE, ListingShare
from poller.wire.protocol import DEFAULT_LIMITS, Limits
from poller.wire.sources import SourceSpec

if TYPE_CHECKING:
    # Imported where used: poller.wire.curve pulls in zmq.auth and asyncio, ~35 ms
    # of every poller's start-up, needed only when the stream uses CURVE.
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
    interval: float = 1.0
    heartbeat_interval: float = 1.0
    max_failures: int = 5
    chunk_items: int = 4096
    max_frame_bytes: int = DEFAULT_LIMITS.max_frame_bytes
    linger: float = 1.0
    # How often the control loop wakes with nothing to do: bounds how late
    # it notices a dead parent that left no EOF (a forked sibling holding the
    # pipe) and how stale a heartbeat can get.
    tick: float = 0.2
    # A directory the parent would have removed on close (its private ipc
    # directory); an orphaned poller removes it, since the parent cannot.
    orphan_cleanup: str | None = None
    # The stream's epoch, when the parent chose it (so its receiver knows it
    # before the first message and can refuse anyone else using the name).
    epoch: int | None = None
    # CURVE client keys when the buffer authenticates its peers.
    curve: CurveClient | None = None
    # A kv_list() call running longer than this is counted as a source stall
    # (None: only stalls the source reports itself, by raising SourceStall).
    stall_timeout: float | None = 30.0
    # The receiver's decoding bounds, so tags it would refuse are refused
    # here, as one clear source error (None: the defaults, max_frame_bytes above).
    limits: Limits | None = None
    # Records from this level on are sent to the buffer (LOG), which re-emits them.
    log_level: int = logging.WARNING
    # The most of the wall clock spent in full listings of a source without
    # a change feed (poller.duty: a listing that took d seconds is followed by
    # the next no sooner than d / listing_share after it started, and polls
    # start every `interval`); 1.0: no bound; "verl": verl's sampler's cycle,
    # the next listing no sooner than 2 s + d + 2p after the poll that took
    # the previous one is done, a share of d / (2d + 3p + 2 s).
    listing_share: ListingShare = DEFAULT_LISTING_SHARE
