"""The per-token-latency autoscaler's pure decisions (thesis §5)."""
import pytest

from polyserve.planner import policy
from polyserve.planner.policy import Sample, Window
from polyserve.proto import ScalerPolicy

pytestmark = pytest.mark.unit


def samples(*pairs, ts=100.0):
    return [Sample(ts=ts, e2e_ms=e2e, output_tokens=n) for e2e, n in pairs]


@pytest.mark.parametrize("current,metric,threshold,expected", [
    (1, 100.0, 50.0, 2),   # ceil(1 × 2)
    (2, 75.0, 50.0, 3),    # ceil(2 × 1.5)
    (3, 51.0, 50.0, 4),    # any excess rounds up
    (3, 50.0, 50.0, 3),    # at the threshold: hold
    (4, 10.0, 50.0, 1),    # ceil(4 × 0.2) = ceil(0.8)
    (3, 10.0, 50.0, 1),    # ceil(3 × 0.2) = 1 (not 2 from float noise)
    (5, 20.0, 50.0, 2),
])
def test_hpa_formula(current, metric, threshold, expected):
    assert policy.hpa_desired(current, metric, threshold, 1, 10) == expected


def test_hpa_clamps_and_edges():
    assert policy.hpa_desired(2, 500.0, 50.0, 1, 3) == 3          # max
    assert policy.hpa_desired(4, 1.0, 50.0, 2, 8) == 2             # min
    assert policy.hpa_desired(0, 500.0, 50.0, 1, 3) == 1           # current 0 -> min
    assert policy.hpa_desired(0, None, 50.0, 0, 3) == 0
    assert policy.hpa_desired(3, None, 50.0, 1, 4) == 3            # no data: hold
    assert policy.hpa_desired(6, None, 50.0, 1, 4) == 4            # no data: hold, clamped
    assert policy.hpa_desired(1, None, 50.0, 2, 4) == 2
    assert policy.hpa_desired(2, 100.0, 0.0, 1, 4) == 2            # bad threshold: hold
    assert policy.hpa_desired(4, 52.0, 50.0, 1, 8, tolerance=0.1) == 4
    assert policy.hpa_desired(4, 60.0, 50.0, 1, 8, tolerance=0.1) == 5
    assert policy.clamp(5, 3, 1) == 3                              # hi < lo -> lo


def test_window_metric_pertoken_is_mean_of_per_request_ratios():
    got, n = policy.window_metric(samples((1000.0, 10), (300.0, 30), (50.0, 0)), "pertoken")
    assert n == 2 and got == pytest.approx((100.0 + 10.0) / 2)   # zero-token request left out


def test_window_metric_request_is_mean_e2e():
    got, n = policy.window_metric(samples((1000.0, 10), (300.0, 30), (50.0, 0)), "request")
    assert n == 3 and got == pytest.approx(450.0)


def test_window_metric_no_data_and_bad_type():
    assert policy.window_metric([], "pertoken") == (None, 0)
    assert policy.window_metric(samples((10.0, 0)), "pertoken") == (None, 0)
    with pytest.raises(ValueError):
        policy.window_metric([], "cpu")


def test_window_is_bounded_and_time_filtered():
    w = Window(max_samples=3)
    for t in range(5):
        w.add(Sample(ts=float(t), e2e_ms=1.0, output_tokens=1))
    assert len(w) == 3
    assert [s.ts for s in w.since(3.0)] == [3.0, 4.0]
    w.prune(4.0)
    assert len(w) == 1


def test_decide_scale_up_pertoken_and_request():
    scaler = ScalerPolicy(type="pertoken", min_replicas=1, max_replicas=3, threshold_ms=20.0)
    d = policy.decide(1, samples((400.0, 10),), scaler, now=100.0)   # 40 ms/token = 2x
    assert d.desired == 2 and d.metric_ms == pytest.approx(40.0) and d.samples == 1
    assert "pertoken" in d.reason
    d = policy.decide(2, samples((400.0, 10),), scaler, now=100.0)   # ceil(4) clamped to 3
    assert d.desired == 3
    rscaler = ScalerPolicy(type="request", min_replicas=1, max_replicas=8, threshold_ms=2000.0)
    d = policy.decide(2, samples((3000.0, 100), (3000.0, 1)), rscaler, now=100.0)
    assert d.desired == 3 and d.metric_ms == pytest.approx(3000.0)


