"""Renders the NM's status as the text `onepiece status` prints."""

from __future__ import annotations

import time
from typing import Any


def _instance(i: dict[str, Any]) -> str:
    s = i.get("stats") or {}
    standing_by = i["role"] == "stage" and i.get("stage") is None and not i.get("serving")
    health = "ready" if i["ready"] else "standing by" if standing_by else "starting"  # (the idle pool: no stage, by design)
    if i["silent_s"] > 2.5:
        health = f"silent {i['silent_s']:.0f}s"
    extra = ""
    if i["role"] == "stage" and i.get("stage") != i.get("serving"):
        health = f"moving to {i.get('stage') or 'idle pool'}" if i.get("serving") else health
    if i["role"] == "stage":
        extra = (f" queue {s.get('queue', 0)}/{s.get('capacity', '?')}"
                 f" busy {s.get('busy', 0)}/{s.get('workers', '?')}"
                 # Still routed while its workers restart (requests wait in its queue): say so.
                 + (f" (workers up {s['ready']}/{s['workers']})"
                    if isinstance(s.get("ready"), int) and isinstance(s.get("workers"), int) and s["ready"] < s["workers"]
                    else "")
                 + f" done {s.get('completed', 0)} failed {s.get('failed', 0)}"
                 # Once a worker is back, nothing else says it died: a crash loop stays visible.
                 + (f" worker deaths {s['worker_deaths']}" if s.get("worker_deaths") else "")
                 + (f" gpu {s['gpu_util']:.0%}" if isinstance(s.get("gpu_util"), (int, float)) else "")
                 + _scheduling(s)
                 + (f"\n{'':17s}a worker fails to start: {s['worker_error']}" if s.get("worker_error") else ""))
    elif i["role"] == "db":
        extra = f" records {s.get('records', 0)} bytes {s.get('bytes', 0)}"
    elif i["role"] == "proxy":
        extra = (f" inflight {s.get('inflight', 0)}/{s.get('max_inflight', '?')}"
                 f" accepted {s.get('accepted', 0)} rejected {s.get('rejected', 0)}"
                 # a full set's 429s and bad requests' 400s are different alarms
                 + (f" ({s['refused']} for capacity)" if isinstance(s.get("refused"), int) else "")
                 + "".join(f" {how} {n}" for how, n in sorted((s.get("ended") or {}).items())
                           if isinstance(n, int)))
    addr = i["addresses"].get("http") or i["addresses"].get("data", "")
    return f"    {i['id']:10s} {health:10s} {addr}{extra}"


def _scheduling(s: dict[str, Any]) -> str:
    """The step scheduler's line: policy, resident states, mean batch, step time, what it did."""
    if not s.get("policy"):
        return ""
    batches = s.get("batches") or 0
    batch = f"{s.get('batched', 0) / batches:.1f}" if batches else "-"
    step = s.get("step_time") or {}
    n = sum(step.get("counts") or [])
    ms = f"{step.get('sum', 0) / n * 1000:.1f} ms" if n else "not measured yet"
    held = f" ({s['resident_bytes'] / 2**20:.1f} MiB)" if s.get("resident_bytes") else ""
    return (f"\n{'':17s}{s['policy']} (batch <= {s.get('max_batch', 1)}): resident {s.get('resident', 0)}{held},"
            f" mean batch {batch}, step {ms}, chunk overhead {s.get('overhead_ms', 0):.1f} ms;"
            f" preempted {s.get('preempted', 0)} cancelled {s.get('cancelled', 0)} expired {s.get('expired', 0)}"
            f" aged {s.get('aged', 0)}"
            + (f"\n{'':17s}refused {s['refused']} plan(s) of its policy, the last: {s.get('last_refused')}"
               if s.get("refused") else ""))


def _rate(r: float | None) -> str:
    return "not measured yet" if r is None else f"{r:.2f}/s"


