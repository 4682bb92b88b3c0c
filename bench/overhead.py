"""What polling costs the trainer process: #1 main-thread slowdown, #2 CPU per poll."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from buffer import ReplayBuffer

from . import pinning
from .baselines.mpqueue import MpQueueBuffer
from .baselines.neighbour import Neighbour, cpu_seconds
from .baselines.thread import ThreadBuffer
from .intervals import Estimate, median_of, ratio_of_medians
from .report import Goal, Table, line_plot, median
from .workload import SyntheticSource

SOURCE = "bench.workload:SyntheticSource"
# The synthetic source is an in-memory store without a change feed: these benchmarks measure the
# stream at the poll_interval they set, so the listing share (by default 0.15: a listing of d seconds
# holds the next back to d / 0.15 after it began, which a large K would reach) is turned off for them.
UNBOUNDED = 1.0


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.002)


def ours(keys: int, changes: int, interval: float) -> ReplayBuffer:
    rb = ReplayBuffer(source=SOURCE, source_kwargs={"keys": keys, "changes": changes}, poll_interval=interval,
                      start_timeout=120, listing_share=UNBOUNDED)
    wait_for(lambda: rb.stats()["polls"] >= 2, 300, "the first polls never arrived")
    return rb


def _spin(n: int, others: list[float] | None = None, queued: list[float] | None = None) -> float:
    """A CPU-bound loop in the main thread; returns its wall time.

    ``others`` gets the CPU share of the process's other threads meanwhile
    (a figure the machine's load does not move, unlike the wall time);
    ``queued`` the seconds the loop was runnable but waiting for a core.
    """
    started, cpu, own, waited = time.perf_counter(), time.process_time(), time.thread_time(), _run_queue_wait()
    total = 0
    for i in range(n):
        total += i * i % 7
    wall = time.perf_counter() - started
    if others is not None:
        others.append(((time.process_time() - cpu) - (time.thread_time() - own)) / wall)
    if queued is not None:
        queued.append(_run_queue_wait() - waited)
    return wall


def _run_queue_wait() -> float:
    """Seconds this thread has waited for a core, runnable (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _Loop(NamedTuple):
    """One loop's wall time, and the part of it spent queued for a core."""

    wall: float
    queued: float

    @classmethod
    def collected(cls, n: int, others: list[float] | None = None) -> _Loop:
        """:func:`_spin` from a collected heap.

        A contender's start leaves garbage-collector debt behind (a full
        snapshot's 100k tag dicts) that its steady state does not have; the
        loop alone gets the same collection, so neither half of a pair pays
        for it.
        """
        gc.collect()
        queued: list[float] = []
        return cls(_spin(n, others, queued), queued[0])


def _bracketed(beside: _Loop, before: _Loop, after: _Loop) -> tuple[float, float]:
    """The loop beside a poller against the mean of the loops alone just before and after it.

    A drift of the machine's load within the pair cancels. Second: the same
    without the time queued for a core.
    """
    return (beside.wall / ((before.wall + after.wall) / 2),
            (beside.wall - beside.queued) / ((before.wall - before.queued + after.wall - after.queued) / 2))


def _calibrate(seconds: float) -> int:
    n = 200_000
    while _spin(n) < seconds / 4:
        n *= 2
    return int(n * seconds / _spin(n))


def slowdown(progress: Callable[[str], None], quick: bool) -> Table:
    keys, changes, interval = 100_000, 1000, 0.1
    rounds = 5 if quick else 11
    placement = pinning.plan(pinning.usable_cores())
    table = Table("1", f"main-thread slowdown, K={keys:,}, {changes} changes per poll, {1 / interval:g} polls/s",
                  ["contender", "loop alone ms", "loop beside poller ms", "slowdown ×", "95% interval",
                   "÷ neighbour's", "× without waits for a core", "÷ neighbour's, without waits",
                   "trainer's other threads, % of a core",
                   "process beside, % of a core"])
    product_share: list[float] = []
    contenders: dict[str, Callable[[], Any]] = {
        "product": lambda: ours(keys, changes, interval),
        # Right after the product, at the median CPU share its poller was measured at so far (one loop's
        # reading swings with the other load on its core): the floor the machine sets for a process doing a
        # poller's kind of work beside the trainer.
        "neighbour (no buffer)": lambda: Neighbour(keys, median(product_share)),
        "thread": lambda: _started(ThreadBuffer(SyntheticSource(keys, changes).kv_list, interval)),
        "mpqueue": lambda: _started(MpQueueBuffer(SyntheticSource, {"keys": keys, "changes": changes}, interval)),
    }
    measured = {name: _Measured() for name in contenders}
    with pinning.pinned_self(placement.trainer):
        n = _calibrate(0.3 if quick else 0.6)
        alone = [_Loop.collected(n)]
        for r in range(rounds):
            # Interleaved: every contender once per round, so a change of the machine's load between rounds
            # hits them all, and the product and its neighbour are measured seconds apart.
            for name, make in contenders.items():
                progress(f"slowdown: round {r + 1}/{rounds}, {name}")
                record = measured[name]
                subject = make()
                try:
                    pid = _busy_pid(subject)
                    if pid and placement.beside is not None:
                        pinning.pin_tree(pid, placement.beside)
                    cpu, started = (cpu_seconds(pid) if pid else 0.0), time.perf_counter()
                    record.beside.append(_Loop.collected(n, record.others))
                    if pid:
                        record.shares.append((cpu_seconds(pid) - cpu) / (time.perf_counter() - started))
                finally:
                    subject.close()
                if name == "product":
                    product_share.append(record.shares[-1])
                alone.append(_Loop.collected(n))
                record.alone.append(alone[-2])
                record.ratios.append(_bracketed(record.beside[-1], alone[-2], alone[-1]))
    neighbour = measured["neighbour (no buffer)"]
    for name, record in measured.items():
        spread = median_of(record.slowdowns())
        table.add(name, median([a.wall for a in record.alone]) * 1e3, median([b.wall for b in record.beside]) * 1e3,
                  spread.value, f"{spread.low:.3g}–{spread.high:.3g}",
                  _with_interval(ratio_of_medians(record.slowdowns(), neighbour.slowdowns())),
                  median(record.unqueued()),
                  _with_interval(ratio_of_medians(record.unqueued(), neighbour.unqueued())),
                  median(record.others) * 100, median(record.shares) * 100 if record.shares else "-")
    product = measured["product"]
    table.goals.append(Goal.estimated("product slowdown ÷ the neighbour's (ratio of medians over rounds)",
                                      ratio_of_medians(product.slowdowns(), neighbour.slowdowns()), 1.05))
    table.goals.append(Goal.estimated("trainer's other threads beside the product, % of a core",
                                      median_of([share * 100 for share in product.others]), 2.0))
    table.notes.append(f"{placement.reason}, as on a trainer host with cores to spare"
                       if placement.pinned else f"{placement.reason}: the slowdown also counts the competition "
                                                "for a core")
    table.notes.append(f"{rounds} interleaved rounds, each contender once per round in the order of the rows "
                       "but the neighbour second, right after the product, at the median CPU share the product's "
                       "poller had so far (last column); a round's slowdown is the loop beside the contender "
                       "against the mean of the loops alone just before and just after it, each from a collected "
                       "heap; the loop is pure Python in the trainer's main thread")
    table.notes.append("slowdown ×: the median over rounds, with a 95% interval (percentile bootstrap over rounds, "
                       "fixed seed, bench/intervals.py); ÷ neighbour's: the ratio of the medians of a contender's "
                       "and the neighbour's per-round slowdowns, with its interval from resampling rounds paired")
    table.notes.append("without waits for a core: the same ratio of wall times less the time the loop was runnable "
                       "but queued for a core (/proc/thread-self/schedstat): pinning keeps the poller off the "
                       "loop's core, not the machine's other load, which the wall-time ratio still counts")
    table.notes.append("trainer's other threads: the CPU the trainer process spends beside the loop (receiver, "
                       "supervisor; for thread and mpqueue their merge): what the loop loses to the GIL at most")
    table.notes.append("neighbour: no buffer at all, a process that compares two dicts of K tag dicts (a poller's "
                       "kind of work, each 100 ms as much as takes the product's share of a core, in CPU time), "
                       "placed where the poller is: the floor of a process beside the trainer (shared caches and "
                       "memory bandwidth); the product's own cost is its slowdown beyond this row's")
    return table


@dataclass
class _Measured:
    """One contender's figures, a value per round."""

    alone: list[_Loop] = field(default_factory=list)  # the loop alone just before it
    beside: list[_Loop] = field(default_factory=list)
    ratios: list[tuple[float, float]] = field(default_factory=list)  # (slowdown, without waits for a core)
    others: list[float] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)

    def slowdowns(self) -> list[float]:
        return [wall for wall, _ in self.ratios]

    def unqueued(self) -> list[float]:
        return [in_process for _, in_process in self.ratios]


def _with_interval(estimate: Estimate) -> str:
    return f"{estimate.value:.3g} ({estimate.low:.3g}–{estimate.high:.3g})"


def _busy_pid(subject: Any) -> int | None:
    """The process working beside the loop: the product's poller, mpqueue's or the neighbour (thread: none)."""
    if isinstance(subject, ReplayBuffer):
        return subject.stats()["poller_pid"]  # type: ignore[no-any-return]
    proc = getattr(subject, "_proc", None) or getattr(subject, "_process", None)  # neighbour, mpqueue
    return proc.pid if proc is not None else None


def _started(subject: Any) -> Any:
    subject.wait_polls(2)
    return subject


def cpu_per_poll(progress: Callable[[str], None], quick: bool) -> Table:
    sizes = [1_000, 10_000, 100_000] if quick else [1_000, 10_000, 100_000, 1_000_000]
    # One poll rate for every K, slow enough that the poller keeps up at the
    # largest: per-second costs (heartbeats, wake-ups) then weigh the same.
    changes, interval, polls = 100, (0.25 if quick else 1.0), 4
    table = Table("2", f"trainer-process CPU per poll, {changes} changes per poll, one poll every {interval:g} s",
                  ["K", "product ms/poll", "thread ms/poll", "thread / product"])
    series: dict[str, tuple[list[float], list[float]]] = {"product": ([], []), "thread": ([], [])}
    for k in sizes:
        progress(f"cpu per poll: product K={k:,}")
        rb = ours(k, changes, interval)
        try:
            peer = rb._core.receiver.peer_info(rb._core.name)
            product = _cpu_per(lambda: peer.polls_applied, polls, timeout=300)
        finally:
            rb.close()
        progress(f"cpu per poll: thread K={k:,}")
        tb = _started(ThreadBuffer(SyntheticSource(k, changes).kv_list, interval))
        try:
            thread = _cpu_per(lambda: tb.polls, polls, timeout=600)
        finally:
            tb.close()
        table.add(f"{k:,}", product * 1e3, thread * 1e3, thread / product)
        series["product"][0].append(k)
        series["product"][1].append(product * 1e3)
        series["thread"][0].append(k)
        series["thread"][1].append(thread * 1e3)
    flat = series["product"][1][-1] / series["product"][1][0]
    table.goals.append(Goal(f"product K={sizes[-1]:,} / K={sizes[0]:,}", flat, 2.0))
    table.notes.append("CPU is time.process_time() of the whole trainer process (all threads) from one poll "
                       "boundary to the next, median of polls")
    table.plot = lambda path: line_plot(path, "trainer CPU per poll", "keys in the store (K)", "ms of CPU per poll",
                                        series)
    return table


def _cpu_per(count: Callable[[], int], polls: int, timeout: float) -> float:
    # Median of per-poll costs, each measured from one poll boundary to the next.
    costs = []
    deadline = time.monotonic() + timeout
    last = count()
    cpu = time.process_time()
    while len(costs) < polls and time.monotonic() < deadline:
        time.sleep(0.02)  # rare wake-ups: this loop's own CPU counts too
        now = count()
        if now != last:
            spent = time.process_time()
            costs.append((spent - cpu) / (now - last))
            last, cpu = now, spent
    if not costs:
        raise TimeoutError("no poll completed")
    return median(costs)
