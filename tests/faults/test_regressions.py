"""What the fault matrix found broken, each pinned where it was fixed; and the
fault helpers themselves (triggers, the CLI's --fault)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.cli import main
from poller.diff import Diff
from poller.faults import parse_fault, raise_
from poller.faults.peer import RoguePeer
from poller.faults.shapes import nested
from poller.faults.store import delete
from poller.sources.sqlite import SqliteSource
from poller.wire.protocol import Kind, Limits, decode, encode_header, iter_encode_delta
from tests.conftest import wait_until
from tests.helpers.deltas import delta_tags, packed_sent, polled

ROOT = Path(__file__).resolve().parents[2]
SQLITE = "poller.sources.sqlite:SqliteSource"


# -- the encoder refuses what the decoder would refuse -----------------------------------------------

class _Scalar:
    """Stands for a numpy/torch scalar in tests that import neither: a 0-d value with item()."""

    shape = ()

    def __init__(self, value: Any) -> None:
        self.value = value

    def item(self) -> Any:
        return self.value


_Scalar.__module__ = "numpy"


class _Array(_Scalar):
    """Stands for a numpy array: a shape and tolist()."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.shape = (len(value),)

    def tolist(self) -> Any:
        return list(self.value)


_Array.__module__ = "numpy"


@pytest.mark.parametrize("tags, problem", [
    ({7: "seven"}, "tag name 7 is int, not str"),
    ({"nested": [{"ok": 1}, {b"fine": {1.5: "x"}}]}, "tag name b'fine' is bytes"),
    ({"text": "x" * (1024 * 1024 + 1)}, "exceeds max_str_len=1048576"),
    ({"text": "é" * (600 * 1024)}, "exceeds max_str_len=1048576"),  # 1.2 MB of UTF-8 in 600k characters
    ({"blob": b"\0" * (1024 * 1024 + 1)}, "exceeds max_str_len=1048576"),
    ({"deep": nested(40)}, "nested deeper than max_depth=32"),
    ({"big": 2**64}, "fits no msgpack integer"),
    ({"small": -(2**63) - 1}, "fits no msgpack integer"),
    ({"text": "\ud800"}, "not valid UTF-8"),
    ({"obj": object()}, "is not plain data"),
    ({"arr": _Array([1, object()])}, "is not plain data"),
    ({"z": _Scalar(1 + 2j)}, "holds a complex, not a number"),
])
def test_tags_the_receiver_would_refuse_are_quarantined_and_the_rest_flows(tags, problem):
    diff = Diff([{"p": {"k": tags, "good": {"global_steps": 1}}}], {}, full=True, limits=Limits(), size=10)
    bodies = list(iter_encode_delta(diff, diff.deletes, poll=1, started=0.0, full=True, chunk_items=10,
                                    max_frame_bytes=64 * 2**20))
    assert [(r.partition, r.key) for r in diff.refused] == [("p", "k")]
    assert problem in diff.refused[0].reason
    sent = decode([encode_header(Kind.DELTA, 1, 0), bodies[0]]).body
    assert delta_tags(sent) == {"p": {"good": {"global_steps": 1}}}


def test_a_structure_shared_with_itself_exponentially_is_refused_in_bounded_time():
    shared: list = [1]
    for _ in range(22):  # 2**22 leaves if walked naively; within max_depth
        shared = [shared, shared]
    diff = polled({}, {"p": {"k": {"v": shared}, "ok": {"v": 1}}}, full=True, limits=Limits())
    assert [(r.key, r.reason) for r in diff.refused] == [("k", "more than max_items=1000000 values in all")]
    assert diff.upserts == {"p": {"ok": {"v": 1}}}


def test_tags_the_receiver_accepts_pass_the_screen_and_plain_scalars_convert():
    tags = {"s": "x" * 1024 * 1024, "b": b"y", "l": [1, 2.5, None, True], "d": {"a": {}}, "t": (1, "two"),
            "np": _Scalar(3), "big": 2**64 - 1, "neg": -(2**63), "arr": _Array([1, 2])}
    diff = polled({}, {"p": {"k": tags}}, full=True, limits=Limits())
    assert diff.refused == []
    assert diff.upserts["p"]["k"] == {**tags, "t": [1, "two"], "np": 3, "arr": [1, 2]}
    assert type(diff.upserts["p"]["k"]["np"]) is int


def test_a_key_that_turns_bad_is_deleted_from_the_receiver_and_comes_back_when_valid():
    sent = packed_sent({"p": {"k": {"v": 1}, "other": {"v": 1}}})
    diff = polled(sent, {"p": {"k": {"v": 2**70}, "other": {"v": 1}}}, full=False, limits=Limits())
    assert diff.upserts == {} and diff.deletes == {"p": ["k"]} and len(diff.refused) == 1
    diff.diff.commit(sent)
    assert sent == packed_sent({"p": {"other": {"v": 1}}})
    diff = polled(sent, {"p": {"k": {"v": 3}, "other": {"v": 1}}}, full=False, limits=Limits())
    assert diff.upserts == {"p": {"k": {"v": 3}}} and diff.refused == []


# -- the SQLite store deleted or replaced under an open connection --------------------------------------

def test_a_deleted_store_file_is_an_error_once_then_a_new_store(db):
    reader, writer = SqliteSource(db), SqliteSource(db)
    try:
        writer.kv_put("old", "p", tag={"v": 1})
        assert reader.kv_list() == {"p": {"old": {"v": 1}}}
        delete(db)
        with pytest.raises(FileNotFoundError, match="deleted while open"):
            reader.kv_list()  # before the fix: {"p": {"old": ...}} forever, from the unlinked file
        assert reader.kv_list() == {}
        writer.kv_put("new", "p", tag={"v": 2})  # the writer notices too, and writes the new file
        assert reader.kv_list() == {"p": {"new": {"v": 2}}}
    finally:
        reader.close()
        writer.close()


