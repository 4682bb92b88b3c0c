"""``python -m bench --only wake-family``: the wake-up line as a family of cadences, buffer.verl beside verl's sampler.

The one-cadence line of ``--only tq`` (TQ-wake) times one trainer: a 0.5 s
train step, the prompt put right before the call, the trainer's clears. A
trainer's cadence decides what a sampler can know before the group it waits
for finishes, so the family crosses every dimension of it, on the same
harness (:mod:`bench.tq_wake`, in :mod:`bench.tq_host`'s process, a real
TransferQueue 0.1.11):

* train step ``train`` ∈ {0.5, 3, 10} s: the time from the call's return
  (and the take) to the next call;
* lead ``lead`` ∈ {0, 3, 10} s: the prompt is put as ``running`` this long
  before the call (longer than the train step: during an earlier call, as
  an asynchronous trainer's rollouts run ahead);
* the trainer's clears: after its step the trainer clears the batch's
  trajectories (``tq.kv_clear``), as verl's does, or it does not;
* K ∈ {10k, 100k} other keys in the store (groups nobody samples);
* kind ∈ sample / wait / sync (:data:`bench.tq_wake.KINDS`).

Per cell (one value of each) and sampler: the time from the rollout's
finishing put (trajectories and the ``finished`` tag) to the call's return,
p50; buffer.verl ÷ verl; and the TransferQueue controller's CPU per call
(from each call to the next, its idle CPU taken off: the threads of its
actor's process that serve requests, read in ``/proc``;
:class:`bench.tq_host.ControllerCpu`). The goals of issue 37: p50 ≤ 0.5 × verl's wherever the
prompt was in the store one verl cycle (2 s) before its group finished
(lead + delay ≥ 2 s: every wake-up of leads 3 and 10, those of lead 0 whose
group finished ≥ 2 s after the call); p50 ≤ verl's everywhere; controller
CPU ≤ verl's. A second table sums each dimension up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .report import Goal, Table, percentile

#: The dimensions of the full run.
SIZES = (10_000, 100_000)
TRAINS = (0.5, 3.0, 10.0)
LEADS = (0.0, 3.0, 10.0)
CLEARS = (True, False)
#: Wake-ups per sampler and cell in the full run: ~86 min on 2 cores (estimate_seconds; the 10 s train steps
#: take 60% of it). The quick run: two per cell, the 0.5 s and 3 s train steps at K=10k, kinds sample and sync
#: (~9 min; all three kinds would take ~13): wait runs sample's asynchronous rules without the selection.
REPS = 3
QUICK_REPS = 2
QUICK_KINDS = ("sample", "sync")
#: verl's own sampler lists the store, then sleeps its poll_interval (2 s) while a call waits: a prompt put this
#: long before its group finished was in the store for at least one of verl's listing cycles.
VERL_CYCLE = 2.0
#: The goals (issue 37): p50 ≤ STRICT × verl's where the prompt was in the store a verl cycle before it finished,
#: ≤ LOOSE × verl's everywhere.
STRICT = 0.5
LOOSE = 1.0
#: Time estimate: the rest of a cycle after the finish (return, take, clear), both samplers' mean, s; the host's
#: start (Ray, TransferQueue, verl's import) and, per K, the preload and the idle reading; per kind, the samplers.
_REST = 0.9
_START = 60.0
_PER_K = {10_000: 10.0, 100_000: 60.0}
_PER_KIND = 5.0


@dataclass(frozen=True)
class FamilyPlan:
    """What one run measures: the sizes K, the kinds of call, the train steps, the leads, the clears, and the
    wake-ups per sampler and cell."""

    sizes: tuple[int, ...]
    kinds: tuple[str, ...]
    trains: tuple[float, ...]
    leads: tuple[float, ...]
    clears: tuple[bool, ...]
    reps: int

    @property
    def cells(self) -> int:
        return len(self.sizes) * len(self.kinds) * len(self.trains) * len(self.leads) * len(self.clears)


def plan(quick: bool) -> FamilyPlan:
    """The full family (108 cells, :data:`REPS` wake-ups each per sampler), or the quick one (K=10k, the 0.5 s
    and 3 s train steps, kinds sample and sync: 24 cells, :data:`QUICK_REPS` each)."""
    from .tq_wake import KINDS

    if quick:
        return FamilyPlan((10_000,), QUICK_KINDS, TRAINS[:2], LEADS, CLEARS, QUICK_REPS)
    return FamilyPlan(SIZES, tuple(KINDS), TRAINS, LEADS, CLEARS, REPS)


def estimate_seconds(chosen: FamilyPlan, rest: float = _REST) -> float:
    """The run's wall time as the host will spend it: per block, the lead room before its first call, the
    warm-up, each wake-up's delay, rest and train step, and the settle; two blocks per turn; plus start-up."""
    from .tq_wake import WakeUp, family_turns, lead_room

    total = _START + sum(_PER_K.get(k, 60.0) for k in chosen.sizes)
    for k in chosen.sizes:
        for kind in chosen.kinds:
            total += _PER_KIND
            for turn in family_turns(k, kind, chosen.trains, chosen.leads, chosen.clears, chosen.reps):
                wakeups = [WakeUp("", 0.0, None, turn.train, turn.clears)] + [
                    WakeUp("", lead, delay, turn.train, turn.clears) for lead, delay in turn.pairs]
                block = lead_room(wakeups, rest) + sum((w.delay or 0.0) + rest + w.train for w in wakeups)
                total += 2 * (block + turn.settle)
    return total


