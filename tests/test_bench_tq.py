"""``python -m bench --only tq`` measures over whole listing cycles: its window and per-listing figures.

Synthetic counter readings, no TransferQueue: a sampler whose listing is done with every 2.4 s,
read every 50 ms as the benchmark's host reads it; and synthetic phase records for the
order the phases run in and the reference each sampler phase is compared with.
"""

from __future__ import annotations

import math

import pytest

from bench.report import Goal, Table
from bench.tq import (
    HALF_WIDTH,
    _fill,
    _listing_cpu,
    bracketed,
    controller_share,
    half_width,
    interval,
    median_interval,
    plan,
    read_cost_bound,
    resolved,
    wake_table,
    writer_goal,
)
from bench.tq_host import WATCH_KEYS, around_listings, more_rounds, schedule, window
from bench.tq_wake import KINDS

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
    # The in-phase estimates inform and decide nothing (issue 29): b's 2% of a core beyond the puts against c's 1%.
    assert not any("beyond the puts" in goal.text or "added" in goal.text for goal in table.goals)
    note = next(n for n in table.notes if n.startswith("K=100,000, information"))
    assert note.endswith("beyond the puts (est.): buffer.verl 2, verl's sampler 1")


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
    _fill(table, records, [100_000], "abcd", max_rounds=8)
    goal = next(goal for goal in table.goals if goal.text.startswith("writer slowdown"))
    # b reads 1.05 every round, d 1.0: both resolved (no spread), and b's interval lies above d's and c's.
    assert goal.detail is not None and goal.detail.startswith("b 1.05 [1.05, 1.05]; c 1 [1, 1]; d 1 [1, 1]")
    assert goal.detail.endswith("; 4 rounds") and not goal.met


def test_the_controllers_cpu_goal_is_each_samplers_rate_times_its_cost_alone() -> None:
    records = _records(100_000, {"a": 200.0, "b": 200.0, "c": 200.0}, drift=0.0, listings_of={"b": 5, "c": 4})
    table = _table()
    _fill(table, records, [100_000], "abc", {100_000: {"b": [0.030, 0.036, 0.034, 0.040],
                                                       "c": [0.034, 0.032, 0.038, 0.036]}})
    note = next(n for n in table.notes if "no writer" in n)
    assert "buffer.verl (product) 35 (30, 36, 34, 40)" in note and "verl 0.9.1 sampler 35 (34, 32, 38, 36)" in note
    # Medians 35 ms each; 5 and 4 listings a 10 s phase: 0.5 and 0.4 a second, 1.75% and 1.4% of a core.
    goal = next(goal for goal in table.goals if goal.text.startswith("controller CPU of buffer.verl"))
    assert (goal.value, goal.limit) == pytest.approx((1.75, 1.4)) and not goal.met


def test_the_controllers_cpu_goal_adds_buffer_verls_targeted_reads_at_the_64_key_cost() -> None:
    records = _records(100_000, {"a": 200.0, "b": 200.0, "c": 200.0}, drift=0.0, listings_of={"b": 3, "c": 5})
    for record in records:
        if record["phase"] == "b":
            record.update(reads=40, reads_seconds=10.0)  # 4 reads a second
    listings = {100_000: {"b": [0.035], "c": [0.035]}}
    table = _table()
    _fill(table, records, [100_000], "abc", listings, {100_000: {1: [0.0003], 64: [0.001]}})
    goal = next(goal for goal in table.goals if goal.text.startswith("controller CPU of buffer.verl"))
    # 0.3 listings/s × 35 ms + 4 reads/s × 1 ms (the 64-key read) = 1.05% + 0.4% against 0.5 × 35 ms = 1.75%.
    assert (goal.value, goal.limit) == pytest.approx((1.45, 1.75)) and goal.met
    assert any("plus its reads 0.4% (27.6% of its total)" in n for n in table.notes)
    # Reads whose cost was not measured: no comparison rather than one that leaves them out.
    table = _table()
    _fill(table, records, [100_000], "abc", listings, {100_000: "not measured: no kv_watch"})
    assert not any(goal.text.startswith("controller CPU of buffer.verl") for goal in table.goals)
    assert any("not costed (not measured: no kv_watch)" in n for n in table.notes)


def test_the_cost_sum_and_the_read_bound() -> None:
    assert controller_share(0.5, 0.035) == pytest.approx(1.75)
    assert controller_share(0.5, 0.035, 4.0, 0.001) == pytest.approx(2.15)
    assert controller_share(0.5, 0.035, 0.0, None) == pytest.approx(1.75)  # no reads: nothing left out
    assert controller_share(0.5, 0.035, 4.0, None) is None
    assert WATCH_KEYS == (1, 64)
    assert read_cost_bound({1: [0.0002, 0.0004, 0.0003], 64: [0.002, 0.001, 0.003]}) == 0.002
    assert read_cost_bound("not measured: no kv_watch") is None and read_cost_bound(None) is None
    assert read_cost_bound({1: [0.0003]}) is None


