"""A rogue peer: a hand-driven DEALER that speaks (or breaks) the wire protocol.

Connect it to a buffer's endpoint and it sends exactly the frames it is told
to: well-formed messages with any epoch and sequence number, or raw bytes
that no codec would produce. It is how the wire-level faults are made::

    peer = RoguePeer(rb.endpoint)
    peer.send_raw([b"\\xc1"])               # malformed msgpack, one frame
    peer.ready(); peer.delta({"p": {"k": {}}}, full=True, reset=True)
    peer.delta({"p": {"k": {}}}, seq=1)     # a replayed sequence number
    peer.close()
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import zmq

from poller.wire.protocol import Delta, Kind, Message, decode, encode_body, encode_header
from poller.wire.tags import pack_tags

__all__ = ["RoguePeer", "WIRE_FAULTS", "packed_delta"]


def _bad_version() -> list[bytes]:
    header = bytearray(encode_header(Kind.DELTA, 1, 0))
    header[1] = 0x09  # [version, ...]: a fixint version 9
    return [bytes(header), b"\x80"]


def _unknown_kind() -> list[bytes]:
    header = bytearray(encode_header(Kind.DELTA, 1, 0))
    header[2] = 0x63  # kind 99
    return [bytes(header), b"\x80"]


#: Frames no well-behaved poller sends, by name; each must be one counted ProtocolError.
WIRE_FAULTS: dict[str, Any] = {
    "malformed-msgpack": lambda: [encode_header(Kind.DELTA, 1, 0), b"\xc1\xc1"],
    "truncated-multipart": lambda: [encode_header(Kind.DELTA, 1, 0)],
    "wrong-version": _bad_version,
    "unknown-kind": _unknown_kind,
    "oversized-header": lambda: [b"\x94" + b"\x01" * 4096, b"\x80"],
    "oversized-body": lambda: [encode_header(Kind.DELTA, 1, 0), b"\x80" * (64 * 1024 * 1024 + 1)],
}


def packed_delta(upserts: dict[str, Any], deletes: dict[str, Any] | None = None, *, poll: int = 1,
                 full: bool = False, reset: bool = False, end: bool = True, sync: int = 0) -> Delta:
    """A DELTA of ``{partition: {key: tags}}``, each key's tags packed alone as a poller packs them."""
    packed = {partition: [list(items), [pack_tags(tags) for tags in items.values()]]
              for partition, items in upserts.items()}
    return Delta(poll=poll, t=time.time(), full=full, reset=reset, end=end, packed=packed, deletes=deletes or {},
                 sync=sync)


class RoguePeer:
    """A scripted poller on ``endpoint`` with the identity ``name``."""

    def __init__(self, endpoint: str, name: bytes | str = b"rogue", epoch: int = 77) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode() if isinstance(name, str) else name)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.epoch = epoch
        self.seq = 0
        self.token = 0  # the sync token of the buffer's first-listing request, once joined

    def send(self, kind: Kind, body: Any, seq: int | None = None, epoch: int | None = None) -> None:
        """A well-formed message; ``seq`` defaults to the next one."""
        seq = self.seq if seq is None else seq
        self.sock.send_multipart([encode_header(kind, self.epoch if epoch is None else epoch, seq),
                                  encode_body(kind, body)])
        self.seq = seq + 1

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))

    def ready(self, join: bool = True, timeout: float = 10.0) -> None:
        """READY; with ``join``, then the first listing a buffer asks a standalone poller for (a SYNC token and a
        RESYNC: buffer.stream), empty and answering the token, as a poller's is: the deltas sent next apply."""
        self.send(Kind.READY, {"pid": 1, "name": "rogue", "poll_interval": 0.1}, seq=0)
        if not join:
            return
        deadline = time.monotonic() + timeout
        resync = False
        while self.token == 0 or not resync:
            message = self.recv(max(0.0, deadline - time.monotonic()))
            if message is None:
                raise TimeoutError(f"the buffer asked no first listing within {timeout}s")
            if message.kind is Kind.SYNC:
                self.token = message.body.token
            resync = resync or message.kind is Kind.RESYNC
        self.send(Kind.DELTA, packed_delta({}, full=True, reset=True, sync=self.token))

    def delta(self, upserts: dict[str, Any], deletes: dict[str, Any] | None = None, *, full: bool = False,
              reset: bool = False, seq: int | None = None) -> None:
        """A whole poll, ``{partition: {key: tags}}`` packed as a poller packs them."""
        self.send(Kind.DELTA, packed_delta(upserts, deletes, full=full, reset=reset, sync=self.token), seq=seq)

    def recv(self, timeout: float = 5.0) -> Message | None:
        """The next control message for this peer, or None after ``timeout``."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> "RoguePeer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