def run(progress: Callable[[str], None], quick: bool) -> list[Table]:
    """The family's two tables: every cell, and each dimension summed up; empty, with the reason, without
    TransferQueue, Ray or verl."""
    from .tq import _host, _missing

    chosen = plan(quick)
    table, summary = _tables(chosen)
    missing = [why for why in (_missing("transfer_queue"), _missing("ray"), _missing("verl")) if why]
    if missing:
        reason = (f"skipped: {'; '.join(missing)}. `make bench` installs TransferQueue (with a CPU torch), Ray "
                  "and verl 0.9.1")
        progress(f"wake-family: {reason}")
        for t in (table, summary):
            t.title += " (skipped)"
            t.notes.append(reason)
        return [table, summary]
    estimate = estimate_seconds(chosen)
    progress(f"wake-family: {chosen.cells} cells, {chosen.reps} wake-ups per sampler and cell; estimated "
             f"{estimate / 60:.0f} min")
    began = time.monotonic()
    _, _, blocks = _host(progress, "serve_family", chosen)
    fill(table, summary, blocks, chosen)
    table.notes.append(f"run time: {(time.monotonic() - began) / 60:.0f} min, estimated {estimate / 60:.0f} min "
                       f"before the run (bench.wake_family.estimate_seconds)")
    if quick:
        steps = ", ".join(f"{t:g}" for t in chosen.trains)
        table.notes.append(f"--quick: K={chosen.sizes[0]:,} only, train steps {steps} s, kinds "
                           f"{', '.join(chosen.kinds)}, {chosen.reps} wake-ups per sampler and cell (the full run: "
                           f"{plan(False).cells} cells, K={', '.join(f'{k:,}' for k in SIZES)}, train steps "
                           f"{', '.join(f'{t:g}' for t in TRAINS)} s, every kind, {REPS} each)")
    return [table, summary]


def _tables(chosen: FamilyPlan) -> tuple[Table, Table]:
    table = Table("WF", f"TransferQueue wake-up family: a finished group -> the call returns, buffer.verl beside "
                        f"verl 0.9.1's sampler, {chosen.cells} cells, {chosen.reps} wake-ups per sampler and cell",
                  ["K", "kind", "train s", "lead s", "trainer clears", "n", "lead actual s b / c", "verl p50 s",
                   "buffer.verl p50 s", "÷", "÷ in store ≥ 2 s", "verl max s", "buffer.verl max s",
                   "controller ms/call verl", "buffer.verl", "÷ CPU", f"p50 ≤ {STRICT:g}×", f"p50 ≤ {LOOSE:g}×",
                   "CPU ≤ verl"])
    summary = Table("WF2", "TransferQueue wake-up family by dimension: every wake-up of the cells holding that value",
                    ["dimension", "cells", "wake-ups per sampler", "verl p50 s", "verl p90 s", "buffer.verl p50 s",
                     "buffer.verl p90 s", "÷ p50", "cells' ÷ median", f"cells p50 ≤ {STRICT:g}×",
                     f"cells p50 ≤ {LOOSE:g}×", "controller ms/call verl", "buffer.verl", "÷ CPU", "cells CPU ≤ verl"])
    return table, summary


