"""The request monitor's admission rules, as pure code on a fake clock (no sleeps, no sockets):
the token bucket, its re-rating when the capacity view changes, and the deadline rule."""

from __future__ import annotations

import pytest

from onepiece.config import deploy_dir, load_workflow
from onepiece.nm.capacity import estimate
from onepiece.proxy.admission import (PATH_MIN_SAMPLES, PATH_SAMPLES, CapacityAdmission, InflightTracker, TokenBucket,
                                      admit, cost, deadline_refusal, standalone_latency)

WF = load_workflow(deploy_dir() / "wan21.yaml")
SHAPE = "64x64x9:10"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stage(name: str, workers: int = 1, queue: int = 0, policy: str = "fcfs", **service: tuple) -> dict:
    svc = {app: {"mean_s": v[0], "recent": v[1], "shapes": v[2] if len(v) > 2 else {},
                 "shares": v[3] if len(v) > 3 else {}} for app, v in service.items()}
    return {"role": "stage", "stage": name, "ready": True,
            "stats": {"ready": workers, "queue": queue, "service": svc, "policy": policy}}


def flight(n: int, due_s: float = 600.0, work_s: float = 0.5,
           promised_s: float | None = None) -> list[tuple[float, float, float]]:
    """``n`` requests in flight, each due in ``due_s`` (admitted for ``promised_s``, default the
    same) with ``work_s`` at the bottleneck."""
    return [(due_s, due_s if promised_s is None else promised_s, work_s)] * n


def view(denoise_s: float = 0.5, denoise_workers: int = 1, queue: int = 0, proxies: int = 1,
         shapes: dict | None = None, policy: str = "fcfs", shares: dict | None = None) -> dict:
    """The NM's monitor view of a t2v set whose bottleneck is denoise_t2v (capacity
    denoise_workers / denoise_s), as nm/capacity.py computes it."""
    members = [stage("text_encode", t2v=(0.01, 10)),
               stage("denoise_t2v", workers=denoise_workers, queue=queue, policy=policy,
                     t2v=(denoise_s, 10, shapes or {}, shares or {})),
               stage("vae_decode", t2v=(0.05, 10))]
    return {"apps": estimate(WF, members), "proxies": proxies}


# --- the bucket ---------------------------------------------------------------------------------
def test_bucket_starts_full_then_admits_at_its_rate():
    b = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [b.try_take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.wait_s(0.0) == pytest.approx(0.5)
    assert not b.try_take(0.49) and b.try_take(0.5)
    # over 10 s of steady arrivals every 0.1 s, 2/s get through (+ what was left of the burst)
    taken = sum(b.try_take(0.5 + 0.1 * i) for i in range(1, 101))
    assert taken == 20
    assert b.tokens <= b.burst


def test_bucket_never_holds_more_than_its_burst():
    b = TokenBucket(rate=5.0, burst=2.0, now=0.0)
    assert b.try_take(100.0) and b.try_take(100.0) and not b.try_take(100.0)


def test_rerate_keeps_the_level_and_accrues_at_the_old_rate_first():
    b = TokenBucket(rate=1.0, burst=1.0, now=0.0)
    assert b.try_take(0.0)
    b.rerate(10.0, 5.0, now=0.5)  # half a token accrued at the old rate; no fresh burst
    assert b.tokens == pytest.approx(0.5)
    assert b.wait_s(0.5) == pytest.approx(0.05)
    b.rerate(0.5, 1.0, now=10.0)  # 0.5 + 9.5 s × 10/s, clamped to the old burst then the new one
    assert b.tokens == pytest.approx(1.0)


def test_give_back_undoes_a_take():
    b = TokenBucket(rate=1.0, burst=1.0, now=0.0)
    assert b.try_take(0.0) and not b.try_take(0.0)
    b.give_back()
    assert b.try_take(0.0)


def test_zero_rate_waits_forever():
    b = TokenBucket(rate=0.0, burst=1.0, now=0.0)
    assert b.try_take(0.0) and b.wait_s(5.0) == float("inf")


def test_a_take_larger_than_the_burst_waits_for_a_full_bucket_and_leaves_a_debt():
    b = TokenBucket(rate=1.0, burst=1.0, now=0.0)
    assert b.try_take(0.0, cost=0.25) and b.try_take(0.0, cost=0.75) and not b.try_take(0.0, cost=0.25)
    assert b.wait_s(0.0, cost=3.0) == pytest.approx(1.0)  # a full bucket is enough
    assert not b.try_take(0.5, cost=3.0) and b.try_take(1.0, cost=3.0)
    assert b.tokens == pytest.approx(-2.0) and b.wait_s(1.0) == pytest.approx(3.0)  # the debt is paid first
    b.give_back(3.0)
    assert b.tokens == pytest.approx(1.0)


# --- admission at capacity ----------------------------------------------------------------------
def test_admits_a_fair_share_of_the_capacity_and_refuses_the_rest():
    clock = Clock()
    adm = CapacityAdmission(burst_s=0.5, headroom=1.0, clock=clock)
    adm.observe(view(denoise_s=0.25, proxies=2))  # the set does 4/s; this proxy admits 2/s
    assert adm.rate("t2v") == pytest.approx(2.0)
    assert adm.buckets["t2v"].burst == pytest.approx(1.0)  # max(1, 2/s × 0.5 s)
    outcomes = []
    for i in range(100):  # 10/s for 10 s
        clock.t = 1000.0 + 0.1 * i
        outcomes.append(adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)))
    admitted = [o for o in outcomes if o is None]
    refused = [o for o in outcomes if o is not None]
    assert len(admitted) == pytest.approx(20, abs=1)
    assert {r.code for r in refused} == {"over_capacity"}
    assert all(r.retry_after_s == 1 for r in refused)  # at least 1 s, the next token is < 0.5 s away
    assert "4.00 requests/s over 2 proxies" in refused[0].message
    # steady: every second admits the same share, not a burst then nothing
    per_second = [sum(o is None for o in outcomes[i:i + 10]) for i in range(0, 100, 10)]
    assert per_second[1:] == [2] * 9


