"""``python -m bench --only visible-default``: its goals and its listing figure, on synthetic latencies.

No buffer runs here: the arithmetic of the goals (p50 ≤ poll_interval/2 + d + 10 ms, p99 ≤
poll_interval + d + 20 ms) against latencies shaped as a fixed schedule gives them, and as the
2 s cycle of d03d3b3 gave them.
"""

from __future__ import annotations

import pytest

from bench.latency import default_schedule_goals, mean_listing_seconds


def _uniform(low: float, high: float, n: int = 1000) -> list[float]:
    """``n`` latencies spread evenly over [low, high]: a change waits for the next listing, uniformly."""
    return [low + (high - low) * i / (n - 1) for i in range(n)]


def test_a_change_that_waits_for_the_next_listing_of_a_fixed_schedule_meets_both_goals() -> None:
    interval, listing_s = 0.1, 0.0011
    # The next listing is uniform over the interval; then the listing itself and ~2 ms of delivery.
    p50, p99 = default_schedule_goals(interval, _uniform(listing_s + 0.002, interval + listing_s + 0.002), listing_s)
    assert p50.limit == pytest.approx(50 + 1.1 + 10) and p99.limit == pytest.approx(100 + 1.1 + 20)
    assert p50.value == pytest.approx(53.1, abs=0.1) and p99.value == pytest.approx(102.1, abs=0.2)
    assert p50.met and p99.met
    assert "poll_interval 0.1 s" in p50.text and "poll_interval 0.1 s" in p99.text


def test_verls_2s_cycle_at_poll_interval_1s_misses_both_goals() -> None:
    # d03d3b3 at the defaults: the next listing no sooner than 2 s + d + 2p after the last poll was done.
    interval, listing_s = 1.0, 0.0011
    p50, p99 = default_schedule_goals(interval, _uniform(listing_s, 2.0 + 2 * listing_s), listing_s)
    assert p50.limit == pytest.approx(500 + 1.1 + 10) and p99.limit == pytest.approx(1000 + 1.1 + 20)
    assert p50.value > 1000 and not p50.met
    assert p99.value > 1900 and not p99.met


def test_the_listing_figure_is_the_mean_of_the_pollers_listings() -> None:
    assert mean_listing_seconds({"listings": 4, "listing_seconds_total": 0.0048}) == pytest.approx(0.0012)
    # No listing timed (a heartbeat not yet in): the goals then read NaN, which is never met.
    missing = mean_listing_seconds({"listings": 0, "listing_seconds_total": 0.0})
    assert missing != missing
    assert not any(goal.met for goal in default_schedule_goals(0.1, [0.05], missing))
