"""The fault matrix: every fault, and what must happen when it strikes.

One :class:`Row` per fault names the outcome it must reach; :func:`run_trial`
plays one trial of a row against a real buffer, a real poller process and a
real SQLite store, and returns what happened as an :class:`Outcome`.
``tests/faults`` asserts every row once; ``python -m bench.faults`` repeats
them and tabulates. A trial goes:

1. the store holds step 1; the buffer starts and the trainer samples step 1
   and consumes one key (``remove`` + ``kv_clear``: it must never come back);
2. step 2's ``running`` markers are written and seen;
3. the fault is triggered (an arm file for source faults, an action on the
   SQLite file or by another tool writing it, the trainer removing keys the
   store then writes again, or a rogue peer's frames) and has fired;
4. step 2 completes in the store and the trainer samples it — what it saw is
   the result, an exception, or the protocol errors counted;
5. the buffer is compared with the store: after recovery they must be equal;
   where the poller is gone or stuck, the buffer must still hold exactly what
   it had. Then ``close()``: its stage and time against the stage's bound.

Three counts hold the buffer to the truth of the store where a row can break
it: restarts caused by a record (a row the store cannot read), stale answers
(a ``sample()`` that answered while the store did not answer) and hidden new
versions (a removed key's new version not shown two ``sync()`` calls later).
Each must be 0; a row that does not measure one leaves it ``None``.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from buffer import ReplayBuffer
from poller import PollerCrashed
from poller.faults import store as store_faults
from poller.faults.peer import WIRE_FAULTS, RoguePeer
from poller.sources.sqlite import SqliteSource
from poller.wire.errors import RemoteTraceback
from poller.wire.protocol import Kind

__all__ = ["Row", "Outcome", "ROWS", "run_trial", "close_bound"]

SQLITE = "poller.sources.sqlite:SqliteSource"
PARTITION = "train"
POLL_INTERVAL = 0.02
# How long a trainer waits for step 2 where the fault must stop the data.
STALL_WAIT = 1.0
# How long everything else may take on a loaded machine; never a measured figure.
GENEROUS = 30.0


@dataclass(frozen=True)
class Row:
    """One fault and the outcome it must reach.

    ``saw`` is what the trainer sees: ``"nothing"``, ``"PollerCrashed"``,
    ``"TimeoutError"`` or ``"ProtocolError"`` (counted in ``stats()``).
    ``says``: what a ``TimeoutError`` the trainer saw must say.
    ``converges``: after recovery the buffer equals the store; otherwise
    the buffer must keep exactly what it held before the fault.
    ``kwargs`` go to the fault's factory, or to the action (its ``kind``).
    """

    name: str
    fault: str | None = None            # a poller.faults factory; None: the plain store
    kwargs: dict[str, Any] = field(default_factory=dict)
    action: str | None = None           # a store action (STORE_ACTIONS, OTHER_WRITERS) or a wire fault
    stage: str = "graceful"
    saw: str = "nothing"
    says: str = "still 'running'"
    cause: str | None = None            # the type of PollerCrashed's __cause__, when it must have one
    restarts: int = 0
    converges: bool = True
    max_restarts: int = 1
    close_timeout: float = 0.5
    once: bool = False                  # the fault fires in one poller process only
    quarantined: bool = False           # a record the wire cannot carry: left out and named, the rest flows

    @property
    def bad_record(self) -> bool:
        """The fault is one record (restarts it causes are counted: none allowed)."""
        return self.quarantined or self.action == "blob-key-deleted"

    @property
    def silent_store(self) -> bool:
        """The store stops answering (samples answered meanwhile are counted: none allowed)."""
        return self.fault == "stall"

    @property
    def new_versions(self) -> bool:
        """Removed keys get new versions (those not shown in time are counted: none allowed)."""
        return self.action == "new-version"


def close_bound(row: Row) -> float:
    """The most a ``close()`` reaching ``row.stage`` may take."""
    t = row.close_timeout
    # graceful: STOP + the wait for BYE (at most 1 s); terminated: two waits;
    # killed: two waits and the reap of a SIGKILLed process (5 s bound).
    return {"graceful": t + 1.0, "already-exited": 1.0, "terminated": 2 * t + 1.0, "killed": 2 * t + 5.0}[row.stage]


# libzmq refuses a frame over the buffer's limit (ZMQ_MAXMSGSIZE) and drops
# its sender before the decoder sees anything: nothing to count.
REFUSED_BY_THE_SOCKET = frozenset({"oversized-body"})

# What the SQLite file suffers from outside (poller.faults.store), undone once step 2 is written.
STORE_ACTIONS = ("delete", "lock", "corrupt")
# What other writers of the SQLite file do (another tool, a restore, the trainer's removals), checked at its bound.
OTHER_WRITERS = ("unreadable-row", "blob-key-deleted", "restore", "new-version")
# The store's client gives up after this long while the store does not answer (poller.faults.stall).
STALL_S = 0.3

# A listing that is not a mapping at all is the source's failure; every other kind is one bad record,
# quarantined by the poller while the rest of the store keeps flowing.
_GARBAGE_KINDS = ("partition-not-a-mapping", "non-str-key", "tags-not-a-mapping", "unencodable",
                  "non-str-tag-key", "overlong-string", "deep", "big-int", "non-str-partition")

ROWS: tuple[Row, ...] = (
    Row("healthy"),
    Row("raise_:transient", "raise_", {"times": 2}),
    Row("raise_:forever", "raise_", saw="PollerCrashed", cause="RemoteTraceback", stage="already-exited",
        converges=False, max_restarts=0),
    Row("flaky", "flaky", {"p": 0.2, "seed": 180}),  # this seed has no 4 failures in a row in 5000 calls
    Row("slow", "slow", {"seconds": 0.2}),
    Row("hang", "hang", saw="TimeoutError", converges=False),
    Row("freeze", "freeze", saw="TimeoutError", stage="killed", converges=False),
    Row("ignore_stop", "ignore_stop", saw="TimeoutError", stage="terminated", converges=False),
    Row("ignore_sigterm", "ignore_sigterm", saw="TimeoutError", stage="killed", converges=False),
    *(Row(f"crash:{how}:once", "crash", {"how": how}, restarts=1, once=True)
      for how in ("exit", "segfault", "abort", "sigkill")),
    Row("crash:segfault:always", "crash", {"how": "segfault"}, saw="PollerCrashed", stage="already-exited",
        restarts=1, converges=False),
    Row("garbage:not-a-mapping", "garbage", {"kind": "not-a-mapping"}, saw="PollerCrashed",
        cause="RemoteTraceback", stage="already-exited", converges=False, max_restarts=0),
    *(Row(f"garbage:{kind}", "garbage", {"kind": kind}, max_restarts=0, quarantined=True)
      for kind in _GARBAGE_KINDS),
    Row("huge:16MiB", "huge", {"megabytes": 16}),
    Row("huge:one-2MiB-value", "huge", {"megabytes": 2, "value_bytes": 2 * 1024 * 1024}, max_restarts=0,
        quarantined=True),
    Row("leak", "leak", {"megabytes": 1}),
    *(Row(f"wire:{name}", action=name, saw="nothing" if name in REFUSED_BY_THE_SOCKET else "ProtocolError")
      for name in WIRE_FAULTS),
    Row("wire:replayed-seq", action="replayed-seq", saw="ProtocolError"),
    Row("wire:out-of-order-seq", action="out-of-order-seq", saw="ProtocolError"),
    Row("wire:same-identity", action="same-identity"),
    Row("store:deleted", action="delete"),
    Row("store:locked", action="lock"),
    Row("store:corrupted", action="corrupt", saw="PollerCrashed", cause="RemoteTraceback", stage="already-exited",
        restarts=1, converges=False),
    # The store stops answering: the poller gives up, and its restarts cannot connect until the store is back;
    # those refused start-ups use none of the budget (max_restarts=1 would otherwise be gone at once).
    Row("store:down-at-restart", "down", restarts=1),
    # Another tool writes a row of the SQLite store's kind that it cannot read, in another partition: that row
    # alone is quarantined and named, every other key flows; the record causes no restart.
    *(Row(f"store:unreadable-row:{kind}", action="unreadable-row", kwargs={"kind": kind}, quarantined=True)
      for kind in store_faults.UNREADABLE),
    # A BLOB key written and deleted, three times (once between two polls): its delete is no source error.
    Row("store:blob-key-deleted", action="blob-key-deleted"),
    # The file rolled back to a backup in place, whose writers went on past the poller's cursor: after sync()
    # the buffer equals the store.
    Row("store:restored-backup", action="restore"),
    # The trainer removes keys; the store updates one in place, clears and puts one with new tags, and puts one
    # with the same tags again: the two new versions are shown after two sync() calls, the same record never.
    Row("remove:new-version", action="new-version"),
    # A client with a deadline whose store stops answering, then answers again: no sample() is answered from
    # the last view meanwhile (TimeoutError naming the store), then the data converges.
    Row("store:stops-answering", "stall", {"seconds": STALL_S}, saw="TimeoutError", says="has not answered for"),
    # A polling thread killed by what `except Exception` does not catch: the poller must end with a fatal
    # ERROR (restarted, then PollerCrashed) instead of heartbeating with no polls.
    Row("thread-death:SystemExit", "raise_", {"exc": "SystemExit"}, saw="PollerCrashed", cause="RemoteTraceback",
        stage="already-exited", restarts=1, converges=False),
    # A forked child (a data-loader worker) exits normally: its exit handlers must leave the parent's poller
    # and ipc directory alone, so the parent's next poller (after a SIGKILL here) still streams.
    Row("fork:child-exits", action="fork-exit", restarts=1),
)


@dataclass
class Outcome:
    """What one trial of a row did."""

    row: str
    stage: str = "?"
    close_s: float = 0.0
    bound_s: float = 0.0
    saw: str = "?"
    cause: str | None = None
    detail: str = ""
    restarts: int = 0
    protocol_errors: int = 0
    source_errors: int = 0
    lost: list[str] = field(default_factory=list)
    resurrected: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    record_restarts: int | None = None      # restarts from the bad record on (rows with one)
    stale_answers: int | None = None        # sample() answered while the store did not answer (a silent store)
    hidden_versions: list[str] | None = None  # new versions of removed keys not shown at the bound
    problems: list[str] = field(default_factory=list)

    def mismatches(self, row: Row) -> list[str]:
        """Every way this outcome differs from what ``row`` requires (empty: it passed)."""
        out = list(self.problems)
        for what, want, got in (("stage", row.stage, self.stage), ("trainer saw", row.saw, self.saw),
                                ("restarts", row.restarts, self.restarts)):
            if want != got:
                out.append(f"{what}: want {want!r}, got {got!r} ({self.detail})")
        if row.cause is not None and self.cause != row.cause:
            out.append(f"cause: want {row.cause}, got {self.cause}")
        if self.close_s > self.bound_s:
            out.append(f"close took {self.close_s:.3f}s, over its {self.bound_s:g}s bound")
        for what, keys in (("lost", self.lost), ("resurrected", self.resurrected), ("not in the store", self.extra),
                           ("sampled twice", self.duplicates)):
            if keys:
                out.append(f"keys {what}: {sorted(keys)}")
        truth: list[tuple[bool, str, int | list[str] | None]] = [
            (row.bad_record, "restarts caused by the record", self.record_restarts),
            (row.silent_store, "samples answered while the store did not answer", self.stale_answers),
            (row.new_versions, "new versions of removed keys hidden after two sync()", self.hidden_versions)]
        for measured, counted, count in truth:
            if measured and count is None:
                out.append(f"{counted}: not measured")
            elif count:
                out.append(f"{counted}: {count}")
        return out


def _wait(predicate: Callable[[], bool], timeout: float = GENEROUS) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _source(row: Row, db: str, workdir: str) -> tuple[str, dict[str, Any]]:
    if row.fault is None:
        return SQLITE, {"path": db}
    kwargs = {"inner": SQLITE, "inner_kwargs": {"path": db}, **row.kwargs,
              "when_exists": os.path.join(workdir, "arm"), "marker": os.path.join(workdir, "fired")}
    if row.once:
        kwargs["once"] = True
    return f"poller.faults:{row.fault}", kwargs


def _wire(action: str, rb: ReplayBuffer) -> int:
    """Play a wire fault from a rogue peer; return the protocol errors it must cause."""
    if action == "same-identity":
        with RoguePeer(rb.endpoint, name=rb.stats()["poller_name"], epoch=5) as peer:
            peer.ready(join=False)  # refused while the poller holds the name: nothing answers it
            peer.delta({PARTITION: {"evil": {"global_steps": 2, "status": "success"}}}, full=True, reset=True)
            time.sleep(0.2)  # long enough to be applied, were it accepted
        return 0
    with RoguePeer(rb.endpoint, name=b"rogue") as peer:
        if action in REFUSED_BY_THE_SOCKET:
            peer.send_raw(WIRE_FAULTS[action]())
            time.sleep(0.3)  # long enough to arrive, were it let through
            return 0
        if action in WIRE_FAULTS:
            peer.send_raw(WIRE_FAULTS[action]())
            # Open until counted: a DEALER closed at once drops what it has not sent.
            _wait(lambda: rb.stats()["protocol_errors"] >= 1, 10.0)
            return 1
        peer.ready()
        peer.delta({"rogue": {"r1": {"v": 1}}}, full=True, reset=True)
        if action == "replayed-seq":
            peer.delta({"rogue": {"r1": {"v": 99}}}, seq=1)
        else:  # out of order: one seq skipped (a gap: a RESYNC request), then the late one
            late = peer.seq
            peer.delta({"rogue": {"r2": {"v": 3}}}, seq=late + 1)
            request = peer.recv(5.0)
            if request is None or request.kind is not Kind.RESYNC:
                raise AssertionError(f"the gap brought no RESYNC but {request}")
            peer.delta({"rogue": {"r1": {"v": 99}}}, seq=late)
        if not _wait(lambda: rb.stats()["protocol_errors"] >= 1, 10.0):
            raise AssertionError("the replayed message was not counted")
        if rb.snapshot("rogue").get("r1") != {"v": 1}:
            raise AssertionError(f"a replayed message was applied: {rb.snapshot('rogue')}")
        return 1


def _store_action(action: str, db: str, writer: SqliteSource) -> Callable[[], None]:
    """Do a store fault; return what undoes it once step 2 is written."""
    if action == "delete":
        store_faults.delete(db)
        writer.close()  # its next call opens the new file, as a restarted writer would
        return lambda: None
    if action == "corrupt":
        store_faults.corrupt(db)
        return lambda: None
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with store_faults.lock(db):
            held.set()
            release.wait(GENEROUS)

    holder = threading.Thread(target=hold, name="store-lock")
    holder.start()
    held.wait(GENEROUS)
    # Writers wait for the lock (their timeout is longer); release it soon.
    threading.Timer(0.5, release.set).start()
    return lambda: holder.join(GENEROUS)


def run_trial(row: Row, workdir: str) -> Outcome:
    """Play one trial of ``row`` in ``workdir`` (an empty directory)."""
    out = Outcome(row.name, bound_s=close_bound(row))
    db = os.path.join(workdir, "kv.db")
    writer = SqliteSource(db)
    writer.kv_batch_put([f"k{i}" for i in range(1, 4)], PARTITION, tags=[{"global_steps": 1, "status": "success"}] * 3)
    source, kwargs = _source(row, db, workdir)
    # The faults wrap the store as one without a change feed, and each fires on a count of listings:
    # no listing share, so they come every POLL_INTERVAL (by default they would be 2 s apart).
    rb = ReplayBuffer(source=source, source_kwargs=kwargs, poll_interval=POLL_INTERVAL, max_restarts=row.max_restarts,
                      close_timeout=row.close_timeout, start_timeout=GENEROUS, listing_share=1.0)
    removed: set[str] = set()
    still_hidden: set[str] = set()  # removed keys the store still holds as they were: never shown again
    sampled: list[str] = []
    try:
        def consume(keys: list[str]) -> None:
            sampled.extend(keys)
            rb.remove(PARTITION, keys)
            writer.kv_clear(keys, PARTITION)
            removed.update(keys)

        consume(rb.sample(PARTITION, global_steps=1, timeout=GENEROUS).keys[:1])
        step2 = ["s2a", "s2b"]
        writer.kv_batch_put(step2, PARTITION, tags=[{"global_steps": 2, "status": "running"}] * 2)
        if not _wait(lambda: all(k in rb.snapshot(PARTITION) for k in step2)):
            out.problems.append("step 2's running markers never arrived")
        good = rb.snapshot(PARTITION)
        rss_before = _wait_rss(rb) if row.fault == "leak" else 0
        undo: Callable[[], None] = lambda: None
        want_protocol_errors = 0
        restarts_before = rb.stats()["restarts"]
        if row.fault is not None:
            open(os.path.join(workdir, "arm"), "w").close()
            if not _wait(lambda: os.path.exists(os.path.join(workdir, "fired"))):
                out.problems.append("the fault never fired")
            if row.silent_store:
                out.stale_answers = _stale_answers(rb, out)
        elif row.action in STORE_ACTIONS:
            undo = _store_action(row.action, db, writer)
        elif row.action in OTHER_WRITERS:
            try:
                still_hidden = _another_writer(row, rb, writer, db, workdir, out)
            except (PollerCrashed, TimeoutError) as exc:  # the stream broke: the rest of the trial says how
                out.problems.append(f"{row.action}: {type(exc).__name__}: {exc}")
            removed |= still_hidden
        elif row.action == "fork-exit":
            out.problems.extend(_fork_exit_then_restart(rb))
        elif row.action is not None:
            want_protocol_errors = _wire(row.action, rb)
        try:
            for key in step2:
                writer.kv_put(key, PARTITION, tag={"global_steps": 2, "status": "success"})
        except Exception as exc:  # a corrupted store refuses writes too
            out.detail = f"writer: {type(exc).__name__}: {exc}"
        undo()
        if row.fault == "down":  # the store comes back once restarts were refused for a while
            if not _wait(lambda: rb.stats().get("start_retries", 0) >= 2):
                out.problems.append(f"no refused restarts while the store was down: {rb.stats()}")
            os.unlink(os.path.join(workdir, "arm"))
        _sample_step2(row, rb, out, consume)
        if row.silent_store:  # the store answers again: the first complete poll makes the view fresh
            os.unlink(os.path.join(workdir, "arm"))
            _sample_again(rb, step2, out, consume)
        if row.action in WIRE_FAULTS or row.action in ("replayed-seq", "out-of-order-seq"):
            _wait(lambda: rb.stats()["protocol_errors"] >= want_protocol_errors, 10.0)
        stats = rb.stats()
        if out.saw == "nothing" and stats["protocol_errors"]:
            out.saw = "ProtocolError"
        if row.action in WIRE_FAULTS and stats["protocol_errors"] != want_protocol_errors:
            out.problems.append(f"{stats['protocol_errors']} protocol errors counted, want {want_protocol_errors}")
        if row.fault == "leak" and not _wait(lambda: (rb.stats()["poller_rss"] or 0) > rss_before + 32 * 2**20, 10.0):
            out.problems.append(f"poller_rss did not grow: {rss_before} -> {rb.stats()['poller_rss']}")
        if row.fault == "huge" and not row.quarantined and out.saw == "nothing":
            _check_huge(rb, out)
        if row.quarantined:
            _check_quarantined(rb, out)
        _compare(row, rb, writer, good, removed, still_hidden, out)
        stats = rb.stats()
        out.restarts, out.protocol_errors, out.source_errors = (stats["restarts"], stats["protocol_errors"],
                                                                stats["source_errors"])
        if row.bad_record:
            out.record_restarts = stats["restarts"] - restarts_before
        out.duplicates = sorted({k for k in sampled if sampled.count(k) > 1})
    finally:
        report = rb.close()
        writer.close()
    out.stage, out.close_s = report.stage, report.seconds
    return out


def _fork_exit_then_restart(rb: ReplayBuffer) -> list[str]:
    """Fork a child that exits normally, then SIGKILL the poller; return what went wrong."""
    pid = os.fork()
    if pid == 0:
        try:
            atexit._run_exitfuncs()  # what a normal exit runs in the child: the buffer's finalizer among them
        finally:
            os._exit(0)
    if not _wait(lambda: os.waitpid(pid, os.WNOHANG) != (0, 0)):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return ["the forked child did not exit"]
    os.kill(rb.stats()["poller_pid"], signal.SIGKILL)
    if not _wait(lambda: rb.stats()["restarts"] >= 1 and rb.stats()["poller_alive"]):
        return [f"the poller was not restarted: {rb.stats()}"]
    return []


def _check_huge(rb: ReplayBuffer, out: Outcome) -> None:
    """All of it arrived, and the poller's memory stays put while it keeps listing it."""
    count = len(rb.snapshot("huge"))
    if count != 16 * 1024:
        out.problems.append(f"the huge partition arrived with {count} of {16 * 1024} keys")
    # A heartbeat sent after the huge listing (one a second; the first one
    # comes at start-up, before it).
    time.sleep(1.2)
    first = _wait_rss(rb)
    # Two heartbeats later (one a second): dozens of polls of the same 16 MiB.
    time.sleep(2.2)
    later = rb.stats()["poller_rss"] or 0
    if later > first + 16 * 2**20:
        out.problems.append(f"poller_rss grew from {first} to {later} while listing the same data")


