"""The poller's launch: a lean child that still behaves like ``spawn``."""

from __future__ import annotations

import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Iterator

import pytest

from buffer import ReplayBuffer
from buffer.process import wait
from poller import PollerProcess, PollerStartupError
from poller.wire.errors import RemoteTraceback
from tests.conftest import alive as _alive

HELPERS = "tests.helpers.sources"


def test_the_exec_child_imports_neither_multiprocessing_nor_the_parents_main():
    with ReplayBuffer(source=f"{HELPERS}:ReportsModules", poll_interval=0.05) as rb:
        loaded = {name: tags["loaded"] for name, tags in rb.snapshot("modules").items()}
    assert loaded == {"multiprocessing": False, "__mp_main__": False, "dataclasses": False}


def test_the_child_sees_the_parents_sys_path(tmp_path: Path):
    (tmp_path / "path_only_source.py").write_text(
        "class Source:\n    def kv_list(self):\n        return {'p': {'k': {'status': 'success'}}}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with ReplayBuffer(source="path_only_source:Source", poll_interval=0.05) as rb:
            assert rb.snapshot("p") == {"k": {"status": "success"}}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("path_only_source", None)


def test_a_callable_the_child_cannot_unpickle_is_a_startup_error(tmp_path: Path):
    module = tmp_path / "vanishing_source.py"
    module.write_text("class Source:\n    def kv_list(self):\n        return {}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import vanishing_source  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    module.unlink()
    try:
        with pytest.raises(PollerStartupError, match="ModuleNotFoundError") as info:
            ReplayBuffer(source=vanishing_source.Source, start_timeout=20)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        del info
    finally:
        sys.modules.pop("vanishing_source", None)


@pytest.fixture
def started_poller() -> Iterator[PollerProcess]:
    """A poller process on its own, started, streaming to a buffer without a poller of its own."""
    rb = ReplayBuffer(source=None, bind="tcp://127.0.0.1:0")
    process = PollerProcess(f"{HELPERS}:ReportsModules", endpoint=rb.endpoint, poll_interval=0.05)
    try:
        process.start(timeout=30)
        yield process
    finally:
        process.close(timeout=1)
        rb.close()


def test_a_poller_process_on_its_own_starts_and_closes_gracefully(started_poller: PollerProcess):
    pid = started_poller.pid
    assert pid is not None and _alive(pid)
    assert wait([started_poller.sentinel], 0) == []
    report = started_poller.close(timeout=5)
    assert report.stage == "graceful" and report.exitcode == 0
    assert not _alive(pid)


def test_join_gives_up_at_its_timeout_and_reaps_a_child_once_it_is_gone(started_poller: PollerProcess):
    pid = started_poller.pid
    assert pid is not None
    assert started_poller.join(0.01) is None and _alive(pid)
    os.kill(pid, signal.SIGKILL)
    assert started_poller.join(5.0) == -signal.SIGKILL  # reaped: no zombie left for close() to find
    report = started_poller.close(timeout=5)
    assert report.stage == "already-exited" and report.exitcode == -signal.SIGKILL


def test_wait_returns_what_is_readable_within_the_timeout():
    import os

    r, w = os.pipe()
    try:
        assert wait([r], 0) == []
        os.write(w, b"x")
        assert wait([r], 1.0) == [r]
    finally:
        os.close(r)
        os.close(w)


def test_an_unpicklable_source_raises_at_once_and_leaves_nothing():
    def local_factory():  # a local function: pickle cannot name it
        return None

    with pytest.raises((AttributeError, pickle.PicklingError), match="pickle"):
        ReplayBuffer(source=local_factory, start_timeout=20)


# -- what `ps` shows -----------------------------------------------------------------------------

def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


@pytest.mark.parametrize("pythonpath", [None, "/opt/the-users-own-path"])
def test_the_poller_and_its_watchdog_have_names_a_person_recognises(monkeypatch: pytest.MonkeyPatch,
                                                                    pythonpath: str | None):
    from tests.helpers.processes import children_of

    if pythonpath is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", pythonpath)
    with ReplayBuffer("tests.helpers.sources:ReportsEnvironment", poll_interval=0.05) as rb:
        pid = rb.stats()["poller_pid"]
        argv = _cmdline(pid)
        assert argv[0] == sys.executable
        assert argv[1:-2] in (["-m", "poller.child"], ["-P", "-m", "poller.child"])
        assert argv[-1] == f"poller:{rb.stats()['poller_name']}" and argv[-2].isdigit()
        # The short command, not `python -c <bootstrap> <the whole sys.path>`.
        assert len("\0".join(argv)) < 200 + len(sys.executable) and all("site-packages" not in a for a in argv)
        assert _comm(pid) == "replay-poller"
        watchdogs = [child for child in children_of(pid) if _comm(child) == "replay-watchdog"]
        assert len(watchdogs) == 1
        assert _cmdline(watchdogs[0]) == argv  # a fork: its name tells it apart
        # The launcher's variables are gone; the user's PYTHONPATH is as it was, for the source's own children.
        environment = rb.snapshot("environment")
        assert environment["PYTHONPATH"]["value"] == (pythonpath or "")
        assert environment["REPLAY_POLLER_SYS_PATH"]["value"] == ""
        assert environment["REPLAY_POLLER_SYS_PATH_PYTHONPATH"]["value"] == ""


def test_a_poller_process_on_its_own_is_named_too(tmp_path: Path):
    process = PollerProcess("poller.sources.sqlite:SqliteSource", endpoint="tcp://127.0.0.1:1",
                            source_kwargs={"path": str(tmp_path / "kv.db")})
    process.start(30)
    try:
        assert _comm(process.pid) == "replay-poller"
    finally:
        process.close(5)