Key = tuple[int, str, float, float, bool]


@dataclass
class Cell:
    """One cell's wake-ups per sampler (``b``: buffer.verl, ``c``: verl's), paired by position."""

    key: Key
    b: list[dict[str, Any]]
    c: list[dict[str, Any]]

    @property
    def where(self) -> str:
        k, kind, train, lead, clears = self.key
        return f"K={k:,} {kind}, train {train:g} s, lead {lead:g} s, {'clears' if clears else 'no clears'}"

    def latencies(self, name: str, eligible_only: bool = False) -> list[float]:
        return [w["latency"] for w in getattr(self, name) if not eligible_only or eligible(w)]

    def costs(self, name: str) -> list[float]:
        return [cost(w) for w in getattr(self, name)]

    def ratio(self, eligible_only: bool = False) -> float | None:
        """buffer.verl's p50 ÷ verl's, over the cell's wake-ups (or those :func:`eligible`); None without any."""
        b, c = self.latencies("b", eligible_only), self.latencies("c", eligible_only)
        if not b or not c:
            return None
        return _p50(b) / _p50(c) if _p50(c) > 0 else float("inf")

    def cpu(self, name: str) -> float:
        """The controller's CPU per call, ms (mean over the cell's wake-ups)."""
        return 1e3 * statistics.mean(self.costs(name))


def eligible(wakeup: dict[str, Any]) -> bool:
    """Whether the prompt was in the store one verl cycle before its group finished (nominally: lead + delay)."""
    return bool(wakeup["lead"] + wakeup["delay"] >= VERL_CYCLE)


def cost(wakeup: dict[str, Any]) -> float:
    """The controller's CPU seconds of one wake-up, from its call to the next, its idle CPU taken off."""
    return float(wakeup["cpu"] - wakeup.get("idle", 0.0) * wakeup["window"])


def _p50(values: list[float]) -> float:
    return float(statistics.median(values))


def cells_of(blocks: Iterable[dict[str, Any]]) -> dict[Key, Cell]:
    """The timed wake-ups of the host's block records, by cell and sampler, each carrying its block's idle
    CPU rate."""
    cells: dict[Key, Cell] = {}
    for block in blocks:
        for wakeup in block["wakeups"]:
            if wakeup["warm"]:
                continue
            key = (block["k"], block["kind"], wakeup["train"], wakeup["lead"], wakeup["clears"])
            cell = cells.setdefault(key, Cell(key, [], []))
            getattr(cell, block["sampler"]).append({**wakeup, "idle": block.get("idle", 0.0)})
    return cells


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "MISSED")


def fill(table: Table, summary: Table, blocks: list[dict[str, Any]], chosen: FamilyPlan) -> None:
    """Rows, goals and notes of both tables from the host's block records."""
    from .tq_wake import KINDS

    cells = cells_of(blocks)
    order = {kind: n for n, kind in enumerate(KINDS)}
    keys = sorted((key for key, cell in cells.items() if cell.b and cell.c),
                  key=lambda key: (key[0], order.get(key[1], 9), key[2], key[3], not key[4]))
    verdicts: dict[Key, tuple[bool | None, bool, bool]] = {}
    for key in keys:
        cell = cells[key]
        k, kind, train, lead, clears = key
        ratio, strict = cell.ratio(), cell.ratio(eligible_only=True)
        cpu_b, cpu_c = cell.cpu("b"), cell.cpu("c")
        verdicts[key] = (None if strict is None else strict <= STRICT, ratio is not None and ratio <= LOOSE,
                         cpu_b <= cpu_c)
        n_strict = len(cell.latencies("b", eligible_only=True))
        shown: Any = "—" if strict is None else (
            f"{strict:.3g}" if n_strict == len(cell.b) else f"{strict:.3g} (n={n_strict})")
        lead_b = _p50([w["lead_actual"] for w in cell.b])
        lead_c = _p50([w["lead_actual"] for w in cell.c])
        table.add(f"{k:,}", kind, train, lead, "yes" if clears else "no", min(len(cell.b), len(cell.c)),
                  f"{lead_b:.1f} / {lead_c:.1f}", _p50(cell.latencies("c")), _p50(cell.latencies("b")),
                  ratio if ratio is not None else "—", shown, max(cell.latencies("c")), max(cell.latencies("b")),
                  cpu_c, cpu_b, cpu_b / cpu_c if cpu_c > 0 else "—", *map(_verdict, verdicts[key]))
    _goals(table, cells, keys, verdicts)
    _summary(summary, cells, keys, verdicts, chosen)
    _notes(table, blocks, cells, keys, chosen)


