"""A trainer SIGKILLed while its poller is healthy, hung, frozen or mid-restart,
or SIGTERMed with its whole process group while the poller ignores SIGTERM,
leaves no orphan: the poller (or its watchdog) ends it within a second."""

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

from poller.common.procfs import state
from tests.conftest import alive, wait_until
from tests.helpers.processes import children_of

REPO = Path(__file__).resolve().parents[2]
SQLITE = "poller.sources.sqlite:SqliteSource"

_TRAINER = textwrap.dedent("""
    import json, sys, time
    from buffer import ReplayBuffer
    if __name__ == "__main__":
        rb = ReplayBuffer(source=sys.argv[1], source_kwargs=json.loads(sys.argv[2]), poll_interval=0.02,
                          max_restarts=3)
        print(rb.stats()["poller_pid"], flush=True)
        time.sleep(120)
""")


def _kill_trainer_and_watch(trainer: subprocess.Popen, victims: list[int], group_sigterm: bool) -> float:
    if group_sigterm:  # as `timeout` or `kill -TERM -PGID` do: trainer, poller and watchdog alike
        os.killpg(trainer.pid, signal.SIGTERM)
    else:
        trainer.kill()
    trainer.wait(10)
    started = time.monotonic()
    wait_until(lambda: not any(alive(pid) for pid in victims), timeout=10.0)
    return time.monotonic() - started


@pytest.mark.parametrize("case", ["healthy", "hung", "frozen", "mid-restart", "wedged, group SIGTERM"])
def test_no_orphan_one_second_after_the_trainer_is_sigkilled(tmp_path, case):
    db = str(tmp_path / "kv.db")
    marker = str(tmp_path / "marker")
    inner = {"inner": SQLITE, "inner_kwargs": {"path": db}}
    source, kwargs = {
        "healthy": (SQLITE, {"path": db}),
        "hung": ("poller.faults:hang", {**inner, "after": 1, "marker": marker}),
        "frozen": ("poller.faults:freeze", {**inner, "after": 1, "marker": marker}),
        "mid-restart": ("tests.helpers.sources:crash_then_hang_on_restart", {"marker": marker}),
        "wedged, group SIGTERM": ("poller.faults:ignore_sigterm", {"after": 1, "marker": marker}),
    }[case]
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), source, json.dumps(kwargs)], stdout=subprocess.PIPE,
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    victims: list[int] = []
    try:
        first = int(trainer.stdout.readline())
        victims.append(first)
        if case != "healthy":
            assert wait_until(lambda: os.path.exists(marker), timeout=30), f"the {case} state was never reached"
        if case == "frozen":
            assert wait_until(lambda: state(first) == "T", timeout=10)
        if case == "mid-restart":
            assert wait_until(lambda: os.path.getsize(marker) > 0, timeout=10)
            with open(marker) as f:
                victims = [int(f.read())]  # the first one is dead; this restart is stuck building its source
        victims += [child for pid in victims for child in sorted(children_of(pid))]  # the watchdogs
        assert all(alive(pid) for pid in victims)
        took = _kill_trainer_and_watch(trainer, victims, group_sigterm=case.endswith("group SIGTERM"))
        survivors = [pid for pid in victims if alive(pid)]
        assert not survivors, f"{survivors} outlived the trainer"
        # The bound is 1 s; the margin is for a loaded machine.
        assert took < 1.5, f"the poller outlived its trainer by {took:.2f}s"
    finally:
        trainer.kill()
        trainer.wait(10)
        trainer.stdout.close()
        for pid in victims:
            if alive(pid):
                os.kill(pid, 9)
