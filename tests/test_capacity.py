"""The request monitor's arithmetic: capacity per application from measured service times."""

import pytest

from onepiece.config import deploy_dir, load_workflow
from onepiece.nm.capacity import estimate, predicted_latency
from onepiece.sched.keys import shape_key
from onepiece.stage.service_times import ServiceTimes

WF = load_workflow(deploy_dir() / "wan21.yaml")


def stage(stage_name, workers=1, queue=0, ready=True, **service):
    """An instance view as the NM holds it; ``service`` maps app -> (mean_s, recent[, shapes])."""
    svc = {app: {"mean_s": v[0], "recent": v[1], "shapes": v[2] if len(v) > 2 else {}} for app, v in service.items()}
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
    # the two queued requests drain at the app's mean (0.5 s each); then this shape's own time
    assert predicted_latency(est, "64x64x9:10") == pytest.approx(0.01 + 0.5 * 2 + 0.3 + 0.2)
    assert predicted_latency(est, "256x256x17:10") == pytest.approx(0.01 + 0.5 * 2 + 0.5 + 0.2)


def test_service_times_window_mix_and_bounds():
    now = [0.0]
    st = ServiceTimes(clock=lambda: now[0])
    for i in range(100):
        st.add("t2v", shape_key({"width": 64, "height": 64, "num_frames": 9, "steps": 10}), 1.0 if i < 50 else 2.0)
    for i in range(200):
        st.add("t2v", f"shape{i}", 3.0)
    rep = st.report()["t2v"]
    assert rep["mean_s"] == 3.0  # the window holds the last 32 only
    assert len(rep["shapes"]) == 64 and "64x64x9:10" not in rep["shapes"]
    assert rep["recent"] == 300
    now[0] = 100.0
    assert st.report()["t2v"]["recent"] == 0


def test_service_time_is_the_mean_so_mixed_shapes_give_true_throughput():
    st = ServiceTimes()
    for _ in range(6):
        st.add("t2v", "small", 0.1)
    for _ in range(4):
        st.add("t2v", "large", 1.5)
    rep = st.report()["t2v"]
    # 10 requests took 6.6 s of worker time: one worker completes 1/0.66 per second
    assert rep["mean_s"] == pytest.approx(0.66)
    assert rep["shapes"] == {"small": pytest.approx(0.1), "large": pytest.approx(1.5)}
    # batched, a request's share of the device is less than its standalone time: both are kept
    st.add("t2v", "small", 0.04, 0.1)
    rep = st.report()["t2v"]
    assert rep["shapes"]["small"] == pytest.approx(0.1) and rep["shares"]["small"] == pytest.approx(0.64 / 7)
    est = estimate(WF, [{"role": "stage", "stage": "denoise_t2v", "ready": True,
                         "stats": {"ready": 1, "queue": 0, "service": st.report(), "policy": "slo"}}])
    row = est["t2v"]["stages"]["denoise_t2v"]
    assert row["shares_s"] == rep["shares"] and row["shapes_s"] == rep["shapes"] and row["policy"] == "slo"


def test_theorem_1_sums_every_application_flowing_into_a_shared_stage():
    # t2v and i2v each deliver 2/s into vae_decode, which takes 0.4 s for either: alone each
    # would need one instance; together they need two
    members = [stage("denoise_t2v", workers=1, t2v=(0.5, 10)), stage("denoise_i2v", workers=1, i2v=(0.5, 10)),
               stage("vae_decode", t2v=(0.4, 10), i2v=(0.4, 10))]
    est = estimate(WF, members)
    assert est["t2v"]["stages"]["vae_decode"]["needed"] == 2
    assert est["i2v"]["stages"]["vae_decode"]["needed"] == 2
    assert not est["t2v"]["stages"]["vae_decode"]["keeps_up"]