def test_a_replaced_store_file_is_reopened(db, tmp_path):
    other = str(tmp_path / "other.db")
    reader = SqliteSource(db)
    try:
        with SqliteSource(db) as w:
            w.kv_put("old", "p", tag={})
        with SqliteSource(other) as w:
            w.kv_put("restored", "p", tag={})
        assert reader.kv_list() == {"p": {"old": {}}}
        delete(db)
        os.rename(other, db)
        assert reader.kv_list() == {"p": {"restored": {}}}
    finally:
        reader.close()


# -- one name, one stream ------------------------------------------------------------------------------------

def test_only_the_pinned_epoch_may_speak_for_a_name():
    with ReplayBuffer(bind="tcp://127.0.0.1:0") as rb:
        rb._core.receiver.expect("worker", 5)
        with RoguePeer(rb.endpoint, name="worker", epoch=6) as impostor:
            impostor.ready(join=False)  # refused: no first listing is asked of it
            impostor.delta({"p": {"evil": {}}}, full=True, reset=True)
            assert wait_until(lambda: rb.stats()["protocol_errors"] == 2)
        with RoguePeer(rb.endpoint, name="worker", epoch=5) as own:
            own.ready()
            own.delta({"p": {"good": {}}}, full=True, reset=True)
            assert wait_until(lambda: rb.snapshot("p") == {"good": {}})
        assert rb.stats()["protocol_errors"] == 2


def test_a_resync_request_that_went_unanswered_is_asked_again():
    with ReplayBuffer(bind="tcp://127.0.0.1:0") as rb, RoguePeer(rb.endpoint) as peer:
        peer.ready()
        peer.delta({"p": {"a": {}}}, full=True, reset=True)
        peer.delta({"p": {"b": {}}}, seq=5)  # a gap
        first = peer.recv()
        assert first is not None and first.kind is Kind.RESYNC
        # This peer "lost" it and goes on with deltas, which are ignored...
        deadline = time.monotonic() + 10
        again = None
        while again is None and time.monotonic() < deadline:
            peer.delta({"p": {"c": {}}})
            again = peer.recv(0.2)
        # ...until the buffer asks again (before the fix it waited forever).
        assert again is not None and again.kind is Kind.RESYNC
        assert "c" not in rb.snapshot("p")


# -- the faults' own triggers --------------------------------------------------------------------------------

def test_a_fault_fires_after_n_calls_and_once_across_processes(tmp_path):
    marker = str(tmp_path / "fired")
    first = raise_(after=2, marker=marker, once=True, times=None)
    assert first.kv_list() == {} and first.kv_list() == {}
    with pytest.raises(RuntimeError, match="injected fault"):
        first.kv_list()
    assert Path(marker).read_text() == str(os.getpid())
    second = raise_(after=0, marker=marker, once=True)  # as a restarted poller would build it
    assert [second.kv_list() for _ in range(3)] == [{}, {}, {}]


def test_a_fault_waits_for_its_arm_file(tmp_path):
    arm = tmp_path / "arm"
    fault = raise_(when_exists=str(arm), times=1)
    assert fault.kv_list() == {}
    arm.touch()
    with pytest.raises(RuntimeError):
        fault.kv_list()
    assert fault.kv_list() == {}  # times=1: recovered


def test_every_fault_is_exported_and_builds_by_spec():
    import poller.faults as faults
    from poller import load_source

    assert set(faults.FAULTS) <= set(faults.__all__)
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        for name in faults.FAULTS:
            source = load_source(f"poller.faults:{name}", {"after": 1})
            assert isinstance(source, faults.Fault) and source.kv_list() == {}  # not fired yet
    finally:
        signal.signal(signal.SIGUSR2, previous)  # the wedging faults install a handler
    with pytest.raises(ValueError, match="how must be one of"):
        faults.crash(how="politely")
    with pytest.raises(ValueError, match="builtin exception"):
        faults.raise_(exc="NoSuchError")


@pytest.mark.parametrize("text, spec, kwargs", [
    ("hang", "poller.faults:hang", {}),
    ("raise:times=2,message=down", "poller.faults:raise_", {"times": 2, "message": "down"}),
    ("crash:how=segfault,after=3", "poller.faults:crash", {"how": "segfault", "after": 3}),
    ("flaky:p=0.25,seed=7", "poller.faults:flaky", {"p": 0.25, "seed": 7}),
])
def test_parse_fault(text, spec, kwargs):
    assert parse_fault(text) == (spec, kwargs)
    assert parse_fault(text, SQLITE, {"path": "x"}) == (spec, {**kwargs, "inner": SQLITE,
                                                               "inner_kwargs": {"path": "x"}})


@pytest.mark.parametrize("text", ["nosuch", "hang:after", "hang:=3", "crash:how"])
def test_a_bad_fault_is_one_line_and_exit_2(capsys, text):
    assert main(["run", "--fault", text, "--connect", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "error" in err


def test_run_fault_wraps_the_source_and_sigterm_still_ends_a_hung_poller(tmp_path, db, store):
    store.kv_put("k", "train", tag={"status": "success"})
    rb = ReplayBuffer(bind="tcp://127.0.0.1:0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "poller", "run", "--source", SQLITE, "--source-kwargs", json.dumps({"path": db}),
         "--fault", "hang:after=1", "--connect", rb.endpoint, "--poll-interval", "0.02"],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: rb.snapshot("train") == {"k": {"status": "success"}}, timeout=30)
        store.kv_put("late", "train", tag={"status": "success"})
        time.sleep(0.3)
        assert "late" not in rb.snapshot("train")  # kv_list() hangs from the second call on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
        rb.close()
