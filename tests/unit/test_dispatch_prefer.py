"""The dispatcher's placement hint (`DispatchRequest.prefer`, dispatcher/prefer.py), in process: the
policy's choice among the workers the gateway names, kept unless it breaks the policy's SLO where the
policy's own pick does not; with the worker index on and off. (The load bound is the gateway's: test_gateway_routing.py.)"""
from __future__ import annotations

import asyncio

import pytest

from polyserve.dispatcher.handlers import DispatchHandlers
from polyserve.proto import Deployment, Subjects
from tests.unit.test_dispatch_liveview import beat, make_view, place, req

pytestmark = pytest.mark.unit


@pytest.fixture(params=[True, False], ids=["index", "scan"])
def index(request) -> bool:
    return request.param

SLOW = "sim-llama2-70b-h100-tp4"  # a 28.8 ms decode step: breaks an ATGT SLO of 20 ms
FAST = "hf-tiny-llama-random-cpu"


def test_a_preferred_worker_is_taken(index):
    view = make_view(index)
    dep = Deployment(id="d", model="m", policy="least_outstanding")
    for wid in ("w1", "w2", "w3"):
        view.heartbeat(beat(wid))
    got = [place(view, dep, req(f"r{i}", prefer=["w3"])) for i in range(3)]
    assert [(c.worker.worker_id, c.prefixed) for c in got] == [("w3", True)] * 3
    c = place(view, dep, req("plain"))  # no hint: the policy's own pick
    assert not c.prefixed and c.worker.worker_id == "w1"
    c = place(view, dep, req("either", prefer=["w3", "w2"]))  # the policy's pick among the preferred
    assert c.prefixed and c.worker.worker_id == "w2"


def test_hints_the_dispatcher_cannot_follow_are_ignored(index):
    view = make_view(index, max_outstanding=3)
    dep = Deployment(id="d", model="m", policy="least_outstanding")
    view.heartbeat(beat("w1"))
    view.heartbeat(beat("w2"))
    view.heartbeat(beat("short", max_input_len=50))
    view.heartbeat(beat("other", dep="e"))
    for prefer in (["gone"], ["other"], ["short"], ["w2"]):
        exclude = ["w2"] if prefer == ["w2"] else []
        c = place(view, dep, req(f"r-{prefer[0]}", prefer=prefer, exclude=exclude))
        assert c.worker.worker_id == "w1" and not c.prefixed, prefer
        view.outstanding.finish(f"r-{prefer[0]}")
    for i in range(3):  # w2 at its max_outstanding: not a candidate, hint or not
        view.outstanding.place(f"full{i}", "w2")
    assert place(view, dep, req("capped", prefer=["w2"])).worker.worker_id == "w1"


@pytest.mark.parametrize("policy", ["caraserve", "aladdin"])
def test_a_preferred_worker_that_breaks_the_slo_is_not_taken(index, policy):
    view = make_view(index)
    dep = Deployment(id="d", model="m", policy=policy, atgt_slo_ms=20.0)
    view.heartbeat(beat("slow", profile=SLOW, max_batch=8, kv_capacity=100_000))
    for wid in ("fast1", "fast2"):
        view.heartbeat(beat(wid, profile=FAST, max_batch=8, kv_capacity=100_000))
    own = view.decide(dep, req("probe"))
    assert own.worker.worker_id != "slow" and not own.decision.scale_out
    c = place(view, dep, req("r1", prefer=["slow"], predicted_tokens=50))
    assert c.worker.worker_id != "slow" and not c.prefixed
    other = "fast2" if own.worker.worker_id == "fast1" else "fast1"
    c = place(view, dep, req("r2", prefer=[other], predicted_tokens=50))
    assert c.worker.worker_id == other and c.prefixed and not c.decision.scale_out


@pytest.mark.parametrize("policy", ["caraserve", "aladdin"])
def test_where_no_worker_meets_the_slo_the_hint_stands_and_asks_for_another_worker(index, policy):
    """Every worker breaks the ATGT SLO: the policy's own pick is flagged (scale-out), so a preferred
    worker that breaks it too costs nothing the policy could have saved; the hint is followed (the
    policy's least harmful among the preferred), still flagged (prefer.follows)."""
    view = make_view(index)
    dep = Deployment(id="d", model="m", policy=policy, atgt_slo_ms=20.0)
    for wid in ("slow1", "slow2", "slow3"):
        view.heartbeat(beat(wid, profile=SLOW, max_batch=8, kv_capacity=100_000))
    own = view.decide(dep, req("probe", predicted_tokens=50))
    assert own.decision.scale_out
    others = sorted({"slow1", "slow2", "slow3"} - {own.worker.worker_id})
    c = place(view, dep, req("r1", prefer=others, predicted_tokens=50))
    assert c.worker.worker_id in others and c.prefixed and c.decision.scale_out


def test_a_lora_request_is_not_hinted_to_a_worker_that_would_evict_an_adapter_for_it(index):
    """A preferred worker whose adapter slots are full with other adapters is not a candidate for a
    LoRA request's hint (a cold start costs more than the cached start saves); one that holds the
    adapter, or has a free slot, is."""
    from polyserve.proto.events import AdapterInfo

    view = make_view(index)
    dep = Deployment(id="d", model="m", policy="least_outstanding")
    held = [AdapterInfo(name=n, rank=8) for n in ("x", "y")]
    view.heartbeat(beat("w1"))
    view.heartbeat(beat("full", adapters=held, max_adapters=2))
    view.heartbeat(beat("holds", adapters=[AdapterInfo(name="sql", rank=8), held[0]], max_adapters=2))
    view.heartbeat(beat("free", adapters=held[:1], max_adapters=2))
    c = place(view, dep, req("r1", adapter="sql", adapter_rank=8, prefer=["full"]))
    assert c.worker.worker_id != "full" and not c.prefixed
    for wid in ("holds", "free"):
        c = place(view, dep, req(f"r-{wid}", adapter="sql", adapter_rank=8, prefer=[wid]))
        assert c.worker.worker_id == wid and c.prefixed
    c = place(view, dep, req("base", prefer=["full"]))  # a base-model request: no adapter to load
    assert c.worker.worker_id == "full" and c.prefixed


def test_the_placement_names_the_hint():
    view = make_view()
    dep = Deployment(id="d", model="m", policy="least_outstanding")

    class Deps:
        async def get(self, dep_id):
            return dep if dep_id == "d" else None

    h = DispatchHandlers(view.settings, view, Deps(), Subjects())
    view.heartbeat(beat("w1"))
    view.heartbeat(beat("w2"))

    async def go():
        a = await h.dispatch(req("a", prefer=["w2"]))
        b = await h.dispatch(req("b"))
        return a, b

    a, b = asyncio.run(go())
    assert (a.worker_id, a.policy) == ("w2", "least_outstanding+prefer")
    assert (b.worker_id, b.policy) == ("w1", "least_outstanding")