def _slowdowns(b: list[float], c: list[float], d: list[float]) -> dict[str, list[float]]:
    return {"b": b, "c": c, "d": d}


def test_the_writer_goal_is_met_when_b_overlaps_d_or_lies_below_c() -> None:
    # Half-widths: [1.0, 1.02, 1.01, 1.01] has sd 0.0082, ± 0.0082 (0.8% of the mean).
    overlapping = writer_goal(10_000, _slowdowns([1.03, 1.05, 1.04, 1.04], [1.04, 1.06, 1.05, 1.05],
                                                 [1.0, 1.02, 1.01, 1.01]), 4, 8)
    assert not overlapping.met  # b [1.032, 1.048] lies above d [1.002, 1.018] and overlaps c [1.042, 1.058]
    below_c = writer_goal(10_000, _slowdowns([1.03, 1.05, 1.04, 1.04], [1.09, 1.11, 1.10, 1.10],
                                             [1.0, 1.02, 1.01, 1.01]), 4, 8)
    assert below_c.met and below_c.interval == pytest.approx((1.0318, 1.0482), abs=1e-4)
    beside_d = writer_goal(10_000, _slowdowns([1.01, 1.03, 1.02, 1.02], [1.0, 1.02, 1.01, 1.01],
                                              [1.0, 1.02, 1.01, 1.01]), 4, 8)
    assert beside_d.met and beside_d.render().startswith("met: writer slowdown beside buffer.verl")
    below_d = writer_goal(10_000, _slowdowns([0.95, 0.97, 0.96, 0.96], [1.0, 1.02, 1.01, 1.01],
                                             [1.0, 1.02, 1.01, 1.01]), 4, 8)
    assert below_d.met  # faster than the phase that lists nothing: no cost to see


def test_the_writer_goal_is_missed_with_the_half_widths_when_the_cap_is_hit() -> None:
    wide = [0.94, 1.10, 1.0, 1.05, 0.96, 1.09, 1.02, 1.01]  # mean 1.021, sd 0.0569: ± 0.0403, 3.9% of the mean
    goal = writer_goal(100_000, _slowdowns(wide, [1.0] * 8, [1.0, 1.02, 1.01, 1.01, 1.0, 1.02, 1.01, 1.01]), 8, 8)
    assert half_width(wide) == pytest.approx(0.0394, abs=5e-4) and half_width(wide) > HALF_WIDTH
    assert not goal.met  # b overlaps d, but its interval is too wide to tell
    assert goal.detail is not None and "half-widths b 3.9%, c 0.0%, d 0.5%" in goal.detail
    assert goal.detail.endswith("8 rounds, the cap of 8 hit with b wider than 3%")
    assert goal.render().startswith("MISSED: ")
    # One round makes no interval at all.
    assert not writer_goal(10_000, _slowdowns([1.0], [1.0], [1.0]), 1, 8).met
    assert math.isinf(half_width([1.0]))


def test_rounds_are_added_until_every_interval_is_resolved() -> None:
    assert resolved(_slowdowns([1.03, 1.05, 1.04, 1.04], [1.0] * 4, [1.0, 1.02, 1.01, 1.01]))
    assert not resolved(_slowdowns([0.95, 1.10, 1.0, 1.05], [1.0] * 4, [1.0] * 4))
    assert not resolved(_slowdowns([1.0], [1.0], [1.0]))
    # A round added is the next round of the schedule: its first phase a is the last one run.
    for phases in ("abcd", "abd"):
        for done in (2, 4, 7):
            assert schedule(phases, done) + more_rounds(phases, done) == [
                (r if n != 2 * (len(phases) - 1) * done else done - 1, name)
                for n, (r, name) in enumerate(schedule(phases, done + 1))]
    order = schedule("abcd", 4) + more_rounds("abcd", 4) + more_rounds("abcd", 5)
    records = [{"k": 1, "seq": seq, "round": r, "phase": name, "batches": 100.0, "seconds": 1.0,
                "controller_cpu": 0.1} for seq, (r, name) in enumerate(order)]
    # Every sampler phase still has a phase a on both sides; the samplers keep swapping places each round.
    assert all(len([x for x in (seq - 1, seq + 1) if order[x][1] == "a"]) == 2
               for seq, (_, name) in enumerate(order) if name != "a")
    assert len(bracketed(records)) == 6 * 3
    assert [name for _, name in more_rounds("abcd", 4)] == ["b", "a", "c", "a", "d", "a"]
    assert [name for _, name in more_rounds("abcd", 5)] == ["d", "a", "c", "a", "b", "a"]


