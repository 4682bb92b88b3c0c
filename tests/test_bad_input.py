"""Bad input gets a clear error and changes nothing.

Every numeric argument of the public API is checked where it enters (a NaN
timeout used to spin a core forever, an infinite interval killed the polling
thread unseen); ``add`` is all or nothing; ``remove`` refuses one string
instead of removing its characters.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from buffer import BufferClosed, ReplayBuffer
from poller import PollerProcess
from poller.cli import main
from poller.polling import PollingThread
from poller.wire.protocol import Kind, decode, encode_header

SQLITE = "poller.sources.sqlite:SqliteSource"
NAN, INF = math.nan, math.inf


@pytest.fixture
def rb():
    buffer = ReplayBuffer()  # no poller: only add/remove/sample
    yield buffer
    buffer.close()


# -- remove and add: types, and all or nothing -------------------------------------------------------

def test_remove_refuses_one_string_instead_of_removing_its_characters(rb):
    rb.add("train", {key: {"status": "success"} for key in ("uid1", "u", "i", "d", "1")})
    with pytest.raises(TypeError, match=r"not one str 'uid1': write remove\(partition_id, \['uid1'\]\)"):
        rb.remove("train", "uid1")
    assert sorted(rb.snapshot("train")) == ["1", "d", "i", "u", "uid1"]  # nothing was removed
    with pytest.raises(TypeError, match="not one bytes"):
        rb.remove("train", b"uid1")
    rb.remove("train", ["uid1"])
    assert "uid1" not in rb.snapshot("train")


def test_remove_with_a_bad_key_removes_nothing(rb):
    rb.add("train", {"a": {"v": 1}, "b": {"v": 2}})
    with pytest.raises(TypeError, match="key 7 is int, not a str; nothing was removed"):
        rb.remove("train", ["a", 7])
    with pytest.raises(TypeError, match="partition_id must be a str"):
        rb.remove(None, ["a"])
    with pytest.raises(TypeError, match="iterable"):
        rb.remove("train", 5)
    assert rb.snapshot("train") == {"a": {"v": 1}, "b": {"v": 2}}


@pytest.mark.parametrize("partition, items, match", [
    (1, {"k": {"v": 1}}, "partition_id must be a str, got int 1"),
    (None, {"k": {"v": 1}}, "partition_id must be a str"),
    ("t", {"ok": {"v": 1}, 7: {"v": 2}}, "item key 7 is int, not a str"),
    ("t", {"ok": {"v": 1}, ("a", "b"): {"v": 2}}, "not a str"),
    ("t", {"ok": {"v": 1}, "bad": "success"}, "tags of 'bad' must be a mapping, got str"),
    ("t", {"ok": {"v": 1}, "bad": None}, "tags of 'bad' must be a mapping"),
    ("t", {"ok": {"v": 1}, "bad": {3: "x"}}, "tag name 3 is not a str"),
    ("t", [("ok", {"v": 1})], "items must be a mapping"),
])
def test_add_checks_every_item_before_applying_any(rb, partition, items, match):
    rb.add("t", {"ok": {"v": 0}})
    with pytest.raises(TypeError, match=match):
        rb.add(partition, items)
    assert rb.snapshot() == {"t": {"ok": {"v": 0}}}  # the good item of the batch was not merged either


# -- sample and close: numbers ------------------------------------------------------------------------

def test_sample_with_a_nan_timeout_is_refused_instead_of_spinning(rb):
    rb.add("t", {"k": {"global_steps": 1, "status": "running"}})
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            rb.sample("t", global_steps=1, timeout=NAN)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the test names it
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # before the fix: a busy loop that never times out; closing ends it
        rb.close()
        thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], ValueError), outcome
    assert "timeout must be a number of seconds >= 0 or None, got nan" in str(outcome[0])


@pytest.mark.parametrize("timeout, match", [
    (INF, "finite"), (1e300, "finite"), (-1, ">= 0"), ("10", "number of seconds"), (True, "number of seconds"),
])
def test_sample_refuses_other_bad_timeouts(rb, timeout, match):
    rb.add("t", {"k": {"global_steps": 1, "status": "success"}})
    with pytest.raises(ValueError, match=match):
        rb.sample("t", global_steps=1, timeout=timeout)


@pytest.mark.parametrize("batch_size", [True, False, 0, -1, 1.0, "2"])
def test_sample_refuses_a_batch_size_that_is_not_a_positive_int(rb, batch_size):
    rb.add("t", {"k": {"status": "success"}})
    with pytest.raises(ValueError, match=rf"batch_size must be an int >= 1, got {batch_size!r}"):
        rb.sample("t", batch_size=batch_size, timeout=0.1)


def test_sample_refuses_a_partition_that_is_not_a_str(rb):
    with pytest.raises(TypeError, match="partition_id must be a str"):
        rb.sample(["t"], global_steps=1, timeout=0)


@pytest.mark.parametrize("timeout", [-1, NAN, INF])
def test_close_refuses_a_bad_timeout_and_stays_usable(db, timeout):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.05)
    try:
        with pytest.raises(ValueError, match="timeout must be"):
            rb.close(timeout)
        rb.add("t", {"k": {"status": "success"}})  # still open
        assert rb.stats()["poller_alive"]
    finally:
        report = rb.close()
    assert report.stage == "graceful"
    with pytest.raises(BufferClosed):
        rb.add("t", {"k": {}})


# -- the constructor, PollerProcess, the CLI -------------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("poll_interval", INF), ("poll_interval", NAN), ("poll_interval", 0), ("poll_interval", 1e12),
    ("start_timeout", NAN), ("start_timeout", 0), ("start_timeout", INF),
    ("close_timeout", NAN), ("close_timeout", -1), ("close_timeout", INF),
    ("max_restarts", True), ("max_restarts", -1), ("max_restarts", 2.5),
    ("restart_window", 0), ("restart_window", NAN),
    ("stale_after", INF),
])
def test_buffer_refuses_bad_numbers_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be .*got {value!r}"):
        ReplayBuffer(source=SQLITE, source_kwargs={"path": "/nonexistent/kv.db"}, **{name: value})


@pytest.mark.parametrize("kwargs", [
    {"poll_interval": INF}, {"poll_interval": NAN}, {"stall_timeout": NAN}, {"chunk_items": True}, {"chunk_items": 0},
    {"max_frame_bytes": -1}, {"listing_share": 0},
])
def test_poller_process_refuses_bad_numbers(kwargs: dict[str, Any]):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        PollerProcess(SQLITE, endpoint="ipc:///nonexistent", **kwargs)


def test_poller_process_start_and_close_refuse_bad_timeouts():
    process = PollerProcess(SQLITE, endpoint="ipc:///nonexistent")
    with pytest.raises(ValueError, match="timeout must be"):
        process.start(NAN)
    with pytest.raises(ValueError, match="timeout must be"):
        process.close(-1)
    assert process.close().stage == "no-poller"  # nothing was started


@pytest.mark.parametrize("interval", ["inf", "nan", "1e300"])
def test_cli_run_refuses_a_non_finite_interval(capsys: pytest.CaptureFixture[str], interval: str):
    assert main(["run", "--source", SQLITE, "--connect", "tcp://127.0.0.1:1", "--poll-interval", interval]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--poll-interval must be" in err[0], err


@pytest.mark.parametrize("option, value", [("--seconds", "nan"), ("--poll-interval", "inf"),
                                           ("--poll-interval", "nan")])
def test_cli_demo_refuses_non_finite_numbers(capsys: pytest.CaptureFixture[str], option: str, value: str):
    from buffer.demo import main as demo_main

    assert demo_main([option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0] and "finite" in err[0], err


# -- a polling thread that dies says so ----------------------------------------------------------------------

class _OneListing:
    def kv_list(self) -> Any:
        return {"p": {"k": {"v": 1}}}


def test_a_polling_thread_that_dies_records_why_and_sends_a_fatal_error():
    # poll_interval=inf passed PollerProcess before it was checked; the thread then died in Event.wait(inf)
    # after the first listing, and the poller went on heartbeating as if all were well.
    sent: list[tuple[Kind, bytes]] = []
    thread = PollingThread(_OneListing(), lambda kind, body, *_: sent.append((kind, body)) is None, poll_interval=INF)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(thread.failed, OverflowError)
    assert [kind for kind, _ in sent] == [Kind.DELTA, Kind.ERROR]
    error = decode([encode_header(Kind.ERROR, 1, 0), sent[-1][1]]).body
    assert error.fatal is True and error.type == "OverflowError"
