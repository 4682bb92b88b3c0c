"""Fixtures for the tests against a real TransferQueue (``make test-integration``).

Nothing here imports TransferQueue or Ray: the store lives in a host process
(see store_host.py), so the test process stays under the leak checks.
"""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from tests.integration.store_host import StoreHost


@pytest.fixture(scope="session")
def store_host() -> Iterator[StoreHost]:
    host = StoreHost()
    yield host
    assert host.stop() == 0


@pytest.fixture
def store(store_host: StoreHost) -> Iterator[StoreHost]:
    """The session's store, open (a test before may have closed it) and empty afterwards."""
    store_host.call("ensure_open")
    yield store_host
    store_host.call("ensure_open")
    store_host.call("clear_all")


@pytest.fixture
def partition() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"
