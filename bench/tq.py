"""``python -m bench --only tq``: what a blocked sampler costs the shared TransferQueue controller.

On a real TransferQueue (Ray, one storage unit) holding K keys, a rollout
writer (a Ray actor) puts 16-key batches with ``kv_batch_put`` for a fixed
time, in three phases of the same length:

* a: no sampler;
* b: ``buffer.verl`` (this product), built as verl builds a custom sampler,
  blocked in ``sample()`` (asked for more groups than will ever complete),
  its poller process listing the store while it waits;
* c: verl 0.9.1's own ``ReplayBufferAsync`` blocked the same way in a thread
  of the trainer process.

Before the phases of each K, the controller's CPU per listing is also
measured alone, no writer running, for each sampler's own request
(:func:`bench.tq_host.listing_cost_alone`).

Per phase: the writer's batches/s and put latency, the CPU of the controller's
process (``/proc/<pid>/stat``), the CPU of what lists for the sampler, and the
sampler's listings, counted exactly: verl's ``tq.kv_list()`` calls at their
call site, the product's from its ``stats()["listings"]``. With a sampler the
rates are taken over a window of whole listing cycles inside the writer's run
(:func:`bench.tq_host.window`): from the end of one listing to the end of a
later one, so a phase is not favoured by where its edges fell between two
listings (6 s phases held 2 or 3 listings of a ~2.4 s cycle: 0.33 or 0.5
listings/s). Each sampler phase runs between two runs of phase a, over
several rounds (:func:`bench.tq_host.schedule`), and is compared with their
mean, so a steady drift of the machine cancels out; ratios and differences
are medians over the rounds, listings/s and the CPU per listing are pooled. The store, Ray and the samplers live
in a host process (:mod:`bench.tq_host`), so none of it stays in this process.

Needs the ``transferqueue`` extra, and verl 0.9.1 for phase c
(``make bench`` or ``make test-integration`` installs both); without
TransferQueue the table says so and is empty.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
import signal
import statistics
from typing import Any, Callable

from .report import Goal, Table, median, percentile

PHASES = {"a": "no sampler", "b": "buffer.verl (product)", "c": "verl 0.9.1 sampler",
          "d": "buffer.verl between calls"}
_SILENCE = 300.0  # the host's longest quiet spell: Ray's start-up on a loaded machine, one phase


def _plan(quick: bool) -> tuple[list[int], int, float, int]:
    """(sizes K, rounds, seconds per phase, wake-ups per sampler and K)."""
    # Full: 25 phases per K, ~14 min on 2 cores; a 15 s phase holds ~5 whole listing cycles of either sampler.
    # The wake-up line: ~3 s a sample, ~3 min per K for 30 of each sampler.
    return ([10_000], 2, 5.0, 10) if quick else ([10_000, 100_000], 4, 15.0, 30)


def _missing(module: str) -> str | None:
    """Why ``module`` cannot be imported here (None when it can), without importing it."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"{module}: {exc}"
    return None if found is not None else f"{module} is not installed"