def _check_quarantined(rb: ReplayBuffer, out: Outcome) -> None:
    """The bad record is named and counted, and it cost no source error and no restart."""
    if not _wait(lambda: rb.stats()["quarantined"] >= 1, 10.0):
        out.problems.append(f"the bad record was not quarantined: {rb.stats()}")
        return
    stats = rb.stats()
    if not stats["quarantined_keys"]:
        out.problems.append("stats()['quarantined_keys'] names no key")
    if stats["source_errors"]:
        out.problems.append(f"the bad record cost {stats['source_errors']} source error(s)")


def _wait_rss(rb: ReplayBuffer) -> int:
    _wait(lambda: bool(rb.stats()["poller_rss"]), 10.0)
    return rb.stats()["poller_rss"] or 0


def _sample_step2(row: Row, rb: ReplayBuffer, out: Outcome, consume: Callable[[list[str]], None]) -> None:
    timeout = STALL_WAIT if row.saw == "TimeoutError" else GENEROUS
    try:
        batch = rb.sample(PARTITION, global_steps=2, timeout=timeout)
    except PollerCrashed as exc:
        out.saw, out.detail = "PollerCrashed", str(exc)
        out.cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        if isinstance(exc.__cause__, RemoteTraceback) and "Traceback" not in exc.__cause__.traceback_text:
            out.problems.append("the remote traceback is empty")
    except TimeoutError as exc:
        out.saw, out.detail = "TimeoutError", str(exc)
        if row.says not in str(exc):
            out.problems.append(f"the TimeoutError does not say {row.says!r}: {exc}")
    else:
        out.saw = "nothing"
        if row.silent_store and out.stale_answers is not None:
            out.stale_answers += 1
        consume(batch.keys)