def test_retry_after_is_the_wait_for_a_token_rounded_up():
    clock = Clock()
    adm = CapacityAdmission(headroom=1.0, clock=clock)
    adm.observe(view(denoise_s=4.0))  # 0.25/s, burst 1
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None
    r = adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1))
    assert r.code == "over_capacity" and r.retry_after_s == 4
    clock.t += 2.5
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)).retry_after_s == 2  # 1.5 s left → 2


def test_a_new_view_re_rates_the_bucket():
    clock = Clock()
    adm = CapacityAdmission(headroom=1.0, clock=clock)
    adm.observe(view(denoise_s=0.1))  # 10/s
    assert adm.rate("t2v") == pytest.approx(10.0)
    adm.observe(view(denoise_s=0.5))  # a denoiser died, or slowed down: 2/s
    assert adm.rate("t2v") == pytest.approx(2.0) and adm.buckets["t2v"].rate == pytest.approx(2.0)
    clock.t += 10
    admitted = 0
    for i in range(50):  # 10/s offered for 5 s
        clock.t += 0.1
        admitted += adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None
    assert admitted == pytest.approx(2 * 5 + 1, abs=1)
    adm.observe(view(denoise_s=0.5, denoise_workers=2))  # scaled out again
    assert adm.rate("t2v") == pytest.approx(4.0)


def test_same_view_object_is_not_re_rated():
    adm = CapacityAdmission(headroom=1.0, clock=Clock())
    v = view()
    adm.observe(v)
    bucket = adm.buckets["t2v"]
    v["apps"]["t2v"]["capacity"] = 100.0  # mutated in place: not a new view
    adm.observe(v)
    assert adm.buckets["t2v"] is bucket and bucket.rate == pytest.approx(2.0)


def test_unknown_capacity_admits_without_a_rate_limit():
    adm = CapacityAdmission(headroom=1.0, clock=Clock())
    members = [stage("text_encode", t2v=(0.01, 1)), stage("denoise_t2v"), stage("vae_decode", t2v=(0.05, 1))]
    adm.observe({"apps": estimate(WF, members), "proxies": 1})
    assert adm.app_view("t2v")["capacity"] is None and adm.rate("t2v") is None
    assert all(adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None for _ in range(100))
    adm.observe(None)  # no view at all (monitor off upstream, NM silent)
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None


def test_zero_capacity_refuses_with_no_capacity():
    adm = CapacityAdmission(no_capacity_retry_s=2, headroom=1.0, clock=Clock())
    adm.observe(view(denoise_workers=0))
    r = adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1))
    assert r.code == "no_capacity" and r.retry_after_s == 2 and "denoise_t2v" in r.message
    # i2v's stages have no instance in this t2v-only set at all
    assert adm.check("i2v", SHAPE, 600.0, False, ahead=flight(1)).code == "no_capacity"


