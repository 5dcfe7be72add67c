"""The pure autoscaling policies: per-token / request HPA, Arlo target tracking, µ-Serve."""
import pytest

from polyserve.planner import autoscalers as A
from polyserve.planner import policy
from polyserve.planner.autoscalers import ClockSignal, Observation, Sample, WorkerLoad

pytestmark = pytest.mark.unit


def reqs(now, *lat_ms, tokens=10):
    return [Sample(ts=now - 1, e2e_ms=x, output_tokens=tokens) for x in lat_ms]


def workers(*loads):
    return [WorkerLoad(f"w{i}", load) for i, load in enumerate(loads)]


def run(scaler, observations):
    state, out = scaler.initial(), []
    for obs in observations:
        state, o = scaler.step(state, obs)
        out.append(o)
    return out


def test_every_policy_has_the_one_interface():
    for kind in A.AUTOSCALERS:
        kw = {"slo_ms": 100.0} if kind == "target_tracking" else {}
        s = A.make_autoscaler(kind, **kw)
        _, o = s.step(s.initial(), Observation(now=0.0, current=1))
        assert isinstance(o, A.Outcome) and o.desired >= 0 and o.reason and s.name
    with pytest.raises(ValueError):
        A.make_autoscaler("cpu")


def test_hpa_reuses_the_planner_rule():
    s = A.HpaScaler("pertoken", threshold_ms=20.0, min_replicas=1, max_replicas=10, stabilization_s=0.0)
    _, o = s.step(s.initial(), Observation(now=100.0, current=2, samples=reqs(100.0, 400.0, 400.0)))
    assert o.desired == policy.hpa_desired(2, 40.0, 20.0, 1, 10) == 4 and o.metric_ms == pytest.approx(40.0)
    r = A.HpaScaler("request", threshold_ms=200.0, max_replicas=10, stabilization_s=0.0)
    _, o = r.step(r.initial(), Observation(now=100.0, current=3, samples=reqs(100.0, 100.0, 100.0)))
    assert o.desired == 2  # ceil(3 × 0.5)
    # old samples fall out of the window; pending workers gate scale-up (the planner's guards)
    _, o = s.step((), Observation(now=100.0, current=2, samples=[Sample(ts=10.0, e2e_ms=999.0, output_tokens=1)]))
    assert o.desired == 2 and o.samples == 0
    _, o = s.step((), Observation(now=100.0, current=2, samples=reqs(100.0, 400.0), pending=1))
    assert o.desired == 2 and "waiting" in o.reason


def test_hpa_stabilises_scale_down_over_its_window_and_names_the_least_busy():
    s = A.HpaScaler("pertoken", threshold_ms=20.0, max_replicas=10, stabilization_s=30.0)
    high, low = reqs(0.0, 400.0), reqs(10.0, 20.0)
    state, o = s.step(s.initial(), Observation(now=0.0, current=4, samples=high))
    assert o.desired == 8
    state, o = s.step(state, Observation(now=10.0, current=4, samples=low, workers=workers(3, 0, 1, 2)))
    assert o.desired == 4  # the 8 of 10 s ago holds the scale-down
    state, o = s.step(state, Observation(now=41.0, current=4, samples=reqs(41.0, 10.0),
                                         workers=workers(3, 0, 1, 2)))
    assert o.desired == 1 and o.remove == ("w1", "w2", "w3")  # the 8 left the window; least busy go


def test_target_tracking_adds_at_95_percent_of_slo():
    s = A.TargetTracking(slo_ms=100.0, max_replicas=5)
    lat = [50.0] * 97 + [96.0, 96.0, 96.0]  # P98 = 96 ms >= 95 ms
    [o] = run(s, [Observation(now=0.0, current=2, samples=reqs(0.0, *lat))])
    assert o.desired == 3 and o.metric_ms == 96.0
    [o] = run(s, [Observation(now=0.0, current=2, samples=reqs(0.0, *([50.0] * 97 + [94.0] * 3)))])
    assert o.desired == 2  # 94 ms: between 50% and 95%: hold
    [o] = run(s, [Observation(now=0.0, current=5, samples=reqs(0.0, 200.0))])
    assert o.desired == 5 and "max_replicas" in o.reason
    [o] = run(s, [Observation(now=0.0, current=2, samples=reqs(0.0, 200.0), pending=1)])
    assert o.desired == 2 and "starting" in o.reason


def test_target_tracking_removes_least_busy_after_60s_below_half_slo():
    s = A.TargetTracking(slo_ms=100.0, hold_s=60.0)
    low = lambda t, cur=3: Observation(now=t, current=cur, samples=reqs(t, 30.0, 40.0),
                                       workers=workers(4, 1, 2)[:cur])
    outs = run(s, [low(0.0), low(30.0), low(59.9), low(60.0), low(90.0, 2), low(120.0, 2)])
    assert [o.desired for o in outs] == [3, 3, 3, 2, 2, 1]
    assert outs[3].remove == ("w1",) and outs[5].remove == ("w1",)
    # a spell above half the SLO restarts the 60 s
    mid = Observation(now=30.0, current=3, samples=reqs(30.0, 70.0), workers=workers(1, 1, 1))
    outs = run(s, [low(0.0), mid, low(50.0), low(100.0), low(110.0)])
    assert [o.desired for o in outs] == [3, 3, 3, 3, 2]


