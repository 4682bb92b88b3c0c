"""Messages as a poller or a buffer puts them on the wire, for tests that speak the protocol themselves."""

from __future__ import annotations

from typing import Any

from poller.wire.protocol import Heartbeat, Message, encode_body, encode_header

# A heartbeat with every field, as a poller that has listed nothing sends it (last_seq: READY's).
HEARTBEAT: dict[str, Any] = {
    "polls": 1, "source_errors": 0, "rss": 1, "stalled_s": 0.0, "source_stalls": 0, "last_seq": 0,
    "quarantined": 0, "quarantined_keys": [], "listings": 0, "listing_s": 0.0, "listing_total_s": 0.0,
    "listing_share": 0.0, "watch_reads": 0, "watch_listings": 0,
}


def heartbeat(**fields: Any) -> Heartbeat:
    """:data:`HEARTBEAT` as a record, with ``fields`` replaced."""
    return Heartbeat(**{**HEARTBEAT, **fields})


def to_frames(message: Message) -> list[bytes]:
    """The two frames of ``message`` (its body a record, or a map of its fields)."""
    return [encode_header(message.kind, message.epoch, message.seq), encode_body(message.kind, message.body)]
