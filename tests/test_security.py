"""Private by default, authenticated on the network, bounded against hostile input.

Everything here runs on one host (ipc and loopback TCP); the two-host tests
are in test_netns.py.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from buffer import ReplayBuffer
from buffer.access import InsecureBindError, is_local_endpoint, normalize_bind
from poller.cli import main
from poller.faults.peer import packed_delta
from poller.sources.sqlite import SqliteSource
from poller.wire.curve import CurveClient, CurveServer, generate_pair, load_key_pair, load_public_key, make_keys
from poller.wire.protocol import Kind, Message, decode
from tests.conftest import wait_until
from tests.helpers.messages import HEARTBEAT, to_frames

SQLITE = "poller.sources.sqlite:SqliteSource"
NOBODY = 65534


# -- the bind policy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, local", [
    ("ipc:///tmp/x/stream", True), ("inproc://x", True), ("tcp://127.0.0.1:5555", True),
    ("tcp://127.3.4.5:1", True), ("tcp://localhost:0", True), ("tcp://lo:0", True), ("tcp://[::1]:0", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:0", False), ("tcp://10.0.0.1:0", False), ("tcp://eth0:0", False),
    ("tcp://[::]:0", False), ("tcp://trainer.example:0", False), ("ws://127.0.0.1:0", False), ("garbage", False),
])
def test_only_ipc_inproc_and_loopback_count_as_local(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


def test_tcp_without_a_host_binds_loopback() -> None:
    assert normalize_bind("tcp://:0") == "tcp://127.0.0.1:0"
    assert normalize_bind("tcp://0.0.0.0:1") == "tcp://0.0.0.0:1"
    rb = ReplayBuffer(bind="tcp://:0")
    try:
        assert rb.endpoint.startswith("tcp://127.0.0.1:") and not rb.endpoint.endswith(":0")
    finally:
        rb.close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://eth0:0"])
def test_a_network_bind_without_curve_is_refused(endpoint: str) -> None:
    with pytest.raises(InsecureBindError, match=r"insecure=True") as info:
        ReplayBuffer(bind=endpoint)
    assert "without authentication" in str(info.value) and "SECURITY.md" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_insecure_true_binds_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="buffer")
    rb = ReplayBuffer(bind="tcp://0.0.0.0:0", insecure=True)
    try:
        assert rb.endpoint.startswith("tcp://0.0.0.0:")
        assert rb.stats()["curve"] is False
    finally:
        rb.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "without authentication" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("kwargs, error", [
    ({"curve": "keys/"}, TypeError), ({"limits": [("max_peers", 1)]}, TypeError),
    ({"limits": {"max_pears": 1}}, ValueError),  # a mapping is fine (config files), an unknown field is not
    ({"stale_after": 0}, ValueError), ({"stale_after": float("nan")}, ValueError),
])
def test_bad_security_arguments(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        ReplayBuffer(**kwargs)


# -- ipc: a second user cannot connect -----------------------------------------------------------------

def _connect_as(uid: int, path: str, timeout: float = 10.0) -> int:
    """Connect to the unix socket ``path`` from a child running as ``uid``; 0 or the errno."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, try, report, leave at once
        code = 255
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(path)
                    code = 0
                except OSError as exc:
                    code = exc.errno or 254
        finally:
            os.write(write_fd, bytes([code]))
            os._exit(0)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], timeout)
        data = os.read(read_fd, 1) if ready else b""
    finally:
        os.close(read_fd)
        if not data:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert data, "the unprivileged child did not report"
    return data[0]


