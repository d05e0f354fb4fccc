"""The chief's Prometheus endpoint (`--prometheus-port`): the run's metrics, read from the chief's
state at each scrape, so there is no second set of counters to keep in step with the first. It
takes the cluster's token and TLS like the chief's gRPC server (prometheus_client renders the
text; the server is the standard library's, so that a token can be checked before it does)."""

from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from asyncps.net.authz import AUTH_METADATA_KEY, TokenRoles
from asyncps.net.security import SecurityConfig

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication
    from prometheus_client.metrics_core import Metric

log = logging.getLogger("asyncps.chief")

METRICS_CLIENT_TIMEOUT_S = 10.0  # a scrape client silent this long loses its connection

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


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, no access log on stderr, and a slow client gives up its thread."""

    timeout = METRICS_CLIENT_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a line each."""


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A scrape per thread, so one stalled client (a TLS handshake that never ends) blocks no other."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that fails its handshake or hangs up is its own problem: no traceback on stderr."""
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)


def bearer_only(app: WSGIApplication, tokens: TokenRoles) -> WSGIApplication:
    """app behind `Authorization: Bearer <token>`: either role's token of the cluster, else 401."""

    def guarded(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION")
        roles = tokens.roles(None if header is None else [(AUTH_METADATA_KEY, str(header))])
        if isinstance(roles, str):  # why there are none: a missing or invalid token (never logged)
            body = f"401 Unauthorized: {roles.split(':')[0]}: send 'Authorization: Bearer <token>' with the " \
                   "cluster's token\n"
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="asyncps"'),
                                                ("Content-Length", str(len(body)))])
            return [body.encode()]
        return app(environ, start_response)

    return guarded


class MetricsServer:
    """Serves /metrics on its own thread until closed, as securely as the cluster's RPCs: a token
    (either role's) required when the cluster has one, TLS with the chief's certificate when it
    uses TLS, and a client certificate of the cluster's CA under mTLS."""

    def __init__(self, host: str, port: int, read: Callable[[], RunMetrics],
                 security: SecurityConfig | None = None) -> None:
        from prometheus_client import CollectorRegistry, make_wsgi_app

        security = security or SecurityConfig()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RunCollector(read))  # type: ignore[arg-type]  # duck-typed collector
        app: WSGIApplication = make_wsgi_app(registry)
        if security.token:
            app = bearer_only(app, TokenRoles(security.token, security.chief_token, security.shared_token))

        class Server(_ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = make_server(host.strip("[]"), port, app, server_class=Server, handler_class=_QuietHandler)
        context = security.ssl_server_context()
        if context is not None:
            # the handshake happens in the request's thread (on its first read), not in the accept loop
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        scheme = "https" if context is not None else "http"
        log.info("Prometheus metrics on %s://%s:%d/metrics (%s)", scheme, host, self.port, security.describe())

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
