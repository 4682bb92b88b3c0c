"""TransferQueue's pickled and extension-typed tag values, one by one: the restricted unpickler
refuses every global it does not know without running or importing it, and a value that does not
read is an UnreadableValue in its place while the rest of the reply reads. The values a real
controller sends: tests/test_transferqueue_source.py."""

from __future__ import annotations

import os
import pickle
import struct
import time

import msgpack
import pytest

from poller.sources.tq_values import MAX_ELEMENTS, UnreadableKey, plain, restricted_loads
from poller.sources.transferqueue import KV_LIST, TransferQueueReplyError, decode_reply
from poller.wire.vocabulary import UnreadableValue
from tests.test_transferqueue_source import GOOD, _reply, typed


class RunsACommand:
    """Pickles as ``os.system(command)``: what a hostile pickle looks like."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        import os

        return os.system, (self.command,)


def _with_tags(tags: dict) -> list[bytes]:
    return _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"bad": tags, "good": GOOD}}, "message": "ok"})


def test_a_pickle_naming_another_global_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(RunsACommand(f"touch {marker}"), protocol=5)
    assert b"system" in payload
    value = restricted_loads(payload)
    assert not marker.exists()
    assert plain(value) == UnreadableValue(f"a pickled {os.system.__module__}.system object, "
                                          "which this source does not unpickle")
    # In a reply: the value is refused in place, the rest of the reply still reads.
    listing = decode_reply(KV_LIST, _with_tags({"x": msgpack.ExtType(1, payload), "n": 1}))["partition_info"]
    assert not marker.exists()
    assert listing == {"p": {"bad": {"x": plain(value), "n": 1}, "good": GOOD}}
    # And in a reply pickled whole.
    message = {"request_type": "KV_LIST_RESPONSE", "body": {"partition_info": {"p": {"bad": {"x": RunsACommand(
        f"touch {marker}")}, "good": GOOD}}}}
    listing = decode_reply(KV_LIST, [b"\xc1\xfe\xed", pickle.dumps(message)])["partition_info"]
    assert not marker.exists()
    assert listing == {"p": {"bad": {"x": plain(value)}, "good": GOOD}}


def test_the_restricted_unpickler_imports_nothing():
    # A global of a module that does not exist: a plain unpickler raises ModuleNotFoundError.
    payload = b"\x80\x04\x8c\x0fno_such_module_\x8c\x01f\x93)R."
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(payload)
    assert plain(restricted_loads(payload)).reason == ("a pickled no_such_module_.f object, "
                                                       "which this source does not unpickle")
    # Tensor and array descriptions are read with no global at all.
    assert plain(restricted_loads(pickle.dumps(("float32", (), 1)), globals_=False)) == ["float32", [], 1]
    assert isinstance(plain(restricted_loads(pickle.dumps(RunsACommand("true")), globals_=False)), UnreadableValue)


def _ext(code: int, meta: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, pickle.dumps(meta))


@pytest.mark.parametrize("value, extra_frames, expected", [
    (_ext(3, ("int32", (2,), 1)), [struct.pack("=2i", -1, 7)], [-1, 7]),
    (_ext(5, (">i4", (2, 1), 1)), [struct.pack(">2i", 5, 6)], [[5], [6]]),
    (_ext(5, ("float64", (0,), 1)), [b""], []),
    (_ext(3, ("int64", (), 2)), [], UnreadableValue("a tensor whose description is not (dtype, shape, frame "
                                                    "index): ('int64', (), 2)")),
    (_ext(3, ("int64", (2,), 1)), [b"\x00" * 8], UnreadableValue("a tensor of shape (2,) and dtype int64 with "
                                                                 "8 bytes of data")),
    (_ext(5, ("float32", (MAX_ELEMENTS + 1,), 1)), [b""], UnreadableValue(
        f"a numpy array of {MAX_ELEMENTS + 1} elements (more than {MAX_ELEMENTS} are not listed)")),
    (msgpack.ExtType(1, b"not a pickle"), [], UnreadableValue(
        "a pickled value that does not unpickle (UnpicklingError: invalid load key, 'n'.)")),
    (msgpack.ExtType(2, b"..."), [], UnreadableValue("a cloudpickled callable")),
    (msgpack.ExtType(4, b"..."), [], UnreadableValue("a nested tensor")),
    (msgpack.ExtType(9, b"..."), [], UnreadableValue(
        "a value in msgpack extension type 9, which TransferQueue does not define")),
])
def test_extension_values_in_a_reply_are_read_or_refused_one_by_one(value, extra_frames, expected):
    listing = decode_reply(KV_LIST, _with_tags({"x": value, "n": 1}) + extra_frames)["partition_info"]
    assert typed(listing) == typed({"p": {"bad": {"x": expected, "n": 1}, "good": GOOD}})


def test_a_map_key_that_cannot_be_read_stands_as_an_unreadable_key_and_the_rest_reads():
    frames = _with_tags({msgpack.ExtType(4, b"..."): 1, msgpack.ExtType(3, pickle.dumps(("int64", (), 1))): 2})
    listing = decode_reply(KV_LIST, frames + [struct.pack("=q", 8)])["partition_info"]
    (key, value), (int_key, int_value) = listing["p"]["bad"].items()
    assert isinstance(key, UnreadableKey) and key.reason == "a nested tensor" and value == 1
    assert (int_key, int_value) == (8, 2)  # a scalar reads in place even as a key
    assert listing["p"]["good"] == GOOD


def _calling(module: str, name: str, *args: object) -> bytes:
    """A pickle of ``module.name(*args)``, written without importing ``module`` (protocol 3: no frames)."""
    return b"\x80\x03c" + f"{module}\n{name}\n".encode() + pickle.dumps(args, protocol=3)[2:-1] + b"R."


@pytest.mark.parametrize("payload, reason", [
    (_calling("torch.storage", "_load_from_bytes", b"not torch's format"),
     "a pickled torch storage this source does not read"),
    (_calling("torch.storage", "_load_from_bytes", pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
              + pickle.dumps(1001, protocol=2) + pickle.dumps({"little_endian": True}, protocol=2)
              + _calling("os", "system", "true")),
     "a pickled torch storage this source does not read (UnpicklingError: os.system in a torch storage)"),
    (_calling("torch._utils", "_rebuild_tensor_v2", "storage", 0, (1,), (1,)),
     "a pickled tensor this source does not read"),
    (_calling("numpy._core.numeric", "_frombuffer", b"\x00", "i1", (1,), "C"),
     "a pickled numpy array this source does not read"),
    (_calling("numpy._core.multiarray", "scalar", "i8", b"\x00" * 8), "a numpy scalar of an unknown dtype"),
])
def test_pickled_numpy_and_torch_values_that_do_not_read_are_unreadable_not_errors(payload, reason):
    assert plain(restricted_loads(payload)).reason.startswith(reason)
    listing = decode_reply(KV_LIST, _with_tags({"x": _pickled_ext(payload), "n": 1}))["partition_info"]
    assert listing["p"]["bad"]["x"].reason.startswith(reason) and listing["p"]["bad"]["n"] == 1


def _pickled_ext(payload: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, payload)


def test_a_reply_pickled_whole_that_is_no_message_is_refused_without_running_anything(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(TransferQueueReplyError, match="not a message map"):
        decode_reply(KV_LIST, [b"\xc1\xfe\xed", pickle.dumps(RunsACommand(f"touch {marker}"))])
    assert not marker.exists()


def test_a_pickle_that_shares_one_list_exponentially_is_read_in_linear_time():
    shared: list = [1]
    for _ in range(100):  # 2**100 leaves if each reference were copied
        shared = [shared, shared]
    started = time.monotonic()
    value = plain(restricted_loads(pickle.dumps(shared)))
    assert time.monotonic() - started < 5
    assert value[0] is value[1]


def test_a_list_that_holds_itself_is_unreadable_and_the_rest_reads():
    loop: list = [1]
    loop.append(loop)
    message = {"request_type": "KV_LIST_RESPONSE", "body": {"partition_info": {"p": {"bad": {"x": loop, "n": 1},
                                                                                     "good": GOOD}}}}
    listing = decode_reply(KV_LIST, [b"\xc1\xfe\xed", pickle.dumps(message)])["partition_info"]
    assert listing["p"]["good"] == GOOD and listing["p"]["bad"]["n"] == 1
    assert listing["p"]["bad"]["x"].reason.startswith("nested deeper than")
