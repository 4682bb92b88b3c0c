"""An explicit ``bind="ipc://PATH"``: one live buffer per path; a stale file is reused."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from buffer import ReplayBuffer
from buffer.access import EndpointInUseError
from tests.conftest import wait_until

SQLITE = "poller.sources.sqlite:SqliteSource"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory short enough for a socket path (sun_path holds 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="bind-", dir="/tmp")
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


def test_a_too_long_path_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="longer than"):
        ReplayBuffer(bind=f"ipc://{tmp_path}/{'x' * 120}")


def test_a_second_buffer_on_a_live_ipc_path_is_refused(short_dir: Path, store) -> None:
    """Regression: the second buffer bound too, and took the first one's stream."""
    path = short_dir / "stream.sock"
    store.kv_put("k1", "p", tag={"v": 1})
    with ReplayBuffer(SQLITE, source_kwargs={"path": store.path}, poll_interval=0.05, bind=f"ipc://{path}") as first:
        with pytest.raises(EndpointInUseError, match=str(path)):
            ReplayBuffer(bind=f"ipc://{path}")
        # The first one still has its stream.
        store.kv_put("k2", "p", tag={"v": 2})
        assert wait_until(lambda: "k2" in first.snapshot("p"), timeout=10)


def test_a_stale_socket_file_is_replaced(short_dir: Path) -> None:
    path = short_dir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, as a killed process leaves it
    assert path.is_socket()
    with ReplayBuffer(bind=f"ipc://{path}") as rb:
        assert rb.endpoint == f"ipc://{path}"


def test_a_path_that_is_not_a_socket_is_never_removed(short_dir: Path) -> None:
    path = short_dir / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(EndpointInUseError, match="not a socket"):
        ReplayBuffer(bind=f"ipc://{path}")
    assert path.read_text() == "keep me"
    assert os.path.exists(path)


def test_a_second_buffer_on_a_tcp_address_in_use_is_refused() -> None:
    first = ReplayBuffer(bind="tcp://127.0.0.1:0")
    try:
        with pytest.raises(EndpointInUseError, match=r"address is in use"):
            ReplayBuffer(bind=first.endpoint)
        assert first.stats()["endpoint"] == first.endpoint  # the first one is untouched
    finally:
        first.close()
