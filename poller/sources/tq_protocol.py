"""TransferQueue's controller request protocol: pure functions, no sockets.

A client connects a DEALER to the controller's ROUTER ("request_handle_socket") and sends one msgpack map per
request, ``{"request_type": "KV_LIST", "sender_id", "receiver_id", "request_id", "timestamp", "body": {...}}``;
the reply is one such map of the matching response type (``KV_LIST_RESPONSE``, body ``{"partition_info": {...},
"message": ...}``) or ``REQUEST_ERROR`` (body ``{"message": ...}``). Tag values are read by
:mod:`poller.sources.tq_values`; the two modules alone in the poller know TransferQueue's formats.

The controller announces no protocol version, so the start-up probe checks the trainer's release against
:data:`KNOWN_VERSIONS` and the shape of the probe's reply (:func:`check_probe_reply`): another shape is a
:class:`TransferQueueProtocolError`; an unknown release whose reply has the known shape is used, with one WARNING.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Sequence

import msgpack

from poller.sources.tq_values import Deferred, batch_meta_tags, decode_ext, plain, restricted_loads
from poller.wire.sources import PackedItems, WatchRead

__all__ = ["KV_LIST", "KV_RETRIEVE_META", "LIST_PARTITIONS", "KNOWN_VERSIONS", "TransferQueueReplyError",
           "TransferQueueProtocolError", "encode_request", "decode_reply", "decode_listing_reply",
           "decode_watch_reply", "check_probe_reply", "unknown_version_warning"]

KV_LIST = "KV_LIST"
# The metadata of named keys of one partition (0.1.8-0.1.11: ``{"keys", "partition_id", "create"}``); with
# ``create`` false it registers nothing and marks nothing consumed (``TransferQueueController.kv_retrieve_meta``).
KV_RETRIEVE_META = "KV_RETRIEVE_META"
LIST_PARTITIONS = "GET_LIST_PARTITIONS"
_RESPONSES = {KV_LIST: "KV_LIST_RESPONSE", KV_RETRIEVE_META: "KV_RETRIEVE_META_RESPONSE",
              LIST_PARTITIONS: "LIST_PARTITIONS_RESPONSE"}
_REQUEST_ERROR = "REQUEST_ERROR"
# TransferQueue marks a reply it had to pickle whole with these leading bytes (0xc1 is never valid msgpack).
_PICKLED_MARKER = b"\xc1\xfe\xed"
# The heads of msgpack's timestamp extension (type -1): fixext 4, fixext 8, ext 8 of 12 bytes.
_TIMESTAMP_MARKERS = (b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff")

#: TransferQueue releases whose controller request protocol this module speaks.
KNOWN_VERSIONS = ("0.1.8", "0.1.9", "0.1.10", "0.1.11")
# The fields of every controller message in those releases (ZMQMessage.serialize()).
_MESSAGE_FIELDS = frozenset({"request_type", "sender_id", "receiver_id", "request_id", "timestamp", "body"})


class TransferQueueReplyError(RuntimeError):
    """The controller refused a request, or sent a reply this side cannot read."""


class TransferQueueProtocolError(TransferQueueReplyError):
    """The controller speaks a protocol (or runs a release) this source does not know."""


def unknown_version_warning(version: str | None, probed: bool) -> str | None:
    """The one WARNING line for a release outside :data:`KNOWN_VERSIONS`, used anyway (None: known, or not given).

    Not refused: verl installs TransferQueue from git main (``0.1.12.dev0``), whose controller usually still
    speaks this protocol; the probe's reply decides.
    """
    if version is None or version in KNOWN_VERSIONS:
        return None
    checked = ("its controller answered the start-up probe in the known protocol" if probed
               else "the start-up probe is off, so its protocol is not checked")
    return (f"TransferQueue {version} is not a release this poller was tested with "
            f"({KNOWN_VERSIONS[0]} to {KNOWN_VERSIONS[-1]}); {checked}, so it is used")


def check_probe_reply(message: Any, address: str) -> None:
    """Refuse a probe reply whose shape is not the protocol of :data:`KNOWN_VERSIONS`."""
    problem = None
    if not isinstance(message, dict):
        problem = f"a {type(message).__name__}, not a message map"
    elif set(message) != _MESSAGE_FIELDS:
        problem = f"message fields {sorted(map(str, message))}, expected {sorted(_MESSAGE_FIELDS)}"
    elif message["request_type"] != _RESPONSES[LIST_PARTITIONS]:
        problem = f"{message['request_type']!r} in answer to {LIST_PARTITIONS}"
    elif not isinstance(message["body"], dict) or not isinstance(message["body"].get("partition_ids"), list):
        problem = "a LIST_PARTITIONS_RESPONSE without a partition_ids list"
    if problem is not None:
        raise TransferQueueProtocolError(
            f"the TransferQueue controller at {address} answered the probe in a protocol this poller does not "
            f"know ({problem}); this source speaks the controller protocol of TransferQueue "
            f"{KNOWN_VERSIONS[0]} to {KNOWN_VERSIONS[-1]}")


def encode_request(request_type: str, body: dict[str, Any], *, sender_id: str, receiver_id: str | None) -> list[bytes]:
    """The frames of one request to the controller."""
    if request_type not in _RESPONSES:
        raise ValueError(f"unsupported request type {request_type!r}")
    return [msgpack.packb({
        "request_type": request_type,
        "sender_id": sender_id,
        "receiver_id": receiver_id,
        "request_id": uuid.uuid4().hex[:8],
        "timestamp": time.time(),
        "body": body,
    }, use_bin_type=True)]


class _ValueReader:
    """Reads msgpack of one reply as the controller's codec wrote it: its extension values and timestamps."""

    def __init__(self, frames: Sequence[bytes]) -> None:
        self.frames = frames
        # Pickled numpy scalars repeat (every key of a step holds the same global_steps): read each once per reply.
        self.scalars: dict[bytes, Any] = {}

    def read(self, data: bytes) -> Any:
        """The value packed in ``data`` (the whole message, or one key's tags), its tag values read."""
        deferred = False
        scalars, frames = self.scalars, self.frames

        def ext_hook(code: int, ext: bytes) -> Any:
            nonlocal deferred
            if code == 1 and ext in scalars:
                return scalars[ext]
            value = decode_ext(code, ext, frames)
            if isinstance(value, Deferred):
                deferred = True
            elif code == 1:
                scalars[ext] = value
            return value

        value = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook, timestamp=3)
        # A second walk only for a value held back, or a possible timestamp (ext -1, msgspec's aware
        # datetime), which msgpack reads as a datetime past the hook.
        if deferred or any(marker in data for marker in _TIMESTAMP_MARKERS):
            return plain(value)
        return value