def test_target_tracking_idle_and_busy_without_samples():
    s = A.TargetTracking(slo_ms=100.0, hold_s=60.0, min_replicas=1)
    idle = [Observation(now=t, current=2, workers=workers(0, 0)) for t in (0.0, 60.0)]
    assert [o.desired for o in run(s, idle)] == [2, 1]
    busy = [Observation(now=t, current=2, workers=workers(3, 0)) for t in (0.0, 60.0)]
    assert [o.desired for o in run(s, busy)] == [2, 2]
    at_min = [Observation(now=t, current=1, workers=workers(0)) for t in (0.0, 100.0)]
    assert [o.desired for o in run(s, at_min)] == [1, 1]


def test_percentile_is_nearest_rank():
    assert A.percentile(list(range(1, 101)), 98) == 98
    assert A.percentile([5.0], 98) == 5.0 and A.percentile([], 98) is None


def test_muserve_scales_out_only_on_a_max_clock_signal_for_its_workers():
    s = A.MuServeScaler(max_replicas=4)
    mine = workers(1, 2)
    hot = ClockSignal("gpu0", scale_out=True, missing=("w0",), at_max=True)
    other = ClockSignal("gpu1", scale_out=True, missing=("zz",), at_max=True)
    cold = ClockSignal("gpu0", scale_out=False, missing=("w0",))
    [o] = run(s, [Observation(now=0.0, current=2, workers=mine, clock_signals=[hot])])
    assert o.desired == 3 and "gpu0" in o.reason
    [o] = run(s, [Observation(now=0.0, current=2, workers=mine, clock_signals=[other, cold])])
    assert o.desired == 2
    [o] = run(s, [Observation(now=0.0, current=2, workers=mine, clock_signals=[hot], pending=1)])
    assert o.desired == 2
    [o] = run(s, [Observation(now=0.0, current=4, workers=mine, clock_signals=[hot])])
    assert o.desired == 4


def test_muserve_optional_idle_release():
    s = A.MuServeScaler(idle_release_s=30.0)
    obs = [Observation(now=t, current=2, workers=workers(0, 0)) for t in (0.0, 29.0, 30.0)]
    assert [o.desired for o in run(s, obs)] == [2, 2, 1]
    assert [o.desired for o in run(A.MuServeScaler(), obs)] == [2, 2, 2]  # µ-Serve: no scale-in


# --------------------------------------------------------------------------- names and the live planner's scalers
def test_names_are_the_core_vocabulary_and_aliases_are_folded():
    from polyserve.core import names

    assert set(A.AUTOSCALERS) <= set(names.SCALERS)
    assert A.make_autoscaler("tracking", slo_ms=100.0).name == "target_tracking"
    assert A.make_autoscaler("museserve").name == A.MuServeScaler().name == "muserve"
    assert A.make_autoscaler("aladdin").name == "aladdin"
    with pytest.raises(ValueError, match="choose one of pertoken"):
        A.make_autoscaler("hpa")


def test_from_policy_builds_the_scaler_a_deployment_names():
    from polyserve.proto import ScalerPolicy

    hpa = A.from_policy(ScalerPolicy(type="request", min_replicas=2, max_replicas=7, window_s=20.0,
                                     threshold_ms=300.0), stabilization_s=30.0, tolerance=0.1, max_step=2)
    assert hpa == A.HpaScaler("request", threshold_ms=300.0, min_replicas=2, max_replicas=7, window_s=20.0,
                              stabilization_s=30.0, tolerance=0.1, max_step=2)
    tt = A.from_policy(ScalerPolicy(type="tracking", max_replicas=5, threshold_ms=800.0), hold_s=15.0)
    assert tt == A.TargetTracking(slo_ms=800.0, min_replicas=1, max_replicas=5, hold_s=15.0, metric="request")
    for kind in ("aladdin", "caraserve", "muserve", "signal"):
        s = A.from_policy(ScalerPolicy(type=kind, min_replicas=1, max_replicas=3))
        assert isinstance(s, A.SignalHold) and s.name == kind
    with pytest.raises(ValueError):
        A.from_policy(ScalerPolicy(type="cpu"))


def test_signal_hold_is_the_planners_hold_decision():
    from polyserve.proto import ScalerPolicy

    s = A.SignalHold("muserve", min_replicas=1, max_replicas=3)
    sp = ScalerPolicy(type="muserve", min_replicas=1, max_replicas=3)
    for current in (0, 2, 5):
        _, o = s.step(s.initial(), Observation(now=0.0, current=current))
        d = policy.hold_decision(current, sp)
        assert (o.desired, o.reason) == (d.desired, d.reason)
