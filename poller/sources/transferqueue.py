"""TransferQueue's controller, as a client: its request protocol and a source that speaks it, without Ray.

::

    trainer process                         poller process
    tq.init() ── owns Ray, the controller   TransferQueueSource
    source_kwargs(conf) ── address ───────▶   DEALER ── KV_LIST ──▶ controller's ROUTER

The trainer owns TransferQueue: only it may call ``tq.close()`` (from any other process that kills the shared
controller for everybody). The poller needs only the controller's address, which :func:`source_kwargs` reads
in the trainer as plain keyword arguments, and speaks the controller's protocol itself: no ``transfer_queue``,
Ray or torch in the poller, and a deadline on every call, which TransferQueue's own client lacks (past it,
:class:`~poller.sources.contract.SourceStall`).

Sections: the protocol (pure functions over frames), :class:`TransferQueueSource` (the socket and its deadlines),
:func:`source_kwargs` (run in the trainer).

A client connects a DEALER to the controller's ROUTER ("request_handle_socket") and sends one msgpack map per
request, ``{"request_type": "KV_LIST", "sender_id", "receiver_id", "request_id", "timestamp", "body": {...}}``;
the reply is one such map of the matching response type (``KV_LIST_RESPONSE``, body ``{"partition_info": {...},
"message": ...}``) or ``REQUEST_ERROR`` (body ``{"message": ...}``). Tag values are made plain by
:mod:`poller.sources.tq_values`; the two modules alone in the poller know TransferQueue's formats.

The controller announces no protocol version, so the start-up probe checks the trainer's release against
:data:`KNOWN_VERSIONS` and the shape of the probe's reply (:func:`check_probe_reply`): another shape is a
:class:`TransferQueueProtocolError`; an unknown release whose reply has the known shape is used, with one WARNING.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

import msgpack
import zmq

from poller.sources.contract import PackedItems, SourceStall, WatchRead
from poller.sources.tq_values import ReplyValues, batch_meta_tags, plain, restricted_loads

__all__ = ["SPEC", "TransferQueueSource", "source_kwargs", "KV_LIST", "KV_RETRIEVE_META", "LIST_PARTITIONS",
           "KNOWN_VERSIONS", "TransferQueueReplyError", "TransferQueueProtocolError", "encode_request", "decode_reply",
           "decode_listing_reply", "decode_watch_reply", "check_probe_reply", "unknown_version_warning"]

logger = logging.getLogger(__name__)

# -- the controller's protocol --------------------------------------------------------------------

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
        message = plain(restricted_loads(frames[1])) if pickled else ReplyValues(frames, _malformed).read(frames[0])
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
    """What a ``KV_RETRIEVE_META`` reply for ``keys`` says of them (:class:`~poller.sources.contract.WatchRead`).

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
        self.values = ReplyValues(frames, _malformed)

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
            # Decoded by tq_values where the poller finds bytes that differ, as decode_reply reads the whole reply.
            partitions[partition] = PackedItems(items, self.values.decode)
        return partitions


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


# -- the source, in the poller process ------------------------------------------------------------

# Releases outside KNOWN_VERSIONS already warned about in this process.
_WARNED: set[str] = set()

#: The spec to give :class:`buffer.ReplayBuffer` (``source=SPEC``).
SPEC = "poller.sources.transferqueue:TransferQueueSource"

# The port TransferQueue's controller serves requests on (ZMQServerInfo.ports).
_REQUEST_PORT = "request_handle_socket"


def _checked_partitions(partition_ids: Any, empty_ok: bool = False) -> list[str]:
    if isinstance(partition_ids, str):
        raise ValueError("partition_ids must be a list of partition ids, not one string")
    partitions = list(partition_ids)
    if (not partitions and not empty_ok) or not all(isinstance(p, str) and p for p in partitions):
        raise ValueError(f"partition_ids must be non-empty strings (or None for all), got {partitions!r}")
    return partitions