def decode_reply(request_type: str, frames: Sequence[bytes], *, probe_address: str | None = None) -> dict[str, Any]:
    """The body of the reply to a ``request_type`` request, its tag values read (:mod:`~poller.sources.tq_values`).

    With ``probe_address``, the reply is the start-up probe's, its shape checked first.

    Raises:
        TransferQueueReplyError: ``REQUEST_ERROR`` from the controller, a reply of another type, or no message.
        TransferQueueProtocolError: a probe reply of an unknown protocol.
    """
    if not frames or not frames[0]:
        raise TransferQueueReplyError("empty reply from the TransferQueue controller")
    pickled = bytes(frames[0][:len(_PICKLED_MARKER)]) == _PICKLED_MARKER
    # The whole message pickled (some value broke msgpack) comes as [marker, pickle].
    if pickled and (len(frames) != 2 or bytes(frames[0]) != _PICKLED_MARKER):
        raise TransferQueueReplyError(f"a pickled reply of {len(frames)} frames, expected the marker and one pickle")
    try:
        message = plain(restricted_loads(frames[1])) if pickled else _ValueReader(frames).read(frames[0])
    except Exception as exc:  # msgpack and pickle raise a zoo of types; all mean "malformed"
        raise _malformed(exc) from exc
    return _body(request_type, message, probe_address)


def decode_listing_reply(frames: Sequence[bytes]) -> dict[str, Any]:
    """:func:`decode_reply` of a ``KV_LIST`` reply, each partition's tags left packed (as ``PackedItems``).

    Walking a reply costs about a quarter of decoding it. A reply of any other shape (pickled whole, a
    non-``str`` key or partition id, an extension value outside the tags, malformed) goes to :func:`decode_reply`.

    Raises:
        TransferQueueReplyError: as :func:`decode_reply`.
    """
    if not frames or bytes(frames[0][:len(_PICKLED_MARKER)]) == _PICKLED_MARKER:
        return decode_reply(KV_LIST, frames)
    try:
        message = _ListingWalk(frames).message()
    except Exception:  # not the plain shape: the whole reply is read the usual way, and judged there
        return decode_reply(KV_LIST, frames)
    return _body(KV_LIST, message, None)


