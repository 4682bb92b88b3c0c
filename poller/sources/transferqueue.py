"""A source that lists a running TransferQueue controller, without Ray (the poller process; source_kwargs: the trainer).

::

    trainer process                         poller process
    tq.init() ── owns Ray, the controller   TransferQueueSource
    source_kwargs(conf) ── address ───────▶   DEALER ── KV_LIST ──▶ controller's ROUTER

The trainer owns TransferQueue: only it may call ``tq.close()`` (from any other process that kills the shared
controller for everybody). The poller needs only the controller's address, which :func:`source_kwargs` reads
in the trainer as plain keyword arguments, and speaks the controller's protocol itself
(:mod:`poller.sources.tq_protocol`): no ``transfer_queue``, Ray or torch in the poller, and a deadline on
every call, which TransferQueue's own client lacks (past it, :class:`~poller.wire.sources.SourceStall`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Mapping, Sequence

import zmq

from poller.sources.tq_protocol import (
    KV_LIST,
    KV_RETRIEVE_META,
    LIST_PARTITIONS,
    TransferQueueReplyError,
    decode_listing_reply,
    decode_reply,
    decode_watch_reply,
    encode_request,
    unknown_version_warning,
)
from poller.wire.sources import SourceStall, WatchRead

__all__ = ["SPEC", "TransferQueueSource", "source_kwargs"]

logger = logging.getLogger(__name__)

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
