"""The modules one changed key passes through are the ones docs/how-it-works.md lists.

A real poller process (recorded by ``tests/helpers/tracing.py``) and a real buffer (recorded in this
process) carry one key whose tags changed in a SQLite store, from the store to
``ReplayBuffer.sample()``. Every product module whose code runs meanwhile, on the poller's threads,
the buffer's receiver or the sampling call, must be one the SQLite column of the table names or
one the page names as deciding only when the key moves; and every module the table names must run.
(tests/integration/test_tq_verl.py checks the TransferQueue column the same way.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from buffer import ReplayBuffer
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until
from tests.helpers.tracing import ALSO_RUN, ROOT, WHEN_ONLY, Recorder, documented


@pytest.mark.parametrize("column", [1, 2])
def test_the_page_lists_at_most_twelve_modules_each_a_step_of_its_own(column: int) -> None:
    steps, section = documented(column)
    stations = [names[0] for names in steps]
    assert 0 < len(stations) <= 12 and len(set(stations)) == len(stations), stations
    for name in [*WHEN_ONLY.values(), *ALSO_RUN.values()]:
        assert f"`{name}`" in section, name


@pytest.mark.timeout(120)
def test_one_changed_key_runs_through_the_modules_the_page_lists(tmp_path: Path) -> None:
    steps, _ = documented(1)
    listed = {name for names in steps for name in names}
    path = str(tmp_path / "kv.db")
    trace_file = tmp_path / "poller-trace.json"
    flag = Path(f"{trace_file}.on")
    store = SqliteSource(path)
    store.kv_batch_put(["k0"], "train", tags=[{"status": "running", "global_steps": 1}])
    trainer = Recorder()
    threading.setprofile(trainer.profile)  # the receiver thread starts after this
    try:
        buffer = ReplayBuffer(None, bind="tcp://127.0.0.1:0")
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    child = None
    try:
        child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "tracing.py"), str(trace_file),
                                  "run", "--source", "poller.sources.sqlite:SqliteSource",
                                  "--source-kwargs", json.dumps({"path": path}), "--connect", buffer.endpoint,
                                  "--poll-interval", "0.05"], env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert wait_until(lambda: buffer.snapshot("train") == {"k0": {"status": "running", "global_steps": 1}},
                          timeout=30)
        flag.touch()
        trainer.recording.set()
        sys.setprofile(trainer.profile)
        try:
            writer = threading.Thread(target=store.kv_batch_put, name="writer",
                                      args=(["k0"], "train"), kwargs={"tags": [{"status": "success"}]})
            writer.start()
            writer.join(30)
            batch = buffer.sample("train", batch_size=1, timeout=30)
        finally:
            sys.setprofile(None)
            trainer.recording.clear()
            flag.unlink()
        assert batch.keys == ["k0"] and batch.tags[0]["status"] == "success"
        assert wait_until(trace_file.exists, timeout=10)
    finally:
        if child is not None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
        buffer.close()
        store.close()
    assert child.returncode == 0
    ran = set().union(*map(set, json.loads(trace_file.read_text()).values()))
    ran |= set().union(*(modules for thread, modules in trainer.modules.items() if thread != "writer"))
    assert ran - WHEN_ONLY.keys() - listed == set(), "a module the page does not list handles the key"
    assert listed - ran == set(), "a module the page lists never ran"