def run(progress: Callable[[str], None], quick: bool) -> list[Table]:
    """The ``tq`` tables: the cost of a blocked sampler (a row per K and phase) and the wake-up line (a row per K
    and sampler), with their goals; empty, with the reason, without TransferQueue."""
    sizes, rounds, seconds, wake_samples = _plan(quick)
    table = Table("TQ", f"TransferQueue controller: cost of a sampler blocked in sample() and between calls, "
                        f"writer putting 16-key batches, {seconds:g} s phases, {rounds} rounds",
                  ["K", "phase", "writer batches/s", "put p50 ms", "put p99 ms", "controller % of a core",
                   "controller % beyond the puts (est.)", "lister % of a core", "listings/s",
                   "controller ms per listing (est.)", "slowdown a ÷ phase ×"])
    missing = [why for why in (_missing("transfer_queue"), _missing("ray")) if why]
    if missing:
        reason = (f"skipped: {'; '.join(missing)}. Install the transferqueue extra with a CPU torch "
                  "(`make bench` does, or `make .venv/.installed-transferqueue`)")
        progress(f"tq: {reason}")
        table.title += " (skipped)"
        table.notes.append(reason)
        return [table]
    phases = "abcd"
    # Only the top-level package: finding a submodule would import verl (and torch) into this process.
    no_verl = _missing("verl")
    if no_verl:
        phases = "abd"
        table.notes.append(f"phase c skipped ({no_verl}): verl 0.9.1 is installed by `make bench`")
        progress(f"tq: phase c skipped: {no_verl}")
    records, alone, wakes = _host(progress, sizes, rounds, seconds, phases, wake_samples)
    _fill(table, records, sizes, phases, alone)
    table.notes.append("a writer Ray actor rewrites one of 64 preloaded groups per batch (16 trajectory keys, "
                       "tags global_steps/status/reward, a 16×8 tensor field), so K stays fixed (plus each of "
                       "those groups' 16th trajectory: 64 keys) while tags change; preloaded groups are a running "
                       "prompt and 15 trajectories, so nothing is ever sampleable and each sampler waits the whole "
                       "phase")
    table.notes.append("d: buffer.verl as in b, started by one get_sampleable_count() and then left without a "
                       "call for the phase, as between verl's calls while the trainer trains (verl's own sampler "
                       "runs no code then); its listings are its polls applied, as in b")
    table.notes.append("both samplers as verl builds them: trainer_mode colocate_async, threshold None, no "
                       "sampler_kwargs, so each lists at its defaults while sample() waits (buffer.verl: every "
                       "wait_poll_interval = 0.02 s; verl: every poll_interval = 2 s); between calls neither lists "
                       "TransferQueue")
    table.notes.append("the product runs with its default listing_share: verl's own cycle, its next listing no "
                       "sooner than 2 s + d + 2p after the poll that took the previous one (d s) is done (listing, "
                       "diff, screen, send: p s after the listing), as verl's sampler sleeps 2 s after it has "
                       "listed and processed the store (poller/duty.py)")
    table.notes.append("listings counted exactly: verl's tq.kv_list() calls at the call site (the sampler module's "
                       "tq wrapped, counted as each returns), the product's stats()['listings']; with a sampler "
                       "every rate is taken over whole listing cycles, from the first listing done with in the "
                       "writer's run to the last (verl: its kv_list() returned; the product: its poll applied, "
                       "stats()['polls'], since its listings count comes with the next heartbeat, up to 1 s "
                       "later, and is read once it has caught up), with the puts that began in it and the CPU "
                       "read then (the host reads the counters every 50 ms); listings/s is the listings in those "
                       "windows over their length, pooled over rounds")
    table.notes.append("controller ms per listing (est.): what one listing costs the controller beyond the puts, "
                       "measured inside each phase, so a drift of the machine's load between phases does not "
                       "count: the controller's CPU in the 1 s before each listing was done with (it holds the "
                       "listing), less the puts begun in those spans charged at the CPU per put of the rest of "
                       "the window; summed over rounds and divided by the listings")
    table.notes.append("a slower writer also spares the controller its puts, so b − a can be small or negative "
                       "(and its goal met) while the sampler's listings cost a lot: the estimate column charges "
                       "each phase's batches at the controller's CPU per batch of its reference (below) and "
                       "shows the rest, compared by the last goal of each K")
    table.notes.append("controller = CPU of the TransferQueueController actor's process over the window (phase "
                       "a: the writer's run); lister = what lists and samples for the sampler: "
                       "buffer.verl's poller process and its threads in the trainer process (the one blocked in "
                       "sample(), the receiver, the supervisor) (b); the thread running verl's sample() and "
                       "TransferQueue's client event loop, which sends kv_list() and decodes its reply (c); medians "
                       "over rounds")
    table.notes.append("each sampler phase runs between two runs of phase a and is compared with their mean (its "
                       "reference): the slowdown (reference batches/s ÷ the phase's), the CPU added (the phase's "
                       "controller CPU − the reference's) and the CPU beyond the puts are medians of those "
                       "per-phase figures; the writer's rate drifts between phases on a loaded 2-core machine "
                       "(phase a's runs are listed per K), and a reference on both sides cancels a steady drift")
    return [table, wake_table(wakes, sizes, alone, wake_samples)]


