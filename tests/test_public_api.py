"""Pins the public surface of the two packages."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import buffer
import poller
from buffer import BatchMeta, BufferClosed, ReplayBuffer, ShutdownReport
from poller import (
    PollerCrashed,
    PollerError,
    PollerProcess,
    PollerStartupError,
    ProtocolError,
    Source,
    load_source,
)
from poller.sources.sqlite import SqliteSource

ROOT = Path(__file__).resolve().parent.parent


class _ListsNothing:
    def kv_list(self) -> Any:
        return {"train": {"k": {"status": "running"}}}


#: A module attribute that already is a source: load_source must use it as is.
READY_MADE_SOURCE = _ListsNothing()

#: A module attribute without kv_list.
NOT_A_SOURCE = 42


def test_buffer_all() -> None:
    assert set(buffer.__all__) == {"ReplayBuffer", "BatchMeta", "ShutdownReport", "BufferClosed",
                                   "InsecureBindError", "EndpointInUseError", "PollerCrashed", "PollerStartupError"}
    assert len(buffer.__all__) == len(set(buffer.__all__))
    for name in buffer.__all__:
        assert hasattr(buffer, name)
    assert buffer.ShutdownReport is buffer.process.ShutdownReport
    # The errors a trainer catches, importable from the package it uses; the same classes as poller's.
    assert buffer.PollerCrashed is poller.PollerCrashed and buffer.PollerStartupError is poller.PollerStartupError
    assert buffer.InsecureBindError is buffer.access.InsecureBindError
    assert issubclass(buffer.InsecureBindError, ValueError)
    assert buffer.EndpointInUseError is buffer.access.EndpointInUseError
    assert issubclass(buffer.EndpointInUseError, OSError)


def test_poller_all() -> None:
    assert set(poller.__all__) == {"PollerProcess", "Source", "SourceStall", "load_source", "Limits", "CurveServer",
                                   "PollerError", "PollerStartupError", "PollerCrashed", "ProtocolError",
                                   "RemoteTraceback"}
    assert len(poller.__all__) == len(set(poller.__all__))
    for name in poller.__all__:
        assert hasattr(poller, name)
    assert PollerProcess is buffer.process.PollerProcess
    assert load_source is poller.sources.contract.load_source
    # Where README names them too.
    from poller.sources import contract as sources
    from poller.wire import curve, errors, protocol

    assert poller.Limits is protocol.Limits and poller.CurveServer is curve.CurveServer
    assert poller.SourceStall is sources.SourceStall and poller.RemoteTraceback is errors.RemoteTraceback


def test_error_hierarchy() -> None:
    for error in (PollerStartupError, PollerCrashed, ProtocolError):
        assert issubclass(error, PollerError)
        assert error is not PollerError
    assert issubclass(PollerError, Exception)
    assert not issubclass(PollerStartupError, PollerCrashed) and not issubclass(PollerCrashed, PollerStartupError)
    assert not issubclass(ProtocolError, (PollerStartupError, PollerCrashed))
    assert issubclass(BufferClosed, Exception)
    # Whether the same start may work later (a store that could not be reached); restarts rely on it.
    assert PollerStartupError("x").unavailable is False
    assert PollerStartupError("x", unavailable=True).unavailable is True


def test_replay_buffer_signature() -> None:
    params = inspect.signature(ReplayBuffer.__init__).parameters
    assert list(params) == ["self", "source", "source_kwargs", "poll_interval", "bind", "start_timeout",
                            "close_timeout", "max_restarts", "restart_window", "curve", "insecure", "limits",
                            "stale_after", "stall_timeout", "max_view_age", "poller_log_level", "listing_share"]
    expected_defaults = {"source": None, "source_kwargs": None, "poll_interval": 1.0, "bind": None,
                         "start_timeout": 30.0, "close_timeout": 5.0, "max_restarts": 3, "restart_window": 600.0,
                         "curve": None, "insecure": False, "limits": None, "stale_after": 5.0,
                         "stall_timeout": 30.0, "max_view_age": None, "poller_log_level": "WARNING", "listing_share": 0.15}
    for name, default in expected_defaults.items():
        param = params[name]
        assert param.default == default and type(param.default) is type(default), name
    assert params["source"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name in list(expected_defaults)[1:]:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    # The same, seen from the class (what users call).
    assert list(inspect.signature(ReplayBuffer).parameters) == list(expected_defaults)


def test_batch_meta_and_shutdown_report_shape() -> None:
    assert ShutdownReport._fields == ("stage", "seconds", "exitcode", "drained")
    assert "keys" in BatchMeta._fields and "tags" in BatchMeta._fields


def test_importing_poller_stays_light() -> None:
    code = ("import json, sys; import poller; "
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('buffer', 'torch', 'ray', 'transfer_queue', 'poller'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert "poller" in loaded  # the probe itself works
    heavy = [m for m in loaded if m.split(".")[0] in ("buffer", "torch", "ray", "transfer_queue")]
    assert heavy == []


# The packages as imported: the source tree, or an installed wheel (.ci/check_dist.py runs these
# tests from an unpacked sdist without the package sources).
PACKAGES_ROOT = Path(poller.__file__).resolve().parent.parent


def _source_files() -> list[Path]:
    files = sorted((PACKAGES_ROOT / "poller").rglob("*.py")) + sorted((PACKAGES_ROOT / "buffer").rglob("*.py"))
    assert len(files) > 10
    return files


def test_only_the_protocol_modules_import_msgpack() -> None:
    # Our wire format (protocol.py frames, encodes and decodes; tags.py is the tag codec), and
    # TransferQueue's controller messages and the tag values in them (another format).
    pattern = re.compile(r"^\s*(import\s+msgpack\b|from\s+msgpack\b)|import_module\(\s*['\"]msgpack", re.M)
    importers = [str(path.relative_to(PACKAGES_ROOT)) for path in _source_files() if pattern.search(path.read_text())]
    assert importers == ["poller/sources/tq_values.py", "poller/sources/transferqueue.py", "poller/wire/protocol.py",
                         "poller/wire/tags.py"]


def test_py_typed_in_both_packages() -> None:
    for package in (poller, buffer):
        marker = Path(package.__file__).parent / "py.typed"
        assert marker.is_file(), marker


# -- load_source -------------------------------------------------------------------------------

def test_load_source_builds_a_class_spec_with_kwargs(tmp_path: Path) -> None:
    path = str(tmp_path / "kv.db")
    source = load_source("poller.sources.sqlite:SqliteSource", {"path": path, "timeout": 2.5})
    try:
        assert isinstance(source, SqliteSource)
        assert isinstance(source, Source)
        assert source.path == path
        assert source.kv_list() == {}
    finally:
        source.close()


def test_load_source_accepts_a_callable() -> None:
    source = load_source(_ListsNothing)
    assert isinstance(source, _ListsNothing)
    assert source.kv_list() == {"train": {"k": {"status": "running"}}}


def test_load_source_uses_a_ready_made_source_as_is() -> None:
    spec = f"{__name__}:READY_MADE_SOURCE"
    assert load_source(spec) is READY_MADE_SOURCE
    assert load_source(spec, {}) is READY_MADE_SOURCE
    assert load_source(READY_MADE_SOURCE) is READY_MADE_SOURCE
    with pytest.raises(ValueError, match="takes no kwargs"):
        load_source(spec, {"path": "x"})


@pytest.mark.parametrize("spec", ["nope", "poller.sources.sqlite", ":SqliteSource", "poller.sources.sqlite:",
                                  "poller.sources.sqlite:NoSuchThing", "poller.sources.sqlite:SqliteSource.nope"])
def test_load_source_rejects_a_bad_spec(spec: str) -> None:
    with pytest.raises(ValueError):
        load_source(spec)


def test_load_source_rejects_what_has_no_kv_list() -> None:
    with pytest.raises(TypeError, match="kv_list"):
        load_source(f"{__name__}:NOT_A_SOURCE")
    with pytest.raises(TypeError, match="kv_list"):
        load_source("builtins:dict")  # callable, but what it builds has no kv_list()
    with pytest.raises(TypeError, match="kv_list"):
        load_source(object)


def test_load_source_lets_factory_errors_through() -> None:
    with pytest.raises(ValueError, match="cannot connect"):
        load_source("tests.helpers.sources:failing_factory", {"host": "h"})
    with pytest.raises(ModuleNotFoundError):
        load_source("no_such_module_for_the_api_test:thing")


def test_stats_has_the_documented_typed_shape(tmp_path: Path) -> None:
    import types
    from typing import Union, get_args, get_origin, get_type_hints

    from buffer.metrics import BufferStats

    hints = get_type_hints(BufferStats)
    with ReplayBuffer("poller.sources.sqlite:SqliteSource", source_kwargs={"path": str(tmp_path / "kv.db")},
                      poll_interval=0.05) as rb:
        stats = rb.stats()
    assert list(stats) == list(hints)  # every documented key, in order, and no other
    manual = (ROOT / "docs" / "using.md").read_text()  # the manual's "Stats" section
    for name, value in stats.items():
        assert f"`{name}`" in manual, f"stats()[{name!r}] is not documented in docs/using.md"
        hint = hints[name]
        options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
        allowed = tuple(get_origin(t) or t for t in options)
        assert isinstance(value, allowed), (name, value, hint)


def test_replay_buffer_sync_signature() -> None:
    params = inspect.signature(ReplayBuffer.sync).parameters
    assert list(params) == ["self", "timeout"]
    assert params["timeout"].default is None


def test_buffer_verl_surface() -> None:
    import buffer.verl as verl

    assert set(verl.__all__) == {"ReplayBuffer", "ReplayBufferAsync", "VerlBatch", "DAPO_FILTERED_REWARD_COUNTS_KEY",
                                 "VerlConfigError"}
    assert issubclass(verl.VerlConfigError, ValueError) and issubclass(verl.VerlConfigError, AssertionError)
    assert verl.DAPO_FILTERED_REWARD_COUNTS_KEY == "_dapo_filtered_reward_counts"
    assert issubclass(verl.ReplayBufferAsync, verl.ReplayBuffer)
    assert "verl" not in buffer.__all__  # a module of its own: pkg://buffer.verl
    # verl's built-in constructor, in its order (poll_interval defaults to sampler_kwargs, then 0.2 s).
    params = inspect.signature(verl.ReplayBuffer.__init__).parameters
    assert list(params) == ["self", "trainer_mode", "trainer_config", "max_off_policy_threshold",
                            "max_off_policy_strategy", "sampler_kwargs", "poll_interval", "refill_fn",
                            "filter_groups_metric", "train_batch_size", "gen_batch_size", "max_inflight_gen_batches",
                            "sync_refill_failed_groups"]
    defaults = {"poll_interval": None, "refill_fn": None, "filter_groups_metric": None, "train_batch_size": None,
                "gen_batch_size": None, "max_inflight_gen_batches": 1, "sync_refill_failed_groups": False}
    for name, default in defaults.items():
        assert params[name].default == default and type(params[name].default) is type(default), name
    for name in ("sample", "get_sampleable_count", "close", "stats", "__enter__", "__exit__"):
        assert callable(getattr(verl.ReplayBuffer, name)), name
    assert callable(verl.ReplayBufferAsync.wait_for_sampleable)
    assert list(inspect.signature(verl.ReplayBuffer.sample).parameters) == \
        ["self", "global_steps", "partition_id", "batch_size"]
    assert list(inspect.signature(verl.ReplayBufferAsync.wait_for_sampleable).parameters) == \
        ["self", "global_steps", "partition_id", "target_count"]
    assert [f for f in verl.VerlBatch.__dataclass_fields__] == ["keys", "tags", "partition_id", "fields",
                                                                "extra_info"]
    from buffer.verl.config import SAMPLER_KWARGS

    assert SAMPLER_KWARGS == {"poll_interval", "filter_groups_metric", "train_batch_size", "gen_batch_size",
                              "max_inflight_gen_batches", "sync_refill_failed_groups", "sample_timeout",
                              "log_interval", "source", "source_kwargs", "start_timeout",
                              "close_timeout", "max_restarts"}


def test_sqlite_source_reads_fields_back() -> None:
    params = inspect.signature(SqliteSource.kv_batch_get).parameters
    assert list(params) == ["self", "keys", "partition_id", "select_fields"]
    assert params["select_fields"].default is None
