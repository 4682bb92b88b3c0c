"""The TransferQueue source without TransferQueue: its request codec, its
arguments, its deadline against an address where nothing answers, and that
importing it stays light. Against a real TransferQueue: tests/integration."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from buffer import ReplayBuffer
from poller import PollerStartupError
from poller.sources.contract import SourceStall
from poller.sources.transferqueue import (
    KNOWN_VERSIONS,
    KV_LIST,
    SPEC,
    TransferQueueProtocolError,
    TransferQueueReplyError,
    TransferQueueSource,
    decode_reply,
    encode_request,
    source_kwargs,
)
from poller.wire.vocabulary import UnreadableValue
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "ray", "transfer_queue", "tensordict")


def heavy_modules_after(statement: str) -> list[str]:
    """Top-level heavy packages in sys.modules after running ``statement`` in a fresh interpreter."""
    code = (f"import json, sys; {statement}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_importing_the_packages_and_the_source_loads_no_transferqueue_ray_or_torch():
    assert heavy_modules_after("import poller, buffer, poller.sources.transferqueue") == []


def _reply(request_type: str, body: dict) -> list[bytes]:
    return [msgpack.packb({"request_type": request_type, "sender_id": "c", "receiver_id": "me",
                           "request_id": "1", "timestamp": 0.0, "body": body})]


def test_a_request_is_one_msgpack_map_the_controller_understands():
    frames = encode_request(KV_LIST, {"partition_id": None}, sender_id="me", receiver_id="TQ_CONTROLLER_1")
    assert len(frames) == 1
    message = msgpack.unpackb(frames[0])
    assert message["request_type"] == "KV_LIST" and message["body"] == {"partition_id": None}
    assert message["sender_id"] == "me" and message["receiver_id"] == "TQ_CONTROLLER_1"
    assert isinstance(message["request_id"], str) and isinstance(message["timestamp"], float)
    with pytest.raises(ValueError):
        encode_request("PUT", {}, sender_id="me", receiver_id=None)


def test_a_listing_reply_passes_through_unchanged():
    info = {"train": {"k": {"global_steps": 3, "status": "running", "score": 0.5, "extra": [1, None]}}}
    body = decode_reply(KV_LIST, _reply("KV_LIST_RESPONSE", {"partition_info": info, "message": "success"}))
    assert body["partition_info"] == info


@pytest.mark.parametrize("frames, match", [
    (_reply("REQUEST_ERROR", {"success": False, "message": "boom"}), "refused KV_LIST: boom"),
    (_reply("GET_META_RESPONSE", {}), "expected KV_LIST_RESPONSE"),
    ([b"\xc1\xfe\xed", b"pickle bytes"], "malformed reply.*UnpicklingError"),
    ([b"\xc1\xfe\xed"], "pickled reply of 1 frames"),
    ([b"\xc1\xfe\xed", pickle.dumps(["KV_LIST_RESPONSE"])], "not a message map"),
    ([b"\x93\x01"], "malformed"),
    ([msgpack.packb([1, 2])], "not a message map"),
    ([], "empty reply"),
])
def test_replies_this_side_will_not_read_are_refused_with_the_reason(frames, match):
    with pytest.raises(TransferQueueReplyError, match=match):
        decode_reply(KV_LIST, frames)


@pytest.mark.parametrize("kwargs, match", [
    ({"address": "127.0.0.1:5555"}, "address"),
    ({"address": "tcp://127.0.0.1:1", "partition_ids": "train"}, "not one string"),
    ({"address": "tcp://127.0.0.1:1", "partition_ids": []}, "non-empty"),
    ({"address": "tcp://127.0.0.1:1", "partition_ids": ["train", ""]}, "non-empty"),
    ({"address": "tcp://127.0.0.1:1", "call_timeout": 0}, "call_timeout"),
    ({"address": "tcp://127.0.0.1:1", "call_timeout": float("nan")}, "call_timeout"),
    ({"address": "tcp://127.0.0.1:1", "call_timeout": None}, "call_timeout"),
    ({"address": "tcp://127.0.0.1:1", "probe_timeout": -1}, "probe_timeout"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransferQueueSource(**kwargs)


def test_source_kwargs_from_the_address_info_init_returns():
    info = {"role": "TransferQueueController", "id": "TQ_CONTROLLER_1", "ip": "127.0.0.1",
            "ports": {"handshake_socket": 1, "request_handle_socket": 4242}}
    kwargs = source_kwargs({"controller": {"zmq_info": info}}, partition_ids=("train",), call_timeout=2.0)
    assert kwargs == {"address": "tcp://127.0.0.1:4242", "controller_id": "TQ_CONTROLLER_1",
                      "partition_ids": ["train"], "call_timeout": 2.0, "probe_timeout": 10.0,
                      "controller_version": _installed_tq()}
    assert json.loads(json.dumps(kwargs)) == kwargs  # plain data: picklable, and fit for --source-kwargs
    assert source_kwargs(dict(info, ip="::1"))["address"] == "tcp://[::1]:4242"
    with pytest.raises(ValueError, match="request_handle_socket"):
        source_kwargs(dict(info, ports={"handshake_socket": 1}))
    with pytest.raises(ValueError, match="no TransferQueue controller address"):
        source_kwargs({"controller": {"zmq_info": {"nothing": 1}}})


def _installed_tq() -> str | None:
    try:
        return importlib.metadata.version("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        return None


def _dead_address() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def test_kv_list_gives_up_at_its_deadline_with_a_stall():
    source = TransferQueueSource(_dead_address(), call_timeout=0.2, probe_timeout=None, partition_ids=["a", "b"])
    try:
        started = time.monotonic()
        with pytest.raises(SourceStall, match=r"kv_list\('a'\) within 0.2s"):
            source.kv_list()
        assert time.monotonic() - started < 5  # the deadline holds for the whole call (0.2 s)
    finally:
        source.close()


def test_an_address_zeromq_cannot_connect_to_fails_every_call_not_as_a_stall():
    # A failure counts towards max_failures and ends a poller; a stall is only counted. The socket that could
    # not connect must not be kept for the next call, which would then wait out its deadline.
    source = TransferQueueSource("tcp://no-port-here", call_timeout=0.2, probe_timeout=None)
    try:
        for _ in range(3):
            with pytest.raises(zmq.ZMQError):
                source.kv_list()
    finally:
        source.close()


def test_a_wrong_address_fails_the_start_up_with_a_clear_error():
    started = time.monotonic()
    with pytest.raises(PollerStartupError, match="no answer from the TransferQueue controller"):
        ReplayBuffer(SPEC, source_kwargs={"address": _dead_address(), "probe_timeout": 0.3}, start_timeout=30)
    assert time.monotonic() - started < 25


def test_a_silent_controller_is_counted_as_stalls_and_the_buffer_still_closes_at_once(caplog):
    caplog.set_level(logging.WARNING, logger="poller")
    # A stalled call counts in the listing share for the time it ran (the controller may still be at
    # it): at the default share the next call would come ~14 s later. This test is about the stalls.
    rb = ReplayBuffer(SPEC, source_kwargs={"address": _dead_address(), "call_timeout": 0.2,
                                           "probe_timeout": None}, poll_interval=0.02, listing_share=1.0)
    try:
        assert wait_until(lambda: rb.stats()["source_stalls"] >= 3, timeout=20)
        stats = rb.stats()
        assert stats["poller_alive"] and stats["restarts"] == 0 and stats["source_errors"] == 0
        warnings = [r.getMessage() for r in caplog.records if "source stall:" in r.getMessage()]
        assert len(warnings) == 1 and "no answer from the TransferQueue controller" in warnings[0]
    finally:
        report = rb.close()
    assert report.stage == "graceful" and report.drained


# -- the protocol check at the probe ------------------------------------------------------------

class OneReplyController:
    """A ROUTER on loopback that answers the first request with ``reply`` (frames), like the controller's socket."""

    def __init__(self, reply: list[bytes]) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.request: dict | None = None
        self._reply = reply
        self._thread = threading.Thread(target=self._serve, name="fake-tq-controller")
        self._thread.start()

    def _serve(self) -> None:
        if self._sock.poll(20_000):
            identity, frame = self._sock.recv_multipart()
            self.request = msgpack.unpackb(frame)
            self._sock.send_multipart([identity, *self._reply])

    def close(self) -> None:
        self._thread.join(30)
        self._sock.close(0)
        self._ctx.term()