WAKE_SAMPLERS = {"b": "buffer.verl (product)", "c": "verl 0.9.1 sampler"}


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95% interval of the median from order statistics (no assumption on the distribution).

    The ``⌊n/2 − 0.98·√n⌋``-th and ``⌈1 + n/2 + 0.98·√n⌉``-th smallest (the
    normal approximation of the binomial that counts the samples below the
    median), clamped to the sample.
    """
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half) - 1)
    high = min(n - 1, math.ceil(n / 2 + half))
    return ordered[low], ordered[high]


def wake_table(records: list[dict[str, Any]], sizes: list[int], alone: dict[int, dict[str, list[float]]],
               per_sampler: int) -> Table:
    """The wake-up line: finished → ``sample()`` returns, per K and sampler (:mod:`bench.tq_wake`), with its goals."""
    from .tq_wake import BLOCK, DELAY, TRAIN_STEP

    table = Table("TQ-wake", f"TransferQueue: a finished group -> sample() returns, {per_sampler} wake-ups per "
                             f"sampler and K, in interleaved blocks of {BLOCK}",
                  ["K", "sampler", "samples", "p50 s", "p50 95% interval s", "p99 s", "max s", "listings/s",
                   "controller ms per listing (alone)", "controller % of a core (est.)"])
    for k in sizes:
        p50: dict[str, float] = {}
        p99: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for name, label in WAKE_SAMPLERS.items():
            blocks = [r for r in records if r["k"] == k and r["sampler"] == name]
            latencies = [x for r in blocks for x in r["latencies"]]
            if not latencies:
                continue
            low, high = median_interval(latencies)
            rate = sum(r["listings"] for r in blocks) / sum(r["seconds"] for r in blocks)
            costs = alone.get(k, {}).get(name)
            per_listing: Any = median(costs) * 1e3 if costs else "—"
            estimate: Any = rate * per_listing / 10 if costs else "—"
            if costs:
                cpu[name] = estimate
            p50[name], p99[name] = percentile(latencies, 50), percentile(latencies, 99)
            table.add(f"{k:,}", f"{name}: {label}", len(latencies), p50[name], f"[{low:.3g}, {high:.3g}]",
                      p99[name], max(latencies), rate, per_listing, estimate)
        if "b" in p50 and "c" in p50:
            table.goals.append(Goal(f"buffer.verl's p50 ≤ 0.5 × verl's (the limit), s, K={k:,}", p50["b"],
                                    0.5 * p50["c"]))
            table.goals.append(Goal(f"buffer.verl's p99 ≤ verl's p50 (the limit), s, K={k:,}", p99["b"], p50["c"]))
        if "b" in cpu and "c" in cpu:
            table.goals.append(Goal(f"controller CPU of buffer.verl's listings ≤ verl's (the limit), % of a core "
                                    f"(listings/s × CPU per listing alone), K={k:,}", cpu["b"], cpu["c"]))
    table.notes.append(f"each wake-up: the trainer puts a prompt of step 1 as running, calls sample(1, 'train', 1) "
                       f"in a thread, and {DELAY[0]:g}-{DELAY[1]:g} s (uniform) after the call one kv_batch_put "
                       "writes its 2 successful trajectories and marks it finished; the figure is that put's "
                       f"return -> sample() returns; then the trajectories are cleared and the trainer 'trains' "
                       f"{TRAIN_STEP:g} s; the store holds K keys (phase a's preload: a running prompt of step 0 and "
                       "15 trajectories per group), no writer running")
    table.notes.append("both samplers as verl builds them (colocate_async, threshold None, no sampler_kwargs), both "
                       "alive for the whole line, taking turns in blocks, the order swapped each block, each "
                       "drawing the same seeded delays in the same order; listings/s "
                       "is each sampler's listings (verl: its tq.kv_list() calls; buffer.verl: stats()['listings']) "
                       "over its blocks' wall time, calls and training steps alike; the controller's CPU is that "
                       "rate × the CPU per listing measured alone (table TQ's note)")
    return table


def _rate(record: dict[str, Any]) -> float:
    return float(record["batches"] / record["seconds"])


def bracketed(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, float]]:
    """One K's sampler phases, each with its reference: ``(record, batches/s, controller CPU)``.

    The reference is the mean of the phase-a runs just before and just after
    the phase (:func:`bench.tq_host.schedule` puts one on either side), so a
    steady drift of the machine between phases cancels out.

    Raises:
        RuntimeError: a sampler phase with no phase a beside it.
    """
    by_seq = {record["seq"]: record for record in records}
    out = []
    for record in sorted(records, key=lambda r: r["seq"]):
        if record["phase"] == "a":
            continue
        around = [by_seq.get(record["seq"] + step) for step in (-1, 1)]
        references = [a for a in around if a is not None and a["phase"] == "a"]
        if not references:
            raise RuntimeError(f"K={record['k']:,} phase {record['phase']} (run {record['seq']}) has no phase a "
                               "beside it")
        out.append((record, sum(map(_rate, references)) / len(references),
                    sum(a["controller_cpu"] for a in references) / len(references)))
    return out


def _fill(table: Table, records: list[dict[str, Any]], sizes: list[int], phases: str,
          alone: dict[int, dict[str, list[float]]] | None = None) -> None:
    """Rows and goals from the host's phase records (medians over rounds, ratios against the bracketing a runs);
    ``alone``: per K, each sampler's controller CPU seconds per listing with nothing else running, per round."""
    for k in sizes:
        by_phase = {p: [r for r in records if r["k"] == k and r["phase"] == p] for p in phases}
        pairs = bracketed([r for r in records if r["k"] == k])
        # Per sampler phase, against the mean of the phase-a runs on either side of it: the writer's
        # slowdown, the controller CPU it added, and that CPU beyond the puts (each of the phase's
        # batches charged at the reference's controller CPU per batch).
        slowdowns = {p: [rate / _rate(r) for r, rate, _ in pairs if r["phase"] == p] for p in phases}
        added = {p: [r["controller_cpu"] - cpu for r, _, cpu in pairs if r["phase"] == p] for p in phases}
        beyond = {p: [r["controller_cpu"] - _rate(r) * cpu / rate for r, rate, cpu in pairs if r["phase"] == p]
                  for p in phases}
        pooled: dict[str, float] = {}
        rates: dict[str, float] = {}  # listings/s, pooled over rounds: phases whose listings are counted
        for p, rs in by_phase.items():
            latencies = [x for r in rs for x in r["latencies"]]
            lister = [r["lister_cpu"] for r in rs if r["lister_cpu"] is not None]
            counted = [r for r in rs if r["listings"] is not None]
            listings = sum(r["listings"] for r in counted)
            per_s: Any = listings / sum(r["seconds"] for r in counted) if counted else "—"
            if counted:
                rates[p] = per_s
            per_listing: Any = sum(_listing_cpu(r) for r in counted) / listings * 1e3 if listings else "—"
            if listings:
                pooled[p] = per_s * per_listing / 10  # % of a core: listings/s × ms per listing
            table.add(f"{k:,}", f"{p}: {PHASES[p]}", median([_rate(r) for r in rs]),
                      percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3,
                      median([r["controller_cpu"] for r in rs]) * 100,
                      median(beyond[p]) * 100 if p != "a" else "—",
                      median(lister) * 100 if lister else "—", per_s, per_listing,
                      median(slowdowns[p]) if p != "a" else "—")
            miscounted = [(r["round"] + 1, r["listings"], r["counted"]) for r in counted
                          if r["counted"] != r["listings"]]
            if miscounted:
                table.notes.append(f"K={k:,} phase {p}: the sampler's own count of listings differs from the "
                                   f"window's (round, window, own count): {miscounted}")
            unaligned = [r["round"] + 1 for r in counted if not r["aligned"]]
            if unaligned:
                table.notes.append(f"K={k:,} phase {p}, round(s) {unaligned}: fewer than two listings ended in the "
                                   "writer's run, so the whole run was the window")
        costs = (alone or {}).get(k)
        if costs:
            table.notes.append(f"K={k:,}: the controller's CPU per listing with no writer, ms, median of "
                               f"{len(costs['b'])} rounds (rounds): "
                               + "; ".join(f"{PHASES[p]} {median(v) * 1e3:.3g} ("
                                           + ", ".join(f"{x * 1e3:.3g}" for x in v) + ")"
                                           for p, v in costs.items())
                               + "; × the phase's listings/s: "
                               + ", ".join(f"{PHASES[p]} {median(v) * rates[p] * 100:.3g}% of a core"
                                           for p, v in costs.items() if p in rates))
        if pooled:
            table.notes.append(f"K={k:,}: the listings' controller CPU, listings/s × ms per listing: "
                               + ", ".join(f"{PHASES[p]} {pooled[p]:.3g}% of a core" for p in pooled))
        table.notes.append(f"K={k:,}: the writer's slowdown, mean over rounds with its 95% interval "
                           "(± 2 standard errors), what one run can resolve: "
                           + "; ".join(f"{p} {interval(slowdowns[p])}" for p in phases if p != "a"))
        table.notes.append(f"K={k:,}: phase a's writer batches/s, run by run: "
                           + ", ".join(f"{_rate(r):.0f}" for r in sorted(by_phase["a"], key=lambda r: r["seq"]))
                           + "; each sampler phase's slowdown against its reference: "
                           + "; ".join(f"{p} " + ", ".join(f"{x:.3g}" for x in slowdowns[p]) for p in phases
                                       if p != "a"))
        table.goals.append(Goal(f"writer slowdown beside buffer.verl (batches/s a ÷ b), K={k:,}",
                                median(slowdowns["b"]), 1.02))
        if "c" in phases:
            table.goals.append(Goal(f"controller CPU added by buffer.verl (b − a) ≤ added by verl's sampler "
                                    f"(c − a, the limit), % of a core, K={k:,}", median(added["b"]) * 100,
                                    median(added["c"]) * 100))
            # The same comparison without the confound of the writer's rate (see the notes).
            table.goals.append(Goal(f"controller CPU beyond the puts (est.): buffer.verl ≤ verl's sampler "
                                    f"(the limit), % of a core, K={k:,}", median(beyond["b"]) * 100,
                                    median(beyond["c"]) * 100))
        if "d" in phases:
            # verl's sampler runs no code between its calls: it lists nothing then.
            table.goals.append(Goal(f"buffer.verl's listings between calls, per second (verl's sampler: none), "
                                    f"K={k:,}", rates["d"], 0.0))
        if "c" not in phases:
            table.notes.append(f"controller CPU added by buffer.verl (b − a), K={k:,}: "
                               f"{median(added['b']) * 100:.3g}% of a core (no verl phase to compare with)")


