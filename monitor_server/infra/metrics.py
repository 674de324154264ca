"""Prometheus metrics of one app instance (own registry, so several apps can live in one process)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class _DatabaseCollector(Collector):
    """Gauges read from the database at scrape time: open alerts by kind, latest loss and step per run."""

    def __init__(
        self, snapshot: Callable[[], tuple[dict[str, int], list[tuple[int, str, float | None, int | None]]]]
    ):
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        alerts, runs = self._snapshot()
        open_alerts = GaugeMetricFamily("fp8scope_open_alerts", "Open alerts by kind", labels=["kind"])
        for kind, count in sorted(alerts.items()):
            open_alerts.add_metric([kind], count)
        loss = GaugeMetricFamily("fp8scope_run_last_loss", "Latest loss per run", labels=["run_id", "run"])
        step = GaugeMetricFamily("fp8scope_run_last_step", "Latest step per run", labels=["run_id", "run"])
        for run_id, name, last_loss, last_step in runs:
            if last_loss is not None:
                loss.add_metric([str(run_id), name], last_loss)
            if last_step is not None:
                step.add_metric([str(run_id), name], last_step)
        yield open_alerts
        yield loss
        yield step


class _CacheCollector(Collector):
    """Runs held in the in-memory caches, by cache (bounded by the ``cache_runs`` setting)."""

    def __init__(self, sizes: Callable[[], dict[str, int]]):
        self._sizes = sizes

    def collect(self) -> Iterable[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("fp8scope_cached_runs", "Runs held in memory, by cache", labels=["cache"])
        for cache, size in sorted(self._sizes().items()):
            gauge.add_metric([cache], size)
        yield gauge


class _FrozenHeapCollector(Collector):
    """Objects frozen out of the cyclic garbage collector (`fp8-monitor serve` freezes its startup heap, so
    a burst of connections does not set off a full collection that walks it on the event loop)."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "fp8scope_gc_frozen_objects", "Objects frozen out of the cyclic GC", value=gc.get_freeze_count()
        )


class Metrics:
    """Ingest counters and latency, plus the database-backed gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FrozenHeapCollector())
        self.batches = Counter(
            "fp8scope_ingest_batches", "Telemetry batches received", ["result"], registry=self.registry
        )
        self.steps = Counter("fp8scope_ingest_steps", "Telemetry steps stored", registry=self.registry)
        self.values = Counter(
            "fp8scope_ingest_values", "Statistic values stored (tensor x step x stat)", registry=self.registry
        )
        self.latency = Histogram(
            "fp8scope_ingest_seconds",
            "Time to decode and store one telemetry batch",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )

    def attach_database(
        self, snapshot: Callable[[], tuple[dict[str, int], list[tuple[int, str, float | None, int | None]]]]
    ) -> None:
        """Register the scrape-time gauges backed by `snapshot`."""
        self.registry.register(_DatabaseCollector(snapshot))

    def attach_caches(self, sizes: Callable[[], dict[str, int]]) -> None:
        """Register the gauge of cached runs backed by `sizes`."""
        self.registry.register(_CacheCollector(sizes))
