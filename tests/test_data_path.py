"""The modules one changed key passes through are the ones docs/how-it-works.md lists.

A real poller process (traced by ``tests/helpers/traced_poller.py``) and a real buffer (traced in
this process) carry one key whose tags changed in a SQLite store, from the store to
``ReplayBuffer.sample()``. Every product module whose code runs meanwhile, on the poller's threads,
the buffer's receiver or the sampling call, must be one the SQLite column of the table names or
one the page names as scheduling or waking only; and every module the table names must run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "how-it-works.md"
TRACED_POLLER = ROOT / "tests" / "helpers" / "traced_poller.py"
# Modules that decide when the key moves, never what it is, as the page names them (checked below): the
# listing schedule, the control loop, the outbox's wake-up pipe, read-your-writes, argument checks, and a
# heartbeat that may fall in the window (the poller's memory, the buffer's figures).
WHEN_ONLY = {"poller.duty": "duty.py", "poller.worker": "worker.py", "poller.wire.wakeup": "wire/wakeup.py",
             "buffer.sync": "sync.py", "buffer.arguments": "buffer/arguments.py",
             "poller.wire.arguments": "wire/arguments.py", "poller.wire.procfs": "wire/procfs.py",
             "buffer.metrics": "buffer/metrics.py"}


def _module(path: str) -> str:
    """``sources/sqlite.py`` -> ``poller.sources.sqlite``; ``wire/tags.py`` -> ``poller.wire.tags``."""
    if path.startswith(("sources/", "wire/")):
        path = "poller/" + path
    return path.removesuffix(".py").replace("/", ".")


def _documented() -> tuple[list[list[str]], str]:
    """The table's SQLite column: the modules each step names, in order; and the section's text."""
    section = DOC.read_text().split("## One changed key, module by module", 1)[1].split("\n## ", 1)[0]
    steps = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            steps.append([_module(path) for path in re.findall(r"`([\w/]+/\w+\.py)`", cells[1])])
    return steps, section


def test_the_page_lists_at_most_twelve_modules_each_a_step_of_its_own() -> None:
    steps, section = _documented()
    stations = [names[0] for names in steps]
    assert 0 < len(stations) <= 12 and len(set(stations)) == len(stations), stations
    for name in WHEN_ONLY.values():
        assert f"`{name}`" in section, name


@pytest.mark.timeout(120)
def test_one_changed_key_runs_through_the_modules_the_page_lists(tmp_path: Path) -> None:
    steps, _ = _documented()
    documented = {name for names in steps for name in names}
    path = str(tmp_path / "kv.db")
    trace_file = tmp_path / "poller-trace.json"
    flag = Path(str(trace_file) + ".on")
    store = SqliteSource(path)
    store.kv_batch_put(["k0"], "train", tags=[{"status": "running", "global_steps": 1}])

    trainer: dict[str, set[str]] = {}
    recording = threading.Event()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set():
            module = frame.f_globals.get("__name__") or ""
            if module.startswith(("poller", "buffer")):
                trainer.setdefault(threading.current_thread().name, set()).add(module)

    threading.setprofile(profile)  # the receiver thread starts after this
    try:
        buffer = ReplayBuffer(None, bind="tcp://127.0.0.1:0")
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    child = None
    try:
        child = subprocess.Popen([sys.executable, str(TRACED_POLLER), str(trace_file), "run",
                                  "--source", "poller.sources.sqlite:SqliteSource",
                                  "--source-kwargs", json.dumps({"path": path}), "--connect", buffer.endpoint,
                                  "--interval", "0.05"], env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert wait_until(lambda: buffer.snapshot("train") == {"k0": {"status": "running", "global_steps": 1}},
                          timeout=30)

        flag.touch()
        recording.set()
        sys.setprofile(profile)
        try:
            writer = threading.Thread(target=store.kv_batch_put, name="writer",
                                      args=(["k0"], "train"), kwargs={"tags": [{"status": "success"}]})
            writer.start()
            writer.join(30)
            batch = buffer.sample("train", batch_size=1, timeout=30)
        finally:
            sys.setprofile(None)
            recording.clear()
            flag.unlink()
        assert batch.keys == ["k0"] and batch.tags[0]["status"] == "success"
    finally:
        if child is not None:
            child.send_signal(signal.SIGTERM)
            child.wait(30)
        buffer.close()
        store.close()
    assert child.returncode == 0
    poller = json.loads(trace_file.read_text())

    ran = set().union(*map(set, poller.values()))
    ran |= set().union(*(modules for thread, modules in trainer.items() if thread != "writer"))
    assert ran - WHEN_ONLY.keys() - documented == set(), "a module the page does not list handles the key"
    assert documented - ran == set(), "a module the page lists never ran"
    assert wait_until(lambda: not flag.exists(), timeout=1)