def interval(values: list[float]) -> str:
    """``mean [low, high]``: the mean of per-round figures and mean ± 2 standard errors ("—" with fewer than two).

    Phase d lists nothing, so its interval is what the slowdown reads with no
    cost at all: a goal's margin narrower than that cannot be told from noise
    in one run (``docs/benchmarks.md``).
    """
    if len(values) < 2:
        return "—"
    mean = statistics.mean(values)
    half = 2 * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.3g} [{mean - half:.3g}, {mean + half:.3g}]"


def _listing_cpu(record: dict[str, Any]) -> float:
    """The controller's CPU seconds of a phase's listings beyond the puts, from inside the phase.

    The spans around the listings against the rest of the window: the puts
    begun around the listings are charged at the rest's CPU per put.
    """
    rest_cpu = record["controller_cpu"] * record["seconds"] - record["around_cpu"]
    rest_batches = record["batches"] - record["around_batches"]
    return float(record["around_cpu"] - record["around_batches"] * rest_cpu / max(rest_batches, 1))


def _host(progress: Callable[[str], None], sizes: list[int], rounds: int, seconds: float, phases: str,
          wake_samples: int) -> tuple[list[dict[str, Any]], dict[int, dict[str, list[float]]], list[dict[str, Any]]]:
    """Run :func:`bench.tq_host.serve` in a spawned process; its phase records and, per K, the controller's
    CPU per listing with nothing else running (:func:`bench.tq_host.listing_cost_alone`).

    The host leads a session of its own: whatever happens here, it and the
    processes it started (Ray's, the poller) are signalled by that group.
    """
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe(duplex=False)
    host = ctx.Process(target=_session, args=(child, sizes, rounds, seconds, phases, wake_samples),
                       name="bench-tq-host")
    host.start()
    child.close()
    records: list[dict[str, Any]] = []
    alone: dict[int, dict[str, list[float]]] = {}
    wakes: list[dict[str, Any]] = []
    try:
        while True:
            if not conn.poll(_SILENCE):
                raise TimeoutError(f"the TransferQueue host sent nothing for {_SILENCE:g} s")
            try:
                kind, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"the TransferQueue host ended without a result (exit code {host.exitcode})") \
                    from None
            if kind == "progress":
                progress(value)
            elif kind == "phase":
                records.append(value)
                listed = "" if value["listings"] is None else \
                    f", {value['listings']} listings in {value['seconds']:.1f} s"
                progress(f"tq: K={value['k']:,} round {value['round'] + 1}/{rounds} phase {value['phase']}: "
                         f"{value['batches'] / value['seconds']:.0f} batches/s, controller "
                         f"{value['controller_cpu'] * 100:.1f}% of a core{listed}")
            elif kind == "alone":
                alone[value["k"]] = value["costs"]
                progress(f"tq: K={value['k']:,}: controller ms per listing alone, "
                         + ", ".join(f"{p} {median(v) * 1e3:.3g}" for p, v in value["costs"].items()))
            elif kind == "wake":
                wakes.append(value)
            elif kind == "error":
                raise RuntimeError(f"the TransferQueue host failed:\n{value}")
            else:
                return records, alone, wakes
    finally:
        conn.close()
        _reap(host)


def _session(conn: Any, sizes: list[int], rounds: int, seconds: float, phases: str, wake_samples: int) -> None:
    from . import tq_host

    os.setsid()
    tq_host.serve(conn, sizes, rounds, seconds, phases, wake_samples)


def _reap(host: Any, timeout: float = 60.0) -> None:
    """Wait for the host (it stops Ray itself); past the deadline, SIGKILL its process group."""
    host.join(timeout)
    if host.is_alive() or _group_alive(host.pid):
        try:
            os.killpg(host.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        host.join(10)
    if host.is_alive():
        raise RuntimeError(f"the TransferQueue host (pid {host.pid}) survived SIGKILL")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