def test_the_plans() -> None:
    quick, full = plan(True), plan(False)
    assert quick.wake_kinds == ("sample",) and quick.sizes == (10_000,) and quick.wake_samples == 10
    assert quick.min_rounds == quick.max_rounds
    assert full.wake_kinds == tuple(KINDS) == ("sample", "wait", "sync") and full.wake_samples >= 30
    assert (full.min_rounds, full.max_rounds) == (4, 8) and full.sizes == (10_000, 100_000)


def test_a_goal_decided_by_a_rule_renders_what_it_saw() -> None:
    goal = Goal("intervals overlap", 1.0, 2.0, verdict=False, detail="b 1 [0.9, 1.1]; d 1.3 [1.2, 1.4]")
    assert not goal.met and goal.render() == "MISSED: intervals overlap (b 1 [0.9, 1.1]; d 1.3 [1.2, 1.4])"


def test_the_medians_interval_comes_from_order_statistics() -> None:
    # n=30: ranks ⌊15 − 0.98·√30⌋ = 9 and ⌈1 + 15 + 5.37⌉ = 22, the 9th and the 22nd smallest.
    assert median_interval([float(x) for x in range(30)]) == (8.0, 21.0)
    assert median_interval([1.0]) == (1.0, 1.0)  # clamped to the sample


def _block(sampler: str, latencies: list[float], listings: int, kind: str = "sample",
           reads: int = 0) -> dict[str, object]:
    return {"k": 10_000, "kind": kind, "sampler": sampler, "block": 0, "seconds": 10.0, "listings": listings,
            "reads": reads, "latencies": latencies}


def test_the_wake_up_goals_compare_buffer_verl_with_verls_median() -> None:
    records = [_block("b", [0.2, 0.3, 0.4], 4), _block("c", [1.0, 1.2, 1.4], 6)]
    table = wake_table(records, [10_000], {10_000: {"b": [0.002], "c": [0.003]}}, 3)
    goals = {goal.text.split(" (")[0]: (goal.value, goal.limit) for goal in table.goals}
    assert goals["buffer.verl's p50 ≤ 0.5 × verl's"] == (0.3, 0.6)
    assert goals["buffer.verl's p99 ≤ verl's p50"][1] == 1.2
    # 0.4 and 0.6 listings a second at 2 and 3 ms each: 0.08% and 0.18% of a core.
    value, limit = goals["controller CPU of buffer.verl ≤ verl's"]
    assert (round(value, 6), round(limit, 6)) == (0.08, 0.18)


def test_the_wake_up_cpu_adds_the_reads_and_shows_their_share() -> None:
    records = [_block("b", [0.2, 0.3, 0.4], 2, reads=40), _block("c", [1.0, 1.2, 1.4], 5)]
    table = wake_table(records, [10_000], {10_000: {"b": [0.003], "c": [0.003]}}, 3,
                       {10_000: {1: [0.0003, 0.0003], 64: [0.0005, 0.0005]}})
    goal = next(goal for goal in table.goals if goal.text.startswith("controller CPU of buffer.verl"))
    # 0.2 listings/s × 3 ms + 4 reads/s × 0.5 ms = 0.06% + 0.2% of a core, against 0.5 × 3 ms = 0.15%.
    assert (goal.value, goal.limit) == pytest.approx((0.26, 0.15)) and not goal.met
    product = next(row for row in table.rows if row[2].startswith("b:"))
    assert product[9] == "4" and product[11] == "0.5" and product[12] == "0.26" and product[13] == "76.9"
    assert any(n.startswith("K=10,000: the controller's CPU per targeted read") and "64 keys 0.5 (0.5, 0.5)" in n
               for n in table.notes)
    # Reads made, their cost not measured: the CPU goal is left out with the reason, the latency goals stay.
    table = wake_table(records, [10_000], {10_000: {"b": [0.003], "c": [0.003]}}, 3, {10_000: "not measured: x"})
    assert [goal.text.split(" (")[0] for goal in table.goals] == ["buffer.verl's p50 ≤ 0.5 × verl's",
                                                                  "buffer.verl's p99 ≤ verl's p50"]
    assert any("not costed (not measured: x)" in n for n in table.notes)


def test_each_kind_of_wake_up_has_its_own_rows_and_goals() -> None:
    records = [_block(sampler, latencies, 4, kind) for kind in ("sync", "sample", "wait")
               for sampler, latencies in (("b", [0.2, 0.3, 0.4]), ("c", [1.0, 1.2, 1.4]))]
    table = wake_table(records, [10_000], {10_000: {"b": [0.002], "c": [0.003]}}, 3)
    assert [row[0] for row in table.rows] == ["sample", "sample", "wait", "wait", "sync", "sync"]
    for kind in KINDS:
        assert len([goal for goal in table.goals if goal.text.endswith(f", {kind}, K=10,000")]) == 3