def decode_watch_reply(frames: Sequence[bytes], keys: Sequence[str]) -> WatchRead | None:
    """What a ``KV_RETRIEVE_META`` reply for ``keys`` says of them (:class:`~poller.wire.sources.WatchRead`).

    The controller pickles a ``BatchMeta`` of the keys found into one extension value: its bytes are the
    fingerprint, its tags read (restricted unpickler) only when ``held`` is called. None: a reply pickled
    whole, whose bytes hold the message's own id and time.

    Raises:
        TransferQueueReplyError: ``REQUEST_ERROR``, a reply of another type, or one without that value.
    """
    if not frames or not frames[0] or bytes(frames[0][:len(_PICKLED_MARKER)]) == _PICKLED_MARKER:
        decode_reply(KV_RETRIEVE_META, frames)  # for its errors (an empty reply too)
        return None
    try:
        message = msgpack.unpackb(frames[0], raw=False, strict_map_key=False, timestamp=3,
                                  ext_hook=lambda code, data: msgpack.ExtType(code, data))
    except Exception as exc:  # msgpack raises a zoo of types; all mean "malformed"
        raise _malformed(exc) from exc
    metadata = _body(KV_RETRIEVE_META, message, None).get("metadata")
    if not isinstance(metadata, msgpack.ExtType):
        raise TransferQueueReplyError(f"{KV_RETRIEVE_META}_RESPONSE without its metadata "
                                      f"(got {type(metadata).__name__})")
    data = metadata.data if metadata.code == 1 else None

    def held() -> tuple[int, dict[str, Any] | None]:
        listed = None if data is None else batch_meta_tags(data)
        if listed is None:
            return len(keys), None
        return len(listed), dict(zip(keys, plain(listed))) if len(listed) == len(keys) else None

    return WatchRead(bytes([metadata.code & 0xFF]) + metadata.data, held)


def _malformed(exc: BaseException) -> TransferQueueReplyError:
    return TransferQueueReplyError(f"malformed reply from the TransferQueue controller: {type(exc).__name__}: {exc}")


class _NotPlain(Exception):
    """The reply is not of the shape :class:`_ListingWalk` reads."""


class _ListingWalk:
    """One KV_LIST reply read with its tags skipped: the message, ``partition_info`` as :class:`PackedItems`."""

    def __init__(self, frames: Sequence[bytes]) -> None:
        self.frame = bytes(frames[0])
        # An extension value outside the tags is not read here: decode_reply reads the whole reply.
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=self._refuse_ext, timestamp=3,
                                         max_buffer_size=max(len(self.frame), 1))
        self.unpacker.feed(self.frame)
        # One for every key's tags, as one decode of the whole reply shares its numpy scalars.
        self.reader = _ValueReader(frames)

    @staticmethod
    def _refuse_ext(code: int, data: bytes) -> Any:
        raise _NotPlain(f"extension type {code} outside the tags")

    def message(self) -> dict[str, Any]:
        message = self._map("body", lambda: self._map("partition_info", self._partitions))
        if self.unpacker.tell() != len(self.frame):
            raise _NotPlain("bytes after the message")
        return message

    def _map(self, name: str, read: Callable[[], Any]) -> dict[Any, Any]:
        """The map next in the reply: its field ``name`` read by ``read``, every other one a plain value."""
        unpacker = self.unpacker
        fields: dict[Any, Any] = {}
        for _ in range(unpacker.read_map_header()):
            field = unpacker.unpack()
            fields[field] = read() if field == name else self._plain_value()
        return fields

    def _plain_value(self) -> Any:
        value = self.unpacker.unpack()
        if plain(value) != value:  # a timestamp, which decode_reply reads as an UnreadableValue
            raise _NotPlain("a value outside the tags that decode_reply reads otherwise")
        return value

    def _partitions(self) -> dict[str, PackedItems]:
        unpacker, frame = self.unpacker, self.frame
        unpack, tell, skip = unpacker.unpack, unpacker.tell, unpacker.skip
        partitions: dict[str, PackedItems] = {}
        for _ in range(unpacker.read_map_header()):
            partition = unpack()
            if type(partition) is not str:
                raise _NotPlain("a partition id that is not a str")
            items: dict[str, bytes] = {}
            for _ in range(unpacker.read_map_header()):
                key = unpack()
                if type(key) is not str:
                    raise _NotPlain("a key that is not a str")
                start = tell()
                skip()
                items[key] = frame[start:tell()]
            partitions[partition] = PackedItems(items, self._decode)
        return partitions

    def _decode(self, blobs: list[bytes]) -> list[Any]:
        """Each key's tags, read as :func:`decode_reply` reads the whole reply."""
        try:
            return list(map(self.reader.read, blobs))
        except Exception as exc:
            raise _malformed(exc) from exc


def _body(request_type: str, message: Any, probe_address: str | None) -> dict[str, Any]:
    """The body of a decoded reply ``message`` to a ``request_type`` request, checked."""
    if probe_address is not None and not (isinstance(message, dict) and message.get("request_type") == _REQUEST_ERROR):
        check_probe_reply(message, probe_address)
    if not isinstance(message, dict) or not isinstance(message.get("body"), dict):
        raise TransferQueueReplyError("the controller's reply is not a message map with a body")
    body: dict[str, Any] = message["body"]
    reply_type = message.get("request_type")
    if reply_type == _REQUEST_ERROR:
        raise TransferQueueReplyError(f"the TransferQueue controller refused {request_type}: "
                                      f"{body.get('message', 'no reason given')}")
    if reply_type != _RESPONSES[request_type]:
        raise TransferQueueReplyError(f"expected {_RESPONSES[request_type]} from the TransferQueue controller, "
                                      f"got {reply_type!r}")
    return body
