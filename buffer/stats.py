"""The shape of ``ReplayBuffer.stats()``: one typed record, each key documented once."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from .replay import _Core

__all__ = ["BufferStats", "collect_stats"]


class BufferStats(TypedDict):
    """What :meth:`buffer.ReplayBuffer.stats` returns."""

    poller_pid: int | None          #: the buffer's own poller process, None without a source
    poller_alive: bool
    restarts: int                   #: restarts of the own poller so far
    epoch: int | None               #: the own poller's current epoch
    messages: int                   #: messages accepted from all peers
    items_received: int             #: keys upserted or deleted by DELTAs
    bytes_received: int             #: frame bytes received, including refused ones
    protocol_errors: int            #: messages refused (malformed, out of bounds, replayed, ...)
    source_errors: int              #: ERROR messages (failed kv_list() calls)
    source_stalls: int              #: kv_list() calls past their deadline, summed over poller restarts
    last_message_age_s: float | None  #: seconds since the last accepted message
    keys: int                       #: keys held
    poller_rss: int | None          #: the own poller's resident memory, from its last heartbeat
    endpoint: str | None            #: the bound endpoint
    poller_name: str | None         #: the own poller's stream name, None without a source
    auth_rejected: int              #: handshakes refused for want of an allowed CURVE key
    curve: bool                     #: whether the endpoint requires CURVE
    peers: int                      #: streams the receiver keeps state for
    resyncs: int                    #: full snapshots asked for (gaps, unknown epochs, peers back from silence)
    stale_after: float
    stale_peers: list[str]          #: peers silent for more than stale_after that never said BYE
    polls: int                      #: complete listings applied from the own poller
    snapshots: int                  #: full ones among them


def collect_stats(core: _Core) -> BufferStats:
    """The current :class:`BufferStats` of an open buffer's core."""
    receiver = core.receiver
    table = receiver.table
    process = core.process
    peer = receiver.peer_info(core.name)
    last = table.last_message_at
    return BufferStats(
        poller_pid=process.pid if process else None,
        poller_alive=bool(process and process.is_alive()),
        restarts=core.restarts,
        epoch=process.epoch if process else None,
        messages=table.messages,
        items_received=table.items_received,
        bytes_received=table.bytes_received,
        protocol_errors=table.protocol_errors,
        source_errors=table.source_errors,
        source_stalls=table.source_stalls,
        last_message_age_s=None if last is None else time.monotonic() - last,
        keys=core.store.key_count(),
        poller_rss=peer.rss if peer else None,
        endpoint=core.endpoint,
        poller_name=core.name if core.source is not None else None,
        auth_rejected=receiver.auth_rejected,
        curve=receiver.curve_enabled,
        peers=receiver.peer_count,
        resyncs=table.resyncs_requested,
        stale_after=receiver.stale_after,
        stale_peers=receiver.stale_peers(),
        polls=peer.polls_applied if peer else 0,
        snapshots=peer.snapshots_applied if peer else 0,
    )
