"""The fault matrix, one trial per row: each fault reaches the outcome its row names.

The rows and the trial live in :mod:`bench.faultmatrix`, which
``python -m bench.faults`` repeats for the reliability report.
"""

from __future__ import annotations

import pytest

from bench.faultmatrix import ROWS, Row, run_trial


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_fault_matrix(row: Row, tmp_path) -> None:
    outcome = run_trial(row, str(tmp_path))
    assert outcome.mismatches(row) == [], outcome
