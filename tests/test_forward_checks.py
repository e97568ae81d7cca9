"""A message that reaches a stage instance for another stage is forwarded only once its routing
fields check out (onepiece.task_header.Routed). An unhashable ``stage`` once escaped the idle
pool's forward loop and ended the instance; now the request fails with the field named."""

from __future__ import annotations

import pytest

from onepiece.stage.deliver import ResultDeliver
from onepiece.transport.message import Message, new_uid
from onepiece.transport.rpc import RpcClient, RpcError
from proxy_harness import WORKFLOW, DbThread
from waiting import wait_for


@pytest.mark.parametrize("header, field", [
    ({"stage": [1], "app": "t2v"}, "stage: Input should be a valid string"),
    ({"stage": {"a": 1}, "app": "t2v"}, "stage: Input should be a valid string"),
    ({"stage": "vae_decode", "app": ["t2v"]}, "app: Input should be a valid string"),
    ({"stage": "vae_decode", "app": "t2v", "hops": "2"}, "hops: Input should be a valid integer"),
])
def test_a_malformed_forward_fails_its_request_with_the_field_named(header, field):
    db = DbThread()
    rpc = RpcClient(db.server.control_address, timeout=1.0, retries=0)
    deliver = ResultDeliver("", WORKFLOW, None, routes=lambda: {"stages": {}, "dbs": [db.addresses]})  # type: ignore[arg-type]
    try:
        uid = new_uid()
        deliver.forward(Message({"uid": uid, **header}))  # raises nothing
        def record() -> dict | None:
            try:
                return rpc.call("get", uid=uid)[0]["record"]
            except RpcError:  # not there yet
                return None
        rec = wait_for(record, timeout=5, what="the request's record")
        assert rec["status"] == "failed", rec
        assert "malformed message to forward" in rec["error"] and field in rec["error"], rec["error"]
    finally:
        deliver.close()
        rpc.close()
        db.close()


def test_a_stage_holds_every_request_to_the_applications_timeout_at_most():
    """The deadline a stage schedules and expires a request by (stage/scheduler.py): its own
    when it has one within the application's timeout, else that timeout from now. A message
    sent straight to a stage without a deadline once pinned a worker indefinitely."""
    from onepiece.task_header import TaskHeader

    now, timeout_s = 10**18, 600.0
    head = {"uid": new_uid(), "app": "t2v", "stage": "denoise_t2v", "params": {}}
    longest = now + int(timeout_s * 1e9)
    assert TaskHeader(**head).held_to(now, timeout_s) == longest  # none: the application's
    assert TaskHeader(**head, deadline=now + 5 * 10**9).held_to(now, timeout_s) == now + 5 * 10**9  # its own
    assert TaskHeader(**head, deadline=longest + 1).held_to(now, timeout_s) == longest  # too far: cut
    assert TaskHeader(**head, deadline=1 << 63).held_to(now, timeout_s) == longest
