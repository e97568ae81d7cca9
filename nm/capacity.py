"""The rate a workflow set can sustain, from its live state (DESIGN §8; the paper's §5, §3.2).

A stage with k ready workers whose measured service time for an application is t completes
k/t of its requests per second. A stage shared by several applications splits that among them
by the recent mix: at mix m (fractions per application) it completes k / Σ m_a·t_a requests a
second, of which the share m_a is application a's. An application's capacity is the least of
its stages' rates, and that stage is its bottleneck.

Theorem 1 of the paper: stage i keeps up with the stage before it when its rate is at least
that stage's, i.e. with N_i ≥ N_{i-1}·T_i/T_{i-1} instances (equal workers per instance);
``needed`` is that count, summed over the applications flowing into a shared stage, and shown
by `onepiece status`.

Stages that share a GPU (instances reporting the same device in ``stats.gpus``: every stage of a
small deployment on one card) do not run side by side: the device time a request takes there is
the sum of its stages' on it, and the set completes no more than one over that a second. The
stage rates alone read 1.8x what such a set served (35.9 against 19.6 requests/s closed-loop on
an H200, `bench/results/h200/overload-path/`). CPU stages sharing a host's cores are not modelled.

Everything here is a pure function of instance views, so it is tested without processes.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable

from onepiece.config import Workflow


def _stage_views(members: Iterable[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    return [i for i in members if i["role"] == "stage" and i["stage"] == stage and i["ready"]]


def _mean(pairs: list[tuple[float, float]]) -> float | None:
    """Weighted mean of (value, weight) pairs; None when nothing was measured."""
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def _per_shape(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """The instances' per-shape figures (``shapes``: standalone, ``shares``: device share) merged."""
    merged: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        for shape, t in (r.get(key) or {}).items():
            merged.setdefault(shape, []).append((t, 1))
    return {s: _mean(p) for s, p in merged.items()}


