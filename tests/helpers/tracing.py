"""Which product modules run while one changed key moves, and which ones docs/how-it-works.md lists.

``python tests/helpers/tracing.py TRACE_FILE ARGS...`` runs ``python -m poller ARGS...`` recorded by
:func:`record_process`; a poller child (``-m poller.child``) started with ``tests/helpers/trace_site`` on its
``PYTHONPATH`` and ``REPLAY_TRACE_FILE`` set records itself the same way. A process records while the file
``TRACE_FILE + ".on"`` exists and writes ``{thread: [modules]}`` as JSON to ``TRACE_FILE`` when it is removed.
"""

from __future__ import annotations

import collections
import json
import os
import re
import runpy
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRACE_SITE = Path(__file__).resolve().parent / "trace_site"
# Modules that decide when the key moves, never what it is, as the page names them: the listing schedule,
# the control loop, the outbox's wake-up pipe, read-your-writes, argument checks, a heartbeat that may
# fall in the window (the poller's memory, the buffer's figures), how a buffer.verl call waits and the watch.
WHEN_ONLY = {"poller.duty": "duty.py", "poller.worker": "worker.py", "poller.common.wakeup": "common/wakeup.py",
             "buffer.sync": "sync.py", "buffer.checks": "buffer/checks.py",
             "poller.common.checks": "common/checks.py", "poller.common.procfs": "common/procfs.py",
             "buffer.metrics": "buffer/metrics.py", "buffer.verl.waiting": "verl/waiting.py",
             "poller.watch": "poller/watch.py"}
# What else the page names as running but no step: the record a packed listing travels in (TransferQueue's),
# and what buffer.verl's sample() reaches its buffer through (its options, its link to the buffer, the buffer).
ALSO_RUN = {"poller.sources.contract": "sources/contract.py", "buffer.verl.config": "verl/config.py",
            "buffer.verl.link": "verl/link.py", "buffer.replay": "replay.py"}


def _module(path: str) -> str:
    """``sources/sqlite.py`` -> ``poller.sources.sqlite``; ``wire/tags.py`` -> ``poller.wire.tags``."""
    if path.startswith(("sources/", "wire/", "common/")):
        path = "poller/" + path
    return path.removesuffix(".py").replace("/", ".")


def documented(column: int) -> tuple[list[list[str]], str]:
    """The modules each step of the page's table names (column 1: SQLite, 2: TransferQueue; "the same" is
    SQLite's), in order; and the section's text."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text.split("## One changed key, module by module", 1)[1].split("\n## ", 1)[0]
    steps = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            cell = cells[1] if cells[column] == "the same" else cells[column]
            steps.append([_module(path) for path in re.findall(r"`([\w/]+/\w+\.py)`", cell)])
    return steps, section


class Recorder:
    """The product modules whose code each thread of this process runs while :meth:`recording` is set, and how
    often each was entered: called from another module (or resumed from one)."""

    def __init__(self) -> None:
        self.modules: dict[str, collections.Counter[str]] = {}
        self.recording = threading.Event()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and self.recording.is_set():
            module = frame.f_globals.get("__name__") or ""
            if module.startswith(("poller", "buffer")):
                caller = frame.f_back
                entered = caller is None or caller.f_globals.get("__name__") != module
                # A module that ran but was not entered (a loop already running in it) is kept at 0.
                entries = self.modules.setdefault(threading.current_thread().name, collections.Counter())
                entries[module] += entered


Entries = dict[str, dict[str, int]]  # thread -> module -> times entered


def trace_one_changed_key(tmp_path: Path, poll_interval: float = 0.05) -> tuple[Entries, Entries]:
    """Carry one key whose tags changed in a SQLite store to ``ReplayBuffer.sample()`` through a real poller
    process (this file as its entry, recording it) and a real buffer (recorded in this process); return what each
    process's threads entered meanwhile (the writer's thread left out). Imports the trainer's package only here:
    the poller child runs this file too."""
    import signal
    import subprocess

    from buffer import ReplayBuffer
    from poller.sources.sqlite import SqliteSource
    from tests.conftest import wait_until

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
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(trace_file),
                                  "run", "--source", "poller.sources.sqlite:SqliteSource",
                                  "--source-kwargs", json.dumps({"path": path}), "--connect", buffer.endpoint,
                                  "--poll-interval", str(poll_interval)], env={**os.environ, "PYTHONPATH": str(ROOT)})
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
    trained = {thread: dict(entries) for thread, entries in trainer.modules.items() if thread != "writer"}
    return json.loads(trace_file.read_text()), trained


def record_process(trace_file: str) -> None:
    """Record every thread of this process while ``trace_file + ".on"`` exists; write the record when it is
    removed (an embedded poller ends with ``os._exit``: no exit handler would run)."""
    recorder = Recorder()
    flag = trace_file + ".on"

    def watch() -> None:
        while True:
            if os.path.exists(flag):
                recorder.recording.set()
            elif recorder.recording.is_set():
                recorder.recording.clear()
                with open(trace_file + ".part", "w") as out:
                    json.dump({thread: dict(entries) for thread, entries in recorder.modules.items()}, out)
                os.replace(trace_file + ".part", trace_file)
            time.sleep(0.002)

    threading.Thread(target=watch, name="trace-watch", daemon=True).start()
    threading.setprofile(recorder.profile)
    sys.setprofile(recorder.profile)


if __name__ == "__main__":
    record_process(sys.argv[1])
    sys.argv = ["poller", *sys.argv[2:]]
    runpy.run_module("poller", run_name="__main__", alter_sys=True)
