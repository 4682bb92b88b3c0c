"""``python -m bench --only tq`` measures over whole listing cycles: its window and per-listing figures.

Synthetic counter readings, no TransferQueue: a sampler whose listing is done with every 2.4 s,
read every 50 ms as the benchmark's host reads it; and synthetic phase records for the
order the phases run in and the reference each sampler phase is compared with.
"""

from __future__ import annotations

import pytest

from bench.report import Table
from bench.tq import _fill, _listing_cpu, bracketed, interval, median_interval, wake_table
from bench.tq_host import around_listings, schedule, window

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


def test_every_sampler_phase_runs_between_two_of_phase_a_and_the_samplers_swap_each_round() -> None:
    order = schedule("abc", 4)
    names = [name for _, name in order]
    assert names == ["a", "b", "a", "c", "a", "c", "a", "b", "a", "b", "a", "c", "a", "c", "a", "b", "a"]
    assert [r for r, name in order if name != "a"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [name for _, name in schedule("ab", 2)] == ["a", "b", "a", "b", "a"]


def _records(k: int, rates: dict[str, float], drift: float, cpu_per_batch: float = 0.001,
             listing_cpu: dict[str, float] | None = None, phases: str = "abc",
             listings_of: dict[str, int] | None = None) -> list[dict]:
    """Phase records in :func:`schedule`'s order: each phase's writer rate ``rates[phase]`` times a
    machine that slows by ``drift`` from one phase to the next; the controller's CPU is the puts'
    plus ``listing_cpu[phase]``."""
    listing_cpu = listing_cpu or {}
    records = []
    for seq, (r, name) in enumerate(schedule(phases, 4)):
        rate = rates[name] * (1 - drift) ** seq
        listings = None if name == "a" else (listings_of or {}).get(name, 5)
        records.append({"k": k, "round": r, "seq": seq, "phase": name, "seconds": 10.0, "batches": rate * 10.0,
                        "latencies": [0.004], "controller_cpu": rate * cpu_per_batch + listing_cpu.get(name, 0.0),
                        "lister_cpu": None if name == "a" else 0.05, "listings": listings, "counted": listings,
                        "aligned": True, "around_cpu": 0.0 if listings else None,
                        "around_batches": 0 if listings else None})
    return records


def test_a_steady_drift_of_the_machine_is_not_counted_as_a_samplers_cost() -> None:
    # The writer slows 10% a phase whatever runs beside it; neither sampler costs anything.
    records = _records(10_000, {"a": 200.0, "b": 200.0, "c": 200.0}, drift=0.10)
    for record, rate, cpu in bracketed(records):
        # The mean of the two neighbours of a geometric drift is within 0.5% of the phase's own rate.
        assert rate / _rate_of(record) == pytest.approx(1.0, abs=0.006)
        assert record["controller_cpu"] - cpu == pytest.approx(0.0, abs=0.002)
    table = _table()
    _fill(table, records, [10_000], "abc")
    slowdown = next(goal for goal in table.goals if goal.text.startswith("writer slowdown"))
    assert slowdown.value == pytest.approx(1.0, abs=0.006)
    # Against the run of phase a before it only (a rotated order's reference), the same drift read
    # as an 11% slowdown: what this pairing removes.
    before = {r["seq"]: r for r in records}
    assert _rate_of(before[0]) / _rate_of(before[1]) == pytest.approx(1 / 0.9)


def test_a_sampler_that_slows_the_writer_and_costs_the_controller_is_seen_through_the_drift() -> None:
    records = _records(100_000, {"a": 200.0, "b": 190.0, "c": 200.0}, drift=0.05,
                       listing_cpu={"b": 0.02, "c": 0.01})
    table = _table()
    _fill(table, records, [100_000], "abc")
    goals = {goal.text.split(",")[0]: goal for goal in table.goals}
    assert goals["writer slowdown beside buffer.verl (batches/s a ÷ b)"].value == pytest.approx(200 / 190, rel=0.01)
    beyond = goals["controller CPU beyond the puts (est.): buffer.verl ≤ verl's sampler (the limit)"]
    assert beyond.value == pytest.approx(2.0, abs=0.01) and beyond.limit == pytest.approx(1.0, abs=0.01)
    assert not beyond.met


def test_a_sampler_phase_without_phase_a_beside_it_is_refused() -> None:
    records = [r for r in _records(10_000, {"a": 200.0, "b": 200.0, "c": 200.0}, drift=0.0) if r["seq"] in (1, 2, 3)]
    records = [r for r in records if r["phase"] != "a"]
    with pytest.raises(RuntimeError, match="no phase a beside it"):
        bracketed(records)


def _table() -> Table:
    return Table("TQ", "t", ["K", "phase", "writer batches/s", "put p50 ms", "put p99 ms", "controller %",
                             "beyond", "lister", "listings/s", "ms per listing", "slowdown"])


def _rate_of(record: dict) -> float:
    return record["batches"] / record["seconds"]


@pytest.mark.parametrize("listings, met", [(0, True), (2, False)])
def test_buffer_verl_listing_between_calls_is_a_missed_goal(listings: int, met: bool) -> None:
    # verl's own sampler runs no code between its calls: any listing of buffer.verl's then is a cost verl has not.
    records = _records(100_000, {"a": 200.0, "b": 200.0, "c": 200.0, "d": 200.0}, drift=0.0, phases="abcd",
                       listings_of={"d": listings})
    table = _table()
    _fill(table, records, [100_000], "abcd")
    quiet = next(goal for goal in table.goals if goal.text.startswith("buffer.verl's listings between calls"))
    assert quiet.value == pytest.approx(listings / 10.0) and quiet.met is met
    assert any(row[1] == "d: buffer.verl between calls" for row in table.rows)


def test_each_samplers_slowdown_is_reported_with_the_interval_one_run_can_resolve() -> None:
    # Four rounds reading 1.0, 1.1, 0.9, 1.0: sd 0.0816, so mean ± 2 standard errors is 1 ± 0.0816.
    assert interval([1.0, 1.1, 0.9, 1.0]) == "1 [0.918, 1.08]"
    assert interval([1.05]) == "—"
    records = _records(100_000, {"a": 200.0, "b": 190.0, "c": 200.0, "d": 200.0}, drift=0.0, phases="abcd")
    table = _table()
    _fill(table, records, [100_000], "abcd")
    note = next(n for n in table.notes if "95% interval" in n)
    assert note.endswith("b 1.05 [1.05, 1.05]; c 1 [1, 1]; d 1 [1, 1]")


def test_the_controllers_cpu_per_listing_alone_is_reported_with_what_it_costs_at_each_samplers_rate() -> None:
    records = _records(100_000, {"a": 200.0, "b": 200.0, "c": 200.0}, drift=0.0, listings_of={"b": 5, "c": 4})
    table = _table()
    _fill(table, records, [100_000], "abc", {100_000: {"b": [0.030, 0.036, 0.034, 0.040],
                                                       "c": [0.034, 0.032, 0.038, 0.036]}})
    note = next(n for n in table.notes if "no writer" in n)
    # Medians 35 ms each; 5 and 4 listings a 10 s phase: 0.5 and 0.4 a second, 1.75% and 1.4% of a core.
    assert "buffer.verl (product) 35 (30, 36, 34, 40)" in note and "verl 0.9.1 sampler 35 (34, 32, 38, 36)" in note
    assert note.endswith("buffer.verl (product) 1.75% of a core, verl 0.9.1 sampler 1.4% of a core")


def test_the_medians_interval_comes_from_order_statistics() -> None:
    # n=30: ranks ⌊15 − 0.98·√30⌋ = 9 and ⌈1 + 15 + 5.37⌉ = 22, the 9th and the 22nd smallest.
    assert median_interval([float(x) for x in range(30)]) == (8.0, 21.0)
    assert median_interval([1.0]) == (1.0, 1.0)  # clamped to the sample


def test_the_wake_up_goals_compare_buffer_verl_with_verls_median() -> None:
    def block(sampler: str, latencies: list[float], listings: int) -> dict[str, object]:
        return {"k": 10_000, "sampler": sampler, "block": 0, "seconds": 10.0, "listings": listings, "reads": 0,
                "latencies": latencies}

    records = [block("b", [0.2, 0.3, 0.4], 4), block("c", [1.0, 1.2, 1.4], 6)]
    table = wake_table(records, [10_000], {10_000: {"b": [0.002], "c": [0.003]}}, 3)
    goals = {goal.text.split(" (")[0]: (goal.value, goal.limit) for goal in table.goals}
    assert goals["buffer.verl's p50 ≤ 0.5 × verl's"] == (0.3, 0.6)
    assert goals["buffer.verl's p99 ≤ verl's p50"][1] == 1.2
    # 0.4 and 0.6 listings a second at 2 and 3 ms each: 0.08% and 0.18% of a core.
    value, limit = goals["controller CPU of buffer.verl's listings ≤ verl's"]
    assert (round(value, 6), round(limit, 6)) == (0.08, 0.18)
