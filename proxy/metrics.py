"""Prometheus metrics of one proxy. Each proxy owns a registry, so several proxies in one
process (tests, `onepiece up` in-process) never collide on metric names."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

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
        self.ended = Counter(
            "onepiece_proxy_ended", "Accepted requests that left this proxy's in-flight count, by how: completed or "
            "failed (the DBs' verdict), cancelled (deleted), expired (its deadline passed before any word of its end)",
            ["app", "outcome"], registry=r,
        )
        self.inflight = Gauge("onepiece_proxy_inflight", "Accepted requests not yet terminal", registry=r)
        self.max_inflight = Gauge("onepiece_proxy_max_inflight", "In-flight limit", registry=r)
        self.submit_latency = Histogram(
            "onepiece_proxy_submit_seconds", "Time to accept a create request (validate, store, send)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r,
        )
        self.refusal_latency = Histogram(
            "onepiece_proxy_refusal_seconds", "Proxy time to refuse a create with 429 (body read, validation, "
            "the monitor's check), from the handler's start", registry=r,
            buckets=(50e-6, 100e-6, 250e-6, 500e-6, 0.001, 0.0025, 0.005, 0.01, 0.025),
        )
        self.send_failures = Counter(
            "onepiece_proxy_send_failures", "Sends to an entrance instance that failed", ["address"], registry=r,
        )

    def watch(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Export the request monitor's view (capacity, admitted rate, per-stage service time
        and rate) from ``snapshot()`` at each scrape; see ``MonitorCollector``."""
        self.registry.register(MonitorCollector(snapshot))

    def accepted_total(self) -> int:
        """Requests accepted so far, all apps together."""
        return _total(self.accepted)

    def ended_totals(self) -> dict[str, int]:
        """Accepted requests that ended so far, by outcome, all apps together."""
        out: dict[str, int] = {}
        for m in self.ended.collect():
            for s in m.samples:
                if s.name.endswith("_total"):
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + int(s.value)
        return out

    def rejected_total(self, reasons: tuple[str, ...] | None = None) -> int:
        """Create requests refused so far, for ``reasons`` (default: all together)."""
        return _total(self.rejected, reasons)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _total(counter: Counter, reasons: tuple[str, ...] | None = None) -> int:
    # Summed over every label value (or those ``reasons``); collect() takes the counter's lock,
    # so any thread may call it.
    return int(sum(s.value for m in counter.collect() for s in m.samples
                   if s.name.endswith("_total") and (reasons is None or s.labels.get("reason") in reasons)))


class MonitorCollector:
    """Gauges read from the request monitor's current view at scrape time, so series of
    applications or stages that left the view disappear with it.

    ``snapshot()`` returns ``{"enabled", "set", "view": the NM's monitor view or None,
    "rates": {app: this proxy's admitted rate or None}, "path_s": {app: seconds}}``
    (ProxyState.monitor_snapshot).
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # collected lazily; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self.snapshot()
        except Exception:  # a scrape must never fail on the monitor's state
            log.warning("request monitor snapshot failed", exc_info=True)
            return
        set_name = str(snap.get("set", ""))
        enabled = GaugeMetricFamily("onepiece_proxy_monitor_enabled",
                                    "1 when the request monitor (capacity and deadline admission) is on")
        enabled.add_metric([], 1.0 if snap.get("enabled") else 0.0)
        yield enabled
        apps = (snap.get("view") or {}).get("apps")
        apps = apps if isinstance(apps, dict) else {}
        cap = GaugeMetricFamily("onepiece_proxy_capacity",
                                "The set's estimated capacity per application (requests/s; absent until measured)",
                                labels=["set", "app"])
        bottleneck = GaugeMetricFamily("onepiece_proxy_bottleneck", "1 for the stage that limits an application",
                                       labels=["set", "app", "stage"])
        svc = GaugeMetricFamily("onepiece_proxy_stage_service_seconds",
                                "Measured mean service time per stage and application, from the NM's view",
                                labels=["set", "app", "stage"])
        rate = GaugeMetricFamily("onepiece_proxy_stage_rate",
                                 "Requests/s a stage sustains for an application (its workers / service time)",
                                 labels=["set", "app", "stage"])
        workers = GaugeMetricFamily("onepiece_proxy_stage_workers", "Ready workers per stage, from the NM's view",
                                    labels=["set", "app", "stage"])
        for app, est in apps.items():
            if not isinstance(est, dict):
                continue
            if isinstance(est.get("capacity"), (int, float)):
                cap.add_metric([set_name, app], float(est["capacity"]))
            if est.get("bottleneck"):
                bottleneck.add_metric([set_name, app, str(est["bottleneck"])], 1.0)
            for stage, row in (est.get("stages") or {}).items():
                if not isinstance(row, dict):
                    continue
                if isinstance(row.get("service_s"), (int, float)):
                    svc.add_metric([set_name, app, stage], float(row["service_s"]))
                if isinstance(row.get("rate"), (int, float)):
                    rate.add_metric([set_name, app, stage], float(row["rate"]))
                if isinstance(row.get("workers"), int):
                    workers.add_metric([set_name, app, stage], float(row["workers"]))
        admitted = GaugeMetricFamily("onepiece_proxy_admit_rate",
                                     "This proxy's admitted rate per application (requests/s: its share of the "
                                     "set's capacity, less the headroom; absent while not rate-limited)", labels=["set", "app"])
        for app, r in (snap.get("rates") or {}).items():
            if r is not None:
                admitted.add_metric([set_name, app], float(r))
        path = GaugeMetricFamily("onepiece_proxy_path_seconds",
                                 "Seconds a request spends between its stages in an idle set (HTTP, hops, the DB), "
                                 "measured by this proxy; its deadline rule allows for them", labels=["set", "app"])
        for app, p in (snap.get("path_s") or {}).items():
            path.add_metric([set_name, app], float(p))
        yield from (cap, bottleneck, admitted, path, svc, rate, workers)