def test_proxies_count_never_divides_by_zero():
    adm = CapacityAdmission(headroom=1.0, clock=Clock())
    adm.observe(view(denoise_s=0.5, proxies=0))
    assert adm.rate("t2v") == pytest.approx(2.0)


# --- the deadline rule --------------------------------------------------------------------------
def test_standalone_time_uses_the_shape_where_measured():
    est = view(denoise_s=0.5, shapes={SHAPE: 0.2})["apps"]["t2v"]
    assert standalone_latency(est, SHAPE) == pytest.approx(0.01 + 0.2 + 0.05)
    assert standalone_latency(est, "256x256x17:10") == pytest.approx(0.01 + 0.5 + 0.05)  # unmeasured: the mean
    assert standalone_latency(est, "256x256x17:10", measured=True) is None


def test_explicit_timeout_is_the_deadline():
    est = view(denoise_s=0.5, queue=4)["apps"]["t2v"]  # predicted 0.01 + 0.5 × 5 + 0.05 = 2.56 s
    assert deadline_refusal(est, SHAPE, 3.0, True, factor=1.0) is None  # the factor is for defaults only
    r = deadline_refusal(est, SHAPE, 1.0, True, factor=5.0)
    assert r.code == "deadline" and r.retry_after_s == 2  # 1.56 s too late → 2
    assert "2.56s" in r.message and "1.00s" in r.message


def test_a_deadline_no_idle_set_meets_says_that_no_wait_helps():
    """Shorter than the request takes on an idle set: "retry later" would never help."""
    est = view(denoise_s=0.5, queue=4)["apps"]["t2v"]  # alone 0.56 s, predicted 2.56 s
    r = deadline_refusal(est, SHAPE, 0.05, True, factor=1.0)
    assert r.code == "deadline" and "even an idle set takes 0.56s" in r.message and "0.05s" in r.message
    assert "longer deadline" in r.hint
    assert "retry later" in deadline_refusal(est, SHAPE, 1.0, True, factor=1.0).hint  # this one can wait


def test_a_near_miss_reads_as_one():
    """Ties admit; a prediction just past the deadline is shown to the digit that tells them apart."""
    est = view(denoise_s=0.5, queue=4)["apps"]["t2v"]  # predicted 2.56 s
    r = deadline_refusal(est, SHAPE, 2.558, True, factor=1.0)
    assert r.code == "deadline"
    assert "in 2.560s exceeds the deadline of 2.558s" in r.message, r.message
    assert deadline_refusal(est, SHAPE, 2.56, True, factor=1.0) is None


def test_default_deadline_is_factor_times_standalone_unless_the_limit_is_tighter():
    idle = view(denoise_s=0.5)["apps"]["t2v"]  # standalone 0.56 s
    assert deadline_refusal(idle, SHAPE, 600.0, False, factor=2.0) is None
    busy = view(denoise_s=0.5, queue=2)["apps"]["t2v"]  # predicted 1.56 s ≤ 2 × 0.56 = 1.12? no
    r = deadline_refusal(busy, SHAPE, 600.0, False, factor=2.0)
    assert r.code == "deadline" and r.retry_after_s == 1
    assert deadline_refusal(busy, SHAPE, 600.0, False, factor=3.0) is None  # 1.68 s allowed
    # the app's limit (timeout_s when not given) is tighter than factor × standalone
    assert deadline_refusal(busy, SHAPE, 1.0, False, factor=3.0).code == "deadline"
    # factor 0: the limit alone
    assert deadline_refusal(busy, SHAPE, 600.0, False, factor=0) is None


def test_requests_in_flight_predict_the_queue_before_a_heartbeat_reports_it():
    # capacity 2/s, standalone 0.56 s; the NM's view shows empty queues (a burst just came)
    est = view(denoise_s=0.5)["apps"]["t2v"]
    assert deadline_refusal(est, SHAPE, 600.0, False, factor=2.0, ahead=flight(1)) is None  # max(0.56, 2/2)=1 ≤ 1.12
    r = deadline_refusal(est, SHAPE, 600.0, False, factor=2.0, ahead=flight(2))  # 3 / 2 = 1.5 s > 1.12 s
    assert r.code == "deadline" and "1.50s" in r.message
    assert deadline_refusal(est, SHAPE, 2.0, True, factor=2.0, ahead=flight(2)) is None  # a patient client
    # the later of the two predictions counts: a queue the NM saw is not forgotten
    queued = view(denoise_s=0.5, queue=4)["apps"]["t2v"]  # 2.56 s
    assert "2.56s" in deadline_refusal(queued, SHAPE, 2.0, True, factor=2.0, ahead=flight(1)).message


