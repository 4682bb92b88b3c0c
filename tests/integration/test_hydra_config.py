"""A ReplayBuffer built by Hydra from an OmegaConf node (``_target_``), as verl builds its parts.

Hydra and OmegaConf come with TransferQueue's dependencies, so this runs with ``make test-integration``;
no TransferQueue store is needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from poller.wire.protocol import DEFAULT_LIMITS
from tests.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_hydra_instantiates_a_buffer_with_limits_as_a_config_node(tmp_path: Path) -> None:
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    from poller.sources.sqlite import SqliteSource

    db = str(tmp_path / "kv.db")
    with SqliteSource(db) as store:
        store.kv_put("k", "train", tag={"global_steps": 1, "status": "success"})
    config = OmegaConf.create({
        "_target_": "buffer.ReplayBuffer",
        "source": "poller.sources.sqlite:SqliteSource",
        "source_kwargs": {"path": db},
        "poll_interval": 0.05,
        "limits": {"max_peers": 8, "max_depth": 12},
        "stall_timeout": 5.0,
        "poller_log_level": "INFO",
    })
    assert isinstance(config.limits, DictConfig)
    rb = instantiate(config)  # _convert_ "none": limits and source_kwargs arrive as DictConfig nodes
    try:
        assert rb._core.receiver.limits == DEFAULT_LIMITS._replace(max_peers=8, max_depth=12)
        assert wait_until(lambda: rb.snapshot("train") == {"k": {"global_steps": 1, "status": "success"}})
    finally:
        assert rb.close().stage == "graceful"
