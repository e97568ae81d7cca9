"""Prometheus metrics of one proxy. Each proxy owns a registry, so several proxies in one
process (tests, `onepiece up` in-process) never collide on metric names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ProxyMetrics", "CONTENT_TYPE_LATEST"]


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "onepiece_proxy_requests", "HTTP requests by route template, method and status code",
            ["endpoint", "method", "code"], registry=r,
        )
        self.accepted = Counter("onepiece_proxy_accepted", "Requests accepted into the pipeline", ["app"], registry=r)
        self.rejected = Counter(
            "onepiece_proxy_rejected", "Create requests refused, by reason (validation code or capacity)",
            ["reason"], registry=r,
        )
        self.inflight = Gauge("onepiece_proxy_inflight", "Accepted requests not yet terminal", registry=r)
        self.max_inflight = Gauge("onepiece_proxy_max_inflight", "In-flight limit", registry=r)
        self.submit_latency = Histogram(
            "onepiece_proxy_submit_seconds", "Time to accept a create request (validate, store, send)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r,
        )
        self.send_failures = Counter(
            "onepiece_proxy_send_failures", "Sends to an entrance instance that failed", ["address"], registry=r,
        )

    def accepted_total(self) -> int:
        """Requests accepted so far, all apps together."""
        return _total(self.accepted)

    def rejected_total(self) -> int:
        """Create requests refused so far, all reasons together."""
        return _total(self.rejected)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _total(counter: Counter) -> int:
    # Summed over every label value; collect() takes the counter's lock, so any thread may call it.
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))
