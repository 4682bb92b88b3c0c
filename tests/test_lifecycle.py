"""Start, crash, restart and close: every path ends, within its bound, clean."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from buffer import ReplayBuffer
from poller import PollerCrashed, PollerStartupError
from poller.wire.errors import RemoteTraceback
from tests.conftest import alive as _alive
from tests.conftest import wait_until
from tests.helpers.processes import close_from_threads

SQLITE = "poller.sources.sqlite:SqliteSource"
HELPERS = "tests.helpers.sources"
FAULTS = "poller.faults"


def _over_sqlite(db: str, **kwargs: object) -> dict:
    return {"inner": SQLITE, "inner_kwargs": {"path": db}, **kwargs}
REPO = Path(__file__).resolve().parent.parent

# -- close stages --------------------------------------------------------------

def test_idle_poller_closes_gracefully_in_milliseconds_whatever_the_interval(db):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=30.0)
    pid = rb.stats()["poller_pid"]
    report = rb.close()
    assert report.stage == "graceful" and report.exitcode == 0 and report.drained
    assert report.seconds < 5.0  # the bound is close_timeout (5 s); typically ~10 ms
    assert not _alive(pid)
    assert rb.close() is report  # idempotent: the same report

def test_poller_stuck_in_kv_list_still_closes_gracefully(db):
    rb = ReplayBuffer(source=f"{FAULTS}:hang", source_kwargs=_over_sqlite(db, after=1), poll_interval=0.01)
    time.sleep(0.2)  # the second kv_list() is now blocked for good
    report = rb.close(timeout=3)
    assert report.stage == "graceful" and report.exitcode == 0 and report.drained

def test_a_polling_thread_waiting_for_its_next_poll_ends_at_once_and_keeps_what_it_sent():
    # What the embedded poller relies on at STOP: woken, the thread ends while BYE goes out
    # (the process then exits with its main thread alone), and frees nothing on its way out.
    from poller.polling import PollingThread
    from poller.wire.tags import pack_tags

    listing = {"p": {"k": {"status": "success"}}}
    thread = PollingThread(type("Source", (), {"kv_list": lambda self: listing})(), lambda *_: True,
                           poll_interval=30.0)
    thread.start()
    try:
        assert wait_until(lambda: thread.polls == 1 and thread.idle)
        sent = thread.sent
        started = time.monotonic()
        thread.stop()
        thread.join(5.0)
        assert not thread.is_alive() and time.monotonic() - started < 1.0
        assert thread.sent is sent and sent == {"p": {"k": pack_tags(listing["p"]["k"])}}  # kept packed
    finally:
        thread.stop()

@pytest.mark.parametrize("fault, stage", [("ignore_stop", "terminated"), ("ignore_sigterm", "killed")])
def test_a_poller_that_ignores_stop_is_terminated_or_killed(tmp_path, fault, stage):
    marker = tmp_path / "stuck"
    rb = ReplayBuffer(source=f"{FAULTS}:{fault}", source_kwargs={"marker": str(marker), "after": 1},
                      poll_interval=0.01)
    assert wait_until(marker.exists, timeout=10)
    started = time.monotonic()
    report = rb.close(timeout=0.5)
    assert report.stage == stage
    assert not report.drained
    assert report.exitcode == (-signal.SIGTERM if stage == "terminated" else -signal.SIGKILL)
    assert time.monotonic() - started < 0.5 * 2 + 5.0

def test_concurrent_closes_all_get_the_same_report(db):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.05)
    reports = close_from_threads(rb, 4, timeout=10)
    assert len(reports) == 4 and all(r is reports[0] for r in reports)
    assert reports[0].stage == "graceful"

def test_a_close_takes_the_watched_poller_over_and_the_supervisor_ends_restarting_nothing(db):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=30.0)
    supervisor = rb._core.supervisor
    pid = rb.stats()["poller_pid"]
    report = rb.close()
    assert report.stage == "graceful" and report.exitcode == 0 and report.drained
    assert not supervisor._thread.is_alive() and supervisor.process is not None and supervisor.process.pid == pid
    assert not _alive(pid)

def test_a_close_racing_the_pollers_own_death_restarts_nothing(db):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=30.0)
    supervisor = rb._core.supervisor
    pid = rb.stats()["poller_pid"]
    os.kill(pid, signal.SIGKILL)
    report = rb.close(timeout=5)  # before, or just after, the supervisor sees the death
    # Reaped by the ladder's first wait, or found dead: either way the SIGKILL's exit code.
    assert report.stage in ("graceful", "already-exited") and report.exitcode == -signal.SIGKILL
    assert not supervisor._thread.is_alive() and supervisor.process is not None and supervisor.process.pid == pid

# -- start-up failures -----------------------------------------------------------

@pytest.mark.parametrize("source, kwargs, match", [
    ("no.such.module:Thing", {}, "ModuleNotFoundError"),
    ("poller.sources.sqlite:NoSuchAttr", {}, "has no attribute"),
    ("not-a-spec", {}, "not of the form"),
    (f"{HELPERS}:failing_factory", {"url": "x"}, "cannot connect to store"),
    ("os:getcwd", {}, "has no kv_list"),
    (f"{HELPERS}:HalfChangeFeed", {}, "a change feed needs kv_snapshot and kv_changes"),
])
def test_startup_failure_raises_with_the_child_traceback_and_leaves_nothing(source, kwargs, match):
    with pytest.raises(PollerStartupError, match=match) as info:
        ReplayBuffer(source=source, source_kwargs=kwargs, start_timeout=20)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "Traceback" in cause.traceback_text

def test_no_ready_before_the_deadline_is_a_startup_error(tmp_path):
    started = time.monotonic()
    with pytest.raises(PollerStartupError, match="no READY within 1s"):
        ReplayBuffer(source=f"{FAULTS}:slow", source_kwargs={"start_s": 60}, start_timeout=1)
    assert time.monotonic() - started < 10

class _Trainer:
    """Like a verl trainer: the buffer comes first, a later init step fails."""

    def __init__(self, db: str) -> None:
        self.replay_buffer = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.05)
        self.pid = self.replay_buffer.stats()["poller_pid"]
        raise RuntimeError("model init failed")

def test_a_trainer_whose_init_fails_leaks_nothing(db):
    with pytest.raises(RuntimeError, match="model init failed") as info:
        _Trainer(db)
    # The half-built trainer is reachable only from the traceback.
    pid = info.traceback[-1].frame.f_locals["self"].pid
    del info
    gc.collect()
    assert wait_until(lambda: not _alive(pid), timeout=5)

# -- crashes and restarts ------------------------------------------------------------

def test_a_crashing_poller_is_restarted_then_sample_raises_poller_crashed(store, db):
    store.kv_put("a", "train", tag={"status": "success"})
    rb = ReplayBuffer(source=f"{FAULTS}:crash", source_kwargs=_over_sqlite(db, after=2, how="exit", code=9),
                      poll_interval=0.02, max_restarts=2)
    try:
        rb.add("train", {"w": {"global_steps": 1, "status": "running"}})
        with pytest.raises(PollerCrashed, match=r"exit code 9.*max_restarts=2") as info:
            rb.sample("train", global_steps=1, timeout=30)
        assert rb.stats()["restarts"] == 2
        assert rb.snapshot("train")["a"] == {"status": "success"}  # data survives the crashes
        del info
    finally:
        report = rb.close()
    assert report.stage == "already-exited"

def test_persistent_source_errors_end_in_poller_crashed_with_the_remote_traceback():
    rb = ReplayBuffer(source=f"{FAULTS}:raise_", source_kwargs={"message": "store is on fire"}, poll_interval=0.01,
                      max_restarts=1)
    try:
        with pytest.raises(PollerCrashed) as info:
            rb.sample("train", batch_size=1, timeout=60)
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "store is on fire" in cause.traceback_text
        assert rb.stats()["source_errors"] >= 10  # 5 in a row, per run
        del info, cause
    finally:
        rb.close()

def test_garbage_from_the_source_is_a_source_error_not_a_broken_stream():
    # A listing that is not a mapping at all (one bad record is quarantined instead: tests/test_quarantine.py).
    rb = ReplayBuffer(source=f"{FAULTS}:garbage", source_kwargs={"kind": "not-a-mapping"},
                      poll_interval=0.01, max_restarts=0)
    try:
        with pytest.raises(PollerCrashed) as info:
            rb.sample("train", batch_size=1, timeout=60)
        assert "expected a mapping of partitions" in info.value.__cause__.traceback_text
        assert rb.stats()["protocol_errors"] == 0
        del info
    finally:
        rb.close()

# -- parent death ---------------------------------------------------------------------

_TRAINER = textwrap.dedent("""
    import sys, time
    from buffer import ReplayBuffer
    if __name__ == "__main__":
        source = sys.argv[1]
        kwargs = ({"path": sys.argv[2]} if source.endswith("SqliteSource") else
                  {"inner": "poller.sources.sqlite:SqliteSource", "inner_kwargs": {"path": sys.argv[2]}, "after": 1})
        rb = ReplayBuffer(source=source, source_kwargs=kwargs, poll_interval=0.02)
        print(rb.stats()["poller_pid"], flush=True)
        time.sleep(120)