def test_check_counts_every_proxys_requests_ahead():
    adm = CapacityAdmission(deadline_factor=2.0, headroom=1.0, clock=Clock())
    adm.observe(view(denoise_s=0.5, proxies=1))
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(2)).code == "deadline"
    # three proxies: one in flight here stands for three in the set; 4 / 2 = 2 s > 1.12 s
    adm.observe(view(denoise_s=0.5, proxies=3))
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)).code == "deadline"


def test_no_prediction_admits():
    members = [stage("text_encode", t2v=(0.01, 1)), stage("denoise_t2v"), stage("vae_decode", t2v=(0.05, 1))]
    est = estimate(WF, members)["t2v"]
    assert deadline_refusal(est, SHAPE, 0.001, True, factor=1.0) is None


def test_check_orders_refusals_and_spends_no_token_on_a_deadline_refusal():
    clock = Clock()
    adm = CapacityAdmission(deadline_factor=2.0, headroom=1.0, clock=clock)
    adm.observe(view(denoise_s=0.5, queue=4))
    tokens = adm.buckets["t2v"].tokens
    r = adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1))
    assert r.code == "deadline" and adm.buckets["t2v"].tokens == tokens
    assert adm.check("t2v", SHAPE, 10.0, True, ahead=flight(1)) is None  # a patient client is admitted
    assert adm.buckets["t2v"].tokens == pytest.approx(tokens - 1)


def test_a_malformed_view_never_fails_a_request():
    adm = CapacityAdmission(headroom=1.0, clock=Clock())
    adm.observe({"apps": {"t2v": {"capacity": None, "stages": "garbage"}}, "proxies": "x"})
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None
    adm.observe({"apps": "garbage"})
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None


def test_an_idle_proxy_admits_even_with_an_empty_bucket():
    clock = Clock()
    adm = CapacityAdmission(headroom=1.0, clock=clock)
    adm.observe(view(denoise_s=10.0))  # a pessimistic 0.1/s
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)).code == "over_capacity"
    # the first finished; a sequential client's next request finds the proxy idle
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=[]) is None
    # but never past a stage without workers or a missed deadline
    adm.observe(view(denoise_s=10.0, denoise_workers=0))
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=[]).code == "no_capacity"
    adm.observe(view(denoise_s=10.0, queue=10))
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=[]).code == "deadline"


# --- wiring: the NM-fed cluster view, the switch in topology and CLI ------------------------------
def test_nm_cluster_drops_a_view_no_heartbeat_renewed(monkeypatch):
    import types

    import onepiece.proxy.service as service

    now = [100.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: now[0])
    member = types.SimpleNamespace(set="set0", heartbeat_s=0.25, monitor=None,
                                   routes={"stages": {}, "dbs": []})
    cluster = service.NmCluster(WF, member)
    assert cluster.monitor() is None
    member.monitor = v = view()
    assert cluster.monitor() is v
    now[0] += 4.9
    assert cluster.monitor() is v  # the NM is slow, not gone
    now[0] += 0.2
    assert cluster.monitor() is None  # 5 s without a new view: fall back to the in-flight cap
    member.monitor = v2 = view()  # heartbeats are back
    assert cluster.monitor() is v2


def test_topology_switches_the_monitor_off_through_the_cli(tmp_path):
    from onepiece.cli import build_parser
    from onepiece.launcher import Deployment, write_topology

    models = {"t2v": tmp_path / "t2v", "i2v": tmp_path / "i2v"}
    on = write_topology(tmp_path, models, "tcp://127.0.0.1:1")
    dep = Deployment(on, tmp_path / "logs", runtime_dir=tmp_path)
    assert dep.topo.sets[0].proxy.monitor is True
    proxy = next(c for c in dep.plan() if c.name == "set0-proxy0")
    assert "--no-monitor" not in proxy.argv
    off = tmp_path / "off"
    off.mkdir()
    dep = Deployment(write_topology(off, models, "tcp://127.0.0.1:1", proxy={"count": 1, "port": 0, "monitor": False}),
                     tmp_path / "logs", runtime_dir=tmp_path)
    proxy = next(c for c in dep.plan() if c.name == "set0-proxy0")
    assert "--no-monitor" in proxy.argv
    args = build_parser().parse_args(proxy.argv[proxy.argv.index("proxy"):])
    assert args.monitor is False
    assert build_parser().parse_args(["proxy"]).monitor is True


