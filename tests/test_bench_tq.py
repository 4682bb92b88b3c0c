"""``python -m bench --only tq`` measures over whole listing cycles: its window and per-listing figures.

Synthetic counter readings, no TransferQueue: a sampler whose listing is done with every 2.4 s,
read every 50 ms as the benchmark's host reads it.
"""

from __future__ import annotations

import pytest

from bench.tq import _listing_cpu
from bench.tq_host import around_listings, window

EVERY, CYCLE = 0.05, 2.4


def _readings(seconds: float, first_mark: float, listing_cpu: float = 0.0, listing_s: float = 0.3,
              puts_cpu_per_s: float = 0.25) -> list[tuple[float, float, float, int, int]]:
    """(time, controller CPU, lister CPU, marks, listings): puts cost ``puts_cpu_per_s`` all along, and each
    listing ``listing_cpu`` more over the ``listing_s`` before its mark."""
    readings = []
    for n in range(int(seconds / EVERY) + 1):
        t = n * EVERY
        marks = 0 if t < first_mark else 1 + int((t - first_mark) / CYCLE + 1e-9)
        cpu = puts_cpu_per_s * t
        for k in range(marks + 1):
            done = first_mark + k * CYCLE
            cpu += listing_cpu * min(1.0, max(0.0, (t - (done - listing_s)) / listing_s))
        readings.append((t, cpu, 0.0, marks, marks))
    return readings


@pytest.mark.parametrize("first_mark", [0.5, 1.3, 2.2])
def test_the_window_holds_whole_cycles_wherever_the_run_begins(first_mark: float) -> None:
    readings = _readings(15.0, first_mark)
    i, j, aligned = window(readings, began=0.0, ended=15.0)
    assert aligned
    listings = readings[j][3] - readings[i][3]
    # From the first listing done with in the run to the last: whole cycles only, so the rate is exact.
    assert readings[j][0] - readings[i][0] == pytest.approx(listings * CYCLE, abs=EVERY)
    assert listings == int((15.0 - first_mark) / CYCLE)


def test_without_two_listings_in_the_run_the_window_is_the_whole_run() -> None:
    readings = _readings(3.0, first_mark=1.0)
    i, j, aligned = window(readings, began=0.0, ended=3.0)
    assert not aligned and (readings[i][0], readings[j][0]) == (0.0, 3.0)


def test_the_cpu_per_listing_is_found_beside_the_puts() -> None:
    readings = _readings(15.0, first_mark=1.0, listing_cpu=0.055)  # 55 ms a listing, as at K=100k
    i, j, _ = window(readings, began=0.0, ended=15.0)
    put_every = 1 / 200  # 200 puts a second, 1.25 ms of the controller each
    starts = [n * put_every for n in range(int(15.0 / put_every))]
    around_cpu, around_batches = around_listings(readings, i, j, starts)
    seconds = readings[j][0] - readings[i][0]
    record = {"controller_cpu": (readings[j][1] - readings[i][1]) / seconds, "seconds": seconds,
              "batches": sum(1 for t in starts if readings[i][0] < t <= readings[j][0]),
              "around_cpu": around_cpu, "around_batches": around_batches}
    listings = readings[j][3] - readings[i][3]
    assert _listing_cpu(record) / listings == pytest.approx(0.055, rel=0.05)