def _goals(table: Table, cells: dict[Key, Cell], keys: list[Key],
           verdicts: dict[Key, tuple[bool | None, bool, bool]]) -> None:
    """Per K and kind, one goal line per goal: how many cells met it, and the worst."""
    groups: dict[tuple[int, str], list[Key]] = {}
    for key in keys:
        groups.setdefault(key[:2], []).append(key)
    for (k, kind), members in groups.items():
        where = f"K={k:,}, {kind}"
        lines = [
            (f"p50 ≤ {STRICT:g} × verl's where the prompt was in the store ≥ {VERL_CYCLE:g} s before its group "
             f"finished (leads 3 and 10; lead 0 when the group finished ≥ {VERL_CYCLE:g} s after the call)", 0,
             lambda c: c.ratio(eligible_only=True), STRICT),
            (f"p50 ≤ {LOOSE:g} × verl's in every cell", 1, lambda c: c.ratio(), LOOSE),
            ("controller CPU per call ≤ verl's in every cell", 2,
             lambda c: c.cpu("b") / c.cpu("c") if c.cpu("c") > 0 else float("inf"), 1.0),
        ]
        for text, index, value, limit in lines:
            applicable = [key for key in members if verdicts[key][index] is not None]
            if not applicable:
                table.notes.append(f"{where}: no cell for the goal “{text}”")
                continue
            met = [key for key in applicable if verdicts[key][index]]
            worst = max(applicable, key=lambda key: value(cells[key]))
            detail = (f"{len(met)}/{len(applicable)} cells; worst {value(cells[worst]):.3g}× at "
                      f"{cells[worst].where.split(', ', 1)[1]}")
            table.goals.append(Goal(f"{text}, {where}", value(cells[worst]), limit,
                                    verdict=len(met) == len(applicable), detail=detail))
    zero = [w for key in keys if key[3] == 0.0 for w in cells[key].b if eligible(w)]
    zero_c = [w for key in keys if key[3] == 0.0 for w in cells[key].c if eligible(w)]
    if zero and zero_c:
        pooled = _p50([w["latency"] for w in zero]) / _p50([w["latency"] for w in zero_c])
        table.goals.append(Goal(f"p50 ≤ {STRICT:g} × verl's, lead 0 s, groups that finished ≥ {VERL_CYCLE:g} s after "
                                f"the call, pooled over every cell ({len(zero)} wake-ups per sampler)",
                                pooled, STRICT))