def _capacity(apps: dict[str, Any]) -> list[str]:
    """Per application: the admitted capacity, its bottleneck, and per stage the measured rate
    and whether it meets Theorem 1's instance count for keeping up with the stage before it."""
    lines = []
    for app, est in apps.items():
        head = f"  capacity {app}: {_rate(est['capacity'])}"
        if est["bottleneck"]:
            head += f", bottleneck {est['bottleneck']}"
        if est.get("shared_gpu"):  # the stages' rates alone would say more
            others = [s for s in est["shared_gpu"]["stages"] if s != est["bottleneck"]]
            # (no other stage: instances of the bottleneck itself share the card)
            head += f" (on a GPU it shares with {', '.join(others)})" if others else " (its instances share a GPU)"
        lines.append(head)
        for stage, s in est["stages"].items():
            t = "-" if s["service_s"] is None else f"{s['service_s'] * 1000:.0f} ms"
            # Theorem 1 is about rates, not load: on an idle set it is advice, not an alarm.
            keep = "" if s["needed"] is None or s["keeps_up"] else (
                f", Theorem 1: {s['needed']} instance(s) would keep up with the stage before at its full rate,"
                f" has {s['instances']}" + (" (falling behind: requests queue)" if s["queue"] else ""))
            lines.append(f"    {stage:14s} rate {_rate(s['rate'])} service {t} workers {s['workers']}"
                         f" queue {s['queue']}{keep}")
    return lines


def _pct(u: float | None) -> str:
    return "not measured yet" if u is None else f"{u:.0%}"


def _elastic(el: dict[str, Any]) -> list[str]:
    """The elastic policy and its recent decisions, each with the utilization it saw."""
    if not el:
        return []
    p = el["policy"]
    late = f" or > {p['late']:.0%} late" if p.get("late", 1) < 1 else ""
    lines = [f"elastic assignment: {'on' if p['enabled'] else 'off'}, move at >= {p['threshold']:.0%} busy{late}, "
             f"return below {p['low']:.0%} over {p.get('cold_windows', 1)} window(s), window {p['window_s']:g}s, "
             f"cooldown {p['cooldown_s']:g}s"
             + (f"; moving: {', '.join(el['moving'])}" if el.get("moving") else "")]
    for d in el.get("decisions", []):
        seen = ", ".join(f"{s} {_pct(v['util'])}x{v['instances']}" for s, v in d["inputs"].items() if v["instances"])
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(d['at']))} {d['instance']} "
                     f"{d['from'] or 'idle pool'} -> {d['to'] or 'idle pool'} (holding {d['holding']}): "
                     f"{d['reason']} [{seen}]")
    return lines


def render(status: dict[str, Any]) -> str:
    from onepiece.deployment import FIELD

    lines = []
    if (status.get("nm") or {}).get(FIELD):
        lines.append(f"deployment {status['nm'][FIELD]}")
    util = (status.get("elastic") or {}).get("utilization", {})
    late = (status.get("elastic") or {}).get("late", {})
    for name, st in status["sets"].items():
        lines.append(f"set {name}")
        for stage, info in st["stages"].items():
            insts = info["instances"]
            ready = sum(1 for i in insts if i["ready"])
            missed = late.get(name, {}).get(stage)
            # Of the instances assigned now: moves change them, the topology's count stays.
            start = "" if info["want"] == len(insts) else f" (the topology starts {info['want']})"
            lines.append(f"  stage {stage}: {ready}/{len(insts)} ready{start}, busy "
                         f"{_pct(util.get(name, {}).get(stage))}"
                         + ("" if missed is None else f", {missed:.0%} of its requests late"))
            lines += [_instance(i) for i in insts]
        for label, key in (("idle pool", "idle"), ("dbs", "dbs"), ("proxies", "proxies")):
            want = (st.get("want") or {}).get(key)
            if st[key] or want:
                # A DB or proxy that is gone said nothing before: the list was one shorter.
                count = "" if want is None else f" {sum(1 for i in st[key] if i['ready'])}/{len(st[key])} ready" + (
                    "" if want == len(st[key]) else f" (the topology starts {want})")
                lines.append(f"  {label}:{count}")
                lines += [_instance(i) for i in st[key]]
        lines += _capacity(st.get("capacity") or {})
    lines += _elastic(status.get("elastic") or {})
    if status.get("events"):
        lines.append("recent events:")
        lines += [f"  {e}" for e in status["events"]]
    return "\n".join(lines)
