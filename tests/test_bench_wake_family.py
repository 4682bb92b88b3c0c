"""``python -m bench --only wake-family``: its plan, its seeded wake-ups, its lead schedule and its tables.

Synthetic block records, no TransferQueue: the tables' cells, the wake-ups the strict goal reads, the
controller's CPU with its idle rate taken off, and the goal lines per K and kind.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.runner import BENCHMARKS, NOT_QUICK
from bench.tq_wake import DELAY, KINDS, WakeUp, family_turns, lead_room, predicted_calls
from bench.wake_family import FamilyPlan, _tables, estimate_seconds, fill, plan


def test_the_family_has_every_cell_and_both_forms_fit_their_time() -> None:
    full, quick = plan(False), plan(True)
    assert full.cells == 108 and full.kinds == tuple(KINDS) and full.sizes == (10_000, 100_000)
    assert (full.trains, full.leads, full.clears) == ((0.5, 3.0, 10.0), (0.0, 3.0, 10.0), (True, False))
    assert quick.sizes == (10_000,) and quick.trains == (0.5, 3.0) and quick.reps == 2
    assert estimate_seconds(full) <= 90 * 60 and estimate_seconds(quick) <= 10 * 60
    assert "wake-family" in BENCHMARKS and "wake-family" in NOT_QUICK


def test_the_turns_are_seeded_and_spread_each_cells_delays() -> None:
    turns = family_turns(10_000, "sample", (0.5, 3.0), (0.0, 3.0, 10.0), (True, False), 3)
    assert turns == family_turns(10_000, "sample", (0.5, 3.0), (0.0, 3.0, 10.0), (True, False), 3)
    assert [(t.clears, t.train) for t in turns] == [(True, 0.5), (True, 3.0), (False, 0.5), (False, 3.0)]
    assert [t.settle for t in turns] == [2.5, 0.0, 2.5, 0.0]
    low, high = DELAY
    width = (high - low) / 3
    for turn in turns:
        assert [lead for lead, _ in turn.pairs[:3]] == [0.0, 3.0, 10.0]  # the first round ascending
        for lead in (0.0, 3.0, 10.0):
            delays = sorted(d for each, d in turn.pairs if each == lead)
            # One delay in each third of the range.
            assert [int((d - low) // width) for d in delays] == [0, 1, 2]
    assert turns[0].pairs != family_turns(100_000, "sample", (0.5,), (0.0, 3.0, 10.0), (True,), 3)[0].pairs


def test_a_long_lead_is_put_during_an_earlier_call_and_the_block_starts_early_enough() -> None:
    # A warm-up, then leads 0 and 10 with a 0.5 s train step and 0.2 s of rest after each finish.
    wakeups = [WakeUp("w", 0.0, None, 0.5, True), WakeUp("a", 0.0, 1.0, 0.5, True),
               WakeUp("b", 10.0, 2.0, 0.5, True)]
    assert predicted_calls(wakeups, 0, 100.0, 0.2) == pytest.approx([100.0, 100.7, 102.4])
    assert predicted_calls(wakeups, 1, 50.0, 0.2) == pytest.approx([50.0, 51.7])
    # b's call is predicted 2.4 s after the warm-up's: the block waits 7.6 s for b's prompt to be put 10 s ahead.
    assert lead_room(wakeups, 0.2) == pytest.approx(7.6)
    assert lead_room(wakeups[:2], 0.2) == 0.0


def _wakeup(lead: float, delay: float, latency: float, cpu: float = 0.01) -> dict[str, Any]:
    return {"uid": "x", "warm": False, "lead": lead, "delay": delay, "train": 0.5, "clears": True, "called": 0.0,
            "lead_actual": lead, "cpu": cpu, "window": 3.0, "latency": latency, "after_call": delay}


def _block(sampler: str, wakeups: list[dict[str, Any]], idle: float = 0.0) -> dict[str, Any]:
    warm = {"uid": "w", "warm": True, "lead": 0.0, "delay": None, "train": 0.5, "clears": True, "called": 0.0,
            "lead_actual": 0.0, "cpu": 0.0, "window": 1.0}
    return {"k": 10_000, "kind": "sample", "sampler": sampler, "block": 0, "train": 0.5, "clears": True,
            "seconds": 20.0, "calls": len(wakeups) + 1, "listings": 4, "reads": 2, "process_cpu": 0.1,
            "latencies": [w["latency"] for w in wakeups], "wakeups": [warm, *wakeups], "idle": idle,
            "idle_process": 0.004, "threads": 2, "load": 0.5}


def test_each_cell_is_a_row_with_its_goals_and_lead_0_reads_the_strict_goal_on_late_finishes() -> None:
    chosen = FamilyPlan((10_000,), ("sample",), (0.5,), (0.0, 3.0), (True,), 2)
    blocks = [
        _block("b", [_wakeup(0.0, 1.0, 0.3, 0.012), _wakeup(3.0, 1.0, 0.2, 0.012),
                     _wakeup(0.0, 2.2, 0.2, 0.012), _wakeup(3.0, 2.0, 0.4, 0.012)], idle=0.001),
        _block("c", [_wakeup(0.0, 1.0, 1.0), _wakeup(3.0, 1.0, 1.0), _wakeup(0.0, 2.2, 1.0),
                     _wakeup(3.0, 2.0, 0.6)], idle=0.001),
    ]
    table, summary = _tables(chosen)
    fill(table, summary, blocks, chosen)
    rows = {row[3]: row for row in table.rows}
    assert set(rows) == {"0", "3"} and all(row[5] == 2 for row in rows.values())
    # Lead 0: p50 0.25 against 1.0; the strict goal reads only the wake-up that finished 2.2 s after the call.
    assert rows["0"][9] == "0.25" and rows["0"][10] == "0.2 (n=1)"
    assert rows["3"][9] == "0.375" and rows["3"][10] == "0.375"
    # CPU: 12 ms and 10 ms a call less 3 s × 1 ms/s idle: 9 ms against 7 ms, missed.
    assert (rows["0"][13], rows["0"][14]) == ("7", "9")
    assert [row[16:] for row in table.rows] == [["met", "met", "MISSED"]] * 2
    goals = {goal.text.split(" (")[0].split(" where")[0].split(" in every")[0]: goal for goal in table.goals}
    assert goals["p50 ≤ 0.5 × verl's"].met and goals["p50 ≤ 1 × verl's"].met
    cpu = goals["controller CPU per call ≤ verl's"]
    assert not cpu.met and cpu.detail is not None and cpu.detail.startswith("0/2 cells")
    late = next(goal for goal in table.goals if "pooled over every cell" in goal.text)
    assert (late.value, late.limit) == (pytest.approx(0.2), 0.5)
    by_dimension = {row[0]: row for row in summary.rows}
    assert by_dimension["all cells"][1:3] == [2, 4]
    assert by_dimension["lead 0 s, group finished ≥ 2 s after the call"][2] == 1
    assert by_dimension["lead 0 s"][9] == "1/1" and by_dimension["all cells"][14] == "0/2"
    assert any("whole process, ms per call" in note for note in table.notes)