def _message(request_type: str, body: dict, **extra: object) -> list[bytes]:
    return [msgpack.packb({"request_type": request_type, "sender_id": "TQ_CONTROLLER_1", "receiver_id": "me",
                           "request_id": "1", "timestamp": 0.0, "body": body, **extra})]


def test_the_probe_accepts_the_protocol_of_the_known_releases():
    controller = OneReplyController(_message("LIST_PARTITIONS_RESPONSE", {"partition_ids": ["train"]}))
    try:
        source = TransferQueueSource(controller.address, probe_timeout=10, controller_version=KNOWN_VERSIONS[-1])
        source.close()
    finally:
        controller.close()
    assert controller.request is not None and controller.request["request_type"] == "GET_LIST_PARTITIONS"


@pytest.mark.parametrize("reply, problem", [
    (_message("LIST_PARTITIONS_RESPONSE", {"partition_ids": ["train"]}, protocol_version=2),
     "message fields .*protocol_version"),
    (_message("PARTITIONS", {"partition_ids": []}), "'PARTITIONS' in answer to GET_LIST_PARTITIONS"),
    (_message("LIST_PARTITIONS_RESPONSE", {"partitions": {"train": {}}}), "without a partition_ids list"),
    ([msgpack.packb(["LIST_PARTITIONS_RESPONSE", ["train"]])], "a list, not a message map"),
])
def test_the_probe_refuses_an_unknown_protocol_with_a_clear_error(reply, problem):
    controller = OneReplyController(reply)
    try:
        with pytest.raises(TransferQueueProtocolError, match=problem) as caught:
            TransferQueueSource(controller.address, probe_timeout=10)
    finally:
        controller.close()
    assert "answered the probe in a protocol this poller does not know" in str(caught.value)
    assert f"TransferQueue {KNOWN_VERSIONS[0]} to {KNOWN_VERSIONS[-1]}" in str(caught.value)


