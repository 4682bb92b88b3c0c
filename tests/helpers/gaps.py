"""Make a buffer's receiver see a gap in its own poller's stream, as if a message had been lost.

The buffer's answer to a gap is the real way a RESYNC is asked for (:mod:`buffer.stream`):
it marks the view broken, drops deltas until the full snapshot, and the snapshot repairs it.
"""

from __future__ import annotations

from typing import Any

from tests.conftest import wait_until


def lose_a_message(rb: Any, timeout: float = 30.0) -> None:
    """Have the receiver expect an earlier sequence number than the poller sends next, and wait for its RESYNC."""
    table = rb._core.receiver.table
    peer = table.peers[rb._core.name.encode()]
    asked = table.resyncs_requested
    for _ in range(max(1, int(timeout / 5))):
        # Written from this thread while the receiver thread may increment it: a lost write is tried again,
        # after a wait longer than the poller's heartbeat interval (1 s), so the gap is seen at most once.
        peer.next_seq -= 1
        if wait_until(lambda: table.resyncs_requested > asked, timeout=5):
            return
    raise AssertionError("the receiver never saw the gap")
