"""The dispatcher's state object (`LiveView`) and the straight dispatch path of its handlers,
in process: no NATS, no Redis. Every decision test runs with the worker index on and off."""
from __future__ import annotations

import asyncio
import random

import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.handlers import DispatchHandlers
from polyserve.dispatcher.liveview import LiveView
from polyserve.dispatcher.registry import WorkerRegistry
from polyserve.proto import (
    Completed,
    Deployment,
    DispatchRequest,
    Failed,
    FirstToken,
    Heartbeat,
    ScaleSignal,
    Subjects,
    WorkerDown,
)
from polyserve.shared.bus import BusError

pytestmark = pytest.mark.unit

PROFILE = "sim-llama2-70b-h100-tp4"  # decode step c3 = 28.8 ms: an ATGT SLO of 20 ms is never met


@pytest.fixture(params=[True, False], ids=["index", "scan"])
def index(request) -> bool:
    return request.param


def make_view(index: bool = True, **kw) -> LiveView:
    return LiveView(DispatcherSettings(index=index, seed=0, **kw), random.Random(0))


def beat(wid: str, dep: str = "d", **kw) -> Heartbeat:
    return Heartbeat(worker_id=wid, deployment=dep, model="m", engine="sim", **{"ttl_s": 60.0, **kw})


def req(rid: str = "r", dep: str = "d", **kw) -> DispatchRequest:
    return DispatchRequest(request_id=rid, deployment=dep, model="m", **{"input_tokens": 100, **kw})


def place(view: LiveView, dep: Deployment, request: DispatchRequest):
    choice = view.decide(dep, request)
    view.record(dep, choice)
    return choice


def test_decide_record_and_events_keep_one_consistent_state(index):
    view = make_view(index)
    dep = Deployment(id="d", model="m", policy="least_outstanding")
    for wid in ("w1", "w2"):
        assert view.heartbeat(beat(wid))
    got = [place(view, dep, req(f"r{i}")).worker.worker_id for i in range(3)]
    assert got == ["w1", "w2", "w1"] and view.placed == 3
    assert (view.outstanding.count("w1"), view.outstanding.count("w2")) == (2, 1)
    assert view.indexed_decisions == (3 if index else 0)
    view.finished(Completed(request_id="r0", worker_id="w1", input_tokens=100, output_tokens=5, e2e_ms=1, ttft_ms=1))
    view.finished(Failed(request_id="r2", worker_id="w1", reason="boom"))
    assert view.outstanding.count("w1") == 0
    assert place(view, dep, req("r3")).worker.worker_id == "w1"
    assert view.worker_down(WorkerDown(worker_id="w1", reason="killed", ts=1e12)) == (True, 1)
    assert not view.heartbeat(beat("w1"))  # older than its worker_down: ignored
    assert {place(view, dep, req(f"s{i}")).worker.worker_id for i in range(3)} == {"w2"}
    if index:
        assert "w1" not in view._indexes["d"].index
    # the scan answers what the index cannot: a retry that excludes a worker, with the reasons
    with pytest.raises(BusError) as err:
        view.decide(dep, req("x", exclude=["w2"]))
    assert err.value.code == 503 and "1 excluded by the caller" in err.value.description


def test_no_worker_and_capped_workers_are_errors(index):
    view = make_view(index, max_outstanding=1)
    dep = Deployment(id="d", model="m")
    with pytest.raises(BusError) as err:
        view.decide(dep, req())
    assert err.value.code == 503 and "none is running" in err.value.description
    view.heartbeat(beat("w1"))
    place(view, dep, req("a"))
    with pytest.raises(BusError) as err:
        view.decide(dep, req("b"))
    assert err.value.code == 429 and "max_outstanding" in err.value.description


def test_unknown_policy_is_refused_before_any_worker_is_looked_at(index):
    from polyserve.dispatcher.policy import UnknownPolicy

    view = make_view(index)
    view.heartbeat(beat("w1"))
    with pytest.raises(UnknownPolicy, match="fastest"):
        view.decide(Deployment(id="d", model="m", policy="fastest"), req())