def test_an_unknown_release_whose_controller_answers_in_the_known_shape_starts_with_one_warning(caplog):
    # verl installs TransferQueue from its git main: a dev release this source was not tested with.
    version = "0.1.12.dev0"
    caplog.set_level(logging.WARNING, logger="poller.sources.transferqueue")
    for _ in range(2):  # a restarted poller builds its source again: still one warning
        controller = OneReplyController(_message("LIST_PARTITIONS_RESPONSE", {"partition_ids": ["train"]}))
        try:
            TransferQueueSource(controller.address, probe_timeout=10, controller_version=version).close()
        finally:
            controller.close()
        assert controller.request is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"TransferQueue {version} is not a release this poller was tested with" in warnings[0]
    assert f"({KNOWN_VERSIONS[0]} to {KNOWN_VERSIONS[-1]})" in warnings[0]
    assert "answered the start-up probe in the known protocol" in warnings[0]


def test_an_unknown_release_whose_controller_answers_in_another_shape_is_refused():
    controller = OneReplyController(_message("PARTITIONS", {"partition_ids": []}))
    try:
        with pytest.raises(TransferQueueProtocolError, match="answered the probe in a protocol this poller does"):
            TransferQueueSource(controller.address, probe_timeout=10, controller_version="0.2.0")
    finally:
        controller.close()


def test_an_unknown_release_is_refused_by_the_buffer_only_for_its_reply():
    # No controller answers: the start fails on the probe's deadline, not on the release number.
    with pytest.raises(PollerStartupError) as caught:
        ReplayBuffer(SPEC, source_kwargs={"address": _dead_address(), "controller_version": "0.2.0",
                                          "probe_timeout": 1}, start_timeout=30)
    assert "not a release this poller knows" not in str(caught.value)
    assert "no answer from the TransferQueue controller" in str(caught.value)


def test_the_extra_range_covers_the_pinned_release_and_only_known_ones():
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirement = config["options.extras_require"]["transferqueue"].split("#")[0].strip()
    assert requirement == f"transferqueue>={KNOWN_VERSIONS[0]},<={KNOWN_VERSIONS[-1]}"
    constraints = (ROOT / "tests/integration/constraints.txt").read_text().splitlines()
    pinned = [line.split("==")[1].strip() for line in constraints if line.startswith("transferqueue==")]
    assert pinned and pinned[0] in KNOWN_VERSIONS


# -- tag values TransferQueue carries outside plain msgpack --------------------------------------
#
# Real KV_LIST replies of a TransferQueue 0.1.11 controller (numpy 2.4.6, torch 2.13.0+cpu, msgspec
# 0.23.0; the file says so too), one per case of tests/integration/tq_values.py: each case's record
# next to a plain record in partition "p". Regenerate with
#     make .venv/.installed-transferqueue && .venv/bin/python -m tests.integration.capture_tq_replies

REPLIES = msgpack.unpackb((ROOT / "tests/data/tq_kv_list_replies.msgpack").read_bytes(), strict_map_key=False)
GOOD = {"global_steps": 1, "status": "success"}


def _unreadable(reason: str) -> UnreadableValue:
    return UnreadableValue(reason)


