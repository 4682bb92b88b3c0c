"""close() from everywhere, a trainer whose constructor fails at each step, and
Ctrl-C in sample(): every path ends, raises the right exception, leaks nothing."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from buffer import BufferClosed, ReplayBuffer
from poller import PollerProcess, PollerStartupError
from poller.sources.sqlite import SqliteSource
from poller.wire.errors import RemoteTraceback
from tests.conftest import alive, wait_until
from tests.helpers.processes import close_from_threads

SQLITE = "poller.sources.sqlite:SqliteSource"
REPO = Path(__file__).resolve().parents[2]


# -- a trainer-like constructor that fails at each of its steps ----------------------------------------

class _Interrupted(Exception):
    """Raised by a timer signal while the buffer's constructor waits for READY."""


class _Trainer:
    """Like a verl trainer: store, then buffer, then the rest; any step may fail."""

    def __init__(self, db: str, fail_at: str) -> None:
        if fail_at == "before":
            raise RuntimeError("config invalid")
        self.store = SqliteSource(db)
        source, kwargs = SQLITE, {"path": db}
        if fail_at == "during:factory":
            source, kwargs = "tests.helpers.sources:failing_factory", {"url": "kv://nowhere"}
        if fail_at == "during:interrupt":
            source, kwargs = "poller.faults:slow", {"start_s": 60}
        self.replay_buffer = ReplayBuffer(source=source, source_kwargs=kwargs, poll_interval=0.05, start_timeout=30)
        if fail_at == "after":
            raise RuntimeError("model init failed")


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted("stopped while starting")


@pytest.mark.parametrize("fail_at, error, match", [
    ("before", RuntimeError, "config invalid"),
    ("during:factory", PollerStartupError, "cannot connect to store"),
    ("during:interrupt", _Interrupted, "stopped while starting"),
    ("after", RuntimeError, "model init failed"),
])
def test_a_trainer_failing_at_any_step_raises_its_own_error_and_leaks_nothing(db, fail_at, error, match):
    previous = signal.signal(signal.SIGALRM, _raise_interrupted)
    if fail_at == "during:interrupt":
        signal.setitimer(signal.ITIMER_REAL, 1.0)
    trainer = None
    started = time.monotonic()
    caught: BaseException | None = None
    try:
        try:  # the trainer's own guard, which cannot help: trainer stays None
            trainer = _Trainer(db, fail_at)
        finally:
            if trainer is not None:
                trainer.replay_buffer.close()
    except BaseException as exc:  # noqa: BLE001 - checked below
        caught = exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert isinstance(caught, error) and re.search(match, str(caught)), repr(caught)
    assert time.monotonic() - started < 20  # the interrupted start did not wait out its 60 s factory
    if fail_at == "during:factory":
        assert isinstance(caught.__cause__, RemoteTraceback)
    # What is left (the half-built trainer: its store and its buffer) is
    # reachable only from the traceback. Dropping it must close the buffer
    # (its finalizer) and the store; the no_leaks fixture checks nothing is left.
    traceback.clear_frames(caught.__traceback__)
    del caught
    gc.collect()


# -- close() from everywhere ------------------------------------------------------------------------------

def _stuck_in_a_poll(tmp_path: Path, close_timeout: float) -> ReplayBuffer:
    """A buffer whose poller ignores SIGTERM and is stuck in its second poll: close() must kill it."""
    marker = tmp_path / "stuck"
    rb = ReplayBuffer(source="poller.faults:ignore_sigterm", source_kwargs={"after": 1, "marker": str(marker)},
                      poll_interval=0.01, close_timeout=close_timeout)
    assert wait_until(marker.exists, timeout=10)
    return rb


def test_concurrent_closes_of_a_poller_that_must_be_killed_all_get_the_one_report(tmp_path):
    rb = _stuck_in_a_poll(tmp_path, close_timeout=0.3)
    reports = close_from_threads(rb, 6, timeout=20)
    assert len(reports) == 6 and all(r is reports[0] for r in reports)
    assert reports[0].stage == "killed" and reports[0].exitcode == -signal.SIGKILL
    assert rb.close() is reports[0]  # and twice