def _stale_answers(rb: ReplayBuffer, out: Outcome) -> int:
    """Once a call of the silent store gave up, ask for what the last view holds; count the answers."""
    if not _wait(lambda: rb.stats()["source_stalls"] >= 1):
        out.problems.append(f"no stalled call was counted: {rb.stats()}")
        return 0
    answers = 0
    # Step 1's two keys left are 'success' in the last view: a stale view would answer both at once.
    for ask in ({"global_steps": 1}, {"batch_size": 1}):
        try:
            rb.sample(PARTITION, timeout=0, **ask)
        except TimeoutError as exc:
            if "has not answered for" not in str(exc):
                out.problems.append(f"sample({ask}) did not name the store that does not answer: {exc}")
        else:
            answers += 1
    return answers


def _sample_again(rb: ReplayBuffer, step2: list[str], out: Outcome, consume: Callable[[list[str]], None]) -> None:
    """The store answers again: step 2 is sampled whole."""
    try:
        batch = rb.sample(PARTITION, global_steps=2, timeout=GENEROUS)
    except Exception as exc:
        out.problems.append(f"no answer once the store answered again: {type(exc).__name__}: {exc}")
        return
    if sorted(batch.keys) != step2:
        out.problems.append(f"step 2 sampled as {batch.keys} once the store answered again")
    consume(batch.keys)