def _summary(summary: Table, cells: dict[Key, Cell], keys: list[Key],
             verdicts: dict[Key, tuple[bool | None, bool, bool]], chosen: FamilyPlan) -> None:
    rows: list[tuple[str, list[Key], bool]] = [("all cells", keys, False)]
    rows += [(f"K {k:,}", [key for key in keys if key[0] == k], False) for k in chosen.sizes]
    rows += [(f"kind {kind}", [key for key in keys if key[1] == kind], False) for kind in chosen.kinds]
    rows += [(f"train step {t:g} s", [key for key in keys if key[2] == t], False) for t in chosen.trains]
    for lead in chosen.leads:
        rows.append((f"lead {lead:g} s", [key for key in keys if key[3] == lead], False))
        if lead + min(_delays()) < VERL_CYCLE:
            rows.append((f"lead {lead:g} s, group finished ≥ {VERL_CYCLE - lead:g} s after the call",
                         [key for key in keys if key[3] == lead], True))
    rows += [(f"trainer clears: {'yes' if c else 'no'}", [key for key in keys if key[4] == c], False)
             for c in chosen.clears]
    for label, members, eligible_only in rows:
        if not members:
            continue
        b = [w for key in members for w in cells[key].b if not eligible_only or eligible(w)]
        c = [w for key in members for w in cells[key].c if not eligible_only or eligible(w)]
        if not b or not c:
            summary.add(label, len(members), 0, *["—"] * 12)
            continue
        lat_b, lat_c = [w["latency"] for w in b], [w["latency"] for w in c]
        ratios = [r for r in (cells[key].ratio(eligible_only) for key in members) if r is not None]
        cpu_b, cpu_c = 1e3 * statistics.mean(map(cost, b)), 1e3 * statistics.mean(map(cost, c))

        summary.add(label, len(members), len(b), _p50(lat_c), percentile(lat_c, 90), _p50(lat_b),
                    percentile(lat_b, 90), _p50(lat_b) / _p50(lat_c), _p50(ratios) if ratios else "—",
                    _counted(verdicts, members, 0), _counted(verdicts, members, 1), cpu_c, cpu_b,
                    cpu_b / cpu_c if cpu_c > 0 else "—", _counted(verdicts, members, 2))
    summary.notes.append("each row pools the wake-ups of every cell holding its value (p50 and p90 over them) and "
                         "counts the cells meeting each goal (of those it applies to); “cells' ÷ median” is the "
                         "median of the cells' own p50 ratios; the lead 0 s row of groups that finished late holds "
                         f"the wake-ups whose group finished ≥ {VERL_CYCLE:g} s after the call, whose prompt was "
                         "thus in the store one verl cycle before (the strict goal's share of the lead 0 cells)")


def _counted(verdicts: dict[Key, tuple[bool | None, bool, bool]], members: list[Key], index: int) -> str:
    """``met/applicable`` of goal ``index`` over the cells ``members``."""
    applicable = [key for key in members if verdicts[key][index] is not None]
    return f"{sum(1 for key in applicable if verdicts[key][index])}/{len(applicable)}"


def _process_per_call(blocks: list[dict[str, Any]]) -> float:
    """The controller's whole-process CPU per call over ``blocks``, ms, its idle rate taken off."""
    calls = sum(r["calls"] for r in blocks)
    spent = sum(r.get("process_cpu", 0.0) - r.get("idle_process", 0.0) * r["seconds"] for r in blocks)
    return 1e3 * spent / calls if calls else float("nan")


def _delays() -> tuple[float, float]:
    from .tq_wake import DELAY

    return DELAY