def test_close_from_a_signal_handler_while_sample_waits(db):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.02)
    rb.add("t", {"k": {"global_steps": 1, "status": "running"}})
    reports: list = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: reports.append(rb.close()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(BufferClosed):
            rb.sample("t", global_steps=1, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert reports and reports[0].stage == "graceful" and reports[0].drained
    assert rb.close() is reports[0]


def test_close_from_a_signal_handler_that_interrupts_close_does_not_deadlock(tmp_path):
    rb = _stuck_in_a_poll(tmp_path, close_timeout=0.5)
    nested: list = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: nested.append(rb.close()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # fires inside the outer close's first wait
        report = rb.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert nested and nested[0].stage == "closing"  # told, not blocked on itself
    assert report.stage == "killed"
    assert rb.close() is report


def test_close_during_a_restart(tmp_path):
    # Every process crashes at its second poll; a restarted one is still
    # starting (or backing off) when close() comes.
    rb = ReplayBuffer(source="poller.faults:crash", source_kwargs={"how": "sigkill", "after": 1},
                      poll_interval=0.02, max_restarts=50)
    assert wait_until(lambda: rb.stats()["restarts"] >= 2, timeout=30)
    report = rb.close(timeout=2)
    assert report.stage in ("graceful", "already-exited", "killed")
    pid = rb._core.process.pid if rb._core.process else None
    assert pid is None or not alive(pid)


def test_close_during_start_up_ends_both(tmp_path):
    process = PollerProcess("poller.faults:slow", endpoint="tcp://127.0.0.1:9", source_kwargs={"start_s": 60})
    errors: list = []

    def start() -> None:
        try:
            process.start(timeout=30)
        except PollerStartupError as exc:
            errors.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    assert wait_until(lambda: process.pid is not None, timeout=10)
    report = process.close(timeout=0.5)
    starter.join(10)
    assert not starter.is_alive()
    assert errors and "closed while starting" in str(errors[0])
    # Until its source is built a poller keeps SIGTERM's default: one wait, not two.
    assert report.stage == "terminated" and report.exitcode == -signal.SIGTERM
    assert not alive(process.pid)


# -- Ctrl-C while sample() waits ---------------------------------------------------------------------------

_CTRL_C = textwrap.dedent("""
    import sys
    from buffer import ReplayBuffer
    if __name__ == "__main__":
        rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": sys.argv[1]},
                          poll_interval=0.02)
        rb.add("t", {"k": {"global_steps": 1, "status": "running"}})
        print("waiting", flush=True)
        try:
            rb.sample("t", global_steps=1, timeout=60)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        report = rb.close()
        print(report.stage, report.drained, flush=True)
""")


def test_ctrl_c_while_sample_waits_raises_keyboard_interrupt_and_close_still_works(tmp_path, db):
    script = tmp_path / "trainer.py"
    script.write_text(_CTRL_C)
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches the
    # trainer and its poller alike.
    trainer = subprocess.Popen([sys.executable, str(script), db], stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        assert trainer.stdout.readline().strip() == "waiting"
        time.sleep(0.2)
        os.killpg(trainer.pid, signal.SIGINT)
        out, _ = trainer.communicate(timeout=30)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(10)
        trainer.stdout.close()
    assert out.split("\n")[:2] == ["KeyboardInterrupt", "graceful True"], out
    assert trainer.returncode == 0


def test_a_start_cut_short_by_its_owner_leaves_nothing(tmp_path):
    """The supervisor's way to honour a close while a child starts: PollerProcess.start(abort_fd=...)."""
    from poller.common.wakeup import WakePipe

    process = PollerProcess("poller.faults:slow", endpoint="tcp://127.0.0.1:9", source_kwargs={"start_s": 60})
    abort = WakePipe()
    try:
        threading.Timer(0.5, abort.poke).start()
        started = time.monotonic()
        with pytest.raises(PollerStartupError, match="closed while starting"):
            process.start(timeout=30, abort_fd=abort.read_fd)
        assert time.monotonic() - started < 20  # not the 30 s start timeout (nor the 60 s factory)
        assert process.pid is not None and not alive(process.pid)
        assert process.close().stage in ("killed", "already-exited")
    finally:
        abort.close()
