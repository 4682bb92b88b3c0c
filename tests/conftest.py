"""Shared fixtures. ``no_leaks`` (autouse) fails any test that leaves a child
process, a thread, a file descriptor or an ipc directory behind."""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from poller.procfs import children_of, is_running

# Each run gets its own temporary directory (inherited by every child), so
# the ipc-directory check sees only this run's files, not another run's.
_RUN_TMP = tempfile.mkdtemp(prefix="replay-tests-")
os.environ["TMPDIR"] = _RUN_TMP
tempfile.tempdir = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import shutil

    shutil.rmtree(_RUN_TMP, ignore_errors=True)


# Settling time for things that end asynchronously (a reaped child, a thread
# finishing its last statement). Generous: the machine is shared and noisy.
_SETTLE_S = 5.0


def _children() -> set[int]:
    return children_of(os.getpid())


def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def _ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "replay-*")))


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


def _ignorable_fd(entry: str) -> bool:
    # multiprocessing opens a resource-tracker pipe and shared-memory areas
    # once per process and keeps them for its lifetime by design.
    target = entry.split("->", 1)[1]
    return target.startswith("/dev/shm/") or "(deleted)" in target


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    import multiprocessing.resource_tracker as rt

    children, fds, dirs, threads = _children(), _fds(), _ipc_dirs(), _threads()
    yield
    deadline = time.monotonic() + _SETTLE_S
    tracker_fd = getattr(rt._resource_tracker, "_fd", None)
    while True:
        new_children = _children() - children
        tracker_pid = getattr(rt._resource_tracker, "_pid", None)
        new_children.discard(tracker_pid)  # type: ignore[arg-type]
        new_threads = _threads() - threads
        new_fds = {e for e in _fds() - fds if not _ignorable_fd(e)
                   and not (tracker_fd is not None and e.startswith(f"{tracker_fd}->"))}
        new_dirs = _ipc_dirs() - dirs
        if not (new_children or new_threads or new_fds or new_dirs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    leaks = []
    if new_children:
        leaks.append(f"child processes {sorted(new_children)}")
        for pid in new_children:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    if new_threads:
        leaks.append(f"threads {sorted(t.name for t in new_threads)}")
    if new_fds:
        leaks.append(f"fds {sorted(new_fds)}")
    if new_dirs:
        leaks.append(f"ipc dirs {sorted(new_dirs)}")
    if leaks:
        pytest.fail("leaked: " + "; ".join(leaks))


@pytest.fixture
def db(tmp_path: Path) -> str:
    """Path of a fresh SQLite store."""
    return str(tmp_path / "kv.db")


@pytest.fixture
def store(db: str) -> Iterator["SqliteSource"]:  # noqa: F821
    from poller.sources.sqlite import SqliteSource

    source = SqliteSource(db)
    yield source
    source.close()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until true or ``timeout``; return the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(interval)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return is_running(pid)