# -- other writers of the SQLite file -----------------------------------------------------------------------


def _another_writer(row: Row, rb: ReplayBuffer, writer: SqliteSource, db: str, workdir: str,
                    out: Outcome) -> set[str]:
    """Play an ``OTHER_WRITERS`` action and check it at its bound.

    Returns the removed keys the store still holds unchanged (they must stay hidden).
    """
    if row.action == "unreadable-row":
        _unreadable_row(rb, writer, db, row.kwargs["kind"], out)
    elif row.action == "blob-key-deleted":
        _blob_key_deleted(rb, db, out)
    elif row.action == "restore":
        _restore_backup(rb, writer, db, os.path.join(workdir, "backup.db"), out)
    else:
        return _new_versions(rb, writer, db, out)
    return set()


def _unreadable_row(rb: ReplayBuffer, writer: SqliteSource, db: str, kind: str, out: Outcome) -> None:
    """Another tool writes a row the store cannot read into another partition: that partition flows too."""
    writer.kv_put("fine", "other", tag={"v": 1})
    store_faults.write_unreadable(db, "other", kind)
    writer.kv_put("after", "other", tag={"v": 2})
    rb.sync(timeout=GENEROUS)
    if rb.snapshot("other") != {"fine": {"v": 1}, "after": {"v": 2}}:
        out.problems.append(f"the other partition's readable keys did not flow: {rb.snapshot('other')}")
    if not _wait(lambda: [partition for partition, *_ in rb.stats()["quarantined_keys"]] == ["other"], 10.0):
        out.problems.append(f"the unreadable row is not the one quarantined: {rb.stats()['quarantined_keys']}")