""")

@pytest.mark.parametrize("source", [SQLITE, f"{FAULTS}:hang"])
def test_parent_sigkill_leaves_no_orphan(tmp_path, db, source):
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), source, db], stdout=subprocess.PIPE, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = trainer.stdout.readline()
        poller_pid = int(line)
        assert _alive(poller_pid)
        trainer.kill()
        trainer.wait(10)
        assert wait_until(lambda: not _alive(poller_pid), timeout=2.0), "the poller outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait(10)
        trainer.stdout.close()

# A trainer that adopts orphans and never reaps them, as one that is PID 1 in a container does (here a child
# subreaper, prctl(PR_SET_CHILD_SUBREAPER)): what a closed buffer leaves behind becomes its child, zombie or not.
_SUBREAPER_TRAINER = textwrap.dedent("""
    import ctypes, json, os, sys, time
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        sys.exit(f"prctl: errno {ctypes.get_errno()}")
    from buffer import ReplayBuffer

    def children():
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            state, parent = stat.rsplit(")", 1)[1].split()[:2]
            if int(parent) == os.getpid():
                found.append([int(entry), state, name])
        return found

    if __name__ == "__main__":
        stages = []
        for _ in range(int(sys.argv[2])):
            rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": sys.argv[1]},
                              poll_interval=0.02)
            stages.append(rb.close().stage)
        print(json.dumps({"stages": stages, "children": children()}), flush=True)
        time.sleep(0.5)  # nothing may turn up later either (a watchdog exits after its poller)
        print(json.dumps({"children": children()}), flush=True)