def test_seed_adds_workers_not_live_yet():
    view = make_view()
    view.heartbeat(beat("w1", waiting=3))
    assert view.seed([beat("w1", ts=1.0), beat("w2", ts=9e9)]) == 1
    assert view.registry.get("w1").waiting == 3  # the heartbeat heard live wins over the Redis copy
    assert view.registry.get("w2") is not None


def test_request_view_carries_the_deployments_slos_and_the_capped_prediction():
    view = make_view()
    dep = Deployment(id="d", model="m", policy="aladdin", ttft_slo_ms=900.0, atgt_slo_ms=40.0)
    rv = view.request_view(dep, req(predicted_tokens=500, max_tokens=64, adapter="a", adapter_rank=8))
    assert (rv.ttft_slo_ms, rv.atgt_slo_ms) == (900.0, 40.0)
    assert (rv.predicted_tokens, rv.max_tokens, rv.adapter, rv.adapter_rank) == (64, 64, "a", 8)
    assert view.request_view(dep, req(predicted_tokens=500)).predicted_tokens == 500  # no cap known
    assert view.request_view(dep, req(predicted_tokens=30, max_tokens=64)).predicted_tokens == 30
    plain = view.request_view(Deployment(id="e", model="m"), req())
    assert (plain.ttft_slo_ms, plain.atgt_slo_ms) == (1600.0, 75.0)  # Aladdin Table 2, the defaults
    over = make_view(ttft_slo_ms=500.0).request_view(dep, req())  # a process-wide override, when > 0
    assert (over.ttft_slo_ms, over.atgt_slo_ms) == (500.0, 40.0)


@pytest.mark.parametrize("policy_name", ["aladdin", "caraserve"])
def test_deployments_with_different_slos_get_different_decisions(index, policy_name):
    """The same workers and request: the deployment served at 75 ms per token places it, the one
    at 20 ms (below the profile's 28.8 ms decode step) finds no worker meeting its SLO."""
    view = make_view(index)
    loose = Deployment(id="loose", model="m", policy=policy_name)
    tight = Deployment(id="tight", model="m", policy=policy_name, atgt_slo_ms=20.0)
    for dep in (loose, tight):
        for i in range(2):
            view.heartbeat(beat(f"{dep.id}-{i}", dep.id, profile=PROFILE, max_batch=8, kv_capacity=100_000))
    a = place(view, loose, req("a", "loose", predicted_tokens=50))
    b = place(view, tight, req("b", "tight", predicted_tokens=50))
    assert not a.decision.scale_out and b.decision.scale_out
    assert (a.request.atgt_slo_ms, b.request.atgt_slo_ms) == (75.0, 20.0)
    if index:
        assert view._indexes["loose"].key == (policy_name, 1600.0, 75.0)
        assert view._indexes["tight"].key == (policy_name, 1600.0, 20.0)
        if policy_name == "aladdin":  # Aladdin's structure is built for the deployment's SLO pair only
            assert list(view._indexes["tight"].index._aladdin) == [(1600.0, 20.0)]
        # the deployment's SLOs change: its index is rebuilt for the new ones
        relaxed = Deployment(id="tight", model="m", policy=policy_name)
        assert not place(view, relaxed, req("c", "tight", predicted_tokens=50)).decision.scale_out
        assert view._indexes["tight"].key == (policy_name, 1600.0, 75.0)


def test_rebalance_plans_against_the_deployments_slos():
    view = make_view()
    view.models.clock = lambda: 1000.0
    dep = Deployment(id="d", model="m", policy="aladdin", atgt_slo_ms=20.0)
    for wid in ("w1", "w2"):
        view.heartbeat(beat(wid, profile=PROFILE, max_batch=8, kv_capacity=100_000))
    place(view, dep, req("r0", predicted_tokens=5))
    # nothing can pass Alg. 1's ATGT check at 20 ms per token: no move is planned
    assert view.rebalance_plan(dep, max_moves=8) == []
    assert view.model_deployments() == ["d"]