def _blob_key_deleted(rb: ReplayBuffer, db: str, out: Outcome) -> None:
    """Another tool writes a BLOB key and deletes it, three times; the last time between two polls at most."""
    for round_ in range(3):
        store_faults.write_unreadable(db, PARTITION, "blob-key")
        if round_ < 2:
            rb.sync(timeout=GENEROUS)
            if not _wait(lambda: rb.stats()["quarantined"] == 1, 10.0):
                out.problems.append(f"round {round_}: the BLOB key was not quarantined: {rb.stats()}")
        store_faults.delete_unreadable(db, PARTITION, "blob-key")
        rb.sync(timeout=GENEROUS)
        if not _wait(lambda: rb.stats()["quarantined"] == 0, 10.0):
            out.problems.append(f"round {round_}: the deleted BLOB key stayed quarantined: {rb.stats()}")
    if rb.stats()["source_errors"]:
        out.problems.append(f"the BLOB key's deletes cost {rb.stats()['source_errors']} source error(s)")


def _restore_backup(rb: ReplayBuffer, writer: SqliteSource, db: str, backup: str, out: Outcome) -> None:
    """The file is rolled back in place to a backup whose history went on past the poller's cursor.

    After ``sync()`` the buffer must equal the restored store at once (not at the next reconciliation).
    """
    finished = {"global_steps": 1, "status": "finished"}
    store_faults.backup(db, backup)
    writer.kv_batch_put(["x1", "x2", "x3"], PARTITION, tags=[finished] * 3)  # gone again with the restore
    rb.sync(timeout=GENEROUS)
    with SqliteSource(backup) as restored:  # more writes than the live file took: past the cursor
        restored.kv_batch_put(["n1", "n2", "n3"], PARTITION, tags=[finished] * 3)
        restored.kv_put("k2", PARTITION, tag={"restored": True})
    store_faults.restore(db, backup)
    rb.sync(timeout=GENEROUS)
    _differences(rb.snapshot(PARTITION), writer.kv_list(PARTITION).get(PARTITION, {}), set(), out)


