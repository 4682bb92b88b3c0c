"""``python -m bench --only verl-loop``: verl 0.9.1's own v1 trainer loop with buffer.verl beside verl's sampler.

The loop is verl's (``run_ppo``, ``TaskRunnerV1.run``, ``fit`` and the mode's hooks, verl's agent loop worker
writing groups) on a real TransferQueue, with only the model side faked: the harness of
tests/integration/verl_loop.py, which the integration test also runs. Each run trains the same steps of one mode
with one sampler, chosen in the config: buffer.verl (``custom_sampler`` ``pkg://buffer.verl`` / ``ReplayBuffer``, no
``sampler_kwargs``) or verl's built-in one (no custom sampler). Both samplers meet the same seeded LLM delays
(0.1-1.2 s per call, drawn from the prompt and the session) and the same 0.3 s "training" per update.

Every mode runs at two store sizes: the loop's own keys only, and with :data:`OTHER_KEYS` keys nobody samples put
into ``"train"`` before ``fit`` (trajectories of groups whose prompt is gone: what a trainer that died between the
sampler's clear of a batch's prompts and its own clear of the trajectories leaves; both samplers list them, neither
hands them out, verl's resume does not re-issue them).

Per mode and size, for each sampler: the wall time of ``fit``; the sampler's time per step (the time inside
``sample``, ``get_sampleable_count`` and ``wait_for_sampleable``, summed over a step: from the trainer's clear of one
batch to its clear of the next), p50 and p99 over the steps; the TransferQueue controller's CPU per step (its actor
process's utime + stime from ``/proc`` over ``fit``); and buffer.verl ÷ verl. A second table shows where each
sampler's time goes by kind of call. The runs of one mode and size are back to back, verl's sampler first, in one
Ray cluster; each run has a controller of its own (``tq.init`` in the TaskRunner).
"""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any, Callable

from .report import Goal, Table, percentile

MODES = ("sync", "colocate_async", "separate_async")
OTHER_KEYS = 100_000
SAMPLERS = ("verl", "buffer.verl")
STEPS = 20
QUICK_STEPS = 5
#: Goals (issue 37): fit wall ≤ FIT_RATIO × verl's; sampler p50 ≤ SAMPLER_RATIO × verl's where verl's p50 > FAST,
#: else ≤ verl's + SLACK.
FIT_RATIO = 0.9
SAMPLER_RATIO = 0.5
FAST = 0.1
SLACK = 0.05
_RUN_TIMEOUT = 900.0  # per run: verl's start-up in two actors, the 100k preload and 20 steps on a loaded machine


def plan(quick: bool) -> tuple[int, tuple[int, ...]]:
    """Steps per run and the sizes (other keys) of the store: 20 steps at both sizes, or 5 on the small store."""
    return (QUICK_STEPS, (0,)) if quick else (STEPS, (0, OTHER_KEYS))


def run(progress: Callable[[str], None], quick: bool) -> list[Table]:
    """The two ``verl-loop`` tables; empty, with the reason, without TransferQueue, Ray or verl."""
    steps, sizes = plan(quick)
    table = Table("VL", f"verl 0.9.1's own v1 trainer loop: buffer.verl beside verl's sampler, {steps} steps per run, "
                        "4 prompts × 2 trajectories per step, real TransferQueue",
                  ["mode", "other keys", "fit wall s: verl", "buffer.verl", "÷", "sampler s/step p50: verl",
                   "buffer.verl", "÷", "sampler s/step p99: verl", "buffer.verl", "controller CPU s/step: verl",
                   "buffer.verl", "÷"])
    kinds = Table("VL2", "verl's own loop: the samplers' time by kind of call (median ms, calls)",
                  ["mode", "other keys", "sampler", "first call", "sample", "count after a sample", "other counts",
                   "wait_for_sampleable", "calls per step"])
    missing = [m for m in ("transfer_queue", "ray", "verl", "hydra") if importlib.util.find_spec(m) is None]
    if missing:
        reason = (f"skipped: {', '.join(missing)} not installed (`make bench` installs TransferQueue, Ray and verl "
                  "0.9.1)")
        progress(f"verl-loop: {reason}")
        table.title += " (skipped)"
        table.notes.append(reason)
        return [table, kinds]

    from tests.integration.verl_loop import LoopHost, LoopRun, completed

    runs = [LoopRun(f"{mode}-{size}-{sampler}", mode, sampler=sampler, steps=steps, preload=size, seed=7,
                    snapshot_clears=False)
            for mode in MODES for size in sizes for sampler in SAMPLERS]
    host = LoopHost(runs, run_timeout=_RUN_TIMEOUT)
    records = {r["settings"]["name"]: r for r in host.results(lambda m: progress(f"verl-loop: {m}"))}
    leftovers = host.leftovers()
    for mode in MODES:
        for size in sizes:
            figures = {}
            for sampler in SAMPLERS:
                record = records[f"{mode}-{size}-{sampler}"]
                problems = completed(record)
                if problems:
                    raise RuntimeError(f"verl-loop: {mode}, {size:,} other keys, {sampler}: {problems}")
                figures[sampler] = measure(record)
                kinds.add(mode, f"{size:,}", sampler, *by_kind(record))
            _row(table, mode, size, figures["verl"], figures["buffer.verl"])
    table.notes += [
        "fit wall: from trainer.fit()'s start (after the agent loop manager is built) to tq.close() in "
        "TaskRunnerV1.run's finally; sampler s/step: the time inside the sampler's public calls, per step (from the "
        "trainer's clear of one batch to its clear of the next; the warm-up and the first call count in step 1); "
        "controller CPU: the TransferQueueController actor's process, /proc/<pid>/stat, over fit, per step",
        "modes as verl runs them: sync (sample per step), colocate_async (one warm-up batch, rollout paused while "
        "training), separate_async (parameter_sync_step 2, hybrid rollout switch on: get_sampleable_count at the "
        "step's start, wait_for_sampleable while lending the trainer's replicas, a count and a sample per "
        "mini-batch, a count of the next step at the step's end); max_off_policy_threshold 2, drop",
        "verl's sampler lists the store at the start of every call and every poll_interval (2 s) while it waits; "
        "buffer.verl with its defaults (poll_interval 2.0 as verl's: a listing at each call's start and every "
        "poll_interval while it waits, the watch bringing one forward when an in-flight prompt changed; nothing "
        f"listed between calls); other keys: {OTHER_KEYS:,} trajectory keys of 6,250 prompt-less groups in "
        "'train', put before fit",
        "the fakes (tests/integration/verl_loop_fakes.py): an LLM call is a seeded 0.1-1.2 s sleep (the same per "
        "prompt and session for both samplers), update_actor 0.3 s, log probs 0.02 s, weight sync 0.05 s; one "
        "agent loop worker, one TransferQueue storage unit",
    ]
    if quick:
        table.notes.append(f"--quick: {QUICK_STEPS} steps per run, the small store only (the full run: {STEPS} steps "
                           f"at both sizes)")
    if leftovers:
        table.notes.append(f"left running after Ray's shutdown: {', '.join(leftovers)}")
    return [table, kinds]


