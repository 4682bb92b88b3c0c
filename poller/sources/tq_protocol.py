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

This module is the one place in the poller that knows that format (checked
against TransferQueue 0.1.11, the version the ``transferqueue`` extra pins).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

import msgpack

__all__ = [
    "KV_LIST",
    "LIST_PARTITIONS",
    "TransferQueueReplyError",
    "encode_request",
    "decode_reply",
]

KV_LIST = "KV_LIST"
LIST_PARTITIONS = "GET_LIST_PARTITIONS"
_RESPONSES = {KV_LIST: "KV_LIST_RESPONSE", LIST_PARTITIONS: "LIST_PARTITIONS_RESPONSE"}
_REQUEST_ERROR = "REQUEST_ERROR"
# TransferQueue marks a reply it had to pickle whole with these leading bytes
# (0xc1 is never valid msgpack).
_PICKLED_MARKER = b"\xc1\xfe\xed"


class TransferQueueReplyError(RuntimeError):
    """The controller refused a request, or sent a reply this side cannot read."""


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


def decode_reply(request_type: str, frames: Sequence[bytes]) -> dict[str, Any]:
    """The body of the controller's reply to a ``request_type`` request.

    Raises:
        TransferQueueReplyError: ``REQUEST_ERROR`` from the controller, a reply
            of another type, or one this side refuses to read (see above).
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