def test_max_tokens_bounds_what_aladdin_reasons_on(index):
    """KV for 100 + 200 tokens but not for 100 + 5000: the request capped at 200 output tokens
    fits; the same prediction without a cap does not (the worker is placed on as a fallback)."""
    view = make_view(index)
    dep = Deployment(id="d", model="m", policy="aladdin")
    view.heartbeat(beat("w1", kv_capacity=1000))
    capped = place(view, dep, req("r1", predicted_tokens=5000, max_tokens=200))
    assert not capped.decision.scale_out and capped.request.predicted_tokens == 200
    (held,) = view.models.requests.requests("w1", view.models.clock(), None)
    assert (held.predicted_tokens, held.max_tokens) == (200, 200)
    view.finished(Failed(request_id="r1", worker_id="w1", reason="test"))
    assert place(view, dep, req("r2", predicted_tokens=5000)).decision.scale_out


def test_sweep_and_first_token_refresh_the_index():
    clock = [0.0]
    view = LiveView(DispatcherSettings(seed=0), random.Random(0), registry=WorkerRegistry(clock=lambda: clock[0]))
    view.models.clock = lambda: 1000.0
    dep = Deployment(id="d", model="m", policy="caraserve")
    view.heartbeat(beat("w1", ttl_s=1.0, profile=PROFILE))
    view.heartbeat(beat("w2", ttl_s=5.0, profile=PROFILE))
    place(view, dep, req("r1"))
    view.first_token(FirstToken(request_id="r1", worker_id="w1", ttft_ms=5))
    assert view._indexes["d"].index.get("w1").requests[0].started
    clock[0] = 2.0  # w1's TTL ran out: the scan answers until the sweep removes it
    assert place(view, dep, req("r2")).worker.worker_id == "w2" and view.indexed_decisions == 1
    view.sweep()
    assert "w1" not in view._indexes["d"].index
    assert place(view, dep, req("r3")).worker.worker_id == "w2" and view.indexed_decisions == 2


# ---------------------------------------------------------------- the handlers' straight path
class Deployments:
    """What the handlers read of the deployment cache."""

    def __init__(self, *deps: Deployment):
        self.deps = {d.id: d for d in deps}

    async def get(self, dep_id: str) -> Deployment | None:
        return self.deps.get(dep_id)

    def cached(self, dep_id: str) -> Deployment | None:
        return self.deps.get(dep_id)


async def test_dispatch_looks_up_decides_records_and_answers(index):
    subjects = Subjects("t")
    view = make_view(index, scale_signal_interval_s=60.0)
    published: list[tuple[str, object]] = []

    async def publish(subject: str, msg: object) -> None:
        published.append((subject, msg))

    deps = Deployments(Deployment(id="d", model="m", policy="round_robin"),
                       Deployment(id="tight", model="m", policy="aladdin", atgt_slo_ms=20.0),
                       Deployment(id="bad", model="m", policy="fastest"))
    h = DispatchHandlers(view.settings, view, deps, subjects, publish=publish)
    await h.on_heartbeat(beat("w1", generate_subject="custom.gen"))
    await h.on_heartbeat(beat("w2"))
    await h.on_heartbeat(beat("t1", "tight", profile=PROFILE))
    p = await h.dispatch(req("r0", priority=3))
    assert (p.request_id, p.worker_id, p.policy, p.priority) == ("r0", "w1", "round_robin", 3)
    assert p.generate_subject == "custom.gen" and p.cancel_subject == subjects.cancel("w1")
    assert (await h.dispatch(req("r1"))).worker_id == "w2"
    assert view.outstanding.count("w1") == view.outstanding.count("w2") == 1 and view.placed == 2
    await h.on_finished(Completed(request_id="r0", worker_id="w1", input_tokens=100, output_tokens=5,
                                  e2e_ms=1, ttft_ms=1))
    assert view.outstanding.count("w1") == 0
    # no worker meets the tight deployment's SLO: placed anyway, and one ScaleSignal per interval
    for rid in ("s0", "s1"):
        assert (await h.dispatch(req(rid, "tight"))).worker_id == "t1"
    ((subject, sig),) = published
    assert subject == subjects.scale_signal("tight") and isinstance(sig, ScaleSignal)
    assert (sig.deployment, sig.source, sig.request_id) == ("tight", "aladdin", "s0")
    for bad, code, text in ((req(dep=""), 400, "non-empty"), (req(input_tokens=-1), 400, "input_tokens"),
                            (req(dep="nope"), 404, "unknown deployment 'nope'"),
                            (req(dep="bad"), 500, "misconfigured: unknown dispatch policy 'fastest'")):
        with pytest.raises(BusError) as err:
            await h.dispatch(bad)
        assert err.value.code == code and text in err.value.description
    assert h.rejected == {400: 2, 404: 1, 500: 1}


