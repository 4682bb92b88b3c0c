"""``stats()`` typed, ``metrics()`` numbers only under stable names, the Prometheus collector, ``peers``."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import typing
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from buffer import ReplayBuffer
from buffer.metrics import METRICS, BufferStats
from buffer.prometheus import ReplayBufferCollector
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
SPEC = "poller.sources.sqlite:SqliteSource"

#: The names are an interface (trackers' dashboards use them): changing one breaks this on purpose.
STABLE_NAMES = [
    "replay.keys", "replay.poller.alive", "replay.poller.restarts", "replay.poller.polls", "replay.poller.snapshots",
    "replay.poller.rss_bytes", "replay.source.errors", "replay.source.stalls", "replay.stream.messages",
    "replay.stream.items", "replay.stream.bytes", "replay.stream.protocol_errors", "replay.stream.resyncs",
    "replay.stream.auth_rejected", "replay.stream.peers", "replay.stream.stale_peers",
    "replay.stream.last_message_age_seconds", "replay.poller.start_retries", "replay.stream.quarantined",
    "replay.view.whole", "replay.view.fresh", "replay.source.listings", "replay.source.last_listing_seconds",
    "replay.source.listing_seconds", "replay.source.listing_share", "replay.source.watch_reads",
    "replay.source.watch_listings", "replay.poller.source_switches",
]


def test_stats_is_a_typed_dict_and_says_what_it_holds(db: str) -> None:
    assert typing.get_type_hints(ReplayBuffer.stats)["return"] is BufferStats
    with ReplayBuffer(SPEC, source_kwargs={"path": db}, poll_interval=0.05) as rb:
        stats = rb.stats()
        assert set(stats) == set(BufferStats.__annotations__)


def test_metrics_are_numbers_under_stable_dotted_names(store: SqliteSource, db: str) -> None:
    store.kv_batch_put(["a", "b", "c"], "train", tags=[{"global_steps": 1, "status": "running"}] * 3)
    with ReplayBuffer(SPEC, source_kwargs={"path": db}, poll_interval=0.05) as rb:
        assert wait_until(lambda: rb.stats()["keys"] == 3)
        metrics = rb.metrics()
        assert list(metrics) == STABLE_NAMES
        assert all(type(value) is float for value in metrics.values()), metrics
        assert json.loads(json.dumps(metrics)) is not None  # what a tracker serialises
        assert metrics["replay.keys"] == 3.0
        assert metrics["replay.poller.alive"] == 1.0 and metrics["replay.poller.polls"] >= 1
        assert metrics["replay.stream.peers"] == 1.0 and metrics["replay.source.stalls"] == 0.0
        assert metrics["replay.stream.items"] >= 3 and metrics["replay.stream.bytes"] > 0
    with ReplayBuffer() as idle:  # no poller, no message yet: unknowns are NaN, never None
        metrics = idle.metrics()
        assert math.isnan(metrics["replay.stream.last_message_age_seconds"])
        assert math.isnan(metrics["replay.poller.rss_bytes"]) and metrics["replay.poller.alive"] == 0.0


def test_the_prometheus_collector_with_a_real_registry(store: SqliteSource, db: str) -> None:
    store.kv_batch_put(["a", "b"], "train", tags=[{"global_steps": 1, "status": "success"}] * 2)
    registry = CollectorRegistry()
    rb = ReplayBuffer(SPEC, source_kwargs={"path": db}, poll_interval=0.05)
    try:
        collector = ReplayBufferCollector(rb, labels={"trainer": "ppo-0"})
        registry.register(collector)
        assert wait_until(lambda: registry.get_sample_value("replay_keys", {"trainer": "ppo-0"}) == 2.0)
        text = generate_latest(registry).decode()
        assert '# TYPE replay_source_stalls_total counter' in text
        assert 'replay_source_stalls_total{trainer="ppo-0"} 0.0' in text
        assert '# TYPE replay_keys gauge' in text and 'replay_poller_alive{trainer="ppo-0"} 1.0' in text
        for metric in METRICS:  # one family for each metric, under its dotted name
            suffix = "_total" if metric.kind == "counter" else ""
            sample = registry.get_sample_value(metric.name.replace(".", "_") + suffix, {"trainer": "ppo-0"})
            assert sample is not None, metric.name
    finally:
        rb.close()
    assert "replay_keys{" not in generate_latest(registry).decode()  # a closed buffer reports nothing
    registry.unregister(collector)


def test_peers_stop_counting_a_poller_that_said_bye(tmp_path: Path, db: str) -> None:
    SqliteSource(db).close()
    rb = ReplayBuffer(bind="tcp://127.0.0.1:0")
    proc = subprocess.Popen([sys.executable, "-m", "poller", "run", "--source", SPEC, "--source-kwargs",
                             json.dumps({"path": db}), "--connect", rb.endpoint, "--poll-interval", "0.05"],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: rb.stats()["peers"] == 1, timeout=20)
        proc.send_signal(signal.SIGTERM)  # drains, says BYE, exits 0
        assert proc.wait(timeout=20) == 0
        assert wait_until(lambda: rb.stats()["peers"] == 0, timeout=10), rb.stats()
        assert rb.metrics()["replay.stream.peers"] == 0.0 and rb.stats()["stale_peers"] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()
        rb.close()


def test_every_metric_is_in_the_manual() -> None:
    # docs/using.md lists the metrics by hand: a metric added without a line there fails here.
    manual = (ROOT / "docs" / "using.md").read_text()
    assert [m.name for m in METRICS if f"`{m.name}`" not in manual] == []