def _new_versions(rb: ReplayBuffer, writer: SqliteSource, db: str, out: Outcome) -> set[str]:
    """The trainer removes three keys; the store then writes new versions of two and the same record of one.

    The new versions must be shown after two ``sync()`` calls (a poll under
    way at the removal may list them: the next complete one shows them,
    docs/using.md); returns the key whose same record must stay hidden.
    """
    finished = {"global_steps": 1, "status": "finished"}
    keys = ["v-in-place", "v-put-again", "v-same-again"]
    writer.kv_batch_put(keys, PARTITION, tags=[finished] * 3)
    rb.sync(timeout=GENEROUS)
    rb.remove(PARTITION, keys)
    writer.kv_put("v-in-place", PARTITION, tag={"status": "failure"})  # updated in place
    store_faults.replace(db, PARTITION, "v-put-again", {"global_steps": 3, "status": "finished"})  # a new record
    store_faults.replace(db, PARTITION, "v-same-again", finished)  # the same record again
    rb.sync(timeout=GENEROUS)
    rb.sync(timeout=GENEROUS)
    have, listed = rb.snapshot(PARTITION), writer.kv_list(PARTITION).get(PARTITION, {})
    out.hidden_versions = [key for key in ("v-in-place", "v-put-again") if have.get(key) != listed.get(key)]
    return {"v-same-again"}


def _compare(row: Row, rb: ReplayBuffer, writer: SqliteSource, good: dict[str, Any], removed: set[str],
             still_hidden: set[str], out: Outcome) -> None:
    if row.converges:
        def listed() -> dict[str, Any]:
            return {k: v for k, v in writer.kv_list(PARTITION).get(PARTITION, {}).items() if k not in still_hidden}

        _wait(lambda: rb.snapshot(PARTITION) == listed(), GENEROUS)
        expected = listed()
    else:
        expected = {k: v for k, v in good.items() if k not in removed}
    _differences(rb.snapshot(PARTITION), expected, removed, out)


def _differences(have: dict[str, Any], expected: dict[str, Any], removed: set[str], out: Outcome) -> None:
    """Add the keys where the buffer (``have``) differs from what it must hold to ``out``."""
    out.lost = sorted(set(out.lost) | {k for k in expected if k not in have})
    out.resurrected = sorted(set(out.resurrected) | {k for k in removed if k in have})
    out.extra = sorted(set(out.extra) | {k for k in have if k not in expected and k not in removed})
    wrong = sorted(k for k in expected if k in have and have[k] != expected[k])
    if wrong:
        out.problems.append(f"keys with other tags than the store's: {wrong}")
