"""verl 0.9.1's own v1 trainer drives buffer.verl on a real TransferQueue, in every mode (issue 37).

verl's ``run_ppo`` starts Ray and its ``TaskRunnerV1.run`` does the rest: ``tq.init``, the trainer of the mode,
its ``fit`` with the mode's hooks (the hybrid rollout switch of separate_async with ``get_sampleable_count`` and
``wait_for_sampleable``), ``_balance_batch``, ``_compute_metrics`` and the clear of each batch, and verl's agent
loop worker writing prompt statuses and trajectories; only the model side is faked
(tests/integration/verl_loop_fakes.py). The sampler is the config's: ``custom_sampler`` ``pkg://buffer.verl`` /
``ReplayBuffer``, with no ``sampler_kwargs``, and once with them on hydra's command line.

All runs share one host and one Ray cluster (started once, ~10 s on 2 cores); each run also starts verl's
TaskRunner and agent loop worker actors (~25 s), then trains 3 steps. About 3 minutes in all. LLM calls fail at
a seeded 10%, so groups end as ``failure`` too (handed out in sync mode, evicted and refilled in the async ones).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

from tests.integration.verl_loop import SAMPLER_KWARGS_OVERRIDE, LoopHost, LoopRun, check, compose

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

FAILURES = 0.1
RUNS = [
    LoopRun("sync", "sync", failure_rate=FAILURES, seed=1),
    LoopRun("colocate_async", "colocate_async", failure_rate=FAILURES, seed=2),
    LoopRun("separate_async", "separate_async", failure_rate=FAILURES, seed=3),
    # sampler_kwargs the way docs/verl.md says to give them on the command line; with validation ("val").
    LoopRun("separate_async_kwargs", "separate_async", failure_rate=FAILURES, seed=4,
            sampler_kwargs=(SAMPLER_KWARGS_OVERRIDE,), validate=True),
]


@pytest.fixture(scope="module")
def loop() -> dict[str, Any]:
    """Every run's record, and what of Ray was still running after the host shut it down."""
    host = LoopHost(RUNS)
    records = host.results(lambda message: print(f"verl loop: {message}", file=sys.stderr, flush=True))
    return {"records": {record["settings"]["name"]: record for record in records}, "leftovers": host.leftovers()}


@pytest.mark.parametrize("run", RUNS, ids=[run.name for run in RUNS])
def test_every_batch_verls_loop_gets_from_buffer_verl_keeps_the_contract(loop: dict[str, Any], run: LoopRun) -> None:
    record = loop["records"][run.name]
    assert check(record) == []
    kinds = [call["kind"] for call in record["calls"]]
    assert all(call["sampler"].startswith("buffer.verl") for call in record["calls"]), "not buffer.verl's calls"
    if run.mode == "separate_async":
        # The hybrid switch ran: counts at each step's start, mini-batches and end, and a wait for sampleable
        # groups while the trainer's replicas were lent to rollout (after a validation, enough groups are
        # sampleable at the first step's start, and the trainer takes its replicas back without waiting).
        assert kinds.count("get_sampleable_count") >= 2 * run.steps, kinds
        assert run.validate or "wait_for_sampleable" in kinds, kinds
    else:
        assert set(kinds) == {"sample"}, kinds
    if run.validate:
        assert any(call["kind"] == "sample" and "val" in (call["args"] + list(call["kwargs"].values()))
                   for call in record["calls"])


def test_sampler_kwargs_given_on_hydras_command_line_reach_the_sampler(loop: dict[str, Any]) -> None:
    assert loop["records"]["separate_async_kwargs"]["poll_interval"] == 0.05
    assert loop["records"]["separate_async"]["poll_interval"] != 0.05  # buffer.verl's default, not the override


def test_after_the_runs_no_process_is_left(loop: dict[str, Any]) -> None:
    # Each run's TaskRunner and poller were gone after it (check() fails a run that left them); Ray's after all.
    assert loop["leftovers"] == []


@pytest.mark.parametrize("override, works", [
    (SAMPLER_KWARGS_OVERRIDE, True),
    ("++trainer.v1.sampler.sampler_kwargs.poll_interval=0.05", True),
    ("+trainer.v1.sampler.sampler_kwargs={poll_interval: 0.05}", True),
    # The key is not in verl's empty mapping, and a mapping replacing it is refused without a '+'.
    ("trainer.v1.sampler.sampler_kwargs.poll_interval=0.05", False),
    ("trainer.v1.sampler.sampler_kwargs={poll_interval: 0.05}", False),
])
def test_which_forms_of_sampler_kwargs_hydras_command_line_takes(override: str, works: bool) -> None:
    from hydra.errors import ConfigCompositionException

    if works:
        assert dict(compose([override]).trainer.v1.sampler.sampler_kwargs) == {"poll_interval": 0.05}
    else:
        with pytest.raises(ConfigCompositionException):
            compose([override])


def _broken(record: dict[str, Any], how: str) -> dict[str, Any]:
    """A copy of a passing ``record`` with one thing a faulty sampler could do."""
    broken = copy.deepcopy(record)
    first = next(call for call in broken["calls"] if call["kind"] == "sample")
    uid = first["keys"][0].split("_", 1)[0]
    selection = next(clear for clear in broken["clears"] if clear["by"] == "sampler" and uid in clear["keys"])
    if how == "running":
        selection["prompt_tags"][uid]["status"] = "running"
    elif how == "tag":
        del first["tags"][0]["seq_len"]
    elif how == "trajectory":
        del first["keys"][0], first["tags"][0]
    elif how == "twice":
        later = max(call["t1"] for call in broken["calls"]) + 1.0
        broken["calls"].append({**copy.deepcopy(first), "t0": later, "t1": later + 1.0})
        broken["clears"].append({**copy.deepcopy(selection), "t": later + 0.5})
    elif how == "unaccounted":
        broken["submits"].append({"partition": "train", "keys": ["never-seen"], "t": 0.0, "global_steps": [1]})
    return broken


@pytest.mark.parametrize("how, says", [
    ("running", "while its prompt was 'running'"),
    ("tag", "verl reads"),
    ("trajectory", "the store held"),
    ("twice", "handed out twice"),
    ("unaccounted", "unaccounted ['never-seen']"),
])
def test_the_checks_catch_what_a_faulty_sampler_would_do(loop: dict[str, Any], how: str, says: str) -> None:
    problems = check(_broken(loop["records"]["sync"], how))
    assert any(says in problem for problem in problems), problems
