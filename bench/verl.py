"""``python -m bench --only verl``: verl's v1 sampler against ``buffer.verl`` on the same store.

Both sample the workload of :mod:`bench.verl_workload` from one SQLite store
of K keys, driven the same way: the trainer calls ``sample(global_steps=s,
partition_id="train", batch_size=B)``; the rollout process finishes the B
groups on a schedule that is the same at every K (:data:`CHUNKS` commits
:data:`GAP` apart, the first :data:`LEAD` plus a random share of
:data:`SPREAD` after the call), so a sample waits as long, through as many
of the product's polls and wake-ups, whatever K; the trainer checks that it
got exactly those groups' trajectories, then the rollouts clear them and
write B new groups.

* trainer-thread CPU per ``sample()`` (``time.thread_time`` of the calling
  thread) and the whole trainer process's CPU over the same call (all its
  threads: for the product, the receiver applying the poller's changes and
  the helpers asking for listings while the call waits), and for the product
  the polls and rule evaluations per call;
* latency from the commit that made the last group terminal to ``sample()``
  returning (monotonic clock, shared by the processes of one host);
* the slowdown of a CPU-bound loop in the trainer's main thread while the
  sampler exists and the rollouts keep changing trajectories, against the
  same loop with the rollouts alone.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections import deque
from functools import partial
from typing import Any, Callable

from poller.sources.sqlite import SqliteSource

from .baselines.verl_v1 import VerlV1Sampler
from .overhead import _calibrate, _spin
from .report import Goal, Table, line_plot, median, percentile
from .verl_workload import KEYS_PER_GROUP, PARTITION, SESSIONS, Rollouts, fill, uid_of

SQLITE = "poller.sources.sqlite:SqliteSource"
INTERVAL = 0.2  # both samplers' poll_interval (given to both; verl's own default, and buffer.verl's, is 2 s)
BATCH = 64  # groups per sample
# The rollouts' schedule per sample, the same at every K: before it was spread over verl's poll
# periods, which grow with K, so at 1M the product waited ~20 s and ~1000 polls per sample and
# its CPU per sample measured the wait as much as the work (bench/results/verl.md before this).
LEAD = 0.2  # s from the call to the first of the batch's commits, at least
SPREAD = 0.6  # plus a uniform random share of this: a random phase of the product's poll schedule
CHUNKS = 4  # the batch turns terminal in this many commits
GAP = 0.05  # s between them
VERL_INTERVAL = 2.0  # verl's default poll_interval, for a second slowdown row


class _Contender:
    """One sampler under test: ``sample(step) -> keys``, ``close()``, and its poller's pid if it has one."""

    def __init__(self, name: str, sample: Callable[[int], list[str]], close: Callable[[], Any],
                 poller_pid: int | None = None, counters: Callable[[], dict[str, int]] | None = None) -> None:
        self.name = name
        self.sample = sample
        self.close = close
        self.poller_pid = poller_pid
        #: the sampler's own counters (polls asked for while waiting, rule evaluations), if it keeps them
        self.counters = counters


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (fields counted after the command name, which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _baseline(db: str) -> _Contender:
    store = SqliteSource(db)
    sampler = VerlV1Sampler(store.kv_list, store.kv_clear, poll_interval=INTERVAL)

    def sample(step: int) -> list[str]:
        return sampler.sample(step, PARTITION, BATCH)[0]

    return _Contender("verl-v1", sample, store.close)


def _product(db: str, interval: float = INTERVAL) -> _Contender:
    from buffer.verl import ReplayBuffer as VerlSampler

    sampler = VerlSampler(trainer_mode="async", trainer_config={}, max_off_policy_threshold=1_000_000,
                          max_off_policy_strategy="drop",
                          sampler_kwargs={"source": SQLITE, "source_kwargs": {"path": db},
                                          "poll_interval": interval, "start_timeout": 600})
    sampler.get_sampleable_count(0, PARTITION)  # starts the poller
    # Its first listing (a snapshot of K keys, ~20 s at 1M) is start-up, not any sample's cost.
    deadline = time.monotonic() + 900
    while sampler.stats()["polls"] < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("the product's first listing never arrived")
        time.sleep(0.05)

    def sample(step: int) -> list[str]:
        return list(sampler.sample(global_steps=step, partition_id=PARTITION, batch_size=BATCH)[0].keys)

    def counters() -> dict[str, int]:
        stats = sampler.stats()
        return {"polls": stats["wait_polls"], "evaluations": stats["decisions"]}

    return _Contender("product", sample, sampler.close, sampler.stats()["poller_pid"], counters)


def _product_available() -> bool:
    try:
        import buffer.verl  # noqa: F401
    except ImportError:
        return False
    return True


class _Run:
    """The groups in flight, oldest first, and the next uid to write."""

    def __init__(self, groups: int) -> None:
        self.backlog = deque(uid_of(n) for n in range(groups))
        self.next_uid = groups
        self.step = 0


def _rounds(contender: _Contender, rollouts: Rollouts, run: _Run, rounds: int,
            progress: Callable[[str], None]) -> dict[str, list[float]]:
    rng = random.Random(1)  # the same delays at every K
    out: dict[str, list[float]] = {"thread_cpu": [], "process_cpu": [], "latency": [], "polls": [],
                                   "evaluations": []}
    for r in range(rounds):
        run.step += 1
        uids = [run.backlog.popleft() for _ in range(BATCH)]
        before = contender.counters() if contender.counters else None
        rollouts.finish(uids, LEAD + rng.uniform(0, SPREAD), CHUNKS, GAP)
        thread_cpu, process_cpu = time.thread_time(), time.process_time()
        keys = contender.sample(run.step)
        returned = time.monotonic()
        out["thread_cpu"].append(time.thread_time() - thread_cpu)
        out["process_cpu"].append(time.process_time() - process_cpu)
        if contender.counters and before is not None:
            after = contender.counters()
            out["polls"].append(after["polls"] - before["polls"])
            out["evaluations"].append(after["evaluations"] - before["evaluations"])
        terminal = rollouts.terminal_at(timeout=600)
        out["latency"].append(returned - terminal)
        got = {key.split("_")[0] for key in keys}
        if got != set(uids) or len(keys) != BATCH * SESSIONS:
            raise AssertionError(f"{contender.name} sampled {len(keys)} keys of {len(got)} groups, "
                                 f"not the {BATCH} groups just finished")
        new = [uid_of(run.next_uid + i) for i in range(BATCH)]
        run.next_uid += BATCH
        rollouts.replace(keys, new, run.step)
        run.backlog.extend(new)
        progress(f"verl: {contender.name} round {r + 1}/{rounds}: {out['thread_cpu'][-1] * 1e3:.1f} ms trainer-thread "
                 f"CPU, {out['process_cpu'][-1] * 1e3:.1f} ms process CPU, latency {out['latency'][-1] * 1e3:.0f} ms"
                 + (f", {out['polls'][-1]} polls, {out['evaluations'][-1]} rule evaluations" if out["polls"] else ""))
    return out


def _slowdown(make: Callable[[], _Contender], rollouts: Rollouts, run: _Run, n: int,
              reps: int) -> tuple[float, float, float]:
    """Median of (loop beside the sampler) / (loop without it), rollouts changing tags in both.

    Also the share of a core the trainer's other threads and the sampler's poller process used meanwhile.
    """
    churn = list(run.backlog)[-1000:]
    ratios: list[float] = []
    others: list[float] = []
    poller: list[float] = []
    for _ in range(reps):
        contender = make()
        rollouts.start_churn(churn, 0.005)
        try:
            pid = contender.poller_pid
            before, started = (_cpu_seconds(pid) if pid else 0.0), time.perf_counter()
            beside = _spin(n, others)
            poller.append(((_cpu_seconds(pid) - before) if pid else 0.0) / (time.perf_counter() - started))
        finally:
            rollouts.stop_churn()
            contender.close()
        rollouts.start_churn(churn, 0.005)
        try:
            alone = _spin(n)
        finally:
            rollouts.stop_churn()
        ratios.append(beside / alone)
    return median(ratios), median(others), median(poller)


def _sizes(quick: bool) -> list[tuple[int, int, int]]:
    """(K, verl-v1 rounds, product rounds): fewer of verl's at 1M, where one of its listings alone takes seconds."""
    return [(10_000, 5, 5), (100_000, 3, 5)] if quick else [(10_000, 20, 15), (100_000, 10, 15), (1_000_000, 3, 15)]


def _cpu_row(cpu: Table, k: int, base: dict[str, list[float]], mine: dict[str, list[float]] | None) -> None:
    b_cpu = median(base["thread_cpu"]) * 1e3
    if mine is None:
        cpu.add(f"{k:,}", len(base["thread_cpu"]), b_cpu, median(base["process_cpu"]) * 1e3, "—", "—", "—", "—",
                "—", "—")
        return
    p_cpu = median(mine["thread_cpu"]) * 1e3
    cpu.add(f"{k:,}", len(base["thread_cpu"]), b_cpu, median(base["process_cpu"]) * 1e3, len(mine["thread_cpu"]),
            p_cpu, median(mine["process_cpu"]) * 1e3, b_cpu / p_cpu, median(mine["polls"]),
            median(mine["evaluations"]))


def _flat_goal(cpu: Table, process_ms: dict[int, float], quick: bool) -> None:
    """Product process CPU per sample() at the largest K run against the smallest: flat in K."""
    small, large = min(process_ms), max(process_ms)
    scope = " (--quick runs no 1M: its largest K)" if quick else ""
    cpu.goals.append(Goal(f"product process CPU per sample(), K={large:,} / K={small:,}{scope}",
                          process_ms[large] / process_ms[small], 2.0))


def run(progress: Callable[[str], None], quick: bool) -> list[Table]:
    product = _product_available()
    sizes = _sizes(quick)
    cpu = Table("V1", f"verl v1: trainer CPU per sample(), {BATCH} groups of {SESSIONS} per sample, "
                      f"poll interval {INTERVAL:g} s, SQLite store",
                ["K", "verl-v1 samples", "verl-v1 thread ms", "verl-v1 process ms", "product samples",
                 "product thread ms", "product process ms", "verl-v1 / product thread", "product polls / sample",
                 "product rule evaluations / sample"])
    lat = Table("V2", "verl v1: last group terminal -> sample() returns",
                ["K", "kv_list() ms", "verl-v1 p50 ms", "verl-v1 p99 ms", "product mean ms", "product p50 ms",
                 "product p99 ms"])
    slow = Table("V3", "verl v1: slowdown of a CPU-bound loop in the trainer's main thread, rollouts writing",
                 ["K", "sampler", "slowdown ×", "trainer's other threads, % of a core", "poller process, % of a core"])
    series: dict[str, tuple[list[float], list[float]]] = {"verl-v1": ([], []), "product thread": ([], []),
                                                          "product process": ([], [])}
    process_ms: dict[int, float] = {}
    n = _calibrate(0.5 if quick else 1.0)
    with tempfile.TemporaryDirectory(prefix="bench-verl-") as tmp:
        for k, base_rounds, product_rounds in sizes:
            db = os.path.join(tmp, f"kv-{k}.db")
            progress(f"verl: filling a SQLite store with {k:,} keys")
            run_state = _Run(k // KEYS_PER_GROUP)
            fill(db, len(run_state.backlog))
            with SqliteSource(db) as probe:
                started = time.perf_counter()
                probe.kv_list()
                list_s = time.perf_counter() - started
            rollouts = Rollouts(db)
            try:
                results = {}
                makers: dict[str, Callable[[], _Contender]] = {"verl-v1": partial(_baseline, db)}
                if product:
                    makers["product"] = partial(_product, db)
                for name, make in makers.items():
                    rounds = base_rounds if name == "verl-v1" else product_rounds
                    progress(f"verl: {name}, K={k:,}, {rounds} samples")
                    contender = make()
                    try:
                        results[name] = _rounds(contender, rollouts, run_state, rounds, progress)
                    finally:
                        contender.close()
                if k == 100_000:
                    slowed = dict(makers)
                    if product:
                        slowed[f"product, interval {VERL_INTERVAL:g} s"] = partial(_product, db, VERL_INTERVAL)
                    for name, make in slowed.items():
                        progress(f"verl: slowdown beside {name}, K={k:,}")
                        # The loop spans several polls of the slower schedule too.
                        loop = n * (5 if name.endswith(f"{VERL_INTERVAL:g} s") else 1)
                        ratio, others, poller = _slowdown(make, rollouts, run_state, loop, 3 if quick else 5)
                        slow.add(f"{k:,}", name, ratio, others * 100, poller * 100 if name != "verl-v1" else "—")
                        if name == "product":
                            slow.goals.append(Goal("product slowdown, K=100,000", ratio, 1.05))
            finally:
                rollouts.close()
            base = results["verl-v1"]
            mine = results.get("product")
            _cpu_row(cpu, k, base, mine)
            lat.add(f"{k:,}", list_s * 1e3, percentile(base["latency"], 50) * 1e3,
                    percentile(base["latency"], 99) * 1e3,
                    sum(mine["latency"]) / len(mine["latency"]) * 1e3 if mine else "—",
                    percentile(mine["latency"], 50) * 1e3 if mine else "—",
                    percentile(mine["latency"], 99) * 1e3 if mine else "—")
            series["verl-v1"][0].append(k)
            series["verl-v1"][1].append(median(base["thread_cpu"]) * 1e3)
            if mine:
                process_ms[k] = median(mine["process_cpu"]) * 1e3
                for label, column in (("product thread", "thread_cpu"), ("product process", "process_cpu")):
                    series[label][0].append(k)
                    series[label][1].append(median(mine[column]) * 1e3)
                if k == 100_000:
                    cpu.goals.append(Goal("verl-v1 / product trainer-thread CPU per sample, K=100,000",
                                          median(base["thread_cpu"]) / median(mine["thread_cpu"]), 50.0,
                                          higher_is_better=True))
                    # buffer.verl keeps verl's schedule (a listing every poll_interval while a call waits):
                    # on this store it is to see a change no later than verl's sampler does.
                    lat.goals.append(Goal("product p99 ms ≤ verl-v1's, K=100,000",
                                          percentile(mine["latency"], 99) * 1e3,
                                          percentile(base["latency"], 99) * 1e3))
    if product and len(process_ms) > 1:
        _flat_goal(cpu, process_ms, quick)
    if not product:
        for table in (cpu, lat, slow):
            table.notes.append("product column empty: buffer.verl is not importable on this branch")
    schedule = (f"the rollouts finish the batch's {BATCH} groups in {CHUNKS} commits {GAP * 1e3:.0f} ms apart, the "
                f"first {LEAD:g} s + U(0, {SPREAD:g} s) after the call (the same seeded delays at every K)")
    cpu.notes.append("median per sample(); thread = time.thread_time() of the calling thread over the call, "
                     "process = time.process_time() of the trainer process (all its threads: for the product also "
                     "the receiver applying the poller's changes and the helper asking for listings while the call "
                     "waits) over the same call; a sample() includes its wait for the groups, as in verl, where the "
                     "trainer's thread lists and rebuilds the whole store every poll while it waits")
    cpu.notes.append(f"every K waits the same way: {schedule}; so the product's wait sees about as many polls "
                     "(asked for every poll_interval, counted from the view's age) and as many changes at every K. "
                     "Polls and rule evaluations per sample are the medians of the sampler's own counters "
                     "(stats()['wait_polls'], ['decisions']): a poll that changed no group of the partition re-runs "
                     "no rule")
    lat.notes.append("a change waits for the next poll to start and for that poll's read, diff and transfer. "
                     "verl-v1's period is the larger of the interval and one listing. The product reads the SQLite "
                     "store by change (a poll costs milliseconds whatever K), and while sample() waits its poller "
                     "polls every poll_interval (the SQLite store has no kv_watch), so a change waits about "
                     "interval/2 on average")
    lat.notes.append(f"from the rollout process's commit that made the last of the batch's groups terminal to "
                     f"sample() returning; {schedule}, a random phase of the product's poll schedule and of verl-v1's "
                     "at 10,000 keys; at larger K one verl-v1 listing outlasts the schedule, so it returns after the "
                     "listing under way and one more; kv_list() ms is one listing of the whole store in the "
                     "trainer, the floor of any poller's period at that K")
    slow.notes.append("median of per-pair ratios: the loop beside the sampler (constructed and, for the product, its "
                      "poller reading the store every interval), then the loop without it; the rollout process "
                      "changes one trajectory every 5 ms in both halves. verl's sampler does nothing between "
                      "sample() calls, so its ratio only shows the noise. The product's poller reads only the "
                      "store's changes (its change feed), so it leaves the loop's core alone; the trainer's own "
                      "threads use next to nothing")
    cpu.plot = lambda path: line_plot(path, "trainer CPU per sample()", "keys in the store (K)",
                                      "ms of CPU per sample()", series)
    return [cpu, lat, slow]