def test_topology_sets_the_default_deadline_factor_through_the_cli(tmp_path, capsys):
    from onepiece.cli import build_parser
    from onepiece.config import ConfigError, load_topology
    from onepiece.launcher import Deployment, write_topology

    models = {"t2v": tmp_path / "t2v", "i2v": tmp_path / "i2v"}
    topo = write_topology(tmp_path, models, "tcp://127.0.0.1:1", proxy={"count": 1, "port": 0, "deadline_factor": 3.5})
    proxy = next(c for c in Deployment(topo, tmp_path / "logs", runtime_dir=tmp_path).plan() if c.name == "set0-proxy0")
    assert build_parser().parse_args(proxy.argv[proxy.argv.index("proxy"):]).deadline_factor == 3.5
    assert build_parser().parse_args(["proxy"]).deadline_factor == 2.0
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["proxy", "--deadline-factor", bad])
        assert e.value.code == 2
    assert "--deadline-factor" in capsys.readouterr().err
    text = topo.read_text().replace("deadline_factor: 3.5", "deadline_factor: -2")
    topo.write_text(text)
    with pytest.raises(ConfigError, match="deadline_factor"):
        load_topology(topo)


def test_headroom_admits_below_the_measured_capacity():
    """Admitting at exactly the capacity runs the bottleneck at utilisation 1; by default a
    tenth is held back."""
    adm = CapacityAdmission(clock=Clock())
    adm.observe(view(denoise_s=0.1, proxies=2))  # capacity 10/s
    assert adm.buckets["t2v"].rate == pytest.approx(0.9 * 10.0 / 2)


def test_a_deadline_first_stage_makes_a_request_wait_only_for_earlier_deadlines():
    # denoise runs slo: 64x64x9 alone 0.01 + 0.2 + 0.05 = 0.26 s; the new request's deadline 0.52 s
    est = view(denoise_s=0.5, policy="slo", shapes={SHAPE: 0.2})["apps"]["t2v"]
    assert est["stages"]["denoise_t2v"]["policy"] == "slo"
    long_ahead = flight(3, due_s=20.0, work_s=2.0)  # three long requests due much later
    # a first-come stage would put the new one behind all three: (3 + 1) / 2 req/s = 2 s
    fcfs = view(denoise_s=0.5, shapes={SHAPE: 0.2})["apps"]["t2v"]
    assert deadline_refusal(fcfs, SHAPE, 0.52, True, factor=2.0, ahead=long_ahead).code == "deadline"
    # a deadline-first one runs it before them, and none of them becomes late
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=long_ahead) is None
    # earlier deadlines ahead count: 0.26 + 2 × 0.2 = 0.66 s > 0.52 s
    r = deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=flight(2, due_s=0.3, work_s=0.2))
    assert r.code == "deadline" and "0.66s" in r.message
    # ... from every proxy of the set: one here stands for three
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=flight(1, due_s=0.3, work_s=0.1)) is None
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=flight(1, due_s=0.3, work_s=0.1),
                            scale=3.0).code == "deadline"


def test_a_deadline_first_stage_refuses_what_would_make_an_admitted_request_late():
    est = view(denoise_s=0.5, policy="edf", shapes={SHAPE: 0.2})["apps"]["t2v"]
    # on time by 0.1 s, and the new request's 0.2 s of denoising would land before it
    r = deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=flight(1, due_s=2.1, work_s=2.0))
    assert r.code == "deadline" and "admitted earlier" in r.message
    # one already late whatever happens is not a reason to refuse
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=flight(1, due_s=1.9, work_s=2.0)) is None
    # enough slack for both
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=flight(1, due_s=2.3, work_s=2.0)) is None