#: case -> the tags of its record as the source lists them.
EXPECTED_TAGS: dict[str, dict] = {
    "np_int64": {"global_steps": 3, "status": "success"},
    "np_float32": {"reward": 0.5, "status": "success"},
    "np_float64": {"reward": 0.25},
    "np_bool": {"ok": True, "bad": False},
    "np_uint8": {"small": 255, "neg": -3},
    "np_arange": {"global_steps": 3, "steps": [0, 1, 2], "half": 0.5},
    "np_array": {"mask": [0, 1, 2, 3], "grid": [[1.0, 1.0], [1.0, 1.0]], "flags": [True, False]},
    "np_str_array": {"names": _unreadable("a numpy array of dtype <U2, which has no plain form")},
    "np_object_array": {"objs": _unreadable("a pickled numpy._core.multiarray._reconstruct object, "
                                            "which this source does not unpickle")},
    "np_datetime": {"when": _unreadable("a numpy scalar of dtype <M8, which has no plain form")},
    "np_complex": {"z": _unreadable("a numpy scalar of dtype <c8, which has no plain form")},
    "torch_scalar": {"reward": 1.0, "global_steps": 3, "ok": True},
    "torch_half": {"bf16": 2.5, "f16": 0.5},
    "torch_tensor": {"ids": [1, 2, 3], "grid": [[0, 1], [2, 3]]},
    "torch_complex": {"z": _unreadable("a tensor of dtype complex64, which has no plain form")},
    "big_int": {"big": 2**70, "status": "success"},
    # A value over 64 bits makes the controller pickle the whole reply: the rest still reads.
    "big_int_with_numpy": {"big": -(2**64), "global_steps": 4, "reward": 1.0, "span": [1, 2]},
    "big_int_with_arrays": {"big": 2**70, "mask": [0, 1, 2], "grid": [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]],
                            "column": [1, 4], "bf16": [1.5, -2.0], "flags": [True, False],
                            "objs": _unreadable("a pickled numpy._core.multiarray._reconstruct object, "
                                                "which this source does not unpickle")},
    "tuple": {"span": [1, 2], "nested": [[3, [4, "x"]]]},
    "set": {"ids": [5]},
    "ordered_dict": {"meta": {"a": 1, "b": [2]}},
    "aware_datetime": {"when": _unreadable("a datetime with a time zone, which has no plain form")},
    "int_tag_name": {7: "x", "status": "success"},
    "int_partition": {"global_steps": 2, "status": "success"},
}


def typed(value: object) -> object:
    """``value`` with the type of every scalar beside it, so that 1, 1.0 and True differ."""
    if isinstance(value, dict):
        return {typed(k): typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


def test_the_captured_replies_cover_every_case_and_come_from_a_known_release():
    assert REPLIES["transferqueue"] in KNOWN_VERSIONS
    assert set(REPLIES["cases"]) == set(EXPECTED_TAGS)


@pytest.mark.parametrize("case", sorted(EXPECTED_TAGS))
def test_each_value_a_real_controller_sends_is_converted_or_unreadable_in_place(case):
    listing = decode_reply(KV_LIST, REPLIES["cases"][case])["partition_info"]
    partition = 1 if case == "int_partition" else "p"
    expected = {partition: {"case": EXPECTED_TAGS[case], "good": GOOD}}
    assert typed(listing) == typed(expected)  # nothing else in the reply is lost or changed


def test_in_a_reply_pickled_whole_every_value_reads_as_it_does_unpickled():
    frames = REPLIES["all_at_once"]
    assert frames[0] == b"\xc1\xfe\xed" and len(frames) == 2  # pickled whole: it holds ints over 64 bits
    listing = decode_reply(KV_LIST, frames)["partition_info"]
    expected = {1 if case == "int_partition" else f"p-{case}": {"case": tags, "good": GOOD}
                for case, tags in EXPECTED_TAGS.items()}
    # The one value whose reason differs: pickled, the datetime class is what is refused.
    expected["p-aware_datetime"]["case"] = {"when": _unreadable("a pickled datetime.datetime object, "
                                                                "which this source does not unpickle")}
    assert typed(listing) == typed(expected)


def test_reading_every_captured_reply_imports_neither_numpy_nor_torch():
    statement = ("import msgpack; from poller.sources.transferqueue import decode_reply; "
                 "d = msgpack.unpackb(open('tests/data/tq_kv_list_replies.msgpack', 'rb').read(), "
                  "strict_map_key=False); "
                 "[decode_reply('KV_LIST', f) for f in [*d['cases'].values(), d['all_at_once']]]")
    code = (f"import json, sys; {statement}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_numpy_scalars_read_the_same_with_and_without_the_unpickler(monkeypatch):
    from poller.sources import tq_values

    replies = [*REPLIES["cases"].values(), REPLIES["all_at_once"]]
    fast = [decode_reply(KV_LIST, frames) for frames in replies]
    monkeypatch.setattr(tq_values, "_fast_numpy_scalar", lambda data: None)
    assert typed(fast) == typed([decode_reply(KV_LIST, frames) for frames in replies])
