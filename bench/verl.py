"""``python -m bench --only verl``: verl's v1 sampler against ``buffer.verl`` on the same store.

Both sample the workload of :mod:`bench.verl_workload` from one SQLite store
of K keys, driven the same way: the trainer calls ``sample(global_steps=s,
partition_id="train", batch_size=B)``; after a random delay the rollout
process finishes B groups; the trainer checks that it got exactly those
groups' trajectories, then the rollouts clear them and write B new groups.

* trainer-thread CPU per ``sample()`` (``time.thread_time`` of the calling
  thread) and the whole trainer process's CPU over the same call;
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
INTERVAL = 0.2  # both pollers' interval (buffer.verl's default; verl's own default is 2 s)
BATCH = 64  # groups per sample
VERL_INTERVAL = 2.0  # verl's default poll_interval, for a second slowdown row


class _Contender:
    """One sampler under test: ``sample(step) -> keys``, ``close()``, and its poller's pid if it has one."""

    def __init__(self, name: str, sample: Callable[[int], list[str]], close: Callable[[], Any],
                 poller_pid: int | None = None) -> None:
        self.name = name
        self.sample = sample
        self.close = close
        self.poller_pid = poller_pid


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

    return _Contender("product", sample, sampler.close, sampler.stats()["poller_pid"])


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


def _rounds(contender: _Contender, rollouts: Rollouts, run: _Run, rounds: int, lead: float, spread: float,
            progress: Callable[[str], None]) -> dict[str, list[float]]:
    rng = random.Random(1)
    out: dict[str, list[float]] = {"thread_cpu": [], "process_cpu": [], "latency": []}
    for r in range(rounds):
        run.step += 1
        uids = [run.backlog.popleft() for _ in range(BATCH)]
        # After the sampler's first look at the store, at a random phase of its poll schedule: both
        # schedules start with the call, so the spread covers several of either's periods.
        rollouts.finish(uids, lead + rng.uniform(0, spread))
        thread_cpu, process_cpu = time.thread_time(), time.process_time()
        keys = contender.sample(run.step)
        returned = time.monotonic()
        out["thread_cpu"].append(time.thread_time() - thread_cpu)
        out["process_cpu"].append(time.process_time() - process_cpu)
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
        progress(f"verl: {contender.name} round {r + 1}/{rounds}: {out['thread_cpu'][-1] * 1e3:.1f} ms trainer CPU, "
                 f"latency {out['latency'][-1] * 1e3:.0f} ms")
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


def _sizes(quick: bool) -> list[tuple[int, int]]:
    """(K, rounds): fewer rounds at 1M, where one baseline poll alone takes seconds."""
    return [(10_000, 5), (100_000, 3)] if quick else [(10_000, 20), (100_000, 10), (1_000_000, 3)]


