"""What polling costs the trainer process: #1 main-thread slowdown, #2 CPU per poll."""

from __future__ import annotations

import time
from typing import Any, Callable

from buffer import ReplayBuffer

from .baselines.mpqueue import MpQueueBuffer
from .baselines.thread import ThreadBuffer
from .report import Goal, Table, line_plot, median
from .workload import SyntheticSource

SOURCE = "bench.workload:SyntheticSource"


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.002)


def ours(keys: int, changes: int, interval: float) -> ReplayBuffer:
    rb = ReplayBuffer(source=SOURCE, source_kwargs={"keys": keys, "changes": changes}, poll_interval=interval,
                      start_timeout=120)
    wait_for(lambda: rb.stats()["polls"] >= 2, 300, "the first polls never arrived")
    return rb


def _spin(n: int, others: list[float] | None = None) -> float:
    """A CPU-bound loop in the main thread; returns its wall time.

    ``others`` gets the CPU share of the process's other threads meanwhile
    (a figure the machine's load does not move, unlike the wall time).
    """
    started, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    total = 0
    for i in range(n):
        total += i * i % 7
    wall = time.perf_counter() - started
    if others is not None:
        others.append(((time.process_time() - cpu) - (time.thread_time() - own)) / wall)
    return wall


def _calibrate(seconds: float) -> int:
    n = 200_000
    while _spin(n) < seconds / 4:
        n *= 2
    return int(n * seconds / _spin(n))


def slowdown(progress: Callable[[str], None], quick: bool) -> Table:
    keys, changes, interval = 100_000, 1000, 0.1
    reps = 3 if quick else 5
    n = _calibrate(0.3 if quick else 0.6)
    contenders: dict[str, Callable[[], Any]] = {
        "product": lambda: ours(keys, changes, interval),
        "thread": lambda: _started(ThreadBuffer(SyntheticSource(keys, changes).kv_list, interval)),
        "mpqueue": lambda: _started(MpQueueBuffer(SyntheticSource, {"keys": keys, "changes": changes}, interval)),
    }
    table = Table("1", f"main-thread slowdown, K={keys:,}, {changes} changes per poll, {1 / interval:g} polls/s",
                  ["contender", "loop alone ms", "loop beside poller ms", "slowdown ×",
                   "trainer's other threads, % of a core"])
    results = {}
    for name, make in contenders.items():
        alone, beside, ratios, others = [], [], [], []
        for r in range(reps):
            progress(f"slowdown: {name} {r + 1}/{reps}")
            subject = make()
            try:
                beside.append(_spin(n, others))
            finally:
                subject.close()
            # The loop alone right after, so a change in the machine's load
            # hits both halves of the pair alike.
            alone.append(_spin(n))
            ratios.append(beside[-1] / alone[-1])
        results[name] = median(ratios)
        table.add(name, median(alone) * 1e3, median(beside) * 1e3, results[name], median(others) * 100)
    table.goals.append(Goal("product slowdown", results["product"], 1.05))
    table.notes.append("median of per-pair ratios (loop beside a running poller, then alone); the loop is pure "
                       "Python in the trainer's main thread; the poller process (about 40% of a core here, "
                       "for its O(K) check and diff per poll) shares the machine's cores, so on a loaded machine "
                       "the wall-time slowdown also counts the competition for a core")
    table.notes.append("the last column is the CPU the trainer process spends beside the loop (receiver, "
                       "supervisor; for thread and mpqueue their merge): what the loop loses to the GIL at most")
    return table


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
