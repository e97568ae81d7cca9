"""`onepiece bench validation`: what the schema checks at the receivers cost per message, against
what the message costs to send over the project's ZMQ transport, measured in the same run
(issue 14's benchmark).

Four messages, each the kind a receiver sees most, shaped as the project writes them:

- ``task``: a data message's header at a stage (stage/scheduler.py): ``TaskHeader`` and the
  application's ``check_params`` (onepiece/task_header.py, onepiece/config.py);
- ``rpc``: a DB ``get`` request (db/protocol.py's ``RPC_SCHEMAS``, checked by transport/rpc.py);
- ``heartbeat``: a stage's heartbeat at the NM (nm/protocol.py's ``HeartbeatArgs``, then
  its stats, holdings and deliveries, as nm/server.py checks them);
- ``db_status``: a DB data message, a stage's progress report (db/protocol.py's ``StatusReport``).

Validation: the checks alone, timed over ``--n`` messages, best of ``--repeats`` batches (µs per
message). Transport, same messages: the two data messages through ``ZmqSender`` -> ``ZmqReceiver``
over loopback TCP (encode, send, receive, decode; µs per message at full rate, the receiver on
a thread of this process); the two requests as ``RpcClient.call`` round trips to an
``RpcServer`` on a thread, without schemas (µs per call). The share is validation / transport.
One process, so sender and receiver share the GIL as a stage's threads do. Writes
``validation.json`` and ``validation.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from onepiece.argtypes import count, out_dir
from onepiece.bench.common import cpu_name
from onepiece.config import deploy_dir, load_workflow
from onepiece.db.protocol import DATA_SCHEMAS, RPC_SCHEMAS
from onepiece.heartbeat import DELIVERED, delivered_of, stage_stats_problem
from onepiece.nm.protocol import SCHEMAS as NM_SCHEMAS, Holdings
from onepiece.schema import checked, problem
from onepiece.task_header import TaskHeader
from onepiece.transport import registry
from onepiece.transport.message import Message, new_uid
from onepiece.transport.rpc import RpcClient, RpcServer

NAMES = {"task": "data message at a stage (task header + params)", "rpc": "RPC request (DB get)",
         "heartbeat": "stage heartbeat at the NM", "db_status": "DB data message (progress report)"}


def messages() -> dict[str, dict[str, Any]]:
    """One message of each kind, as the proxy, a stage or a client writes it."""
    now = time.time_ns()
    uid = new_uid()
    params = {"prompt": "a cat surfing a wave at sunset, cinematic", "negative_prompt": "blurry", "width": 64,
              "height": 64, "num_frames": 9, "steps": 10, "guidance": 5.0, "seed": 7, "fps": 16,
              "max_sequence_length": 64}
    task = {"uid": uid, "ts": now, "app": "t2v", "stage": "text_encode", "set": "set0", "deadline": now + 60 * 10**9,
            "priority": 0, "reserve": {"text_encode": 1.5, "denoise_t2v": 0.4}, "kind": "task", "params": params,
            "trace": [{"stage": "proxy", "event": "leave", "t": now}]}
    service = {"t2v": {"mean_s": 0.8, "recent": 40, "shapes": {"64x64x9/cfg/L64": 0.8}, "shares": {}}}
    stats = {"ready": 2, "queue": 3, "workers": 2, "policy": "edf", "busy_s": 120.5, "slot_s": 300.0,
             "service": service, "holding": [new_uid() for _ in range(4)]}
    heartbeat = {"instance": "set0-denoise_t2v0", "ready": True, "stats": stats, "version": 12,
                 "serving": "set0", "deployment": "", DELIVERED: {"tcp://127.0.0.1:5601": [[new_uid(), 0.2]]}}
    status = {"uid": uid, "app": "t2v", "set": "set0", "kind": "status", "status": "in_progress",
              "stage": "denoise_t2v", "progress": 40, "deadline": now + 60 * 10**9}
    return {"task": task, "rpc": {"uid": uid}, "heartbeat": heartbeat, "db_status": status}


def validators() -> dict[str, Callable[[dict[str, Any]], Any]]:
    """Per kind, what its receiver checks before it uses a field."""
    app = load_workflow(deploy_dir() / "wan21.yaml").applications["t2v"]
    status_schema, get_schema, hb_schema = DATA_SCHEMAS["status"], RPC_SCHEMAS["get"], NM_SCHEMAS["heartbeat"]

    def task(h: dict[str, Any]) -> None:
        app.check_params(checked(TaskHeader, h).params)

    def heartbeat(req: dict[str, Any]) -> None:
        args = checked(hb_schema, req, "heartbeat")
        stats = dict(args.stats)
        holding = stats.pop("holding", None)
        bad = problem(Holdings, {"holding": holding}, "stats") or stage_stats_problem(stats)
        if bad or delivered_of(args.delivered) is None:
            raise ValueError(bad or "delivered: malformed")

    return {"task": task, "rpc": lambda r: checked(get_schema, r, "get"), "heartbeat": heartbeat,
            "db_status": lambda h: checked(status_schema, h, "status")}


def per_message_us(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """Best of ``repeats`` batches of ``n`` calls, in µs per call (the best: the least disturbed
    by the machine's other work)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def zmq_data_us(header: dict[str, Any], n: int, repeats: int) -> float:
    """µs per message through ZmqSender -> ZmqReceiver over loopback TCP, at full rate."""
    rx = registry.listen("tcp://127.0.0.1:0")
    tx = registry.connect(rx.address)
    try:
        best = float("inf")
        for _ in range(repeats + 1):  # the first batch warms the connection up
            got = threading.Event()

            def receive() -> None:
                for _ in range(n):
                    if rx.recv(5.0) is None:
                        return
                got.set()

            t = threading.Thread(target=receive)
            t0 = time.perf_counter()
            t.start()
            for _ in range(n):
                tx.send(Message(dict(header), {}), timeout=5.0)
            t.join(30)
            if not got.is_set():
                raise RuntimeError("messages were lost on loopback TCP")
            best = min(best, time.perf_counter() - t0)
        return best / n * 1e6
    finally:
        tx.close()
        rx.close()


def rpc_us(op: str, args: dict[str, Any], n: int, repeats: int) -> float:
    """µs per ``RpcClient.call`` round trip to an RpcServer that checks nothing and answers {}."""
    server = RpcServer("tcp://127.0.0.1:0", {op: lambda req, blobs: {}})
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(server.sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                server.handle()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = RpcClient(server.address, timeout=5.0, retries=0)
    try:
        per_message_us(lambda: client.call(op, **args), max(10, n // 20), 1)  # warm-up
        return per_message_us(lambda: client.call(op, **args), n, repeats)
    finally:
        client.close()
        stop.set()
        t.join(5)
        server.close()


def measure(n: int, repeats: int) -> dict[str, dict[str, float]]:
    msgs, checks = messages(), validators()
    out = {}
    for kind, msg in msgs.items():
        check = checks[kind]
        check(msg)  # a message that fails its own check would time the error path
        v = per_message_us(lambda: check(msg), n, repeats)
        if kind in ("task", "db_status"):
            sent, how = zmq_data_us(msg, n, repeats), "zmq tcp, one way"
        else:
            op = "get" if kind == "rpc" else "heartbeat"
            sent, how = rpc_us(op, msg, max(200, n // 10), repeats), "rpc round trip (zmq tcp)"
        out[kind] = {"validation_us": v, "transport_us": sent, "share": v / sent, "transport": how,
                     "header_bytes": len(json.dumps(msg))}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=count(), default=5000, help="messages per timed batch (default %(default)s)")
    p.add_argument("--repeats", type=count(), default=5, help="batches; the best counts (default %(default)s)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for validation.json and validation.md")


def run(args: argparse.Namespace) -> int:
    rows = measure(args.n, args.repeats)
    doc = {"bench": "validation", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "n": args.n,
           "repeats": args.repeats, "messages": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "validation.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Validation per message ({doc['when']}, {doc['cpu']})", "",
             f"Best of {doc['repeats']} batches of {doc['n']} messages (RPC round trips: batches of "
             f"{max(200, doc['n'] // 10)}); transport measured in the same run.", "",
             "| message | header bytes | validation µs | send µs | over | validation / send |",
             "|---|---:|---:|---:|---|---:|"]
    for kind, r in doc["messages"].items():
        lines.append(f"| {NAMES[kind]} | {r['header_bytes']} | {r['validation_us']:.1f} | {r['transport_us']:.1f} "
                     f"| {r['transport']} | {r['share']:.0%} |")
    return "\n".join(lines) + "\n"
