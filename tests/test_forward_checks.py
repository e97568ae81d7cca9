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
