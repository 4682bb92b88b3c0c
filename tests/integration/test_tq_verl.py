"""buffer.verl on a real TransferQueue: verl's rules as its trainer and agent loop write them, built both ways,
tq.close() before the sampler is dropped, a SIGKILLed trainer, and the verl v1 example.

The scenarios run inside the store host (tests/integration/verl_scenarios.py), where TransferQueue is live as in
a verl trainer; the pollers they start are children of the host and are checked there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import alive, wait_until
from tests.integration.trainers import sigkill_after_start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = "tests.integration.verl_scenarios"


def run(store: Any, name: str) -> dict[str, Any]:
    return store.call("run", f"{SCENARIOS}:{name}", timeout=240)


def test_sync_rules_built_the_custom_path_way(store):
    out = run(store, "sync_rules")
    # The waiting sample returned on the change (the poller lists every 50 ms), not after seconds of sleeps.
    assert out["latency_s"] < 5.0


def test_a_waiting_sample_has_its_prompts_watched_and_their_finish_listed_at_once(store):
    out = run(store, "watched_finish")
    assert out["reads_before"] >= 1 and out["watch_listings"] >= 1, out
    assert out["keys"] == out["group"], out


def test_between_calls_transferqueue_is_not_listed_and_a_call_lists_it_first(store):
    out = run(store, "between_calls")
    assert out["idle_polls"] == 0, out
    assert (out["first"], out["second"]) == (1, 2) and out["polls_for_the_call"] == 1, out


def test_async_drop_failure_refill_and_wait_built_with_verls_full_signature(store):
    out = run(store, "async_rules")
    assert sum(out["refill_calls"]) == 3


def test_sync_dapo_reads_extra_fields_from_transferqueue_and_failed_groups_are_refilled(store):
    out = run(store, "dapo_rules")
    assert out["metrics"]["training/filter_groups/evicted_samples"] == 1


def test_tq_close_before_the_sampler_is_dropped_neither_hangs_nor_kills(store):
    held = run(store, "hold_sampler")
    assert held["keys"] == 1
    store.call("close_tq")  # verl's finally: the store goes first; the sampler is never closed
    out = run(store, "drop_sampler")
    assert out["outcome"].startswith("TimeoutError") and out["waited_s"] < 30, out
    assert out["poller_alive_after_tq_close"] and out["poller_gone"], out


def test_a_reinitialised_transferqueue_is_followed_at_once_and_its_old_keys_are_gone(store):
    # verl's trainer may tq.close() and tq.init() again (a new controller on a new port); verl's own sampler,
    # held across it, lists the new store at its next call. So must buffer.verl, and show nothing of the old one.
    held = run(store, "hold_across_reinit")
    assert held["old_keys"] >= 3, held
    store.call("close_tq")
    store.call("ensure_open")  # tq.init() again: a new controller
    out = run(store, "sample_after_reinit")
    assert out["outcome"] == "returned", out
    assert out["waited_s"] < 30, out
    assert out["batch"] == out["expected"] and len(out["batch"]) == 2, out  # verl 0.9.1's own batch
    assert {key.split("_")[0] for key in out["batch"]} == {out["fresh"]}, out
    assert out["old_keys_in_batch"] == [], out
    # The buffer holds what the new store holds (the trajectories; the prompt it handed out is cleared).
    assert out["keys_held"] == out["keys_in_new_store"] == 2, out
    # A deliberate switch to the new controller: the old poller stopped, no crash restart counted.
    assert out["new_poller"] and out["old_poller_gone"], out
    assert out["restarts"] == 0 and out["switches"] == 1, out


_TRAINER = textwrap.dedent("""
    import json, sys, time
    from buffer.verl import ReplayBuffer
    rb = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                      max_off_policy_strategy="drop", sampler_kwargs={"source_kwargs": json.loads(sys.argv[1])})
    rb.get_sampleable_count(0, "train")  # starts the poller
    print(json.dumps({"poller_pid": rb.stats()["poller_pid"]}), flush=True)
    time.sleep(600)
""")


def test_a_sigkilled_trainer_leaves_no_poller(store):
    poller_pid = sigkill_after_start(_TRAINER, store.call("kwargs"))["poller_pid"]
    assert wait_until(lambda: not alive(poller_pid), timeout=10)
    assert store.call("list", "train") is not None  # the controller serves on


def test_the_verl_v1_example_on_transferqueue():
    tmp = tempfile.mkdtemp(prefix="tq-verl-", dir="/tmp")
    try:
        result = subprocess.run([sys.executable, "examples/verl_v1_trainer.py", "--store", "transferqueue",
                                 "--mode", "colocate_async", "--steps", "2"], cwd=REPO,
                                env=dict(os.environ, TMPDIR=tmp), capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["trainer-built", "step", "step", "fit-done", "store-closed"]
    # tq.close() ran with the sampler still alive; its poller is gone with the trainer.
    assert not alive(events[1]["poller_pid"])


def test_verl_0_9_1_loads_and_builds_the_sampler_itself(store):
    # verl's load_extern_type("pkg://buffer.verl", ...) and PPOTrainer._build_replay_buffer, run as installed.
    out = run(store, "built_by_verl")
    assert set(out) == {"sync", "colocate_async"}, out


def test_one_finished_prompt_runs_through_the_modules_the_page_lists(store, tmp_path):
    """docs/how-it-works.md's TransferQueue column, against what runs (tests/test_data_path.py does SQLite's).
    Besides the steps, only modules the page names as deciding when the key moves, or as running beside the
    path (buffer.verl reaching its buffer, its options, the record a packed listing travels in), may run."""
    from tests.helpers.tracing import ALSO_RUN, WHEN_ONLY, documented

    steps, section = documented(2)
    listed = {name for names in steps for name in names}
    assert all(f"`{name}`" in section for name in ALSO_RUN.values())
    out = store.call("run", f"{SCENARIOS}:traced_sample", timeout=240, trace_file=str(tmp_path / "trace.json"))
    assert len(out["keys"]) == 1 and out["closed"] == "graceful", out  # the group's one trajectory
    ran = set().union(*map(set, out["poller"].values()), *map(set, out["trainer"].values()))
    assert ran - WHEN_ONLY.keys() - ALSO_RUN.keys() - listed == set(), json.dumps(out)
    assert listed - ran == set(), json.dumps(out)


def test_a_sample_after_the_controller_died_says_which_call_timed_out_and_how_long_the_store_is_silent(store):
    # It read "sync() timed out after 5.13e-05s (timeout=0.0s) ... after 15.0s": an inner wait, and not how long
    # the store had not answered, which docs/transferqueue.md promises.
    try:
        out = run(store, "sample_after_the_controller_died")
    finally:
        store.call("after_controller_killed")
    message = out["message"]
    assert message.startswith("sample(") and "timed out after 15s" in message, message
    assert "has not answered for" in message and "timeout=0" not in message, message
    assert out["waited_s"] < 30, out
