"""A stopped trainer or poller (SIGSTOP: a long GC pause, a debugger, a swapped-out host) gets its stream back.

Each case stops the process holding the buffer, and the poller of another
buffer, while the store changes, then resumes them and requires the buffer to
equal the store again and the close to be graceful and drained. Before the
fix a trainer stopped for 5 s or more never converged: the poller's
connection was dropped and redialled, the buffer refused the new connection
while it still held the old one, and the poller streamed into it for good.
The trials live in :mod:`bench.pauses`, which also measures them.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from bench.pauses import PauseOutcome, run_pause

# Generous: the bound README states is a few seconds; this only says "it converges".
_DEADLINE = 20.0


def _both(stopped_s: float, workdir: str) -> list[PauseOutcome]:
    """The trainer case and the poller case, side by side (each waits mostly)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_pause, target, stopped_s, os.path.join(workdir, target),
                               converge_deadline=_DEADLINE) for target in ("trainer", "poller")]
        return [f.result() for f in futures]


@pytest.mark.parametrize("stopped_s", [1, 5, 10])
@pytest.mark.timeout(120)
def test_a_stopped_process_gets_its_stream_back(stopped_s: float, tmp_path) -> None:
    for target in ("trainer", "poller"):
        os.mkdir(tmp_path / target)
    for outcome in _both(stopped_s, str(tmp_path)):
        assert outcome.ok, outcome
        assert (outcome.missing, outcome.extra, outcome.wrong) == ([], [], []), outcome


@pytest.mark.timeout(180)
def test_a_process_stopped_for_30s_gets_its_stream_back(tmp_path) -> None:
    """The long case: one test, trainer and poller at once, so it costs ~35 s of the suite."""
    for target in ("trainer", "poller"):
        os.mkdir(tmp_path / target)
    for outcome in _both(30, str(tmp_path)):
        assert outcome.ok, outcome


@pytest.mark.parametrize("stopped_s", [1, 5, 10])
@pytest.mark.timeout(120)
def test_a_sync_called_as_a_stopped_trainer_resumes_is_answered(stopped_s: float, tmp_path) -> None:
    """A SYNC sent while the stream reconnects was lost and never sent again: sync() timed out."""
    outcome = run_pause("trainer", stopped_s, str(tmp_path), converge_deadline=_DEADLINE, sync_after=15.0)
    assert outcome.sync_error is None and outcome.sync_s is not None, outcome
    assert outcome.ok, outcome
