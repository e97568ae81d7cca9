"""An HTTP fuzz of the proxy's served OpenAPI schema (schemathesis): requests generated from
``/openapi.json``, valid and invalid, sent over real HTTP to a real proxy with a real DB behind
it (tests/proxy_harness.py); no answer may be a 5xx, and every answer must be one the schema
declares (status, content type, headers, body). A thread plays the pipeline, so created videos
complete and their content can be read, listed and deleted."""

from __future__ import annotations

import threading

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks
from schemathesis.generation import GenerationMode

import proxy_harness as H

# The checks of what the proxy answers. Not the ones that judge acceptance by the schema alone
# (positive_data_acceptance...): some limits cannot be written in it (4k+1 frames, a size in
# multiples of 16 within the model's bounds, an image for image-to-video models only).
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_headers_conformance, checks.response_schema_conformance]


class Pipeline:
    """Completes every request that reaches the entrance: a result written to the DB, as the
    last stage writes one."""

    def __init__(self, h: H.Harness) -> None:
        self.h, self.stop, self.completed = h, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = self.h.entrance.recv(0.1)
            if msg is not None:
                self.h.db.result(msg.uid, b"\x00\x00\x00\x18ftypmp42 a video")
                self.completed += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def served():
    h = H.Harness(max_inflight=10_000, max_body_bytes=1 << 20)
    pipeline = Pipeline(h)
    try:
        yield h, schemathesis.openapi.from_url(h.url + "/openapi.json"), pipeline
    finally:
        pipeline.close()
        h.close()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_the_schema_admits_or_breaks_gets_a_5xx_or_an_undeclared_answer(served, mode):
    h, schema, pipeline = served

    @given(case=schema.as_strategy(generation_mode=mode))
    # Bounded: 150 requests a mode, none over 10 s (a loaded 2-core machine answers in ms).
    @settings(max_examples=150, deadline=10_000, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=h.url, checks=CHECKS)

    fuzz()
    assert h.healthz()["status"] == "ok"
    if mode == GenerationMode.POSITIVE:
        assert pipeline.completed > 0  # valid creates got through to the pipeline, not only refusals


def test_the_schema_declares_what_the_proxy_answers(served):
    _, schema, _ = served
    raw = schema.raw_schema
    ops = {(path, method): op for path, item in raw["paths"].items() for method, op in item.items()}
    assert not [k for k, op in ops.items() if "422" in op["responses"]]  # the proxy answers 400
    assert {"400", "401", "409", "413", "415", "429", "503"} <= set(ops["/v1/videos", "post"]["responses"])
    content = ops["/v1/videos/{video_id}/content", "get"]["responses"]["200"]["content"]
    assert list(content) == ["video/mp4"]
    names = [p["name"] for p in ops["/v1/videos", "get"]["parameters"]]
    assert names == ["after", "limit", "order"]
    (variant,) = [p for p in ops["/v1/videos/{video_id}/content", "get"]["parameters"] if p["name"] == "variant"]
    assert variant["schema"]["enum"] == ["video", ""]
    form = ops["/v1/videos", "post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    assert form["priority"]["anyOf"] == [{"type": "integer", "minimum": -1000, "maximum": 1000}]  # no null in a form
    assert list(ops["/metrics", "get"]["responses"]["200"]["content"]) == ["text/plain"]



def test_the_answers_about_real_videos_conform(served):
    """Retrieve, download and delete with the ids of real videos (completed by the pipeline), the
    rest of each request drawn from the schema: the 200s with their bodies, then the 404s of
    what was deleted or purged after its download."""
    h, schema, _ = served
    ids = [h.create(prompt=f"video {i}").json()["id"] for i in range(6)]
    H.wait_for(lambda: all(h.http.get(f"/v1/videos/{v}").json()["status"] == "completed" for v in ids),
               what="the pipeline completed the videos")
    ops = [schema[path][method] for path, method in (("/v1/videos/{video_id}", "GET"),
                                                     ("/v1/videos/{video_id}/content", "GET"),
                                                     ("/v1/videos/{video_id}", "DELETE"))]
    seen: set[int] = set()

    @given(case=st.sampled_from(ids).flatmap(lambda vid: st.one_of(
        [op.as_strategy(path_parameters={"video_id": vid}) for op in ops])))
    @settings(max_examples=60, deadline=10_000, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: schemathesis.Case) -> None:
        seen.add(case.call_and_validate(base_url=h.url, checks=CHECKS).status_code)

    fuzz()
    assert 200 in seen and 404 in seen, seen