def stage_state(workflow: Workflow, stage: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers, queue and measured service times of one stage across its ready instances."""
    views = _stage_views(members, stage)
    apps = [a for a, spec in workflow.applications.items() if stage in spec.stages]
    workers = sum(int(v["stats"].get("ready", 0)) for v in views)
    queue = sum(int(v["stats"].get("queue", 0)) for v in views)
    service, shapes, shares, recent = {}, {}, {}, {}
    for app in apps:
        # Instances that served more of the app recently weigh more (weight ≥ 1 once measured).
        rows = [(v["stats"].get("service") or {}).get(app) for v in views]
        rows = [r for r in rows if r]
        service[app] = _mean([(r["mean_s"], 1 + r.get("recent", 0)) for r in rows])
        recent[app] = sum(r.get("recent", 0) for r in rows)
        shapes[app], shares[app] = (_per_shape(rows, key) for key in ("shapes", "shares"))
    # The mix, with one pseudo-arrival per application so an idle app still gets a share.
    total = sum(recent.values()) + len(apps)
    mix = {a: (recent[a] + 1) / total for a in apps}
    known = {a: t for a, t in service.items() if t}
    per_request = sum(mix[a] * t for a, t in known.items()) / sum(mix[a] for a in known) if known else None
    rates = {}
    for app in apps:
        if not workers or per_request is None or service[app] is None:
            rates[app] = 0.0 if not workers else None  # no workers: nothing gets through
        else:
            rates[app] = mix[app] * workers / per_request
    policies = collections.Counter(str(v["stats"].get("policy") or "") for v in views)
    return {"instances": len(views), "workers": workers, "queue": queue, "service_s": service,
            "shapes_s": shapes, "shares_s": shares, "mix": mix, "recent": recent, "rate": rates,
            "policy": policies.most_common(1)[0][0] if policies else ""}


def shared_gpus(workflow: Workflow, members: list[dict[str, Any]], app: str,
                service: dict[str, float | None]) -> dict[str, dict[str, float]]:
    """Per GPU (``stats.gpus``) that serves ``app``'s stages, the device seconds each of them
    spends on it per request of ``app``: an instance takes its share of the stage's requests
    (its ready workers over the stage's), spread over its workers' GPUs, or on every rank's GPU
    at once for a collaboration group (its ranks compute each request together). ``service``:
    each stage's seconds per request of ``app``."""
    out: dict[str, dict[str, float]] = {}
    for st in workflow.applications[app].stages:
        t, views = service.get(st), _stage_views(members, st)
        total = sum(int(v["stats"].get("ready", 0)) for v in views)
        if not t or not total:
            continue
        together = workflow.stages[st].mode == "collaboration"
        for v in views:
            gpus = [g for g in (v["stats"].get("gpus") or []) if isinstance(g, str)]
            if not gpus:
                continue
            each = int(v["stats"].get("ready", 0)) / total * t / (1 if together else len(gpus))
            for g in gpus:
                on = out.setdefault(g, {})
                on[st] = on.get(st, 0.0) + each
    return out


def estimate(workflow: Workflow, members: list[dict[str, Any]]) -> dict[str, Any]:
    """Per application of one set: capacity (requests/s, None until every stage has been
    measured), bottleneck, predicted latency, and per stage its rate and Theorem 1's count."""
    stages = {s: stage_state(workflow, s, members) for s in workflow.stages}
    out: dict[str, Any] = {}
    # Theorem 1 on a shared stage counts the flow of every application through it.
    demand: dict[str, float] = {}
    # Each application's device seconds per request on each GPU, and its share of the arrivals:
    # what its first stage passed of it recently, with one pseudo-arrival as in a stage's mix,
    # over every application's (its first stage's own mix where all enter at one stage; an
    # application that alone enters at its stage read a share of 1 there, whatever the others').
    gpu_load = {app: shared_gpus(workflow, members, app, {st: stages[st]["service_s"][app] for st in spec.stages})
                for app, spec in workflow.applications.items()}
    arrivals = {app: stages[spec.stages[0]]["recent"][app] + 1 for app, spec in workflow.applications.items()}
    mix = {app: n / sum(arrivals.values()) for app, n in arrivals.items()}
    for app, spec in workflow.applications.items():
        rows, prev_rate = {}, None
        for st in spec.stages:
            s = stages[st]
            rate, t = s["rate"][app], s["service_s"][app]
            per_instance = s["workers"] / s["instances"] if s["instances"] else 0
            if prev_rate is not None and t:
                demand[st] = demand.get(st, 0.0) + prev_rate * t  # busy workers this flow needs
            rows[st] = {"rate": rate, "service_s": t, "shapes_s": s["shapes_s"][app], "shares_s": s["shares_s"][app],
                        "instances": s["instances"],
                        "workers": s["workers"], "queue": s["queue"], "policy": s["policy"],
                        "per_instance": per_instance}
            prev_rate = rate
        rates = [(r["rate"], st) for st, r in rows.items()]
        shared = None
        if any(r is None for r, _ in rates):
            capacity, bottleneck = None, None  # not every stage measured yet: no estimate
        else:
            capacity, bottleneck = min(rates)
            for gpu, busy in gpu_load.get(app, {}).items():
                # Per second the card is busy R * sum_a m_a * (seconds a request of a takes there),
                # R the set's requests a second and m the applications' mix: at most 1. (An
                # application whose time there is not measured yet adds none.)
                per = sum(mix[a] * sum(by_app.get(gpu, {}).values()) for a, by_app in gpu_load.items())
                if per > 0 and mix[app] / per < capacity * (1 - 1e-9):
                    capacity, bottleneck = mix[app] / per, max(busy, key=busy.get)
                    shared = {"gpu": gpu, "stages": sorted({st for by_app in gpu_load.values()
                                                            for st in by_app.get(gpu, {})})}
        out[app] = {"capacity": capacity, "bottleneck": bottleneck, "stages": rows, "shared_gpu": shared}
    for est in out.values():
        for st, row in est["stages"].items():
            per_instance = row.pop("per_instance")
            row["needed"] = (max(1, math.ceil(demand[st] / per_instance - 1e-9))
                             if st in demand and per_instance else None)
            row["keeps_up"] = row["needed"] is None or row["instances"] >= row["needed"]
    return out


def at_shape(row: dict[str, Any], shape: str) -> float | None:
    """A stage row's standalone time for a request of ``shape``: the shape's if measured, else
    the row's mean (``service_s``). (Not extrapolated from other shapes: on the tiny models,
    whose fixed costs dominate small shapes, scaling by W·H·frames·steps was off by 100x.)"""
    return (row.get("shapes_s") or {}).get(shape) or row.get("service_s")


def predicted_latency(app_estimate: dict[str, Any], shape: str) -> float | None:
    """Seconds a new request of ``shape`` would take, from ``estimate(...)[app]``: at each
    stage the queue ahead drained by its workers (at the application's mean service time: the
    queue holds all shapes), plus its own service time (``at_shape``). Cheap: the proxy calls
    it on every create."""
    total = 0.0
    for s in app_estimate["stages"].values():
        mean = s["service_s"]
        if mean is None or not s["workers"]:
            return None
        total += mean * s["queue"] / s["workers"] + at_shape(s, shape)
    return total
