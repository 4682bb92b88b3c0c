"""The modules one changed key passes through are the ones docs/how-it-works.md lists.

A real poller process (recorded by ``tests/helpers/tracing.py``) and a real buffer (recorded in this
process) carry one key whose tags changed in a SQLite store, from the store to
``ReplayBuffer.sample()``. Every product module whose code runs meanwhile, on the poller's threads,
the buffer's receiver or the sampling call, must be one the SQLite column of the table names or
one the page names as deciding only when the key moves; and every module the table names must run.
(tests/integration/test_tq_verl.py checks the TransferQueue column the same way.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tracing import ALSO_RUN, WHEN_ONLY, documented, trace_one_changed_key


@pytest.mark.parametrize("column", [1, 2])
def test_the_page_lists_at_most_twelve_modules_each_a_step_of_its_own(column: int) -> None:
    steps, section = documented(column)
    stations = [names[0] for names in steps]
    assert 0 < len(stations) <= 12 and len(set(stations)) == len(stations), stations
    for name in [*WHEN_ONLY.values(), *ALSO_RUN.values()]:
        assert f"`{name}`" in section, name


@pytest.mark.timeout(120)
def test_one_changed_key_runs_through_the_modules_the_page_lists(tmp_path: Path) -> None:
    steps, _ = documented(1)
    listed = {name for names in steps for name in names}
    poller, trainer = trace_one_changed_key(tmp_path)
    ran = set().union(*map(set, poller.values()), *map(set, trainer.values()))
    assert ran - WHEN_ONLY.keys() - listed == set(), "a module the page does not list handles the key"
    assert listed - ran == set(), "a module the page lists never ran"
