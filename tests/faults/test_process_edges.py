"""Process edges: forked children, trainers killed by a signal, dead polling
threads, restart budgets over time, a store that is down while the poller restarts."""

from __future__ import annotations

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
from poller import PollerCrashed
from poller.wire.errors import RemoteTraceback
from tests.conftest import wait_until
from tests.helpers.lines import first_line

ROOT = Path(__file__).resolve().parents[2]
SQLITE = "poller.sources.sqlite:SqliteSource"


def _ipc_dir(rb: ReplayBuffer) -> str:
    return os.path.dirname(rb.endpoint[len("ipc://"):])


def _run(code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False)


# -- 1. a forked child's exit leaves the parent's buffer alone ----------------------------------------------

_FORK = """
    import json, os, sys, time
    from buffer import ReplayBuffer
    from poller.sources.sqlite import SqliteSource

    db, how = sys.argv[1], sys.argv[2]
    store = SqliteSource(db)
    rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db},
                      poll_interval=0.02, max_restarts=1)
    ipc = os.path.dirname(rb.endpoint[len("ipc://"):])
    first_pid = rb.stats()["poller_pid"]
    pid = os.fork()
    if pid == 0:
        if how == "close":  # e.g. a `with` block unwinding in a forked worker
            rb.close()
            os._exit(0)
        sys.exit(0)  # a normal exit: atexit runs the buffer's finalizer in this child
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    out = {"dir_kept": os.path.isdir(ipc), "same_poller": rb.stats()["poller_pid"] == first_pid}
    os.kill(rb.stats()["poller_pid"], 9)  # the parent's next poller must still reach the buffer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (rb.stats()["restarts"] >= 1 and rb.stats()["poller_alive"]):
        time.sleep(0.02)
    store.kv_put("after", "p", tag={"status": "success"})
    while time.monotonic() < deadline and "after" not in rb.snapshot("p"):
        time.sleep(0.02)
    out["streamed_after_restart"] = "after" in rb.snapshot("p")
    out["restarts"] = rb.stats()["restarts"]
    out["stage"] = rb.close().stage
    out["dir_removed_on_close"] = not os.path.isdir(ipc)
    print(json.dumps(out))
"""


@pytest.mark.parametrize("how", ["exit", "close"])
def test_a_forked_child_that_exits_does_not_touch_the_parents_poller_or_ipc_dir(db, how):
    result = _run(_FORK, db, how)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"dir_kept": True, "same_poller": True, "streamed_after_restart": True, "restarts": 1,
                   "stage": "graceful", "dir_removed_on_close": True}, result.stderr


# -- 6. a trainer killed by a signal with no poller: its ipc dir is removed by the next buffer ---------------

_NO_SOURCE = """
    import os, sys, time
    from buffer import ReplayBuffer
    rb = ReplayBuffer()  # no source: no poller, no watchdog to clean up after us
    print(os.path.dirname(rb.endpoint[len("ipc://"):]), flush=True)
    time.sleep(60)
"""


def _killed_trainer_dir() -> str:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_NO_SOURCE)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        directory = first_line(proc).strip()
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert os.path.isdir(directory)  # SIGKILL: nobody removed it
    return directory


def test_the_ipc_dir_of_a_trainer_killed_by_a_signal_is_removed_by_the_next_buffer():
    stale = _killed_trainer_dir()
    with ReplayBuffer() as rb:
        assert not os.path.exists(stale)
        assert os.path.isdir(_ipc_dir(rb))  # its own is there


def test_ipc_dirs_of_live_owners_and_unknown_dirs_are_left_alone(tmp_path):
    from buffer.ipcdir import OWNER_FILE, PREFIX

    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_NO_SOURCE)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    import tempfile

    foreign = tempfile.mkdtemp(prefix=PREFIX)  # another pid namespace's (a container sharing /tmp)
    unknown = tempfile.mkdtemp(prefix=PREFIX)  # no owner file: not ours to judge
    with open(os.path.join(foreign, OWNER_FILE), "w") as f:
        json.dump({"pid": 2 ** 22 + 1, "start": 1, "pidns": "pid:[1]"}, f)
    try:
        live_dir = first_line(live).strip()
        with ReplayBuffer():
            assert os.path.isdir(live_dir) and os.path.isdir(foreign) and os.path.isdir(unknown)
    finally:
        live.kill()
        live.wait(30)
        if live.stdout is not None:
            live.stdout.close()
        import shutil

        shutil.rmtree(foreign)
        shutil.rmtree(unknown)
    with ReplayBuffer():  # now its owner is gone
        assert not os.path.exists(live_dir)


# -- 3. a polling thread that dies ends the poller: restarted, then PollerCrashed -------------------------------

