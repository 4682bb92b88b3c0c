"""Shared fixtures. ``no_leaks`` (autouse) fails any test that leaves a child
process, a thread, a file descriptor or an ipc directory behind."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import leaks
from tests.helpers.processes import is_running

# Each run gets its own temporary directory (inherited by every child), so
# the ipc-directory check sees only this run's files, not another run's.
_RUN_TMP = tempfile.mkdtemp(prefix="replay-tests-")
os.environ["TMPDIR"] = _RUN_TMP
tempfile.tempdir = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import shutil

    shutil.rmtree(_RUN_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test that left a child process, thread, fd or ipc directory behind.

    Things that end asynchronously (a reaped child, a thread finishing its
    last statement) get a generous 5 s: the machine is shared and noisy.
    """
    before = leaks.snapshot()
    yield
    left = leaks.left_since(before)
    leaks.kill(left.children)
    if any(left):
        pytest.fail("leaked: " + left.describe())


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