def test_decide_no_samples_holds_current_clamped():
    scaler = ScalerPolicy(min_replicas=2, max_replicas=4, threshold_ms=20.0)
    assert policy.decide(3, [], scaler, now=0.0).desired == 3
    assert policy.decide(1, [], scaler, now=0.0).desired == 2
    assert policy.decide(7, [], scaler, now=0.0).desired == 4
    d = policy.decide(0, [], scaler, now=0.0)
    assert d.desired == 2 and "min_replicas" in d.reason


def test_scale_down_stabilization_keeps_the_recent_maximum():
    scaler = ScalerPolicy(min_replicas=1, max_replicas=8, threshold_ms=20.0)
    low = samples((20.0, 10),)  # 2 ms/token: ceil(4 × 0.1) = 1
    history = [(70.0, 4), (95.0, 3)]
    d = policy.decide(4, low, scaler, now=100.0, history=history, stabilization_s=30.0)
    assert d.desired == 4 and d.recommended == 1 and "stabilization" in d.reason
    d = policy.decide(4, low, scaler, now=100.0, history=[(60.0, 4), (95.0, 3)], stabilization_s=30.0)
    assert d.desired == 3
    assert policy.decide(4, low, scaler, now=100.0, history=history, stabilization_s=0).desired == 1
    high = samples((800.0, 10),)  # scale-up is never delayed
    assert policy.decide(2, high, scaler, now=100.0, history=[(99.0, 1)], stabilization_s=30.0).desired == 8


def test_start_gate_and_max_step():
    scaler = ScalerPolicy(min_replicas=1, max_replicas=8, threshold_ms=20.0)
    high = samples((800.0, 10),)  # 80 ms/token = 4x
    d = policy.decide(2, high, scaler, now=0.0, pending=1)
    assert d.desired == 2 and "starting worker" in d.reason
    assert policy.decide(2, high, scaler, now=0.0, max_step=1).desired == 3
    assert policy.decide(6, samples((20.0, 10),), scaler, now=0.0, max_step=2).desired == 4
    assert policy.decide(0, [], scaler, now=0.0, pending=3).desired == 1  # gate only when current > 0


def test_plan_starts_and_stops_spread_over_agents():
    assert policy.plan_starts({"g0": 2, "g1": 0}, 1) == {"g1": 1}
    assert policy.plan_starts({"g0": 2, "g1": 0}, 3) == {"g1": 2, "g0": 1}
    assert policy.plan_starts({}, 2) == {}
    assert policy.plan_stops({"g0": 1, "g1": 3}, 1) == {"g1": 1}
    assert policy.plan_stops({"g0": 2, "g1": 2}, 3) == {"g0": 2, "g1": 1}
    assert policy.plan_stops({"g0": 1}, 5) == {"g0": 1}


# --------------------------------------------------------------------------- scale signals
def signal_scaler(kind="muserve", lo=1, hi=3):
    return ScalerPolicy(type=kind, min_replicas=lo, max_replicas=hi)


def test_signal_sources_are_opt_in_per_scaler_type():
    assert policy.signal_sources("pertoken") == policy.signal_sources("request") == ()
    assert policy.signal_sources("muserve") == ("miad",) and policy.signal_sources("aladdin") == ("aladdin",)
    assert set(policy.signal_sources("signal")) == {"aladdin", "caraserve", "miad"}
    for kind in ("pertoken", "request"):
        assert policy.signal_decision(1, signal_scaler(kind), "miad", now=0.0, last_signal=None,
                                      cooldown_s=0.0) is None
    assert policy.signal_decision(1, signal_scaler("aladdin"), "miad", now=0.0, last_signal=None,
                                  cooldown_s=0.0) is None  # a source the type does not honour