def test_standalone_times_and_shares_follow_the_cost_model_not_the_estimates_made_as_requests_finished():
    """A worker's first steps of a shape are slow (cold caches, lazy set-up): the first requests'
    estimates are high. The report asks the cost model again for the window's requests, so once
    its medians settle the monitor admits against what a request takes now, not a window's mean
    of older estimates: neither its latency (standalone) nor the stage's rate (shares)."""
    from onepiece.sched.core import SchedCore
    from onepiece.sched.costs import CostModel
    from onepiece.sched.options import ScheduleSpec
    from onepiece.sched.virtual import request

    key = "64x64x9/cfg/L64"
    core = SchedCore(ScheduleSpec(policy="slo", max_batch=1, chunk_steps=10), CostModel())
    core.worker_up("w0")
    st = ServiceTimes()

    def one(uid: str, step_s: float) -> None:
        core.add(request(uid, key, steps=10))
        core.schedule(0.0)
        for _ in range(10):
            core.stepped([uid], step_s)
        core.idle("w0")
        st.finished(core, core.finished(uid), "64x64x9:10")

    for i in range(3):
        one(f"cold{i}", 0.5)  # the model's median is 0.5 s a step
    before = st.report()["t2v"]
    assert before["shapes"]["64x64x9:10"] == pytest.approx(5.0, rel=0.01)
    assert before["mean_s"] == before["shares"]["64x64x9:10"] == pytest.approx(5.0, rel=0.01)  # batch 1: alike
    for _ in range(40):
        core.costs.observe(key, 1, 0.1)  # later steps: 0.1 s (the window's median moves there)
    after = st.report()["t2v"]  # none finished since
    assert after["shapes"]["64x64x9:10"] == pytest.approx(1.0, rel=0.01)
    assert after["mean_s"] == after["shares"]["64x64x9:10"] == pytest.approx(1.0, rel=0.01)


def on_gpus(view, *gpus):
    view["stats"]["gpus"] = list(gpus)
    return view


def test_stages_that_share_a_gpu_pass_one_request_per_their_summed_device_time():
    """Every stage of a set on one card (the H200 runs): the card passes a request per the sum
    of their times, not per the slowest stage's (which read 1.8x what such a set served)."""
    members = [on_gpus(v, "GPU-a") for v in t2v_only(text_encode=0.1, denoise_t2v=0.5, vae_decode=0.2)]
    est = estimate(WF, members)["t2v"]
    assert est["capacity"] == pytest.approx(1 / 0.8)  # (not 1 / 0.5: the slowest stage's)
    assert est["bottleneck"] == "denoise_t2v"  # the stage that takes most of the card
    assert est["shared_gpu"] == {"gpu": "GPU-a", "stages": ["denoise_t2v", "text_encode", "vae_decode"]}
    from onepiece.proxy.admission import bottleneck_work

    # what a request ahead costs the deadline-first rule there: the card's time, not one stage's
    assert bottleneck_work(est, "64x64x9:10") == pytest.approx(0.8)
    from onepiece.status import render

    text = render({"sets": {"set0": {"stages": {}, "idle": [], "dbs": [], "proxies": [], "capacity": {"t2v": est}}}})
    assert "capacity t2v: 1.25/s, bottleneck denoise_t2v (on a GPU it shares with text_encode, vae_decode)" in text
    # a card each: the slowest stage, as before
    members = [on_gpus(v, f"GPU-{i}") for i, v in enumerate(t2v_only(text_encode=0.1, denoise_t2v=0.5, vae_decode=0.2))]
    est = estimate(WF, members)["t2v"]
    assert est["capacity"] == pytest.approx(1 / 0.5) and est["shared_gpu"] is None
    # no GPUs reported (CPU stages): as before
    assert estimate(WF, t2v_only(text_encode=0.1))["t2v"]["capacity"] == pytest.approx(1 / 0.5)


def test_a_shared_gpu_counts_each_instance_by_its_share_of_the_stage():
    """Two denoise instances, one on the card the light stages use and one on its own: the
    shared card does half the denoising (0.25 s a request) beside 0.3 s of the rest."""
    members = [on_gpus(stage("text_encode", t2v=(0.1, 10)), "GPU-a"), on_gpus(stage("vae_decode", t2v=(0.2, 10)), "GPU-a"),
               on_gpus(stage("denoise_t2v", t2v=(0.5, 10)), "GPU-a"), on_gpus(stage("denoise_t2v", t2v=(0.5, 10)), "GPU-b")]
    est = estimate(WF, members)["t2v"]
    assert est["capacity"] == pytest.approx(1 / 0.55)
    # an instance of two workers on two cards puts half of its share on each
    members[2:] = [on_gpus(stage("denoise_t2v", workers=2, t2v=(0.5, 10)), "GPU-a", "GPU-b")]
    assert estimate(WF, members)["t2v"]["capacity"] == pytest.approx(1 / 0.55)
    # a collaboration group's ranks compute each request together: each card the whole time
    wf = WF.model_copy(deep=True)
    wf.stages["denoise_t2v"].mode, wf.stages["denoise_t2v"].workers = "collaboration", 2
    members[2:] = [on_gpus(stage("denoise_t2v", workers=1, t2v=(0.5, 10)), "GPU-a", "GPU-b")]
    assert estimate(wf, members)["t2v"]["capacity"] == pytest.approx(1 / 0.8)


