"""The differential test's comparator and seed loop (runs inside the store host).

Every decision is compared whole: the error (type and message), the waits
verl needed and ours honoured, the ``refill_fn`` calls, the metrics (names
and values), the count or sampleable set, the batch (keys and tags) and the
keys cleared in the store. A difference verl's code allows by design is one
of the :data:`ALLOWANCES`, counted every time it is used; anything else fails
the seed.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

from tests.integration.verl_diff import (
    Call,
    Forward,
    Outcome,
    config_for,
    crash_text,
    decide_ours,
    decide_verl,
    next_call,
    our_sampler,
    verl_sampler,
)
from tests.integration.verl_world import PARTITIONS, Model, World, advance

#: Documented differences between verl 0.9.1's sampler and buffer.verl (README, "verl").
ALLOWANCES = {
    "batch_order": "inside one batch verl lists keys in the store's listing order, buffer.verl group by group, "
                   "oldest prompt first: batches are compared as key -> tags maps",
    "tie_at_boundary": "among terminal groups of the same global_steps at the batch's edge verl takes them in set "
                       "iteration order (hash order), buffer.verl finished before failure, then in arrival order: "
                       "the groups taken may differ only there, one for one, with the same global_steps",
}

STEPS = 4


def _uids(keys: Any) -> set[str]:
    return {key.split("_")[0] for key in keys}


def _terminal_steps(model: Model, pid: str, uids: set[str]) -> set[Any]:
    steps = set()
    for uid in uids:
        entry = model[pid].get(uid)
        if entry is None or entry.tags.get("status") not in ("finished", "failure"):
            return {"not a terminal prompt"}
        steps.add(entry.tags.get("global_steps"))
    return steps


_NO_TRAJECTORIES = "RuntimeError: Sync replay buffer selected terminal groups with no materializable trajectories."


def _empty_tie(failed: Outcome, other: Outcome, call: Call, model: Model) -> bool:
    """One side took only groups without trajectories (and raised), the other took, in the same tie, some with.

    Both are verl's rule: the oldest ``global_steps`` first, in any order within it.
    """
    if not (failed.error or "").startswith(_NO_TRAJECTORIES) or other.error or not other.batch:
        return False
    taken = _uids(other.batch)
    steps = _terminal_steps(model, call.pid, taken)
    if len(steps) != 1 or "not a terminal prompt" in steps:
        return False
    step = steps.pop()
    terminal = [uid for uid, entry in model[call.pid].items()
                if entry.tags.get("is_prompt") and entry.tags.get("status") in ("finished", "failure")]
    older = [uid for uid in terminal if model[call.pid][uid].tags["global_steps"] < step]
    empty = [uid for uid in terminal if model[call.pid][uid].tags["global_steps"] == step
             and not any(key.split("_")[0] == uid and key != uid for key in model[call.pid])]
    return not older and len(empty) >= call.size


def compare(verl: Outcome, ours: Outcome, call: Call, model: Model) -> tuple[list[str], list[str]]:
    """The differences (empty: the decision matches) and the allowances used."""
    diffs: list[str] = []
    used: list[str] = []
    if verl.error or ours.error:
        if verl.error == ours.error:
            return diffs, used
        if _empty_tie(verl, ours, call, model) or _empty_tie(ours, verl, call, model):
            used.append("tie_at_boundary")
        else:
            diffs.append(f"error: verl {verl.error!r}, ours {ours.error!r}")
        return diffs, used
    if verl.waits != ours.waits:
        diffs.append(f"waits: verl waited on {verl.waits} states, ours on {ours.waits}")
    if verl.refill_calls != ours.refill_calls:
        diffs.append(f"refill_fn calls: verl {verl.refill_calls}, ours {ours.refill_calls}")
    if verl.metrics != ours.metrics:
        diffs.append(f"metrics: verl {verl.metrics}, ours {ours.metrics}")
    if verl.count != ours.count:
        diffs.append(f"sampleable count: verl {verl.count}, ours {ours.count}")
    if verl.sampleable != ours.sampleable:
        diffs.append(f"sampleable: verl {sorted(verl.sampleable or ())}, ours {sorted(ours.sampleable or ())}")
    pid = call.pid
    vb, ob = verl.batch or {}, ours.batch or {}
    vc, oc = verl.cleared.get(pid, set()), ours.cleared.get(pid, set())
    swapped = (_uids(vb) ^ _uids(ob)) | _uids(vc ^ oc)
    if swapped:
        steps = _terminal_steps(model, pid, swapped)
        chosen = _terminal_steps(model, pid, (_uids(vb) | _uids(ob)) - swapped) - {"not a terminal prompt"}
        one_step = len(steps) == 1 and "not a terminal prompt" not in steps
        if call.kind == "sample" and one_step and all(step <= min(steps) for step in chosen):
            used.append("tie_at_boundary")
        else:
            diffs.append(f"groups: only verl {sorted(_uids(vb) - _uids(ob))}, only ours "
                         f"{sorted(_uids(ob) - _uids(vb))}; cleared only by verl {sorted(vc - oc)}, "
                         f"only by ours {sorted(oc - vc)}")
    for side, batch in (("verl", vb), ("ours", ob)):
        # Whatever groups a side took, it took them whole and with the stored tags.
        for uid in _uids(batch):
            wanted = {key: entry.tags for key, entry in model[pid].items() if key.split("_")[0] == uid and key != uid}
            got = {key: tags for key, tags in batch.items() if key.split("_")[0] == uid}
            if got != wanted:
                diffs.append(f"batch of {side}: group {uid} is {got}, the store holds {wanted}")
    keep = {key: tags for key, tags in vb.items() if key.split("_")[0] not in swapped}
    if keep != {key: tags for key, tags in ob.items() if key.split("_")[0] not in swapped}:
        diffs.append(f"batch: verl {vb}, ours {ob}")
    elif [k for k in verl.batch_order if k in keep] != [k for k in ours.batch_order if k in keep]:
        used.append("batch_order")
    for other in PARTITIONS:
        if other != pid and verl.cleared.get(other) != ours.cleared.get(other):
            diffs.append(f"cleared in {other!r}: verl {sorted(verl.cleared[other])}, "
                         f"ours {sorted(ours.cleared[other])}")
    if {k for k in vc if k.split("_")[0] not in swapped} != {k for k in oc if k.split("_")[0] not in swapped}:
        diffs.append(f"cleared: only verl {sorted(vc - oc)}, only ours {sorted(oc - vc)}")
    return diffs, used


def _features(kwargs: dict[str, Any], call: Call, outcome: Outcome) -> list[str]:
    """What one decision exercised, for the coverage the test asserts and prints."""
    threshold = kwargs["max_off_policy_threshold"]
    features = [f"mode={kwargs['trainer_mode']}", f"strategy={kwargs['max_off_policy_strategy']}",
                f"threshold={'None' if threshold is None else 'int'}", f"dapo={kwargs['filter_groups_metric']}",
                f"partition={call.pid}", f"call={call.kind}"]
    if kwargs["sync_refill_failed_groups"]:
        features.append("sync_refill_failed_groups")
    if outcome.refill_calls:
        features.append("refill_fn called")
    if outcome.waits:
        features.append("waited")
    if outcome.error:
        features.append("error")
    features.extend(f"metric {name.split('/', 1)[-1]}" for name in outcome.metrics
                    if name.endswith("evicted_samples") or name.endswith("surplus_samples"))
    return features


def _post(world: World) -> Model:
    """The model of what is in the store now (the samplers' clears are not in the model until listed)."""
    listed = world.listing()
    post = world.snapshot()
    for pid in PARTITIONS:
        post[pid] = {key: entry for key, entry in post[pid].items() if key in listed[pid]}
    return post


def run_seed(seed: int, steps: int = STEPS) -> dict[str, Any]:
    world = World(seed)
    world.restore({pid: {} for pid in PARTITIONS})
    kwargs = config_for(seed)
    verl_refill, our_refill = Forward(), Forward()
    hook: dict[str, Any] = {"on_wait": None}
    verl = verl_sampler(kwargs, verl_refill, lambda: hook["on_wait"]())
    ours = our_sampler(kwargs, our_refill)
    rng = random.Random(f"scenario-{seed}")
    global_steps = 0
    last: tuple[str, list[str]] | None = None
    report: dict[str, Any] = {"decisions": 0, "allowances": Counter(), "diffs": [], "config": kwargs,
                              "covered": Counter()}
    try:
        for step in range(steps):
            if last is not None:  # the trainer clears the trajectories it trained on
                world.clear(last[0], [key for key in last[1] if key in world.model[last[0]]])
            for _ in range(rng.choice((1, 2))):
                advance(world, "train", global_steps, rng)
            if rng.random() < 0.4:
                advance(world, "val", global_steps, rng)
            call = next_call(kwargs, rng, global_steps)
            before, counter = world.snapshot(), world.counter
            verl_outcome = decide_verl(world, verl, verl_refill, hook, call, (seed, step))
            after, after_counter = _post(world), world.counter
            world.restore(before)
            world.counter = counter
            our_outcome = decide_ours(world, ours, our_refill, call, (seed, step), verl_outcome.waits)
            diffs, used = compare(verl_outcome, our_outcome, call, world.snapshot())
            report["decisions"] += 1
            report["allowances"].update(used)
            report["covered"].update(_features(kwargs, call, verl_outcome))
            report["diffs"].extend(f"step {step} {call}: {diff}" for diff in diffs)
            world.restore(after)
            world.counter = after_counter
            last = (call.pid, sorted(verl_outcome.batch)) if verl_outcome.batch else None
            global_steps += rng.choice((0, 1, 1, 2))
    finally:
        ours.close()
    return report


def run_seeds(conf: Any, seeds: list[int], steps: int = STEPS) -> dict[str, Any]:
    """Each seed's scenario; returns the counts, the allowances used and every failing seed with its reasons."""
    started = time.monotonic()
    out: dict[str, Any] = {"seeds": 0, "decisions": 0, "allowances": {}, "failures": {}, "covered": {}}
    allowances: Counter[str] = Counter()
    covered: Counter[str] = Counter()
    for seed in seeds:
        try:
            report = run_seed(seed, steps)
        except Exception:
            out["failures"][seed] = [f"crashed:\n{crash_text()}"]
            continue
        out["seeds"] += 1
        out["decisions"] += report["decisions"]
        allowances.update(report["allowances"])
        covered.update(report["covered"])
        if report["diffs"]:
            out["failures"][seed] = [f"config {report['config']}", *report["diffs"]]
    out["allowances"] = dict(allowances)
    out["covered"] = dict(sorted(covered.items()))
    out["seconds"] = round(time.monotonic() - started, 1)
    return out
