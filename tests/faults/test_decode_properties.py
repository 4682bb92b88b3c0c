"""Property test: whatever frames arrive, ``decode()`` raises ProtocolError or
returns a checked Message — never any other exception."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from poller.wire.errors import ProtocolError
from poller.wire.protocol import PROTOCOL_VERSION, RECORDS, Kind, Message, decode

_FIELDS = sorted({name for record in RECORDS.values() for name in record._fields})

_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**64, max_value=2**64),
                     st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.binary(max_size=4)), inner, max_size=4)),
    max_leaves=12)
# Headers that are nearly right get past the first checks and reach the body's.
_headers = st.one_of(
    _values,
    st.tuples(st.sampled_from([PROTOCOL_VERSION, 0, 2, -1]), st.sampled_from([int(k) for k in Kind] + [0, 99]),
              st.integers(min_value=-5, max_value=2**63), st.integers(min_value=-5, max_value=2**63)).map(list),
)
_bodies = st.one_of(_values, st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=len(_FIELDS)))


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        assume(False)  # not representable in msgpack: nothing a peer could send
        raise


def _decodes_or_refuses(frames: list[bytes]) -> None:
    try:
        message = decode(frames)
    except ProtocolError:
        return
    assert isinstance(message, Message) and isinstance(message.body, RECORDS[message.kind])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_arbitrary_bytes(frames: list[bytes]) -> None:
    _decodes_or_refuses(frames)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_headers, _bodies, st.binary(max_size=3))
def test_arbitrary_msgpack(header: Any, body: Any, tail: bytes) -> None:
    _decodes_or_refuses([_pack(header), _pack(body)])
    _decodes_or_refuses([_pack(header), _pack(body) + tail])  # trailing bytes after a valid object
