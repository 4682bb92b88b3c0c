"""TransferQueue's controller request protocol: pure functions, no sockets.

The controller binds a ZeroMQ ROUTER ("request_handle_socket"); a client
connects a DEALER and sends one frame per request, a msgpack map::

    {"request_type": "KV_LIST", "sender_id": ..., "receiver_id": ...,
     "request_id": ..., "timestamp": ..., "body": {"partition_id": None}}

and gets back one such map whose ``request_type`` is the matching response
(``KV_LIST_RESPONSE``, body ``{"partition_info": {...}, "message": ...}``) or
``REQUEST_ERROR`` (body ``{"message": ...}``). TransferQueue's own codec may
add frames after the first (tensor buffers), tag values in msgpack
extension types (pickle, tensors, arrays) or a whole pickled reply; listing
tags never needs them, and this side never unpickles what arrives over a
socket, so any of them is refused with an error that says so.

This module is the one place in the poller that knows that format.

The controller announces no protocol version, so the source checks two things
at its probe: the TransferQueue release the trainer runs (when it is known,
:data:`KNOWN_VERSIONS`: the releases whose controller serves these two
requests with these message and body fields and whose controller actor
:func:`~poller.sources.transferqueue.source_kwargs` finds through Ray, 0.1.8
to 0.1.11; ``make test-integration`` runs the one pinned in
``tests/integration/constraints.txt``, and passed with 0.1.8 as well), and the shape of the controller's
reply to the probe (:func:`check_probe_reply`). A reply of another shape is a
:class:`TransferQueueProtocolError` that says what this source speaks; an
unknown release whose reply has the known shape is used, with one WARNING.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

import msgpack

__all__ = [
    "KV_LIST",
    "LIST_PARTITIONS",
    "KNOWN_VERSIONS",
    "TransferQueueReplyError",
    "TransferQueueProtocolError",
    "encode_request",
    "decode_reply",
    "check_version",
    "check_probe_reply",
    "unknown_version_warning",
]

KV_LIST = "KV_LIST"
LIST_PARTITIONS = "GET_LIST_PARTITIONS"
_RESPONSES = {KV_LIST: "KV_LIST_RESPONSE", LIST_PARTITIONS: "LIST_PARTITIONS_RESPONSE"}
_REQUEST_ERROR = "REQUEST_ERROR"
# TransferQueue marks a reply it had to pickle whole with these leading bytes
# (0xc1 is never valid msgpack).
_PICKLED_MARKER = b"\xc1\xfe\xed"

#: TransferQueue releases whose controller request protocol this module speaks.
KNOWN_VERSIONS = ("0.1.8", "0.1.9", "0.1.10", "0.1.11")
# The fields of every controller message in those releases (ZMQMessage.serialize()).
_MESSAGE_FIELDS = frozenset({"request_type", "sender_id", "receiver_id", "request_id", "timestamp", "body"})


class TransferQueueReplyError(RuntimeError):
    """The controller refused a request, or sent a reply this side cannot read."""


class TransferQueueProtocolError(TransferQueueReplyError):
    """The controller speaks a protocol (or runs a release) this source does not know."""


def _speaks() -> str:
    return f"this source speaks the controller protocol of TransferQueue {KNOWN_VERSIONS[0]} to {KNOWN_VERSIONS[-1]}"


def check_version(version: str | None) -> bool:
    """Whether ``version`` is a release of :data:`KNOWN_VERSIONS` (``None``: not known, counted as known).

    An unknown release is not refused here: verl installs TransferQueue from
    its git main (``0.1.12.dev0`` and the like), whose controller usually
    still speaks this protocol. The probe's reply decides
    (:func:`check_probe_reply`); the caller warns with :func:`unknown_version_warning`.
    """
    return version is None or version in KNOWN_VERSIONS


def unknown_version_warning(version: str, probed: bool) -> str:
    """The one WARNING line for a release outside :data:`KNOWN_VERSIONS` that is used anyway."""
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
            f"know ({problem}); {_speaks()}")


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


def _refuse_extension(code: int, data: bytes) -> Any:
    raise TransferQueueReplyError(
        f"the reply holds a value in msgpack extension type {code} (TransferQueue uses them for pickled "
        f"objects, tensors and arrays); tags listed by this source must be plain msgpack values: "
        f"str, int, float, bool, None, lists and maps")


def decode_reply(request_type: str, frames: Sequence[bytes], *, probe_address: str | None = None) -> dict[str, Any]:
    """The body of the controller's reply to a ``request_type`` request.

    With ``probe_address``, the reply is the start-up probe's and its shape is
    checked first (:func:`check_probe_reply`).

    Raises:
        TransferQueueReplyError: ``REQUEST_ERROR`` from the controller, a reply
            of another type, or one this side refuses to read (see above).
        TransferQueueProtocolError: a probe reply of an unknown protocol.
    """
    if not frames or not frames[0]:
        raise TransferQueueReplyError("empty reply from the TransferQueue controller")
    if bytes(frames[0][:len(_PICKLED_MARKER)]) == _PICKLED_MARKER:
        raise TransferQueueReplyError("the controller sent a pickled reply, which this source does not unpickle; "
                                      "tags listed by this source must be plain msgpack values")
    if len(frames) > 1:
        raise TransferQueueReplyError(f"the reply has {len(frames)} frames: it carries tensor or array data, "
                                      f"which tags listed by this source must not hold")
    try:
        message = msgpack.unpackb(frames[0], raw=False, strict_map_key=False, ext_hook=_refuse_extension)
    except TransferQueueReplyError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types; all mean "malformed"
        raise TransferQueueReplyError(f"malformed reply from the TransferQueue controller: "
                                      f"{type(exc).__name__}: {exc}") from exc
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
