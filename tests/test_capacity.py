"""The request monitor's arithmetic: capacity per application from measured service times."""

import pytest

from onepiece.config import deploy_dir, load_workflow
from onepiece.nm.capacity import estimate, predicted_latency
from onepiece.stage.service_times import ServiceTimes, shape_key

WF = load_workflow(deploy_dir() / "wan21.yaml")


def stage(stage_name, workers=1, queue=0, ready=True, **service):
    """An instance view as the NM holds it; ``service`` maps app -> (median_s, recent[, shapes])."""
    svc = {app: {"median_s": v[0], "recent": v[1], "shapes": v[2] if len(v) > 2 else {}} for app, v in service.items()}
    return {"role": "stage", "stage": stage_name, "ready": ready,
            "stats": {"ready": workers, "queue": queue, "service": svc}}


T2V = ["text_encode", "denoise_t2v", "vae_decode"]


def t2v_only(**overrides):
    times = {"text_encode": 0.01, "denoise_t2v": 0.5, "vae_decode": 0.2}
    times.update(overrides)
    return [stage(s, t2v=(t, 10)) for s, t in times.items()]


def test_capacity_is_the_slowest_stage_and_names_it():
    est = estimate(WF, t2v_only())["t2v"]
    assert est["bottleneck"] == "denoise_t2v"
    assert est["capacity"] == pytest.approx(1 / 0.5)  # denoise_t2v serves t2v alone: no split


def test_more_workers_or_instances_raise_capacity():
    members = t2v_only() + [stage("denoise_t2v", t2v=(0.5, 10)) for _ in range(2)]
    est = estimate(WF, members)["t2v"]
    # three denoisers complete 6/s; now the shared vae_decode limits: t2v's share of its 5/s,
    # with one pseudo-arrival kept for the idle i2v so that it is never starved
    assert est["bottleneck"] == "vae_decode"
    assert est["capacity"] == pytest.approx((11 / 12) / 0.2)
    est = estimate(WF, t2v_only() + [stage("denoise_t2v", workers=3, t2v=(0.5, 10))])["t2v"]
    assert est["stages"]["denoise_t2v"]["rate"] == pytest.approx(4 / 0.5)


def test_unmeasured_stage_gives_no_estimate_and_no_workers_gives_zero():
    members = [stage("text_encode", t2v=(0.01, 1)), stage("denoise_t2v", t2v=(0.5, 1)), stage("vae_decode")]
    assert estimate(WF, members)["t2v"]["capacity"] is None
    members = t2v_only()[:2] + [stage("vae_decode", ready=False, t2v=(0.2, 1))]
    est = estimate(WF, members)["t2v"]
    assert est["capacity"] == 0.0 and est["bottleneck"] == "vae_decode"


def test_shared_stage_splits_by_recent_mix():
    # vae_decode serves both apps: 30 recent t2v at 0.2 s, 10 recent i2v at 0.6 s (+1 prior each)
    members = [stage("vae_decode", t2v=(0.2, 30), i2v=(0.6, 10))]
    s = estimate(WF, members)
    mix_t2v, mix_i2v = 31 / 42, 11 / 42
    per_request = (mix_t2v * 0.2 + mix_i2v * 0.6)
    assert s["t2v"]["stages"]["vae_decode"]["rate"] == pytest.approx(mix_t2v / per_request)
    assert s["i2v"]["stages"]["vae_decode"]["rate"] == pytest.approx(mix_i2v / per_request)


def test_theorem_1_counts_instances_a_stage_needs_to_keep_up():
    est = estimate(WF, t2v_only(denoise_t2v=0.5, vae_decode=1.2))["t2v"]["stages"]
    # denoise completes 2/s; vae_decode at 1.2 s needs ceil(2 * 1.2) = 3 instances to keep up
    assert est["vae_decode"]["needed"] == 3 and not est["vae_decode"]["keeps_up"]
    # literally the theorem: to match text_encode's t2v share of 100/s, denoise (0.5 s) needs 46
    assert est["denoise_t2v"]["needed"] == 46 and not est["denoise_t2v"]["keeps_up"]
    assert est["text_encode"]["needed"] is None  # the first stage has nothing to keep up with
    est = estimate(WF, t2v_only(denoise_t2v=0.5, vae_decode=0.4))["t2v"]["stages"]
    assert est["vae_decode"]["needed"] == 1 and est["vae_decode"]["keeps_up"]


def test_predicted_latency_uses_the_shape_and_the_queue():
    members = [stage("text_encode", t2v=(0.01, 5)),
               stage("denoise_t2v", queue=2, t2v=(0.5, 5, {"64x64x9:10": 0.3})),
               stage("vae_decode", t2v=(0.2, 5))]
    est = estimate(WF, members)["t2v"]
    assert predicted_latency(est, "64x64x9:10") == pytest.approx(0.01 + 0.3 * 3 + 0.2)
    assert predicted_latency(est, "256x256x17:10") == pytest.approx(0.01 + 0.5 * 3 + 0.2)


def test_service_times_window_mix_and_bounds():
    now = [0.0]
    st = ServiceTimes(clock=lambda: now[0])
    for i in range(100):
        st.add("t2v", shape_key({"width": 64, "height": 64, "num_frames": 9, "steps": 10}), 1.0 if i < 50 else 2.0)
    for i in range(200):
        st.add("t2v", f"shape{i}", 3.0)
    rep = st.report()["t2v"]
    assert rep["median_s"] == 3.0  # the window holds the last 32 only
    assert len(rep["shapes"]) == 64 and "64x64x9:10" not in rep["shapes"]
    assert rep["recent"] == 300
    now[0] = 100.0
    assert st.report()["t2v"]["recent"] == 0


def test_a_slow_first_request_does_not_skew_the_service_time():
    st = ServiceTimes()
    st.add("t2v", "s", 5.0)  # a fresh worker's first request (JIT, allocator warm-up)
    for _ in range(9):
        st.add("t2v", "s", 0.2)
    rep = st.report()["t2v"]
    assert rep["median_s"] == 0.2 and rep["shapes"]["s"] == 0.2