class TransferQueueSource:
    """Lists a running TransferQueue controller at ``address``.

    Args:
        address: the controller's request endpoint, ``tcp://host:port`` (what :func:`source_kwargs` gives).
        controller_id: the controller's id, sent as the receiver of each request.
        partition_ids: poll only these partitions (one request each, under one deadline); ``None`` lists
            every partition with one request.
        call_timeout: the deadline of one call, in seconds.
        probe_timeout: on construction, wait this long for the controller to answer a cheap request, so a
            wrong address or an unknown protocol fails the poller's start-up clearly; ``None`` skips the probe.
        controller_version: the trainer's release; one outside ``KNOWN_VERSIONS`` is used, with one WARNING.

    Raises:
        ValueError: bad arguments.
        SourceStall: the probe got no answer within ``probe_timeout``.
        TransferQueueProtocolError: the probe was answered in an unknown protocol.
    """

    def __init__(self, address: str, *, controller_id: str = "", partition_ids: Sequence[str] | None = None,
                 call_timeout: float = 10.0, probe_timeout: float | None = 10.0,
                 controller_version: str | None = None) -> None:
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"address must be a 'tcp://host:port' endpoint, got {address!r}")
        for name, value in (("call_timeout", call_timeout), ("probe_timeout", probe_timeout)):
            if (value is not None or name == "call_timeout") and not (
                    isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.address = address
        self.controller_id = controller_id
        self.partition_ids = None if partition_ids is None else _checked_partitions(partition_ids)
        self.call_timeout = float(call_timeout)
        self._sender_id = f"replay-poller-{os.getpid()}"
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        if probe_timeout is not None:
            try:
                reply = self._exchange(LIST_PARTITIONS, {}, probe_timeout, f"a {LIST_PARTITIONS} probe")
                decode_reply(LIST_PARTITIONS, reply, probe_address=address)
            except BaseException:
                self.close()
                raise
            # The poller lists from another thread than this one, which opens a socket of its own.
            self._drop_socket()
        warning = unknown_version_warning(controller_version, probe_timeout is not None)
        if warning is not None and controller_version not in _WARNED:
            # Once per process: a restarted poller builds its source again.
            _WARNED.add(controller_version)  # type: ignore[arg-type]  # not None: it has a warning
            logger.warning("%s", warning)

    def __repr__(self) -> str:
        return (f"<TransferQueueSource {self.address} partitions={self.partition_ids or 'all'} "
                f"call_timeout={self.call_timeout:g}s>")

    def kv_list(self) -> dict[str, Any]:
        """``{partition_id: {key: tags}}`` from the controller; missing partitions are left out.

        Raises:
            SourceStall: no complete answer within ``call_timeout``.
            TransferQueueReplyError: the controller refused the request or sent a reply this source does not read.
        """
        return self._listing(packed=False)

    def kv_list_packed(self) -> dict[str, Any]:
        """:meth:`kv_list`, each partition's tags left packed (``PackedItems``) where the reply's shape allows."""
        return self._listing(packed=True)

    def _listing(self, packed: bool) -> dict[str, Any]:
        deadline = time.monotonic() + self.call_timeout
        listing: dict[str, Any] = {}
        asked: list[str | None] = [None] if self.partition_ids is None else list(self.partition_ids)
        for partition_id in asked:
            what = f"kv_list({'' if partition_id is None else repr(partition_id)})"
            reply = self._exchange(KV_LIST, {"partition_id": partition_id}, self.call_timeout, what, deadline)
            body = decode_listing_reply(reply) if packed else decode_reply(KV_LIST, reply)
            partitions = body.get("partition_info")
            if not isinstance(partitions, dict):
                raise TransferQueueReplyError("KV_LIST_RESPONSE without a partition_info map")
            if self.partition_ids is None:
                return partitions
            listing.update(partitions)
        return listing

    def kv_watch(self, partition_id: str, keys: Sequence[str], timeout: float | None = None) -> WatchRead | None:
        """``keys`` of ``partition_id`` as the controller holds them now (None: no fingerprint to be had).

        One ``KV_RETRIEVE_META`` request: it reads only the keys named (~1% of a 100k-key listing's cost) and
        changes nothing there (``create`` is false; the controller logs a key not found at WARNING).

        Raises:
            SourceStall: no answer within ``timeout`` (default ``call_timeout``).
            TransferQueueReplyError: the controller refused the request or sent a reply this source does not read.
        """
        timeout = self.call_timeout if timeout is None else timeout
        body = {"keys": list(keys), "partition_id": partition_id, "create": False}
        what = f"kv_watch({partition_id!r}, {len(keys)} keys)"
        return decode_watch_reply(self._exchange(KV_RETRIEVE_META, body, timeout, what), keys)

    def include_partitions(self, partition_ids: Sequence[str]) -> None:
        """List these partitions too from the next listing on (with ``partition_ids=None`` all are listed already).

        Raises:
            ValueError: a partition id is not a non-empty string.
        """
        added = _checked_partitions(partition_ids, empty_ok=True)
        if self.partition_ids is not None:
            self.partition_ids += [p for p in dict.fromkeys(added) if p not in self.partition_ids]

    def close(self) -> None:
        """Close this source's socket. TransferQueue itself is left alone."""
        self._drop_socket()
        if not self._ctx.closed:
            self._ctx.term()

    def _drop_socket(self) -> None:
        # A request that timed out may still be answered later, never to be read as the next one's answer.
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _exchange(self, request_type: str, body: dict[str, Any], timeout: float, what: str,
                  deadline: float | None = None) -> list[bytes]:
        """Send one request and return the frames of its reply by ``deadline`` (default: ``timeout`` from now)."""
        if deadline is None:
            deadline = time.monotonic() + timeout
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.address)
            except BaseException:  # an address ZeroMQ refuses: a failure of every call, not a stall of the next
                sock.close(0)
                raise
            self._sock = sock
        sock = self._sock
        frames = encode_request(request_type, body, sender_id=self._sender_id, receiver_id=self.controller_id)
        try:
            if self._wait(sock, zmq.POLLOUT, deadline):
                sock.send_multipart(frames, zmq.NOBLOCK)
                if self._wait(sock, zmq.POLLIN, deadline):
                    return sock.recv_multipart(zmq.NOBLOCK)
            raise SourceStall(f"no answer from the TransferQueue controller at {self.address} to {what} "
                              f"within {timeout:g}s")
        except BaseException:
            self._drop_socket()
            raise

    @staticmethod
    def _wait(sock: zmq.Socket, event: int, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        return remaining > 0 and bool(sock.poll(max(1, int(remaining * 1000)), event))


# -- the trainer side -----------------------------------------------------------------------------

def source_kwargs(conf: Any = None, *, partition_ids: Sequence[str] | None = None, call_timeout: float = 10.0,
                  probe_timeout: float | None = 10.0) -> dict[str, Any]:
    """Keyword arguments for :class:`TransferQueueSource`, from the trainer's live TransferQueue (after ``tq.init()``).

    ``conf`` is what ``init()`` returned (its ``controller.zmq_info``), a ``ZMQServerInfo`` or its
    ``to_dict()``; without one the controller actor is asked through Ray. JSON-able, so it also serves
    ``python -m poller run --source-kwargs``; ``controller_version`` is the release installed here.

    Raises:
        ValueError: ``conf`` holds no controller address.
    """
    info = _controller_info(conf)
    ip = str(info["ip"]).strip("[]")
    host = f"[{ip}]" if ":" in ip else ip
    try:
        port = int(info["ports"][_REQUEST_PORT])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"the controller info {info!r} has no {_REQUEST_PORT!r} port") from None
    return {
        "address": f"tcp://{host}:{port}",
        "controller_id": str(info.get("id", "")),
        "partition_ids": None if partition_ids is None else list(partition_ids),
        "call_timeout": call_timeout,
        "probe_timeout": probe_timeout,
        "controller_version": _installed_version(),
    }


def _installed_version() -> str | None:
    """The TransferQueue release installed in this (the trainer's) environment, read without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transferqueue")
    except PackageNotFoundError:
        return None


def _controller_info(conf: Any) -> dict[str, Any]:
    """The controller's ``{"id", "ip", "ports"}`` from ``conf``, or from Ray."""
    info = conf
    controller = _get(conf, "controller")
    if controller is not None:
        info = _get(controller, "zmq_info")
    if info is None:
        # Imported only here, in the trainer: the poller never needs Ray.
        import ray

        actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        info = ray.get(actor.get_zmq_server_info.remote(), timeout=60)
    if hasattr(info, "to_dict"):
        info = info.to_dict()
    if not isinstance(info, Mapping) or "ip" not in info or "ports" not in info:
        raise ValueError(f"no TransferQueue controller address in {conf!r}")
    return dict(info)


def _get(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]`` (an OmegaConf config, a dict), else None."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    try:
        return getattr(obj, name, None)
    except Exception:  # OmegaConf raises on some missing keys in struct mode
        return None
