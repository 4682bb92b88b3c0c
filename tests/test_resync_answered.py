"""A RESYNC that a snapshot already under way answers costs no second snapshot.

A trainer resumed from SIGSTOP asks for a resync while the snapshot its
poller sends on the new connection is already on its way, and asks again
every second until that snapshot starts; at a million keys each extra
snapshot cost seconds. RESYNC carries the last seq the buffer had received
(``after``); the poller skips a request its latest snapshot started after.
Here a real poller process talks to a ROUTER socket driven by hand.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Iterator

import pytest
import zmq

from buffer.process import PollerProcess
from poller.sources.sqlite import SqliteSource
from poller.wire.protocol import Delta, Kind, Message, Resync, Sync, decode

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 20.0
from tests.helpers.messages import to_frames


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, str]]:
    # Not tmp_path: nested under the suite's temporary directory, its path can pass
    # the 107 bytes an ipc:// endpoint may have.
    directory = tempfile.mkdtemp(prefix="resync-")
    endpoint = f"ipc://{directory}/buffer.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        yield sock, endpoint
    finally:
        sock.close(0)
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)


def _next(sock: zmq.Socket, kind: Kind, deadline: float) -> tuple[bytes, Message]:
    """The next message of ``kind`` from the poller (others are read and dropped)."""
    while time.monotonic() < deadline:
        if sock.poll(100):
            identity, *frames = sock.recv_multipart()
            message = decode(frames)
            if message.kind is kind:
                return identity, message
    raise AssertionError(f"no {kind.name} before the deadline")


def _snapshot_start(sock: zmq.Socket, deadline: float) -> tuple[bytes, Message]:
    while True:
        identity, message = _next(sock, Kind.DELTA, deadline)
        body = message.body
        assert isinstance(body, Delta)
        if body.full and body.reset:
            return identity, message


def _send(sock: zmq.Socket, identity: bytes, message: Message) -> None:
    sock.send_multipart([identity, *to_frames(message)])


def test_a_resync_the_latest_snapshot_answers_is_skipped_and_a_later_one_is_not(router, db: str,
                                                                                  store: SqliteSource) -> None:
    sock, endpoint = router
    store.kv_batch_put([f"k{i}" for i in range(10)], "p")
    process = PollerProcess("poller.sources.sqlite:SqliteSource", endpoint=endpoint, source_kwargs={"path": db},
                            poll_interval=0.05)
    process.start(timeout=DEADLINE_S)
    try:
        deadline = time.monotonic() + DEADLINE_S
        identity, first = _snapshot_start(sock, deadline)  # the first poll is a snapshot
        epoch = first.epoch
        # Asked "after" a seq before that snapshot: it already answers, so no second one comes.
        _send(sock, identity, Message(Kind.RESYNC, epoch, 0, Resync("test", after=first.seq - 1)))
        # A SYNC round trip proves the poller read the RESYNC and listed since (one socket, in order).
        _send(sock, identity, Message(Kind.SYNC, epoch, 0, Sync(token=1, partitions=[], mark=False)))
        while True:
            _, message = _next(sock, Kind.DELTA, deadline)
            body = message.body
            assert not (body.full and body.reset), "a second snapshot answered a resync already answered"
            if body.end and body.sync >= 1:
                break
        # Asked after the latest seq received: a new snapshot, as before.
        _send(sock, identity, Message(Kind.RESYNC, epoch, 0, Resync("test", after=message.seq)))
        _, again = _snapshot_start(sock, deadline)
        assert again.seq > message.seq
        # Asked after no message received (-1): every such RESYNC is answered.
        _send(sock, identity, Message(Kind.RESYNC, epoch, 0, Resync("test", after=-1)))
        _, third = _snapshot_start(sock, deadline)
        assert third.seq > again.seq
    finally:
        report = process.close()
    assert report.stage in ("graceful", "terminated", "killed")