def test_without_its_own_timeout_a_request_is_ordered_by_the_limit_and_held_to_the_factor():
    """No timeout_s: the stage orders it by the application's limit (600 s, after everything
    admitted before it), while admission holds it to 2 × its standalone time (0.52 s)."""
    est = view(denoise_s=0.5, policy="slo", shapes={SHAPE: 0.2})["apps"]["t2v"]
    earlier = flight(2, due_s=599.0, work_s=0.2, promised_s=0.7)  # admitted a moment ago, the same way
    r = deadline_refusal(est, SHAPE, 600.0, False, factor=2.0, ahead=earlier)  # 0.26 + 0.4 > 0.52
    assert r.code == "deadline" and "0.66s" in r.message
    assert deadline_refusal(est, SHAPE, 600.0, False, factor=2.0, ahead=earlier[:1]) is None  # 0.46 s
    # one with its own, tighter deadline passes them, unless that makes one miss its promise
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0, ahead=earlier) is None
    assert deadline_refusal(est, SHAPE, 0.52, True, factor=2.0,
                            ahead=flight(1, due_s=599.0, work_s=0.2, promised_s=0.3)).code == "deadline"


def test_work_at_the_bottleneck_is_per_worker_and_zero_while_unmeasured():
    adm = CapacityAdmission(clock=Clock())
    assert adm.work("t2v", SHAPE) == 0.0
    adm.observe(view(denoise_s=0.5, denoise_workers=2, shapes={SHAPE: 0.3}))
    assert adm.work("t2v", SHAPE) == pytest.approx(0.15)
    assert adm.work("t2v", "256x256x17:10") == pytest.approx(0.25)  # the app's mean where unmeasured


def test_each_request_is_charged_its_shapes_share_of_the_bottleneck():
    """The capacity is in mean requests of the recent mix; a run of small requests is not
    refused at the mix's rate, nor a large one admitted as if it were the mean."""
    small, large = SHAPE, "192x192x17:25"
    v = view(denoise_s=0.5, shares={small: 0.1, large: 2.0})  # mean 0.5 s: 2 mean requests/s
    assert cost(v["apps"]["t2v"], small) == pytest.approx(0.2) and cost(v["apps"]["t2v"], large) == pytest.approx(4.0)
    assert cost(v["apps"]["t2v"], "32x32x5:2") == 1.0  # not measured: the mean
    clock = Clock()
    adm = CapacityAdmission(headroom=1.0, clock=clock)
    adm.observe(v)
    admitted = 0
    for i in range(100):  # 10 small requests a second for 10 s: 10 × 0.1 s = 1 s of work a second
        clock.t = 1000.0 + 0.1 * i
        admitted += adm.check("t2v", small, 600.0, False, ahead=flight(1)) is None
    assert admitted == pytest.approx(100, abs=2)  # the stage does 10/s of these, not 2/s
    clock.t += 10
    admitted = 0
    for i in range(100):  # large ones at 10/s: 2 s of work each, so one every 2 s
        clock.t += 0.1
        admitted += adm.check("t2v", large, 600.0, False, ahead=flight(1)) is None
    assert admitted == pytest.approx(5 + 1, abs=1)
    # a refusal for another reason gives back what was charged
    tokens = adm.buckets["t2v"].tokens
    clock.t += 100
    assert adm.check("t2v", large, 600.0, False, ahead=flight(1)) is None
    adm.give_back("t2v", large)
    assert adm.buckets["t2v"].tokens == pytest.approx(min(adm.buckets["t2v"].burst, tokens + 100 * 2.0))


def test_a_deadline_first_bottleneck_is_admitted_by_the_deadline_rule_alone():
    clock = Clock()
    adm = CapacityAdmission(deadline_factor=2.0, headroom=1.0, clock=clock)
    adm.observe(view(denoise_s=0.5, policy="slo", shapes={SHAPE: 0.2}))
    for _ in range(20):  # far over the bucket's 2/s: nothing ahead has an earlier deadline
        assert adm.check("t2v", SHAPE, 0.52, True, ahead=flight(5, due_s=60.0, work_s=1.0)) is None
    r = adm.check("t2v", SHAPE, 600.0, False, ahead=flight(2, due_s=0.3, work_s=0.2))
    assert r.code == "deadline"
    adm.observe(view(denoise_s=0.5, policy="fcfs", shapes={SHAPE: 0.2}))  # first-come: the bucket again
    assert [adm.check("t2v", SHAPE, 600.0, True, ahead=flight(1)) is None for _ in range(3)].count(True) == 1