def test_a_shared_gpu_counts_every_application_that_runs_on_it():
    """t2v and i2v share the card of text_encode and vae_decode: the card's time per second is
    each application's rate times what its requests take there."""
    i2v = ["text_encode", "image_encode", "vae_encode", "denoise_i2v", "vae_decode"]
    members = [on_gpus(stage("text_encode", t2v=(0.1, 30), i2v=(0.1, 10)), "GPU-a"),
               on_gpus(stage("vae_decode", t2v=(0.2, 30), i2v=(0.2, 10)), "GPU-a")]
    members += [on_gpus(stage(s, t2v=(0.5, 30)), f"GPU-{s}") for s in ("denoise_t2v",)]
    members += [on_gpus(stage(s, i2v=(0.05, 10)), f"GPU-{s}") for s in i2v[1:4]]
    est = estimate(WF, members)
    m_t2v, m_i2v = 31 / 42, 11 / 42  # text_encode's mix
    per_request = m_t2v * 0.3 + m_i2v * 0.3  # card seconds per request of the set
    assert est["i2v"]["capacity"] == pytest.approx(m_i2v / per_request)  # (vae_decode alone: m_i2v / 0.2)
    assert est["i2v"]["shared_gpu"]["stages"] == ["text_encode", "vae_decode"]
    assert est["t2v"]["capacity"] == pytest.approx(1 / 0.5)  # its own card's denoising binds first


def test_a_shared_gpu_splits_by_the_arrivals_when_applications_enter_at_different_stages():
    """i2v may encode its image first ([image_encode, text_encode, ...]: its pre-denoise stages
    run in any order), so t2v enters at text_encode and i2v at image_encode, each its first
    stage's only application there: each read a share of the arrivals of 1, and the card was
    split evenly whatever the mix (0.59/s each at 3:1, t2v's capacity a third too low and
    i2v's nearly twice what the card passes)."""
    wf = load_workflow(deploy_dir() / "wan21.yaml")
    wf.applications["i2v"].stages = ["image_encode", "text_encode", "vae_encode", "denoise_i2v", "vae_decode"]
    wf = type(wf).model_validate(wf.model_dump())  # a workflow the loader accepts
    members = [on_gpus(stage("text_encode", t2v=(0.1, 30), i2v=(0.1, 10)), "G"),
               on_gpus(stage("image_encode", i2v=(0.1, 10)), "G"), on_gpus(stage("vae_encode", i2v=(0.1, 10)), "G"),
               on_gpus(stage("denoise_t2v", t2v=(0.4, 30)), "G"), on_gpus(stage("denoise_i2v", i2v=(0.3, 10)), "G"),
               on_gpus(stage("vae_decode", t2v=(0.2, 30), i2v=(0.2, 10)), "G")]
    est = estimate(wf, members)
    m_t2v, m_i2v = 31 / 42, 11 / 42  # the arrivals, as text_encode (which both pass) counts them
    per_request = m_t2v * 0.7 + m_i2v * 0.8  # card seconds per request of the set
    assert est["t2v"]["capacity"] == pytest.approx(m_t2v / per_request)
    assert est["i2v"]["capacity"] == pytest.approx(m_i2v / per_request)


def test_status_says_so_when_the_bottlenecks_own_instances_share_a_gpu():
    """Two denoise instances on one card (the light stages on another): the card bounds the
    capacity with no other stage on it, and status named none ("shares with )")."""
    from onepiece.status import render

    members = [on_gpus(stage("text_encode", t2v=(0.1, 10)), "GPU-a"), on_gpus(stage("vae_decode", t2v=(0.2, 10)), "GPU-a"),
               on_gpus(stage("denoise_t2v", t2v=(0.5, 10)), "GPU-b"), on_gpus(stage("denoise_t2v", t2v=(0.5, 10)), "GPU-b")]
    est = estimate(WF, members)["t2v"]
    assert est["shared_gpu"] == {"gpu": "GPU-b", "stages": ["denoise_t2v"]}
    text = render({"sets": {"set0": {"stages": {}, "idle": [], "dbs": [], "proxies": [], "capacity": {"t2v": est}}}})
    assert "capacity t2v: 2.00/s, bottleneck denoise_t2v (its instances share a GPU)" in text
