"""The chief's Prometheus endpoint (`--metrics-port`): the run's metrics, read from the chief's
state at each scrape, so there is no second set of counters to keep in step with the first."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

log = logging.getLogger("asyncps.chief")

#: Upper bounds of the staleness histogram's buckets (updates); +Inf is added.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


@dataclass(frozen=True)
class RunMetrics:
    """What a scrape reports: one consistent reading of the chief's state."""

    updates: int
    updates_per_s: float
    dropped_by_reason: Mapping[str, int]  # shard counters, summed over shards
    staleness: Mapping[int, int]  # staleness -> pushes
    live_workers: int
    planned_workers: int
    eval_loss: float
    eval_accuracy: float
    epochs: float
    fraction_done: float  # -1: the run has no stop condition


def staleness_buckets(histogram: Mapping[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets (`le` bound, count) ending with +Inf, and the sum of staleness."""
    buckets: list[tuple[str, float]] = []
    for bound in STALENESS_BUCKETS:
        buckets.append((str(bound), float(sum(c for s, c in histogram.items() if s <= bound))))
    buckets.append(("+Inf", float(sum(histogram.values()))))
    return buckets, float(sum(s * c for s, c in histogram.items()))


class RunCollector:
    """A prometheus_client collector over a function that reads RunMetrics."""

    def __init__(self, read: Callable[[], RunMetrics]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        """The metric families of one reading."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m = self._read()
        yield CounterMetricFamily("asyncps_updates", "Updates applied (accepted pushes, mean over shards)",
                                  value=m.updates)
        yield GaugeMetricFamily("asyncps_updates_per_second", "Recent rate of applied updates", value=m.updates_per_s)
        drops = CounterMetricFamily("asyncps_dropped_pushes", "Pushes the shards dropped, by reason (summed "
                                    "over shards)", labels=["reason"])
        for reason, count in sorted(m.dropped_by_reason.items()):
            drops.add_metric([reason], count)
        yield drops
        buckets, total = staleness_buckets(m.staleness)
        yield HistogramMetricFamily("asyncps_staleness", "Staleness of every recorded push (updates)",
                                    buckets=buckets, sum_value=total)
        yield GaugeMetricFamily("asyncps_live_workers", "Workers registered and heartbeating", value=m.live_workers)
        yield GaugeMetricFamily("asyncps_planned_workers", "Workers the run was planned for",
                                value=m.planned_workers)
        yield GaugeMetricFamily("asyncps_eval_loss", "Test loss of the latest evaluation (NaN before the first)",
                                value=m.eval_loss)
        yield GaugeMetricFamily("asyncps_eval_accuracy", "Test accuracy of the latest evaluation",
                                value=m.eval_accuracy)
        yield GaugeMetricFamily("asyncps_epochs", "Examples trained on, in epochs", value=m.epochs)
        yield GaugeMetricFamily("asyncps_fraction_done", "Share of the run done (-1: no stop condition)",
                                value=m.fraction_done if math.isfinite(m.fraction_done) else -1.0)


class MetricsServer:
    """Serves /metrics over HTTP on its own thread until closed."""

    def __init__(self, host: str, port: int, read: Callable[[], RunMetrics]) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(RunCollector(read))  # type: ignore[arg-type]  # duck-typed collector
        self._server: WSGIServer
        self._server, self._thread = start_http_server(port, host, registry)
        self.port: int = self._server.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
