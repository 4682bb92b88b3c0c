"""``ReplayBuffer`` built from a config file (Hydra/OmegaConf ``_target_``): plain values only.

``limits`` may be a mapping of some of ``Limits``' fields; ``stall_timeout`` and ``poller_log_level``
reach the poller process.
"""

from __future__ import annotations

import logging
import types

import pytest

from buffer import ReplayBuffer
from poller.wire.protocol import DEFAULT_LIMITS, Limits
from tests.conftest import wait_until


def test_limits_as_a_plain_mapping() -> None:
    # What Hydra passes for `limits: {max_peers: 8, max_depth: 12}` under a `_target_: buffer.ReplayBuffer` node.
    for mapping in ({"max_peers": 8, "max_depth": 12}, types.MappingProxyType({"max_peers": 8, "max_depth": 12})):
        with ReplayBuffer(limits=mapping) as rb:
            limits = rb._core.receiver.limits
            assert isinstance(limits, Limits)
            assert limits == DEFAULT_LIMITS._replace(max_peers=8, max_depth=12)


def test_bad_limits_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"unknown limits \['max_pears'\]; the fields of poller.Limits"):
        ReplayBuffer(limits={"max_pears": 8})
    with pytest.raises(ValueError, match="max_peers must be a positive integer"):
        ReplayBuffer(limits={"max_peers": 0})
    with pytest.raises(TypeError, match="a mapping of its fields"):
        ReplayBuffer(limits=[("max_peers", 8)])  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, match", [
    ({"stall_timeout": 0}, "stall_timeout"),
    ({"stall_timeout": "5"}, "stall_timeout"),
    ({"poller_log_level": "LOUD"}, "poller_log_level"),
    ({"poller_log_level": -1}, "poller_log_level"),
])
def test_bad_poller_options_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayBuffer(**kwargs)


def test_stall_timeout_reaches_the_poller() -> None:
    # kv_list() takes 2 s: past a 0.3 s stall_timeout it is a stall; under the default 30 s it is not.
    with ReplayBuffer("poller.faults:slow", source_kwargs={"seconds": 2.0}, poll_interval=0.05,
                      stall_timeout=0.3, start_timeout=30) as rb:
        assert wait_until(lambda: rb.stats()["source_stalls"] >= 1, timeout=20)
    with ReplayBuffer("poller.faults:slow", source_kwargs={"seconds": 2.0}, poll_interval=0.05,
                      start_timeout=30) as rb:
        assert wait_until(lambda: rb.stats()["polls"] >= 1, timeout=20)
        assert rb.stats()["source_stalls"] == 0


def test_poller_log_level_decides_what_the_trainer_sees(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="poller")

    def said_hello() -> bool:
        return any("chatty source says hello" in r.getMessage() for r in caplog.records)

    with ReplayBuffer("tests.helpers.sources:Chatty", source_kwargs={"level": "INFO"}, poll_interval=0.05,
                      poller_log_level="INFO") as rb:
        assert wait_until(said_hello, timeout=20)
        assert rb.stats()["polls"] >= 1
    hello = [r for r in caplog.records if "chatty source says hello" in r.getMessage()]
    assert hello[0].levelno == logging.INFO and hello[0].name == "poller"
    caplog.clear()
    with ReplayBuffer("tests.helpers.sources:Chatty", source_kwargs={"level": "INFO"}, poll_interval=0.05) as rb:
        assert wait_until(lambda: rb.stats()["polls"] >= 5, timeout=20)
    assert not said_hello()  # INFO stays in the poller by default (WARNING)
