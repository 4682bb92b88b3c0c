"""buffer.verl on a real TransferQueue lists only the partitions it is asked about, within the listing share.

A listing of d seconds is followed by the next no sooner than d / listing_share after it began, however often
sync() asks (the poll's own processing is checked in tests/test_listing_share.py).

The scenarios run inside the store host (tests/integration/listing_scenarios.py), where TransferQueue is live
as in a verl trainer.
"""

from __future__ import annotations

from typing import Any

import pytest

from poller.common.checks import DEFAULT_LISTING_SHARE

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


def test_listings_of_transferqueue_keep_within_the_listing_share_while_syncs_ask_every_20ms(store):
    out = run(store, "share_while_syncs_ask_every_20ms")
    listings = out["listings"]
    assert not out["errors"] and out["answered"] >= 2, out
    # A listing of d seconds is followed by the next no sooner than d / share after it began, however often
    # sync() asks (the log's clock has microseconds: a little slack).
    for (began, ended), (next_began, _) in zip(listings, listings[1:]):
        assert next_began - began >= (ended - began) / DEFAULT_LISTING_SHARE - 1e-3, listings
    assert 0 < out["figures"]["listing_share"] <= 1, out


def test_kv_watch_moves_with_the_keys_named_and_creates_nothing_in_the_controller(store):
    out = run(store, "watch_reads_named_keys_and_changes_nothing")
    assert out["unmoved"] and out["moved"] and out["removed"], out
    assert out["partitions_after"] == out["partitions_before"] and out["keys_after"] == out["keys_before"], out