def run(progress: Callable[[str], None], quick: bool) -> list[Table]:
    product = _product_available()
    sizes = _sizes(quick)
    cpu = Table("V1", f"verl v1: trainer CPU per sample(), {BATCH} groups of {SESSIONS} per sample, "
                      f"poll interval {INTERVAL:g} s, SQLite store",
                ["K", "samples", "verl-v1 thread ms", "product thread ms", "verl-v1 / product",
                 "verl-v1 process ms", "product process ms"])
    lat = Table("V2", "verl v1: last group terminal -> sample() returns",
                ["K", "kv_list() ms", "verl-v1 p50 ms", "verl-v1 p99 ms", "product mean ms", "product p50 ms",
                 "product p99 ms"])
    slow = Table("V3", "verl v1: slowdown of a CPU-bound loop in the trainer's main thread, rollouts writing",
                 ["K", "sampler", "slowdown ×", "trainer's other threads, % of a core", "poller process, % of a core"])
    series: dict[str, tuple[list[float], list[float]]] = {"verl-v1": ([], []), "product": ([], [])}
    n = _calibrate(0.5 if quick else 1.0)
    with tempfile.TemporaryDirectory(prefix="bench-verl-") as tmp:
        for k, rounds in sizes:
            db = os.path.join(tmp, f"kv-{k}.db")
            progress(f"verl: filling a SQLite store with {k:,} keys")
            run_state = _Run(k // KEYS_PER_GROUP)
            fill(db, len(run_state.backlog))
            with SqliteSource(db) as probe:
                started = time.perf_counter()
                probe.kv_list()
                list_s = time.perf_counter() - started
            lead = 1.5 * list_s + 0.05
            # verl's period is a listing, its rebuild (about as long again) and the interval.
            spread = 3 * (2 * list_s + INTERVAL)
            rollouts = Rollouts(db)
            try:
                results = {}
                makers: dict[str, Callable[[], _Contender]] = {"verl-v1": partial(_baseline, db)}
                if product:
                    makers["product"] = partial(_product, db)
                for name, make in makers.items():
                    progress(f"verl: {name}, K={k:,}, {rounds} samples")
                    contender = make()
                    try:
                        results[name] = _rounds(contender, rollouts, run_state, rounds, lead, spread, progress)
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
            b_cpu = median(base["thread_cpu"]) * 1e3
            p_cpu = median(mine["thread_cpu"]) * 1e3 if mine else float("nan")
            cpu.add(f"{k:,}", rounds, b_cpu, p_cpu, b_cpu / p_cpu if mine else "—",
                    median(base["process_cpu"]) * 1e3, median(mine["process_cpu"]) * 1e3 if mine else "—")
            lat.add(f"{k:,}", list_s * 1e3, percentile(base["latency"], 50) * 1e3,
                    percentile(base["latency"], 99) * 1e3,
                    sum(mine["latency"]) / len(mine["latency"]) * 1e3 if mine else "—",
                    percentile(mine["latency"], 50) * 1e3 if mine else "—",
                    percentile(mine["latency"], 99) * 1e3 if mine else "—")
            series["verl-v1"][0].append(k)
            series["verl-v1"][1].append(b_cpu)
            if mine:
                series["product"][0].append(k)
                series["product"][1].append(p_cpu)
                if k == 100_000:
                    cpu.goals.append(Goal("verl-v1 / product trainer-thread CPU per sample, K=100,000",
                                          b_cpu / p_cpu, 50.0, higher_is_better=True))
                    lat.goals.append(Goal("product p99 ms, K=100,000", percentile(mine["latency"], 99) * 1e3,
                                          5 + INTERVAL * 1e3 / 2))
    if not product:
        for table in (cpu, lat, slow):
            table.notes.append("product column empty: buffer.verl is not importable on this branch")
    cpu.notes.append("median per sample(); thread = time.thread_time() of the calling thread over the call, "
                     "process = time.process_time() of the trainer process (all its threads) over the same call; "
                     "a sample() includes its wait for the groups, as in verl, where the trainer's thread lists "
                     "and rebuilds the whole store every poll while it waits")
    lat.notes.append("a change waits for the next poll to start and for that poll's read, diff and transfer. "
                     "verl-v1's period is the larger of the interval and one listing. The product reads the SQLite "
                     "store by change (a poll costs milliseconds whatever K), and while sample() waits its poller "
                     "polls every wait_poll_interval (interval/10), so a change waits about interval/20 on average")
    lat.notes.append("from the rollout process's commit that made the last of the batch's groups terminal to "
                     "sample() returning; groups turn terminal after the sampler's first look, at a random time "
                     "spread over three of verl's poll periods (so at a random phase of either schedule); "
                     "kv_list() ms is one listing of the whole store in the trainer, the floor of any poller's "
                     "period at that K")
    slow.notes.append("median of per-pair ratios: the loop beside the sampler (constructed and, for the product, its "
                      "poller reading the store every interval), then the loop without it; the rollout process "
                      "changes one trajectory every 5 ms in both halves. verl's sampler does nothing between "
                      "sample() calls, so its ratio only shows the noise. The product's poller reads only the "
                      "store's changes (its change feed), so it leaves the loop's core alone; the trainer's own "
                      "threads use next to nothing")
    cpu.plot = lambda path: line_plot(path, "trainer-thread CPU per sample()", "keys in the store (K)",
                                      "ms of CPU per sample()", series)
    return [cpu, lat, slow]