""")


def test_a_graceful_close_leaves_no_process_behind_not_even_a_zombie(tmp_path, db):
    # Before: each poller's watchdog outlived it, orphaned, and was adopted by the nearest subreaper; a trainer
    # that never reaps (PID 1 in a container) collected one zombie `replay-watchdog` per open/close cycle.
    script = tmp_path / "trainer.py"
    script.write_text(_SUBREAPER_TRAINER)
    trainer = subprocess.run([sys.executable, str(script), db, "10"], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert trainer.returncode == 0, trainer.stderr
    first, later = map(json.loads, trainer.stdout.splitlines())
    assert first["stages"] == ["graceful"] * 10
    assert first["children"] == [] and later["children"] == [], (first, later)


def test_a_picklable_callable_works_as_source(db, store):
    from poller.sources.sqlite import SqliteSource

    store.kv_put("k", "train", tag={"status": "success"})
    with ReplayBuffer(source=SqliteSource, source_kwargs={"path": db}, poll_interval=0.05) as rb:
        assert rb.snapshot("train") == {"k": {"status": "success"}}

def test_a_poller_killed_from_outside_is_restarted_and_the_stream_continues(db, store):
    store.kv_put("before", "train", tag={"status": "success"})
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.02, max_restarts=1)
    try:
        first = rb.stats()["poller_pid"]
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: rb.stats()["restarts"] == 1 and rb.stats()["poller_alive"], timeout=15)
        assert rb.stats()["poller_pid"] != first
        store.kv_put("after", "train", tag={"status": "success"})
        store.kv_clear(["before"], "train")  # vanished while it was being restarted
        assert wait_until(lambda: rb.snapshot("train") == {"after": {"status": "success"}})
    finally:
        report = rb.close()
    assert report.stage == "graceful"


def test_a_waiter_in_a_non_daemon_thread_does_not_hang_the_interpreter_exit(db, tmp_path):
    """Regression: the interpreter joins non-daemon threads before atexit handlers and
    finalizers run, so a buffer never closed left a thread in sample(timeout=None), and
    the process, waiting forever."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent("""
        import sys, threading
        from buffer import ReplayBuffer, BufferClosed

        rb = ReplayBuffer("poller.sources.sqlite:SqliteSource", source_kwargs={"path": sys.argv[1]},
                          poll_interval=0.05)
        rb.add("train", {"k": {"global_steps": 1, "status": "running"}})

        def wait():
            try:
                rb.sample("train", global_steps=1, timeout=None)
            except BufferClosed as exc:
                print("woken:", type(exc).__name__, flush=True)

        threading.Thread(target=wait, name="waiter").start()   # not a daemon
        print("waiting", flush=True)
        # the main thread ends here, with the buffer open
    """))
    proc = subprocess.Popen([sys.executable, str(script), db], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the interpreter did not exit: the waiter was never woken")
    assert proc.returncode == 0
    assert out.split("\n")[:2] == ["waiting", "woken: BufferClosed"]