def test_a_deadline_first_bottleneck_reports_no_admitted_rate():
    """/metrics (``onepiece_proxy_admit_rate``: "absent while not rate-limited") and /healthz
    read ``rate``: behind a deadline-first bottleneck no bucket limits, so there is none."""
    adm = CapacityAdmission(headroom=1.0, clock=Clock())
    adm.observe(view(denoise_s=0.5, policy="slo", shapes={SHAPE: 0.2}))
    assert [adm.check("t2v", SHAPE, 600.0, True, ahead=flight(5, work_s=0.01)) for _ in range(10)] == [None] * 10
    assert adm.rate("t2v") is None  # (it said 2.0/s while admitting these 10 at once)
    adm.observe(view(denoise_s=0.5, policy="fcfs", shapes={SHAPE: 0.2}))
    assert adm.rate("t2v") == pytest.approx(2.0)


# --- the path between the stages ----------------------------------------------------------------
def measured(queue: int = 0, proxies: int = 1, policy: str = "fcfs") -> dict:
    """A t2v set measured at SHAPE by every stage: standalone 0.01 + 0.2 + 0.05 = 0.26 s;
    capacity 2/s (denoise's mean 0.5 s over the mix)."""
    members = [stage("text_encode", t2v=(0.01, 10, {SHAPE: 0.01})),
               stage("denoise_t2v", queue=queue, policy=policy, t2v=(0.5, 10, {SHAPE: 0.2})),
               stage("vae_decode", t2v=(0.05, 10, {SHAPE: 0.05}))]
    return {"apps": estimate(WF, members), "proxies": proxies}


def test_the_default_deadline_allows_for_the_path_between_stages():
    est = measured()["apps"]["t2v"]
    # one request ahead: (1 + 1) / 2 = 1.0 s against 2 × 0.26 = 0.52 s
    assert deadline_refusal(est, SHAPE, 600.0, False, factor=2.0, ahead=flight(1)).code == "deadline"
    # 0.25 s between the stages: through the idle set 0.51 s, so 1.02 s allowed, and the one
    # ahead is through the bottleneck in 1.0 s, then the path: 1.25 s
    r = deadline_refusal(est, SHAPE, 600.0, False, factor=2.0, ahead=flight(1), path_s=0.25)
    assert r.code == "deadline" and "1.25s" in r.message and "1.02s" in r.message
    assert deadline_refusal(est, SHAPE, 600.0, False, factor=3.0, ahead=flight(1), path_s=0.25) is None
    # a request's own deadline stays; its prediction counts the path (0.26 + 0.25 > 0.5)
    assert deadline_refusal(est, SHAPE, 0.5, True, factor=2.0) is None
    r = deadline_refusal(est, SHAPE, 0.5, True, factor=2.0, path_s=0.25)
    assert r.code == "deadline" and "0.51s" in r.message


def test_behind_a_deadline_first_stage_the_path_comes_after_the_work_ahead():
    est = measured(policy="slo")["apps"]["t2v"]
    # one admitted for 0.9 s with 0.4 s of work ahead of it; a new one due sooner, with 0.2 s
    # of work, goes first: the other is done at 0.6 s, with a 0.25 s path at 0.85 s (on
    # time), with a 0.35 s path at 0.95 s (late)
    later = flight(1, due_s=5.0, work_s=0.4, promised_s=0.9)
    assert deadline_refusal(est, SHAPE, 1.0, True, factor=2.0, ahead=later, path_s=0.25) is None
    r = deadline_refusal(est, SHAPE, 1.0, True, factor=2.0, ahead=later, path_s=0.35)
    assert r.code == "deadline" and "miss its deadline" in r.message


