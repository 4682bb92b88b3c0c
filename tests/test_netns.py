"""Two real hosts: the buffer in one network namespace, standalone pollers in
another, over TCP with CURVE across a veth pair (see tests/helpers/netns.py).

Needs root and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from buffer import ReplayBuffer
from buffer.access import InsecureBindError
from poller.sources.sqlite import SqliteSource
from poller.wire.curve import CurveServer, make_keys
from tests.conftest import wait_until
from tests.helpers.netns import NetnsPair, netns_unavailable

ROOT = Path(__file__).resolve().parent.parent
SPEC = "poller.sources.sqlite:SqliteSource"

_why_not = netns_unavailable()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=f"two-host tests skipped: {_why_not}")


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsPair]:
    pair = NetnsPair().create()
    try:
        yield pair
    finally:
        pair.close()
        assert not pair.exists(), "a network namespace outlived the tests"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A buffer key pair, an allowed poller pair and a pair the buffer never heard of."""
    out = tmp_path_factory.mktemp("keys")
    allowed, other = out / "allowed", out / "other"
    paths = {}
    for name, where in (("server", out), ("poller", allowed), ("stranger", other)):
        public, secret = make_keys(where, name)
        paths[name], paths[f"{name}_secret"] = public, secret
    paths["allowed_dir"] = allowed
    return paths


@pytest.fixture
def server(keys: dict[str, Path]) -> CurveServer:
    return CurveServer.from_files(keys["server_secret"], keys["allowed_dir"])


