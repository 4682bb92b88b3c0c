"""The poller's launch: a lean child that still behaves like ``spawn``."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from buffer import ReplayBuffer
from poller import PollerProcess, PollerStartupError
from poller.errors import RemoteTraceback
from poller.launch import wait
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


def test_a_poller_process_on_its_own_starts_and_closes_gracefully():
    rb = ReplayBuffer(source=None, bind="tcp://127.0.0.1:0")
    process = PollerProcess(f"{HELPERS}:ReportsModules", endpoint=rb.endpoint, interval=0.05)
    try:
        process.start(timeout=30)
        pid = process.pid
        assert pid is not None and _alive(pid)
        assert wait([process.sentinel], 0) == []
        report = process.close(timeout=5)
        assert report.stage == "graceful" and report.exitcode == 0
        assert not _alive(pid)
    finally:
        process.close(timeout=1)
        rb.close()


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
