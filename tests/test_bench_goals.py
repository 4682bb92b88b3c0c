"""The arithmetic and the pinning behind the goals of #1 (slowdown), #3 (change -> visible) and #5 (close).

Synthetic figures, no timing: the interval of a ratio of medians over paired
rounds, how goals render and decide, the #3 goal limits, and the pinning
helpers on a real child process (its threads moved, this process's masks
put back).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from bench import pinning
from bench.intervals import median_of, ratio_of_medians
from bench.latency import fixed_schedule_goals
from bench.report import Goal


def test_the_ratio_of_medians_and_its_interval_from_paired_rounds() -> None:
    product = [1.10, 1.12, 1.08, 1.30, 1.11, 1.09, 1.13]
    neighbour = [1.00, 1.02, 0.99, 1.18, 1.01, 1.00, 1.03]
    estimate = ratio_of_medians(product, neighbour)
    assert estimate.value == pytest.approx(1.11 / 1.01)
    assert estimate.rounds == 7
    assert estimate.low <= estimate.value <= estimate.high
    # Resampling picks whole rounds, so the interval stays within the ratios that a round's medians can make.
    assert estimate.low >= min(product) / max(neighbour) and estimate.high <= max(product) / min(neighbour)
    # A fixed seed: the same figures print the same interval.
    assert ratio_of_medians(product, neighbour) == estimate


def test_the_interval_narrows_as_rounds_agree() -> None:
    steady = ratio_of_medians([1.1] * 9, [1.0] * 9)
    assert (steady.low, steady.value, steady.high) == pytest.approx((1.1, 1.1, 1.1))
    noisy = ratio_of_medians([1.1, 1.3, 0.9, 1.2, 1.0, 1.25, 0.95, 1.15, 1.05], [1.0] * 9)
    assert noisy.high - noisy.low > 0.1
    assert noisy.low < 1.1 < noisy.high


def test_a_median_alone_gets_the_same_interval() -> None:
    estimate = median_of([2.0, 3.0, 2.5, 2.2, 4.0])
    assert estimate.value == 2.5
    assert 2.0 <= estimate.low <= 2.5 <= estimate.high <= 4.0


@pytest.mark.parametrize("cases, references, message", [
    ([1.0, 2.0], [1.0], "must pair"),
    ([], [], "no rounds"),
    ([1.0], [0.0], "positive"),
])
def test_figures_that_make_no_ratio_are_refused(cases: list[float], references: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ratio_of_medians(cases, references)


def test_a_goal_on_an_estimate_is_decided_by_its_value_and_prints_its_interval() -> None:
    met = Goal.estimated("product ÷ neighbour", ratio_of_medians([1.04, 1.05, 1.03], [1.0, 1.0, 1.0]), 1.05)
    assert met.met and met.value == pytest.approx(1.04)
    assert "95% interval 1.03–1.05" in met.render() and met.render().startswith("met:")
    missed = Goal.estimated("idle close / its poller's kill", ratio_of_medians([2.4, 2.6, 2.5], [1.0, 1.0, 1.0]), 2.0)
    assert not missed.met and missed.render().startswith("MISSED:")
    assert "interval" not in Goal("plain", 1.0, 2.0).render()


def test_change_to_visible_goals_are_half_an_interval_plus_5_ms_and_an_interval_plus_10() -> None:
    uniform = [0.002 + 0.1 * i / 999 for i in range(1000)]  # the wait for the next poll, and 2 ms of delivery
    p50, p99 = fixed_schedule_goals(0.1, uniform, "K=1,000")
    assert (p50.limit, p99.limit) == pytest.approx((55.0, 110.0))
    assert p50.value == pytest.approx(52.0, abs=0.1) and p50.met and p99.met
    slow = [latency + 0.004 for latency in uniform]  # 6 ms beyond the wait: more than a poll's share
    assert not fixed_schedule_goals(0.1, slow, "K=1,000")[0].met
    assert fixed_schedule_goals(1.0, uniform, "x")[0].limit == pytest.approx(505.0)


def test_the_plan_pins_two_cores_apart_and_says_when_it_cannot() -> None:
    placement = pinning.plan({3, 1, 7})
    assert placement.pinned and placement.trainer == {1} and placement.beside == {3}
    for usable in ({5}, set()):
        alone = pinning.plan(usable)
        assert not alone.pinned and alone.beside is None
        assert "not pinned" in alone.reason and f"{len(usable)} usable core" in alone.reason


_CHILD = """
import os, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
sys.stdin.read()
os.kill(child, 9)
os.waitpid(child, 0)
"""


def test_pin_tree_moves_every_thread_of_a_process_and_of_its_children() -> None:
    core = min(pinning.usable_cores())
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        threads = pinning.threads_of(proc.pid) + pinning.threads_of(grandchild)
        assert len(threads) == 3  # the child's two threads (main, sleeper) and its fork
        assert pinning.pin_tree(proc.pid, {core}) == 3
        assert all(os.sched_getaffinity(tid) == {core} for tid in threads)
    finally:
        proc.communicate("", timeout=30)
    assert pinning.threads_of(proc.pid) == [] and pinning.pin_tree(proc.pid, {core}) == 0  # gone: nothing moved


def test_pinned_self_puts_back_every_threads_own_mask() -> None:
    usable = pinning.usable_cores()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, args=(30,))
    worker.start()
    try:
        assert worker.native_id is not None
        before = {tid: os.sched_getaffinity(tid) for tid in pinning.threads_of(os.getpid())}
        with pinning.pinned_self({min(usable)}):
            assert os.sched_getaffinity(0) == {min(usable)}
            assert os.sched_getaffinity(worker.native_id) == {min(usable)}
        assert {tid: os.sched_getaffinity(tid) for tid in pinning.threads_of(os.getpid())} == before
        with pinning.pinned_self(None):  # a machine it cannot pin on: nothing moves
            assert os.sched_getaffinity(0) == usable
    finally:
        stop.set()
        worker.join(10)
