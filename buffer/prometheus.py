"""A Prometheus collector for a :class:`~buffer.ReplayBuffer` (``pip install 'zmq-replay-poller[prometheus]'``),
for the registry the trainer already exposes (no server of ours)::

    from prometheus_client import REGISTRY
    from buffer.prometheus import ReplayBufferCollector

    collector = ReplayBufferCollector(rb)
    REGISTRY.register(collector)
    ...
    REGISTRY.unregister(collector)   # before or after rb.close(): a closed buffer reports nothing

Each metric of :data:`buffer.metrics.METRICS` becomes one family, dots turned into underscores
(counters end in ``_total``), with the constant labels given (e.g. ``{"trainer": "ppo-0"}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from buffer.errors import BufferClosed
from buffer.metrics import METRICS, BufferStats

if TYPE_CHECKING:
    from buffer.replay import ReplayBuffer

__all__ = ["ReplayBufferCollector"]


class ReplayBufferCollector(Collector):
    """Reads ``buffer.stats()`` at every scrape; register it with a ``prometheus_client`` registry."""

    def __init__(self, buffer: ReplayBuffer, labels: Mapping[str, str] | None = None) -> None:
        self._buffer = buffer
        self._labels = dict(labels or {})

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering never reads the buffer."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._buffer.stats()
        except BufferClosed:
            return iter(())
        return self._families(stats)

    def _families(self, stats: BufferStats | None) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        for metric in METRICS:
            name = metric.name.replace(".", "_")
            family: CounterMetricFamily | GaugeMetricFamily
            if metric.kind == "counter":
                family = CounterMetricFamily(name, metric.help, labels=names)
            else:
                family = GaugeMetricFamily(name, metric.help, labels=names)
            if stats is not None:
                family.add_metric(values, metric.read(stats))
            yield family