@pytest.mark.parametrize("policy_name", ["aladdin", "caraserve"])
async def test_bookkeeping_after_the_reply_is_never_missed(index, policy_name):
    """For aladdin/caraserve the handler answers before it records the placement
    (`LiveView.record_later`); every read in between settles the queue first: the next
    decision counts it, an event about it (completed before the loop turned) finds it, and
    the state ends as with `record`, once the event loop has turned twice."""
    view = make_view(index)
    deps = Deployments(Deployment(id="d", model="m", policy=policy_name))
    h = DispatchHandlers(view.settings, view, deps, Subjects("t"))
    for wid in ("w1", "w2", "w3"):
        await h.on_heartbeat(beat(wid, profile=PROFILE, max_batch=8))
    first = await h.dispatch(req("a"))
    assert view.placed == 0 and view.outstanding.count(first.worker_id) == 0  # not recorded yet
    await h.on_finished(Completed(request_id="a", worker_id=first.worker_id, input_tokens=100,
                                  output_tokens=5, e2e_ms=1, ttft_ms=1))
    assert view.placed == 1 and len(view.outstanding) == 0  # recorded, then completed
    # the same decisions as a view that records each placement at once (the next decision
    # counts the ones answered before it)
    ref = make_view(index)
    for wid in ("w1", "w2", "w3"):
        ref.heartbeat(beat(wid, profile=PROFILE, max_batch=8))
    dep = deps.deps["d"]
    ref.record(dep, ref.decide(dep, req("a")))
    ref.finished(Completed(request_id="a", worker_id=first.worker_id, input_tokens=100, output_tokens=5,
                           e2e_ms=1, ttft_ms=1))
    sizes = [100, 3000, 50, 800, 20]
    got = [(await h.dispatch(req(f"r{i}", input_tokens=n))).worker_id for i, n in enumerate(sizes)]
    want = [place(ref, dep, req(f"r{i}", input_tokens=n)).worker.worker_id for i, n in enumerate(sizes)]
    assert got == want
    assert view.placed == 5  # the last one still queued...
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert view.placed == 6 and all(view.outstanding.count(w) == ref.outstanding.count(w) for w in ("w1", "w2", "w3"))
    if index:
        assert view._indexes["d"].index.views() == ref._indexes["d"].index.views()


@pytest.mark.parametrize("policy_name", ["aladdin", "caraserve", "least_outstanding"])
def test_a_placement_updates_the_indexed_view_as_a_rebuild_would(policy_name, monkeypatch):
    """`record` updates the chosen worker's indexed view in place (outstanding + 1, the
    request appended as the book's newest entry): with the book's clock still, the same view
    as one rebuilt from the heartbeat and the book, a retry of a placed request included."""
    from polyserve.dispatcher import liveview

    in_place = []
    real = liveview._DepIndex.placed
    monkeypatch.setattr(liveview._DepIndex, "placed", lambda di, wid, r, e=None: (in_place.append(wid), real(di, wid, r, e)))
    view = make_view(True, max_outstanding=3)
    view.models.clock = lambda: 1000.0
    dep = Deployment(id="d", model="m", policy=policy_name)
    for wid in ("w1", "w2", "w3"):
        assert view.heartbeat(beat(wid, profile=PROFILE, kv_capacity=100_000, max_batch=8))
    rng = random.Random(1)
    for i in range(7):
        place(view, dep, req(f"r{i}", input_tokens=rng.choice([10, 300, 2000]), predicted_tokens=rng.choice([5, 80])))
        if i == 3:
            view.first_token(FirstToken(request_id="r1", worker_id=view.outstanding._placed["r1"][0], ttft_ms=50.0))
    place(view, dep, req("r2", input_tokens=50, predicted_tokens=5))  # a retry: moves or stays
    di = view._indexes["d"]
    modelled = policy_name != "least_outstanding"
    for hb in view.registry.live("d"):
        extras = view.models.extras(hb, 1000.0) if modelled else None
        assert di.index.get(hb.worker_id) == liveview._view(hb, view.outstanding.count(hb.worker_id), extras)
    assert di.capped == {hb.worker_id for hb in view.registry.live("d") if view.outstanding.count(hb.worker_id) >= 3}
    assert view.placed == 8 and view.indexed_decisions > 0  # (capped workers: the scan answers)
    assert len(in_place) >= 7  # in place, but a retry that stays on its worker (then the rebuild)