class Pollers:
    """Standalone pollers started in the poller host's namespace; all stopped at the end."""

    def __init__(self, hosts: NetnsPair, tmp_path: Path) -> None:
        self.hosts, self.tmp_path, self.procs = hosts, tmp_path, []

    def start(self, db: str, endpoint: str, name: str, *curve_args: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "poller", "run", "--source", SPEC, "--source-kwargs",
                json.dumps({"path": db}), "--connect", endpoint, "--poll-interval", "0.05", "--name", name, *curve_args]
        with open(self.tmp_path / f"{name}.stderr", "wb") as err:
            proc = subprocess.Popen(self.hosts.in_poller_host(argv), cwd=ROOT, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(proc)
        return proc

    def stderr(self, name: str) -> str:
        return (self.tmp_path / f"{name}.stderr").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def pollers(hosts: NetnsPair, tmp_path: Path) -> Iterator[Pollers]:
    p = Pollers(hosts, tmp_path)
    try:
        yield p
    finally:
        p.close()


def _curve_args(keys: dict[str, Path], who: str) -> tuple[str, ...]:
    return ("--curve-secret", str(keys[f"{who}_secret"]), "--curve-server-key", str(keys["server"]))


def _buffer(hosts: NetnsPair, server: CurveServer, **kwargs: Any) -> ReplayBuffer:
    with hosts.trainer_side():
        return ReplayBuffer(bind=f"tcp://{hosts.trainer_ip}:0", curve=server, **kwargs)


def _store(tmp_path: Path, name: str, rows: dict[str, dict[str, Any]], partition: str = "train") -> SqliteSource:
    store = SqliteSource(str(tmp_path / f"{name}.db"))
    store.kv_batch_put(list(rows), partition, tags=list(rows.values()))
    return store


def test_binding_the_veth_address_without_curve_is_refused(hosts: NetnsPair) -> None:
    # The veth address is a network interface: binding it without CURVE is refused.
    with hosts.trainer_side(), pytest.raises(InsecureBindError, match="insecure=True"):
        ReplayBuffer(bind=f"tcp://{hosts.trainer_ip}:0")


def test_data_flows_and_pollers_without_an_allowed_key_inject_nothing(
        hosts: NetnsPair, keys: dict[str, Path], server: CurveServer, pollers: Pollers, tmp_path: Path) -> None:
    good = _store(tmp_path, "good", {"k1": {"status": "success"}, "k2": {"status": "running"}})
    evil = _store(tmp_path, "evil", {"evil": {"status": "success"}}, partition="evil")
    rb = _buffer(hosts, server)
    try:
        assert rb.endpoint.startswith(f"tcp://{hosts.trainer_ip}:")
        pollers.start(good.path, rb.endpoint, "good", *_curve_args(keys, "poller"))
        assert wait_until(lambda: rb.snapshot() == {"train": {"k1": {"status": "success"},
                                                              "k2": {"status": "running"}}}, timeout=20)
        good.kv_put("k2", "train", tag={"status": "success"})
        assert wait_until(lambda: rb.snapshot("train")["k2"] == {"status": "success"}, timeout=10)
        assert rb.stats()["auth_rejected"] == 0 and rb.stats()["peers"] == 1

        # 1. No CURVE at all, 2. a key the buffer does not allow, 3. an allowed
        # key but the wrong server key: each is refused and counted.
        wrong_server = ("--curve-secret", str(keys["poller_secret"]), "--curve-server-key", str(keys["stranger"]))
        for name, args in (("rogue", ()), ("stranger", _curve_args(keys, "stranger")), ("impostor", wrong_server)):
            before = rb.stats()["auth_rejected"]
            proc = pollers.start(evil.path, rb.endpoint, name, *args)
            assert wait_until(lambda: rb.stats()["auth_rejected"] > before, timeout=15), name
            if name == "stranger":
                # The refused poller says why on its stderr, instead of retrying in silence (it may
                # write it a moment after the buffer counted the refusal: wait for it before SIGTERM).
                assert wait_until(lambda: "refused the CURVE handshake" in pollers.stderr("stranger"),
                                  timeout=15), pollers.stderr("stranger")
            assert proc.poll() is None  # it keeps knocking; it just never gets in
            proc.terminate()
            proc.wait(timeout=10)
        stats = rb.stats()
        assert "evil" not in rb.snapshot()
        assert stats["peers"] == 1 and stats["protocol_errors"] == 0  # nothing of theirs reached the decoder
    finally:
        good.close()
        evil.close()
        rb.close()
    assert "Traceback" not in pollers.stderr("good")


def test_a_cut_link_goes_stale_reconnects_and_resyncs_without_loss(
        hosts: NetnsPair, keys: dict[str, Path], server: CurveServer, pollers: Pollers, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="buffer")
    rows = {f"k{i}": {"global_steps": 1, "status": "success"} for i in range(20)}
    store = _store(tmp_path, "store", rows)
    rb = _buffer(hosts, server, stale_after=1.5)
    try:
        proc = pollers.start(store.path, rb.endpoint, "cut", *_curve_args(keys, "poller"))
        assert wait_until(lambda: rb.snapshot("train") == rows, timeout=20)
        # The trainer consumed k0 but the store still lists it: it must not come back.
        rb.remove("train", ["k0"])

        hosts.set_link(False)
        try:
            store.kv_batch_put([f"new{i}" for i in range(5)], "train", tags=[{"status": "running"}] * 5)
            store.kv_clear(["k1", "k2"], "train")
            store.kv_put("k3", "train", tag={"status": "failure"})
            assert wait_until(lambda: rb.stats()["stale_peers"] == ["cut"], timeout=10)
            assert rb.stats()["last_message_age_s"] > 1.5
            assert wait_until(lambda: any("no message from poller cut" in r.getMessage() for r in caplog.records))
            time.sleep(3.5)  # past the poller's 3 s heartbeat timeout: it drops the dead connection
            assert rb.stats()["last_message_age_s"] > 4.0  # nothing got through the cut
        finally:
            hosts.set_link(True)

        expected = {k: v for k, v in store.kv_list()["train"].items() if k != "k0"}
        assert set(expected) == {f"k{i}" for i in range(3, 20)} | {f"new{i}" for i in range(5)}
        assert wait_until(lambda: rb.snapshot("train") == expected, timeout=20), rb.snapshot("train")
        stats = rb.stats()
        assert stats["stale_peers"] == [] and stats["last_message_age_s"] < 1.5
        assert stats["resyncs"] >= 1  # the reconnected stream had a gap and was resynced
        assert proc.poll() is None  # the same process reconnected by itself
        # A resync is a full snapshot: no key arrived twice in sample order, none resurrected.
        batch = rb.sample("train", batch_size=len([k for k, v in expected.items() if v["status"] == "success"]),
                          timeout=5)
        assert len(batch.keys) == len(set(batch.keys)) and "k0" not in batch.keys
        assert stats["auth_rejected"] == 0 and stats["protocol_errors"] == 0
    finally:
        hosts.set_link(True)
        store.close()
        rb.close()


def test_a_sigkilled_poller_host_is_noticed_through_missing_heartbeats(
        hosts: NetnsPair, keys: dict[str, Path], server: CurveServer, pollers: Pollers, tmp_path: Path) -> None:
    store = _store(tmp_path, "store", {"k": {"status": "success"}})
    stale_after = 1.5
    rb = _buffer(hosts, server, stale_after=stale_after)
    try:
        proc = pollers.start(store.path, rb.endpoint, "doomed", *_curve_args(keys, "poller"))
        assert wait_until(lambda: rb.snapshot("train") == {"k": {"status": "success"}}, timeout=20)
        assert rb.stats()["stale_peers"] == [] and rb.stats()["stale_after"] == stale_after
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=10)
        assert wait_until(lambda: rb.stats()["stale_peers"] == ["doomed"], timeout=stale_after + 10)
        noticed_after = time.monotonic() - killed_at
        # Documented bound: within stale_after of the last message; the margin is for a loaded machine.
        assert noticed_after <= stale_after + 3.0, noticed_after
        assert rb.snapshot("train") == {"k": {"status": "success"}}  # what it had stays
    finally:
        store.close()
        rb.close()
