"""Who may reach the buffer's endpoint: the bind policy, ipc paths and the CURVE gate.

:func:`check_bind`: ``ipc://`` and loopback ``tcp://`` (``tcp://:PORT`` means loopback) reach only this
host; anything else counts as the network (failing closed) and needs CURVE or ``insecure=True`` (logged
as a warning). The gate (:class:`Gatekeeper`, in the receiver thread): pyzmq's ZAP authenticator admits
only allowed keys, so no other peer's frame reaches the decoder, and a socket monitor counts failed
handshakes (``auth_rejected``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import stat
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from poller.wire.curve import ZAP_DOMAIN, CurveServer

__all__ = ["check_bind", "is_local_endpoint", "InsecureBindError", "EndpointInUseError", "claim_ipc_path",
           "Gatekeeper"]

logger = logging.getLogger(__name__)

_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/]*):(?P<port>[^/]+)$")
_LOCAL_TRANSPORTS = ("ipc://", "inproc://")


class InsecureBindError(ValueError):
    """Binding a network-reachable endpoint without authentication was refused."""


def normalize_bind(endpoint: str) -> str:
    """``tcp://:PORT`` (no host) becomes ``tcp://127.0.0.1:PORT``; everything else is unchanged."""
    match = _TCP.match(endpoint)
    if match and match.group("host") == "":
        return f"tcp://127.0.0.1:{match.group('port')}"
    return endpoint


def is_local_endpoint(endpoint: str) -> bool:
    """True only for endpoints no other host can reach: ipc, inproc, tcp on loopback."""
    if endpoint.startswith(_LOCAL_TRANSPORTS):
        return True
    match = _TCP.match(endpoint)
    if not match:
        return False  # another transport (ws, pgm, ...) or unparsable: assume the network
    host = match.group("host").strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a host name


def check_bind(endpoint: str, curve: CurveServer | None, insecure: bool) -> str:
    """The endpoint to bind, or :class:`InsecureBindError` for the network without ``curve`` or ``insecure``."""
    endpoint = normalize_bind(endpoint)
    if curve is not None or is_local_endpoint(endpoint):
        return endpoint
    if not insecure:
        raise InsecureBindError(
            f"refusing to bind {endpoint} without authentication: anyone who can reach it could write "
            f"into the replay buffer. Pass curve=CurveServer.from_files(...) (see SECURITY.md), bind "
            f"loopback (tcp://127.0.0.1:PORT), or pass insecure=True to accept the risk.")
    logger.warning("binding %s without authentication (insecure=True): any host that can reach it can "
                   "write into this replay buffer", endpoint)
    return endpoint


class EndpointInUseError(OSError):
    """An ``ipc://`` path to bind is held by a live socket, or is not a socket at all."""


def claim_ipc_path(endpoint: str) -> None:
    """Refuse (:class:`EndpointInUseError`) an ``ipc://`` path in use or not a socket; clear a stale one.

    libzmq unlinks whatever sits at the path before it binds, so a second buffer given the same path
    silently took the first one's stream. A socket nobody listens on was left by a dead process and is
    removed. (For mistakes, not for a race between two hostile binders.)
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return  # only filesystem paths; abstract names fail to bind when taken
    path = endpoint[len("ipc://"):]
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EndpointInUseError(f"cannot bind {endpoint}: {path} exists and is not a socket; choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        logger.info("removing %s, a stale socket left by a process that is gone", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    except OSError as exc:
        raise EndpointInUseError(f"cannot bind {endpoint}: cannot tell whether {path} is in use ({exc})") from exc
    finally:
        probe.close()
    raise EndpointInUseError(f"cannot bind {endpoint}: {path} is in use by a live socket (another buffer?); "
                             f"choose another path, or close that buffer first")


def restrict_ipc_socket(endpoint: str) -> None:
    """Make a bound ipc socket file connectable by its owner only (a caller-chosen path may sit in a shared dir)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        try:
            os.chmod(endpoint[len("ipc://"):], 0o600)
        except OSError as exc:
            logger.debug("could not chmod %s: %s", endpoint, exc)


# Every failed handshake, by its monitor event.
_REJECTIONS = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no CURVE or no detail",
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed, e.g. wrong server key",
               zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key not allowed"}
_REJECTED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Gatekeeper:
    """The ZAP authenticator and handshake monitor of one ROUTER socket, in its thread (no ``curve``: nothing)."""

    def __init__(self, ctx: zmq.Context, curve: CurveServer | None) -> None:
        self.curve = curve
        self.rejected = 0
        self._auth: ThreadAuthenticator | None = None
        self.monitor: zmq.Socket | None = None
        if curve is not None:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
            auth.start()
            self._auth = auth
            auth.configure_curve_callback(ZAP_DOMAIN, self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question: is this client's public key allowed?"""
        return self.curve is not None and key in self.curve.allowed

    def arm(self, sock: zmq.Socket) -> None:
        """Configure ``sock`` (before bind) and start watching its handshakes."""
        if self.curve is None:
            return
        self.curve.apply(sock)
        self.monitor = sock.get_monitor_socket(_REJECTED)

    def on_monitor(self) -> None:
        """Count the failed handshakes the monitor has reported."""
        assert self.monitor is not None
        while True:
            try:
                event: Any = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if not event["event"] & _REJECTED:
                continue
            self.rejected += 1
            # Rate-limited: a rogue peer retrying every 100 ms must not flood the log.
            level = logging.WARNING if self.rejected <= 5 or self.rejected % 100 == 0 else logging.DEBUG
            logger.log(level, "rejected a peer without an allowed CURVE key on %s (#%d, %s)",
                       event.get("endpoint", b"").decode(errors="replace"), self.rejected,
                       _REJECTIONS.get(event["event"], event["event"]))

    def close(self, sock: zmq.Socket) -> None:
        """Close the monitor, ``sock``, then the authenticator: libzmq lets a CURVE client in unchecked
        while no ZAP handler is bound."""
        if self.monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

