"""buffer.verl on a real TransferQueue lists only the partitions it is asked about, within the listing share.

The scenarios run inside the store host (tests/integration/listing_scenarios.py), where TransferQueue is live
as in a verl trainer.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCENARIOS = "tests.integration.listing_scenarios"


def run(store: Any, name: str) -> dict[str, Any]:
    return store.call("run", f"{SCENARIOS}:{name}", timeout=240)


def test_the_verl_sampler_lists_only_train_and_val_not_another_partition(store):
    figures = run(store, "only_its_partitions")["figures"]
    assert figures["listings"] >= 1 and figures["listing_seconds"] > 0
    assert figures["listing_seconds_total"] >= figures["listing_seconds"] and 0 < figures["listing_share"] <= 1


def test_partition_ids_given_in_source_kwargs_are_kept(store):
    run(store, "partitions_given_are_kept")
