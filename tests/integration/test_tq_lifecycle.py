"""Shutdown orders and deaths with a real TransferQueue: every path ends within
its bound, leaves nothing behind, and never takes the controller down."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from buffer import ReplayBuffer
from poller.sources.transferqueue import SPEC
from tests.conftest import alive, wait_until
from tests.integration.trainers import sigkill_after_start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_the_right_order_buffer_close_then_tq_close_is_graceful(store, partition):
    rb = ReplayBuffer(SPEC, source_kwargs=store.call("kwargs"), poll_interval=0.05)
    store.call("put", "k", partition, {"status": "success"})
    assert wait_until(lambda: "k" in rb.snapshot(partition))
    pid = rb.stats()["poller_pid"]
    report = rb.close()
    assert report.stage == "graceful" and report.exitcode == 0 and report.drained
    assert not alive(pid)
    # The poller left the controller alone: the store still answers, then closes.
    assert store.call("list", partition) == {partition: {"k": {"status": "success"}}}
    store.call("close_tq")


def test_the_wrong_order_tq_close_first_still_closes_within_its_bound(store, partition):
    # Default settings: a stalled call is not a listing, so the next comes one poll_interval after it gave up.
    rb = ReplayBuffer(SPEC, source_kwargs=store.call("kwargs", call_timeout=1.0), poll_interval=0.05)
    try:
        store.call("put", "k", partition, {"status": "running"})
        assert wait_until(lambda: "k" in rb.snapshot(partition))
        store.call("close_tq")  # the controller goes away under a running poller
        assert wait_until(lambda: rb.stats()["source_stalls"] >= 2, timeout=60)
        # TransferQueue's own client, in the same situation, is still waiting.
        assert store.call("own_client_blocks", 3.0)
        assert rb.stats()["poller_alive"] and rb.stats()["restarts"] == 0
        pid = rb.stats()["poller_pid"]
    finally:
        report = rb.close(timeout=5.0)
    assert report.stage == "graceful" and report.exitcode == 0
    assert report.seconds < 5.0
    assert not alive(pid)


_TRAINER = textwrap.dedent("""
    import json, sys, time
    from buffer import ReplayBuffer
    from poller.sources.transferqueue import SPEC
    rb = ReplayBuffer(SPEC, source_kwargs=json.loads(sys.argv[1]), poll_interval=0.05)
    print(json.dumps({"poller_pid": rb.stats()["poller_pid"], "endpoint": rb.endpoint}), flush=True)
    time.sleep(600)
""")


def test_a_sigkilled_trainer_leaves_no_poller_and_the_controller_unaffected(store, partition):
    started = sigkill_after_start(_TRAINER, store.call("kwargs"))
    assert wait_until(lambda: not alive(started["poller_pid"]), timeout=10)
    ipc_dir = os.path.dirname(started["endpoint"].removeprefix("ipc://"))
    assert wait_until(lambda: not os.path.exists(ipc_dir), timeout=10)
    # The controller serves on, for the test and for a new buffer.
    store.call("put", "after", partition, {"status": "success"})
    with ReplayBuffer(SPEC, source_kwargs=store.call("kwargs"), poll_interval=0.05) as rb:
        assert rb.snapshot(partition) == {"after": {"status": "success"}}


def _run_example(*args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    # Ray's socket paths must fit in 108 bytes; the tests' TMPDIR is too deep.
    tmp = tempfile.mkdtemp(prefix="tq-example-", dir="/tmp")
    try:
        result = subprocess.run([sys.executable, "examples/verl_style_trainer.py", *args], cwd=REPO,
                                env=dict(os.environ, TMPDIR=tmp), capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result, events


def test_the_example_trainer_runs_its_whole_lifecycle():
    result, events = _run_example("--steps", "2", "--rows", "6")
    assert result.returncode == 0, result.stderr
    names = [e["event"] for e in events]
    assert names == ["buffer-started", "step", "step", "fit-done", "buffer-closed", "store-closed"]
    closed = events[names.index("buffer-closed")]
    assert closed["stage"] == "graceful" and closed["drained"]
    assert not alive(events[0]["poller_pid"])


def test_the_example_trainer_whose_constructor_fails_leaks_nothing():
    result, events = _run_example("--fail-init")
    assert result.returncode == 1
    assert "RuntimeError: trainer init failed" in result.stderr  # the trainer's own error, not hidden
    names = [e["event"] for e in events]
    assert names == ["buffer-started", "buffer-closed", "store-closed"]
    assert events[1]["stage"] == "graceful"
    assert not alive(events[0]["poller_pid"])