def test_signal_adds_one_worker_with_cooldown_pending_and_max():
    sc = signal_scaler()
    d = policy.signal_decision(2, sc, "miad", now=100.0, last_signal=None, cooldown_s=10.0, reason="gpu g0")
    assert d.desired == 3 and "miad (gpu g0): add one worker" in d.reason
    assert policy.signal_decision(2, sc, "miad", now=105.0, last_signal=100.0, cooldown_s=10.0) is None
    assert policy.signal_decision(2, sc, "miad", now=111.0, last_signal=100.0, cooldown_s=10.0).desired == 3
    assert policy.signal_decision(2, sc, "miad", now=111.0, last_signal=100.0, cooldown_s=10.0, pending=1) is None
    at_max = policy.signal_decision(3, sc, "miad", now=111.0, last_signal=None, cooldown_s=10.0)
    assert at_max.desired == 3 and "at max_replicas=3" in at_max.reason
    assert policy.signal_decision(0, sc, "miad", now=0.0, last_signal=None, cooldown_s=0.0).desired == 1


def test_hold_decision_keeps_signal_scalers_within_bounds():
    sc = signal_scaler(lo=1, hi=3)
    assert policy.hold_decision(2, sc).desired == 2
    assert policy.hold_decision(0, sc).desired == 1
    assert policy.hold_decision(5, sc).desired == 3
    assert "grows on scale signals from miad" in policy.hold_decision(2, sc).reason


# --------------------------------------------------------------------------- PlannerState
def test_planner_state_windows_lengths_and_forget():
    from polyserve.planner.state import PlannerState

    m = PlannerState(max_samples=3)
    for t in (1.0, 2.0, 3.0, 4.0):
        m.add_completed("enc", Sample(ts=t, e2e_ms=10.0, output_tokens=1), input_tokens=-5 if t == 4.0 else 7)
    m.add_completed("llm", Sample(ts=4.0, e2e_ms=10.0, output_tokens=1), input_tokens=9)
    assert m.sample_count("enc") == 3 and [n for _, n in m.lengths["enc"]] == [7, 7, 7, 0]
    assert [s.ts for s in m.samples("enc", now=5.0, window_s=2.5, reset_on_scale=True)] == [3.0, 4.0]
    m.last_change["enc"] = 3.5
    assert [s.ts for s in m.samples("enc", now=5.0, window_s=2.5, reset_on_scale=True)] == [4.0]
    assert [s.ts for s in m.samples("enc", now=5.0, window_s=2.5, reset_on_scale=False)] == [3.0, 4.0]
    m.decisions["gone"] = None
    m.forget(known={"enc", "llm"}, other={"llm"})
    assert "llm" not in m.lengths and "gone" not in m.decisions and "enc" in m.windows
    m.add_completed("llm", Sample(ts=5.0, e2e_ms=1.0, output_tokens=1), input_tokens=9)
    assert "llm" not in m.lengths  # known not to be an encoder deployment: no lengths kept


def test_planner_state_workers_pending_and_loads():
    from polyserve.planner.state import PlannerState
    from polyserve.proto import AgentInfo, Heartbeat

    m = PlannerState()
    agents = [AgentInfo(gpu_id="g0", simulated=True, control_subject="x", workers={"w1": "d", "w2": "d"})]
    m.track_workers(agents, now=100.0, stale_s=600.0)
    assert m.pending(["w1", "w2"], now=110.0, grace_s=60.0) == 2
    m.heartbeat(Heartbeat(worker_id="w1", deployment="d", model="m", engine="sim", running=2, waiting=1), 111.0)
    assert m.pending(["w1", "w2"], now=112.0, grace_s=60.0) == 1
    assert m.pending(["w1", "w2"], now=200.0, grace_s=60.0) == 0  # past the grace: not counted as starting
    assert [(w.worker_id, w.load) for w in m.worker_loads(["w1", "w2"])] == [("w1", 3.0)]
    m.track_workers([], now=2000.0, stale_s=600.0)  # unlisted and stale: forgotten
    assert m.heartbeats == {} and m.loads == {} and m.first_seen == {}


def test_planner_state_keeps_a_scalers_state_while_its_name_stays():
    from polyserve.planner import autoscalers as A
    from polyserve.planner.state import PlannerState

    m = PlannerState()
    tt = A.TargetTracking(slo_ms=100.0)
    assert m.scaler_for("d", tt) == tt.initial()
    m.keep_scaler("d", tt, A.TrackingState(below_since=5.0))
    assert m.scaler_for("d", A.TargetTracking(slo_ms=200.0)) == A.TrackingState(below_since=5.0)
    assert m.scaler_for("d", A.HpaScaler("pertoken")) == ()  # another scaler starts afresh