def measure(record: dict[str, Any]) -> dict[str, float]:
    """One run's figures: fit wall, the sampler's seconds per step (p50, p99), the controller's CPU per step."""
    fit = record["fit"]
    per_step = sampler_seconds_per_step(record)
    steps = len(per_step)
    return {"fit": fit["t1"] - fit["t0"], "p50": statistics.median(per_step), "p99": percentile(per_step, 99),
            "cpu": (fit["controller_cpu1"] - fit["controller_cpu0"]) / steps}


def sampler_seconds_per_step(record: dict[str, Any]) -> list[float]:
    """Seconds inside the sampler's calls in each step; a step ends with the trainer's clear of its batch."""
    ends = [c["t"] for c in record["clears"] if c["by"] == "trainer" and c["partition"] == "train"]
    totals = [0.0] * len(ends)
    for call in record["calls"]:
        step = next((i for i, end in enumerate(ends) if call["t0"] < end), None)
        if step is not None:
            totals[step] += call["t1"] - call["t0"]
    return totals


def by_kind(record: dict[str, Any]) -> list[str]:
    """Median ms and count of: the run's first call, samples, counts right after a sample, other counts, waits;
    and the calls per step."""
    calls = record["calls"]
    groups: dict[str, list[float]] = {"first": [], "sample": [], "after": [], "count": [], "wait": []}
    for i, call in enumerate(calls):
        seconds = call["t1"] - call["t0"]
        if i == 0:
            groups["first"].append(seconds)
        elif call["kind"] == "sample":
            groups["sample"].append(seconds)
        elif call["kind"] == "get_sampleable_count":
            groups["after" if calls[i - 1]["kind"] == "sample" else "count"].append(seconds)
        else:
            groups["wait"].append(seconds)
    cells = [f"{statistics.median(v) * 1000:.0f} ({len(v)})" if v else "—" for v in groups.values()]
    return cells + [f"{len(calls) / record['settings']['steps']:.1f}"]


def _row(table: Table, mode: str, size: int, verl: dict[str, float], ours: dict[str, float]) -> None:
    where = f"{mode}, {size:,} other keys"
    table.add(mode, f"{size:,}", verl["fit"], ours["fit"], ours["fit"] / verl["fit"], verl["p50"], ours["p50"],
              ours["p50"] / verl["p50"] if verl["p50"] else float("nan"), verl["p99"], ours["p99"], verl["cpu"],
              ours["cpu"], ours["cpu"] / verl["cpu"] if verl["cpu"] else float("nan"))
    table.goals.append(Goal(f"fit wall, buffer.verl ÷ verl, {where}", ours["fit"] / verl["fit"], FIT_RATIO))
    if verl["p50"] > FAST:
        table.goals.append(Goal(f"sampler s/step p50, buffer.verl ÷ verl (verl's > {FAST:g} s), {where}",
                                ours["p50"] / verl["p50"], SAMPLER_RATIO))
    else:
        table.goals.append(Goal(f"sampler s/step p50, buffer.verl ≤ verl's + {SLACK * 1000:.0f} ms, {where}",
                                ours["p50"], verl["p50"] + SLACK))
    table.goals.append(Goal(f"controller CPU s/step, buffer.verl ≤ verl's, {where}", ours["cpu"], verl["cpu"]))