@pytest.mark.parametrize("policy_name", ["aladdin", "round_robin"])
def test_a_retry_on_the_same_worker_is_counted_once(policy_name):
    """A request placed again on the worker that holds it: one placement there, not two
    (the in-place update does not apply; the view is rebuilt)."""
    view = make_view(True)
    dep = Deployment(id="d", model="m", policy=policy_name)
    assert view.heartbeat(beat("w1", profile=PROFILE, kv_capacity=100_000))
    for _ in range(2):
        assert place(view, dep, req("r0")).worker.worker_id == "w1"
    v = view._indexes["d"].index.get("w1")
    assert v.outstanding == 1 and len(v.requests) == (1 if policy_name == "aladdin" else 0)


def test_registry_takes_a_fleet_wide_silence_for_a_nats_stall_by_the_smallest_live_ttl():
    """`silent()`: two or more workers heard, none for half the smallest live TTL. Every heartbeat
    asks it; while heartbeats flow a bound answers without a scan of every worker, and the scan
    still decides once the gap is long enough (here after the short-TTL worker left)."""
    now = [100.0]
    reg = WorkerRegistry(clock=lambda: now[0], wall=lambda: now[0])

    def beat(wid: str, ttl: float) -> Heartbeat:
        return Heartbeat(worker_id=wid, deployment="d", model="m", engine="sim", ttl_s=ttl, ts=now[0])

    reg.heartbeat(beat("w1", 2.0))
    now[0] += 1.5
    assert not reg.silent(), "one worker falling silent is its own fault"
    reg.heartbeat(beat("w2", 10.0))
    now[0] += 0.9
    assert not reg.silent()
    now[0] += 0.2  # 1.1 s: past half the smallest TTL (2 s)
    assert reg.silent()
    reg.down(WorkerDown(worker_id="w1", reason="test", ts=now[0]))
    reg.heartbeat(beat("w3", 10.0))
    now[0] += 3.0  # 3 s: under half of the 10 s TTLs now live
    assert not reg.silent()
    now[0] += 2.5
    assert reg.silent()
    now[0] += 40.0  # beyond MAX_SILENCE_S: not a stall any more
    assert not reg.silent()


def test_the_dispatcher_process_raises_its_gc_threshold_and_the_setting_is_checked():
    """`gc_gen0` (issue 15: Python's 700 put a young collection into every ~10th dispatch and a
    full one of the fleet's views, up to 60 ms, into some): applied by the dispatcher's own process
    (`tune_process`, called by `run_main`), in a child here so this test process keeps its own;
    0 keeps Python's; a negative value is refused."""
    import subprocess
    import sys

    from polyserve.shared.settings import SettingsError

    code = ("import gc, sys; from polyserve.dispatcher.config import load_settings; "
            "from polyserve.dispatcher.service import DispatcherService; "
            "before = gc.get_threshold(); DispatcherService(load_settings(sys.argv[1:])).tune_process(); "
            "print(before, gc.get_threshold(), gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split("\n")[0] == "(700, 10, 10) (20000, 10, 10) True", out
    out = subprocess.run([sys.executable, "-c", code, "--gc-gen0", "0"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.split("\n")[0] == "(700, 10, 10) (700, 10, 10) False", out
    with pytest.raises(SettingsError, match="gc_gen0"):
        DispatcherSettings(gc_gen0=-1).validate()