@pytest.fixture
def open_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-traversable temporary directory, so only the buffer's own 0700 directory can stop a stranger."""
    directory = Path(tempfile.mkdtemp(prefix="rp-open-", dir="/tmp"))
    directory.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_another_user_cannot_connect_to_the_default_ipc_endpoint(open_tmp: Path) -> None:
    # Control: the same child reaches a socket that others may enter.
    control = str(open_tmp / "control.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(control)
        os.chmod(control, 0o777)
        listener.listen(1)
        assert _connect_as(NOBODY, control) == 0
    os.unlink(control)

    rb = ReplayBuffer()
    try:
        path = rb.endpoint[len("ipc://"):]
        directory = Path(path).parent
        assert directory.parent == open_tmp
        info = directory.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert _connect_as(NOBODY, path) == 13  # EACCES
        assert _connect_as(os.geteuid(), path) == 0  # the owner gets in
        assert rb.stats()["messages"] == 0
    finally:
        rb.close()
    assert not directory.exists()  # removed on close
    assert list(open_tmp.iterdir()) == []


# -- CURVE on loopback ---------------------------------------------------------------------------------

@pytest.fixture
def server_keys(tmp_path: Path) -> dict[str, Path]:
    out = {}
    assert main(["keys", "--out", str(tmp_path / "server"), "--name", "server"]) == 0
    assert main(["keys", "--out", str(tmp_path / "allowed"), "--name", "poller"]) == 0
    out["server_secret"] = tmp_path / "server" / "server.key_secret"
    out["server"] = tmp_path / "server" / "server.key"
    out["allowed"] = tmp_path / "allowed"
    out["poller_secret"] = tmp_path / "allowed" / "poller.key_secret"
    return out


class _Dealer:
    """A hand-driven peer that may or may not hold CURVE keys."""

    def __init__(self, endpoint: str, curve: CurveClient | None, name: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, name)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(endpoint)

    def send_snapshot(self, items: dict[str, Any], epoch: int = 5, join: bool = False) -> None:
        """READY, then a snapshot; with ``join``, one answering the token the buffer asks a first listing with."""
        ready = {"pid": 1, "name": "x", "poll_interval": 0.1}
        self.sock.send_multipart(to_frames(Message(Kind.READY, epoch, 0, ready)))
        token = 0
        while join and not token and self.sock.poll(10_000):
            message = decode(self.sock.recv_multipart())
            if message.kind is Kind.SYNC:
                token = message.body.token
        self.sock.send_multipart(to_frames(Message(Kind.DELTA, epoch, 1, packed_delta({"p": items}, full=True,
                                                                                   reset=True, sync=token))))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_curve_admits_allowed_keys_only(server_keys: dict[str, Path]) -> None:
    server = CurveServer.from_files(server_keys["server_secret"], server_keys["allowed"])
    allowed = CurveClient.from_files(server_keys["poller_secret"], server_keys["server"])
    public, secret = generate_pair()
    unknown = CurveClient(public, secret, server.public_key)
    wrong_server = CurveClient(allowed.public_key, allowed.secret_key, generate_pair()[0])
    rb = ReplayBuffer(bind="tcp://127.0.0.1:0", curve=server)
    peers = []
    try:
        assert rb.stats()["curve"] is True
        for i, (curve, name) in enumerate([(None, b"plain"), (unknown, b"unknown"), (wrong_server, b"impostor")]):
            peers.append(_Dealer(rb.endpoint, curve, name))
            peers[-1].send_snapshot({"evil": {"status": "success"}})
            assert wait_until(lambda: rb.stats()["auth_rejected"] > i), name
        good = _Dealer(rb.endpoint, allowed, b"good")
        peers.append(good)
        good.send_snapshot({"ok": {"status": "success"}}, join=True)
        assert wait_until(lambda: rb.snapshot() == {"p": {"ok": {"status": "success"}}})
        stats = rb.stats()
        assert stats["messages"] == 2 and stats["peers"] == 1 and stats["protocol_errors"] == 0
    finally:
        for peer in peers:
            peer.close()
        rb.close()


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1:0", None])
def test_the_buffers_own_poller_authenticates_with_an_ephemeral_key(
        server_keys: dict[str, Path], store: SqliteSource, bind: str | None) -> None:
    # The allowed set holds no key of the child's: it gets one for this buffer only.
    server = CurveServer.from_files(server_keys["server_secret"], [])
    store.kv_put("k", "train", tag={"status": "success"})
    rb = ReplayBuffer(SQLITE, source_kwargs={"path": store.path}, poll_interval=0.05, bind=bind, curve=server)
    try:
        assert rb.snapshot() == {"train": {"k": {"status": "success"}}}
        store.kv_put("k2", "train", tag={"status": "running"})
        assert wait_until(lambda: "k2" in rb.snapshot("train"))
        assert rb.stats()["auth_rejected"] == 0
    finally:
        report = rb.close()
    assert report.stage == "graceful" and report.drained


# -- keys ----------------------------------------------------------------------------------------------

def test_keys_command_writes_a_private_pair_and_never_overwrites(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "keys"
    assert main(["keys", "--out", str(out), "--name", "host1"]) == 0
    assert "host1.key_secret" in capsys.readouterr().out
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "host1.key_secret").stat().st_mode) == 0o600
    public, secret = load_key_pair(out / "host1.key_secret")
    assert load_public_key(out / "host1.key") == public and len(secret) == 40
    with pytest.raises(ValueError, match="no secret key"):
        load_key_pair(out / "host1.key")
    before = (out / "host1.key_secret").read_bytes()
    assert main(["keys", "--out", str(out), "--name", "host1"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (out / "host1.key_secret").read_bytes() == before
    with pytest.raises(ValueError):
        make_keys(out, "../escape")


@pytest.mark.parametrize("args, needle", [
    (["--curve-secret", "x.key_secret"], "go together"),
    (["--curve-server-key", "x.key"], "go together"),
    (["--curve-secret", "/nonexistent.key_secret", "--curve-server-key", "/nonexistent.key"], "cannot read"),
])
def test_run_rejects_bad_curve_options_in_one_line(args: list[str], needle: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--source", SQLITE, "--connect", "tcp://127.0.0.1:1", *args]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_curve_client_never_shows_its_secret() -> None:
    public, secret = generate_pair()
    client = CurveClient(public, secret, public)
    assert secret.decode() not in repr(client)



def test_a_curve_socket_without_its_authenticator_fails_closed(tmp_path: Path) -> None:
    # No ZAP handler in this context: libzmq would admit any client that knows
    # the server key, unless the socket enforces its ZAP domain (CurveServer.apply does).
    _, secret_file = make_keys(tmp_path, "server")
    server = CurveServer.from_files(secret_file, [])
    public, secret = generate_pair()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    client: _Dealer | None = None
    try:
        server.apply(router)
        router.bind("tcp://127.0.0.1:0")
        client = _Dealer(router.getsockopt_string(zmq.LAST_ENDPOINT), CurveClient(public, secret, server.public_key),
                         b"valid-but-unchecked")
        client.send_snapshot({"k": {}})
        assert router.poll(1000) == 0
    finally:
        if client is not None:
            client.close()
        router.close(0)
        ctx.term()


def test_a_peer_cannot_flood_the_trainers_log(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: forwarded LOG (at any level the peer chose, up to 1 MiB each), ERROR and
    gap warnings were logged one for one, though this file's SECURITY.md says they are bounded."""
    from poller.faults.peer import RoguePeer

    caplog.set_level(logging.DEBUG)
    with ReplayBuffer() as rb, RoguePeer(rb.endpoint) as peer:
        peer.ready()
        for _ in range(100):
            for _ in range(3):  # forwarded LOG has a larger budget (100 a minute) than the rest (10)
                peer.send(Kind.LOG, {"level": 10**6, "name": "x", "message": "y" * 100_000})
            peer.send(Kind.ERROR, {"type": "E", "message": "z" * 100_000, "traceback": "", "fatal": False,
                                   "count": 1})
            peer.send(Kind.HEARTBEAT, dict(HEARTBEAT, last_seq=peer.seq - 1),
                      seq=peer.seq + 1)  # a gap every time
        assert wait_until(lambda: rb.stats()["messages"] >= 501, timeout=20)
        assert rb.stats()["source_errors"] == 100  # all counted, whatever was logged
    forwarded = [r for r in caplog.records if r.name == "poller"]
    errors = [r for r in caplog.records if "kv_list() failed" in r.getMessage()]
    gaps = [r for r in caplog.records if "gap in the stream" in r.getMessage()]
    assert 1 <= len(forwarded) <= 110, len(forwarded)
    for records in (errors, gaps):
        assert 1 <= len(records) <= 20, len(records)
    assert max(r.levelno for r in forwarded) == logging.ERROR  # clamped, not 10**6
    assert max(len(r.getMessage()) for r in forwarded + errors) < 3000