def test_a_dead_polling_thread_is_seen_restarted_and_then_reported(db, tmp_path):
    arm = tmp_path / "arm"
    kwargs = {"inner": SQLITE, "inner_kwargs": {"path": db}, "exc": "SystemExit", "when_exists": str(arm)}
    with ReplayBuffer(source="poller.faults:raise_", source_kwargs=kwargs, poll_interval=0.02,
                      max_restarts=1) as rb:
        rb.add("p", {"k": {"global_steps": 1, "status": "running"}})
        arm.touch()  # kv_list() now raises SystemExit, which `except Exception` let kill the thread
        with pytest.raises(PollerCrashed) as info:
            rb.sample("p", global_steps=1, timeout=60)
        # The last poller's ERROR travels on the stream, its exit through the
        # pidfd: the crash can be reported before the receiver has applied it.
        assert wait_until(lambda: rb.stats()["source_errors"] >= 2, timeout=10)
        stats = rb.stats()
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert info.value.__cause__.exc_type == "SystemExit"
    assert stats["restarts"] == 1 and not stats["poller_alive"]


# -- 5. restarts are counted within a window; an unreachable store uses none ------------------------------------

def _kill_and_wait_restart(rb: ReplayBuffer, restarts: int) -> None:
    os.kill(rb.stats()["poller_pid"], signal.SIGKILL)
    assert wait_until(lambda: rb.stats()["restarts"] == restarts and rb.stats()["poller_alive"], timeout=30), \
        rb.stats()


def test_restarts_are_counted_within_the_window(db, store):
    with ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.02, max_restarts=1,
                      restart_window=1.0) as rb:
        _kill_and_wait_restart(rb, 1)
        time.sleep(1.2)  # the first restart is now out of the window
        _kill_and_wait_restart(rb, 2)  # before: the 2nd crash in the buffer's life was fatal
        store.kv_put("k", "p", tag={"status": "success"})
        assert rb.sample("p", batch_size=1, timeout=30).keys == ["k"]


def test_crashes_within_the_window_still_use_up_the_budget(db):
    with ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.02, max_restarts=1) as rb:
        _kill_and_wait_restart(rb, 1)
        os.kill(rb.stats()["poller_pid"], signal.SIGKILL)
        with pytest.raises(PollerCrashed, match=r"max_restarts=1 restarts within 600s were used"):
            rb.sample("p", batch_size=1, timeout=30)


def _store_down(db: str, down: Path) -> dict:
    return {"inner": SQLITE, "inner_kwargs": {"path": db}, "when_exists": str(down)}


def test_a_poller_that_cannot_reach_its_store_at_restart_keeps_trying(db, store, tmp_path):
    down = tmp_path / "down"
    with ReplayBuffer(source="poller.faults:down", source_kwargs=_store_down(db, down), poll_interval=0.02,
                      max_restarts=1) as rb:
        down.touch()  # kv_list() fails until the poller gives up; its restarts cannot connect
        seen: list[int] = []  # stats()["restarts"] read all along the refusals

        def retried_three_times() -> bool:
            stats = rb.stats()
            seen.append(stats["restarts"])
            return stats["start_retries"] >= 3

        assert wait_until(retried_three_times, timeout=60), rb.stats()
        # Refused start-ups use no budget: before, max_restarts=1 was gone after one refusal (PollerCrashed).
        # The tries are one restart, counted once: a counter never goes down (it went 1 -> 0 -> 1 before).
        assert seen == sorted(seen) and seen[-1] == 1, seen
        store.kv_put("back", "p", tag={"status": "success"})
        down.unlink()  # the store is back
        assert rb.sample("p", batch_size=1, timeout=60).keys == ["back"]
        stats = rb.stats()
        assert stats["restarts"] == 1 and stats["poller_alive"]


def test_close_while_the_store_is_down_is_prompt(db, tmp_path):
    down = tmp_path / "down"
    rb = ReplayBuffer(source="poller.faults:down", source_kwargs=_store_down(db, down), poll_interval=0.02)
    down.touch()
    assert wait_until(lambda: rb.stats()["start_retries"] >= 1, timeout=60), rb.stats()
    started = time.monotonic()
    report = rb.close(timeout=1.0)
    assert time.monotonic() - started < 15  # generous: one start-up attempt under way at most
    assert report.stage in ("already-exited", "graceful", "terminated", "killed")


def test_a_source_unavailable_at_construction_is_still_a_startup_error(db, tmp_path):
    from poller import PollerStartupError

    down = tmp_path / "down"
    down.touch()
    with pytest.raises(PollerStartupError, match="ConnectionRefusedError") as info:
        ReplayBuffer(source="poller.faults:down", source_kwargs=_store_down(db, down))
    assert info.value.unavailable