def test_the_path_is_measured_on_requests_admitted_into_an_idle_set():
    adm = CapacityAdmission(deadline_factor=2.0, headroom=1.0, burst_s=1000.0, clock=Clock())  # no rate limit here
    adm.observe(measured())
    tracker = InflightTracker(1000)
    t = 10**18

    def one(uid: str, after_s: float | None, status: str = "completed", explicit: bool = False) -> None:
        """Admitted at t, done ``after_s`` later (None: left with no done event)."""
        assert admit(adm, tracker, uid, "t2v", SHAPE, t, 600.0, 600.0, explicit) is None
        tracker.release(uid)
        if after_s is None:
            adm.forget(uid)
        else:
            adm.done(uid, status, t + int(after_s * 1e9))

    for i, after in enumerate([0.36, 0.41]):  # 0.1 and 0.15 s beyond the 0.26 s standalone
        one(f"a{i}", after)
    assert adm.path_s("t2v") == 0.0 and adm.paths() == {}  # fewer than PATH_MIN_SAMPLES: not yet
    # one admitted behind another (its own deadline, so the rule admits it) queued: no sample
    assert admit(adm, tracker, "first", "t2v", SHAPE, t, 600.0, 600.0, False) is None
    assert admit(adm, tracker, "behind", "t2v", SHAPE, t, 600.0, 600.0, True) is None
    tracker.release("behind")
    adm.done("behind", "completed", t + int(5e9))
    tracker.release("first")
    adm.done("first", "completed", t + int(0.28e9))  # 0.02 s
    assert PATH_MIN_SAMPLES == 3 and adm.path_s("t2v") == pytest.approx(0.1)  # median of 0.1, 0.15, 0.02
    # failed, deleted or never handed over: no sample; nor a request of a shape some stage has
    # not measured (no standalone time to subtract), nor one while the NM's view shows a queue
    one("failed", 3.0, status="failed")
    one("gone", None)
    adm.done("gone", "completed", t + int(9e9))  # a late event for it finds nothing
    assert admit(adm, tracker, "u", "t2v", "256x256x17:10", t, 600.0, 600.0, True) is None
    tracker.release("u")
    adm.done("u", "completed", t + int(9e9))
    adm.observe(measured(queue=1))
    one("queued", 9.0, explicit=True)
    adm.observe(measured())
    assert adm.path_s("t2v") == pytest.approx(0.1)
    # what the stages' workers took, from the trace, is subtracted where the event says it:
    # here 0.3 s against a standalone estimate of 0.26 s, so the samples are 0.05 s, not 0.09 s
    for i in range(3):
        assert admit(adm, tracker, f"w{i}", "t2v", SHAPE, t, 600.0, 600.0, False) is None
        tracker.release(f"w{i}")
        adm.done(f"w{i}", "completed", t + int(0.35e9), service_s=0.3)
    assert adm.path_s("t2v") == pytest.approx(0.05)
    # a slow one counts at most its standalone time; the window keeps the latest PATH_SAMPLES
    for i in range(PATH_SAMPLES):
        one(f"slow{i}", 10.0)
    assert adm.path_s("t2v") == pytest.approx(0.26)
    # with another proxy in the set its requests are invisible here: nothing is measured
    adm.observe(measured(proxies=2))
    one("two proxies", 0.3)
    assert adm.path_s("t2v") == pytest.approx(0.26)
    # what the proxy admits with it: at factor 3 the default limit is 3 × (0.26 + 0.26) = 1.56 s,
    # and one request ahead is through in (1 + 1) / 2 + 0.26 = 1.26 s; without the path the
    # limit is 0.78 s, and 1.0 s refuses it
    adm.observe(measured())
    adm.deadline_factor = 3.0
    assert adm.deadline_s("t2v", SHAPE, 600.0, False) == pytest.approx(1.56)
    assert adm.check("t2v", SHAPE, 600.0, False, ahead=flight(1)) is None
    fresh = CapacityAdmission(deadline_factor=3.0, headroom=1.0, burst_s=1000.0, clock=Clock())
    fresh.observe(measured())
    assert fresh.check("t2v", SHAPE, 600.0, False, ahead=flight(1)).code == "deadline"


def test_the_tracker_says_how_each_request_left_once():
    """``on_end`` hears each accepted request once: with the outcome it was released with, or
    ``expired`` when its deadline passed before any word of its end; a slot only given back (a
    create that failed) is not an ending."""
    heard: list[tuple[str, str]] = []
    t = InflightTracker(10, lambda app, how: heard.append((app, how)))
    now = 1_000_000_000_000
    for uid, app in (("done", "t2v"), ("gone", "i2v"), ("back", "t2v"), ("late", "t2v")):
        assert t.try_admit(uid, now + (1 if uid == "late" else 10**12), app, now_ns=now)
    assert t.release("done", "completed") and not t.release("done", "completed")  # once
    assert t.release("back")  # given back, not ended
    assert t.sweep(now + 2) == 1  # "late": its deadline passed before any word of it
    assert t.release("gone", "cancelled")
    assert heard == [("t2v", "completed"), ("t2v", "expired"), ("i2v", "cancelled")] and len(t) == 0