def _notes(table: Table, blocks: list[dict[str, Any]], cells: dict[Key, Cell], keys: list[Key],
           chosen: FamilyPlan) -> None:
    from .tq_wake import DELAY, KINDS, SETTLE

    low, high = DELAY
    table.notes += [
        f"each wake-up: the prompt (step 1) is put as running `lead` s before the call, the call of the kind runs "
        f"in a thread, and {low:g}-{high:g} s after the call (uniform, each cell's delays drawn one from each of "
        f"{chosen.reps} equal slices of the range, the same for both samplers in the same order) one kv_batch_put "
        "writes the group's 2 successful trajectories and marks its prompt finished; the figure is that put's "
        "return -> the call's return; the trainer then takes the group (wait: a sample(1, 'train', 1), untimed), "
        "trains `train` s and clears the group's trajectories (`trainer clears` yes, as verl's trainer does after "
        "its step; no: they stay until the block's end), then makes the next call",
        "kinds: " + "; ".join(f"{kind}: {text}" for kind, text in KINDS.items()),
        "both samplers as verl builds them (threshold None, no sampler_kwargs; verl's sync ReplayBuffer also gets "
        "what verl's trainer passes its built-in one at data.train_batch_size=1), alive together for each K and "
        "kind; per (K, kind, clears, train step) each runs one block, the order swapped from one to the next: an "
        "untimed warm-up wake-up (its group finished before the call, so the first timed call follows one made a "
        f"train step before), then {chosen.reps} wake-ups of every lead (the first round's leads ascending, the "
        f"others shuffled, seeded), then a pause of {SETTLE:g} s less the train step (at least 0) so that what the "
        "last call set off ends in the block",
        "a lead longer than the train step is realised as an asynchronous trainer's rollouts run ahead: the "
        "prompt goes in during an earlier call, at the call's predicted time less the lead, predicted from the "
        "delays, the train steps and the fastest rest of a cycle (return, take, clear) the sampler showed in its "
        "last 10 wake-ups, so a lead comes out at its nominal value or a little longer; `lead actual` is the "
        "median of the put -> call times (b: buffer.verl, c: verl)",
        "÷ in store ≥ 2 s: the ratio of the p50s over the wake-ups whose prompt was in the store one verl cycle "
        f"({VERL_CYCLE:g} s: verl's poll_interval) before its group finished, nominal lead + delay ≥ {VERL_CYCLE:g} s: "
        "all of leads 3 and 10, those of lead 0 whose group finished ≥ 2 s after the call (n: how many, when not "
        "all; —: none in the cell); the strict goal is read there",
        "controller ms/call: the CPU of the TransferQueueController actor's threads that serve requests (found "
        "before each K's wake-ups as those whose CPU rose with a burst of listings, puts and clears; "
        "/proc/<pid>/task/<tid>/schedstat, nanoseconds) from each call to the next call (its wait, its take, the "
        "train step and the trainer's clear, with the puts the rollout made meanwhile, which are the same for both "
        "samplers), their idle CPU per second (read over 5 s before the wake-ups) taken off; mean over the cell's "
        "wake-ups. The whole process (/proc/<pid>/stat, 10 ms ticks) idles at several ms a second in Ray's own "
        "threads while a listing of 10k keys costs ~2 ms: its figure per call, per K and kind, is in the notes "
        "below as a check",
        f"p90 per cell needs ~10 wake-ups; with {chosen.reps} per cell it is given per dimension (table WF2), "
        "each cell shows its maximum",
    ]
    short = [(cells[key].where, w["lead"], w["lead_actual"]) for key in keys for name in ("b", "c")
             for w in getattr(cells[key], name) if w["lead_actual"] < w["lead"] - 0.25]
    if short:
        table.notes.append(f"{len(short)} wake-up(s) had a lead more than 0.25 s short of the nominal (the call came "
                           "earlier than predicted): " + "; ".join(f"{where} {actual:.2f} s" for where, _, actual
                                                                  in short[:8]) + ("; ..." if len(short) > 8 else ""))
    for lead in chosen.leads:
        for name, label in (("b", "buffer.verl"), ("c", "verl")):
            actual = [w["lead_actual"] for key in keys if key[3] == lead for w in getattr(cells[key], name)]
            if actual and lead > 0:
                table.notes.append(f"lead {lead:g} s, {label}: actual leads {min(actual):.2f}-{max(actual):.2f} s, "
                                   f"median {_p50(actual):.2f} s")
    for k in chosen.sizes:
        for kind in chosen.kinds:
            mine = [r for r in blocks if r["k"] == k and r["kind"] == kind]
            per_call = {}
            for name in ("b", "c"):
                own = [r for r in mine if r["sampler"] == name]
                calls = sum(r["calls"] for r in own)
                if calls:
                    per_call[name] = (sum(r["listings"] for r in own) / calls, sum(r["reads"] for r in own) / calls)
            if len(per_call) == 2:
                process = {name: _process_per_call([r for r in mine if r["sampler"] == name]) for name in "bc"}
                table.notes.append(f"K={k:,} {kind}: listings per call (warm-ups included) buffer.verl "
                                   f"{per_call['b'][0]:.2g}, verl {per_call['c'][0]:.2g}; buffer.verl's targeted "
                                   f"reads per call {per_call['b'][1]:.3g}; the controller's whole process, ms per "
                                   f"call over the blocks (idle off): buffer.verl {process['b']:.3g}, verl "
                                   f"{process['c']:.3g}")
    idle = {r["k"]: r.get("idle", 0.0) for r in blocks}
    loads = [r["load"] for r in blocks if "load" in r]
    process_idle = {r["k"]: r.get("idle_process", 0.0) for r in blocks}
    threads = {r["k"]: r.get("threads", 0) for r in blocks}
    table.notes.append("the controller's idle CPU, serving threads / whole process: "
                       + ", ".join(f"K={k:,} ({threads[k]} serving threads) {v * 1e3:.2g} / "
                                   f"{process_idle[k] * 1e3:.2g} ms/s" for k, v in sorted(idle.items()))
                       + (f"; load average (1 min) at the blocks' ends {min(loads):.2f}-{max(loads):.2f}, median "
                          f"{_p50(loads):.2f}, on 2 cores shared with other work" if loads else ""))
