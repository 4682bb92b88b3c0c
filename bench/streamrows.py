"""Fault-matrix rows for the stream itself: stopped processes and a contested ipc path.

Kept apart from :data:`bench.faultmatrix.ROWS` because a stopped-process trial
takes seconds by design (``tests/faults/test_pauses.py`` plays those once);
``python -m bench.faults`` runs both sets.

- ``pause:trainer:10s`` / ``pause:poller:10s``: :func:`bench.pauses.run_pause`,
  the trainer process (or its poller) SIGSTOPped for 10 s while the store
  changes; the buffer must equal the store again after SIGCONT and close
  gracefully and drained.
- ``pause:trainer:6s+sync``: the trainer SIGSTOPped for 6 s, then
  ``sync(timeout=15)`` called the moment it resumes, while its stream
  reconnects: the sync must be answered (a SYNC lost on the reconnect is
  sent again), and the buffer converge as above.
- ``first-view:slow-listing``: every listing of the store takes 6 s, longer
  than the constructor waits: ``sample()`` must give no answer until the
  first complete listing is applied (``TimeoutError`` naming it), then the
  whole step.
- ``bind:same-ipc-path``: a second buffer given the first one's explicit
  ``ipc://`` path is refused (``EndpointInUseError``), and the first buffer's
  stream is untouched, also across a restart of its poller.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from buffer import ReplayBuffer
from buffer.access import EndpointInUseError
from poller.sources.sqlite import SqliteSource

from .faultmatrix import GENEROUS, PARTITION, SQLITE, Outcome, Row, close_bound
from .pauses import run_pause

__all__ = ["STREAM_ROWS", "run_stream_trial"]

STREAM_ROWS: tuple[Row, ...] = (
    Row("pause:trainer:10s", action="pause:trainer:10", close_timeout=5.0),
    Row("pause:poller:10s", action="pause:poller:10", close_timeout=5.0),
    Row("pause:trainer:6s+sync", action="pause:trainer:6:sync", close_timeout=5.0),
    Row("first-view:slow-listing", action="first-view"),
    Row("bind:same-ipc-path", action="bind", saw="EndpointInUseError", restarts=1, once=True),
)


def run_stream_trial(row: Row, workdir: str) -> Outcome:
    """Play one trial of a :data:`STREAM_ROWS` row in ``workdir``."""
    if row.action is not None and row.action.startswith("pause:"):
        return _pause(row, workdir)
    if row.action == "bind":
        return _bind(row, workdir)
    if row.action == "first-view":
        return _first_view(row, workdir)
    raise ValueError(f"not a stream row: {row.name}")


def _pause(row: Row, workdir: str) -> Outcome:
    assert row.action is not None
    _, target, seconds, *sync = row.action.split(":")
    pause = run_pause(target, float(seconds), workdir, converge_deadline=GENEROUS,
                      sync_after=15.0 if sync else None)
    out = Outcome(row.name, stage=pause.stage, close_s=pause.close_s, bound_s=close_bound(row), saw="nothing",
                  restarts=int(pause.stats.get("restarts", 0)), lost=pause.missing, extra=pause.extra,
                  detail=f"converged {pause.converged_s}s after SIGCONT, resyncs {pause.stats.get('resyncs')}"
                         + (f", sync() answered in {pause.sync_s}s" if sync else ""))
    out.problems += pause.problems
    if pause.converged_s is None:
        out.problems.append(f"the buffer did not converge within {GENEROUS}s of SIGCONT")
    if pause.wrong:
        out.problems.append(f"keys with other tags than the store's: {pause.wrong[:20]}")
    return out


def _bind(row: Row, workdir: str) -> Outcome:
    out = Outcome(row.name, bound_s=close_bound(row))
    db = os.path.join(workdir, "kv.db")
    writer = SqliteSource(db)
    short = tempfile.mkdtemp(prefix="bind-", dir="/tmp")  # sun_path holds 107 bytes
    endpoint = f"ipc://{short}/stream"
    marker = os.path.join(workdir, "crashed")
    try:
        writer.kv_put("k1", PARTITION, tag={"v": 1})
        # The first buffer's poller crashes once, after a few polls: its restart
        # reconnects to the path, which is where a second buffer took the stream.
        first = ReplayBuffer("poller.faults:crash", source_kwargs={
            "inner": SQLITE, "inner_kwargs": {"path": db}, "after": 5, "marker": marker, "once": True},
            bind=endpoint, poll_interval=0.02, max_restarts=1, close_timeout=row.close_timeout,
            start_timeout=GENEROUS)
        try:
            try:
                second = ReplayBuffer(bind=endpoint)
            except EndpointInUseError as exc:
                out.saw, out.detail = "EndpointInUseError", str(exc)
                if short not in str(exc):
                    out.problems.append(f"the error does not name the path: {exc}")
            else:
                out.saw = "nothing"
                second.close()
            deadline = time.monotonic() + GENEROUS
            while first.stats()["restarts"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            writer.kv_put("k2", PARTITION, tag={"v": 2})
            want = writer.kv_list()
            while first.snapshot() != want and time.monotonic() < deadline:
                time.sleep(0.02)
            _compare(out, set(want.get(PARTITION, {})), set(first.snapshot(PARTITION)), first)
        finally:
            report = first.close()
        out.stage, out.close_s = report.stage, report.seconds
    finally:
        writer.close()
        shutil.rmtree(short, ignore_errors=True)
    return out


def _compare(out: Outcome, want: set[str], have: set[str], rb: ReplayBuffer) -> None:
    """What the buffer lost and showed extra, against what the store holds; its restarts so far."""
    out.lost, out.extra = sorted(want - have), sorted(have - want)
    out.restarts = rb.stats()["restarts"]


# Longer than the constructor's capped wait for the first listing (5 s).
_SLOW_LISTING_S = 6.0


def _first_view(row: Row, workdir: str) -> Outcome:
    out = Outcome(row.name, bound_s=close_bound(row))
    db = os.path.join(workdir, "kv.db")
    writer = SqliteSource(db)
    keys = [f"s3-{i:04d}" for i in range(1000)]
    writer.kv_batch_put(keys, PARTITION, tags=[{"global_steps": 3, "status": "success"}] * len(keys))
    try:
        rb = ReplayBuffer("poller.faults:slow", source_kwargs={
            "inner": SQLITE, "inner_kwargs": {"path": db}, "seconds": _SLOW_LISTING_S},
            poll_interval=60.0, close_timeout=row.close_timeout, start_timeout=GENEROUS)
        try:
            try:
                early = rb.sample(PARTITION, global_steps=3, timeout=0.2)
            except TimeoutError as exc:
                if "not whole" not in str(exc):
                    out.problems.append(f"the TimeoutError does not say the view is not whole: {exc}")
            else:
                out.problems.append(f"a partial answer of {len(early.keys)} of {len(keys)} keys before the first "
                                    f"complete listing")
            batch = rb.sample(PARTITION, global_steps=3, timeout=GENEROUS)
            out.saw = "nothing"
            out.detail = f"answered {len(batch.keys)} keys once whole"
            _compare(out, set(keys), set(batch.keys), rb)
        finally:
            report = rb.close()
        out.stage, out.close_s = report.stage, report.seconds
    finally:
        writer.close()
    return out
