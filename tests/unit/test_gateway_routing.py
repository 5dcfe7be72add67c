"""The gateway's own placement for load-only policies (services/gateway/routing.py and
admission.place_here): its counts, each policy's choice, and when a request may start
without waiting for its prediction."""
from __future__ import annotations

import asyncio

from opentelemetry import trace

from polyserve.gateway import admission
from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.context import GatewayState
from polyserve.gateway.routing import LocalRouter, candidates
from polyserve.proto import DispatchRequest, Heartbeat, Subjects


def hb(wid: str, running: int = 0, waiting: int = 0, max_batch: int = 4, max_input_len: int = 0,
       dep: str = "d") -> Heartbeat:
    return Heartbeat(worker_id=wid, deployment=dep, model="m", engine="sim", running=running, waiting=waiting,
                     max_batch=max_batch, max_input_len=max_input_len)


def test_counts_follow_requests_and_heartbeats_add_the_others():
    r = LocalRouter()
    a, b = hb("a"), hb("b")
    r.assign("r1", "a")
    r.assign("r2", "a")
    r.assign("r2", "a")  # idempotent
    r.assign("r2", "b")  # moved (migration or redirect): counts once, on its new worker
    assert (r.load(a), r.load(b)) == (1, 1)
    r.on_heartbeat(hb("a", running=3, waiting=1))  # 4 on it, 1 of them ours: 3 from other gateways
    assert r.load(a) == 4
    r.release("r1")
    r.release("r1")  # once
    assert r.load(a) == 3 and "a" not in r.own
    r.on_heartbeat(hb("b", running=0))  # ours not there yet: never below zero
    assert r.load(b) == 1
    r.forget("a")
    assert r.load(a) == 0


def test_least_outstanding_breaks_ties_by_kv_then_worker_id_and_spreads():
    r = LocalRouter()
    ws = [hb("c"), hb("a"), hb("b")]
    seq = []
    for i in range(6):
        w = r.choose("least_outstanding", "d", ws)
        r.assign(f"r{i}", w.worker_id)
        seq.append(w.worker_id)
    assert seq == ["a", "b", "c", "a", "b", "c"]
    full = Heartbeat(worker_id="a", deployment="d", model="m", engine="sim", kv_used=90, kv_capacity=100)
    assert LocalRouter().choose("least_outstanding", "d", [full, hb("b")]).worker_id == "b"


def test_round_robin_power_of_two_and_random():
    r = LocalRouter(seed=1)
    ws = [hb("b"), hb("a"), hb("c")]
    assert [r.choose("round_robin", "d", ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert r.choose("round_robin", "other", ws).worker_id == "a"  # per deployment
    r.assign("r1", "a")
    r.assign("r2", "a")
    picks = {r.choose("power_of_two", "d", ws).worker_id for _ in range(50)}
    assert picks == {"b", "c"}  # the loaded one loses every pair it is in; the pairs vary
    assert {r.choose("random", "d", ws).worker_id for _ in range(60)} == {"a", "b", "c"}


def test_candidates_respect_exclusions_and_input_limits():
    ws = [hb("a", max_input_len=100), hb("b"), hb("c")]
    assert [w.worker_id for w in candidates(ws, 200, ["c"])] == ["b"]


def _state(**kw) -> GatewayState:
    return GatewayState(GatewaySettings(**kw), Subjects("polyserve"), trace.get_tracer("t"), asyncio.Event())


def _req(**kw) -> DispatchRequest:
    base = dict(request_id="r", deployment="d", model="m", input_tokens=10)
    base.update(kw)
    return DispatchRequest(**base)


def test_place_here_only_for_load_only_policies_with_a_heartbeat():
    gs = _state()
    assert admission.place_here(gs, _req(), "least_outstanding") is None  # no heartbeat yet: the dispatcher
    asyncio.run(gs.on_heartbeat(hb("a", max_batch=2)))
    placement, free = admission.place_here(gs, _req(), "least_outstanding")
    assert (placement.worker_id, placement.policy, free) == ("a", "least_outstanding", True)
    gs.router.release("r")
    assert admission.place_here(gs, _req(), "aladdin") is None  # reads performance models
    assert admission.place_here(gs, _req(), "first_fit") is None  # reads the prediction
    assert admission.place_here(gs, _req(adapter="lora-1"), "least_outstanding") is None  # adapter placement
    assert admission.place_here(gs, _req(exclude=["a"]), "least_outstanding") is None
    assert admission.place_here(_state(local_dispatch=False), _req(), "least_outstanding") is None


def test_a_request_waits_for_its_prediction_only_when_it_would_queue():
    gs = _state()
    asyncio.run(gs.on_heartbeat(hb("a", max_batch=2)))
    assert admission.place_here(gs, _req(request_id="r1"), "least_outstanding")[1] is True  # counted at once
    assert admission.place_here(gs, _req(request_id="r2"), "least_outstanding")[1] is True  # 1 of 2 slots taken
    assert admission.place_here(gs, _req(request_id="r3"), "least_outstanding")[1] is False  # full: it queues
    assert gs.router.own == {"a": 3}
    gs2 = _state()
    asyncio.run(gs2.on_heartbeat(hb("a", running=0, waiting=1, max_batch=8)))
    assert admission.place_here(gs2, _req(), "least_outstanding")[1] is False  # a queue already


def test_a_busy_worker_makes_the_request_wait_for_its_prediction_without_a_second_choice():
    """round_robin on full workers: the choice `place_here` made is the one `place` uses (its
    state moves once per request), and the request waits for its prediction (it will queue)."""
    from polyserve.proto import Prediction

    gs = _state()
    for w in ("a", "b"):
        asyncio.run(gs.on_heartbeat(hb(w, running=1, max_batch=1)))  # both full: each request queues
    events: list = []

    async def event(kind, ev, counted=False):
        events.append((kind, ev))

    gs.event = event

    async def run() -> list[str]:
        chosen = []
        for i in range(4):
            req = _req(request_id=f"r{i}")
            here = admission.place_here(gs, req, "round_robin")
            assert here is not None and here[1] is False
            done = asyncio.get_running_loop().create_future()
            done.set_result(Prediction(request_id=req.request_id, model="m", length_class=1, tokens_estimate=9,
                                       source="history"))
            p = await admission.place(gs, req, {"request_id": req.request_id, "deployment": "d", "model": "m"},
                                      after=done, policy="round_robin", here=here[0])
            chosen.append(p.worker_id)
        return chosen

    assert asyncio.run(run()) == ["a", "b", "a", "b"]
    assert [k for k, _ in events] == ["dispatched"] * 4


def test_after_a_fleet_wide_silence_placement_goes_the_dispatcher_path_for_a_ttl():
    """A NATS stall (no worker heard for over ttl/2) and its aftermath: the gateway does not
    place on heartbeats until the fleet has been heard as usual for a TTL again."""
    gs = _state()
    asyncio.run(gs.on_heartbeat(hb("a")))  # the first heartbeat ends no stall
    assert admission.place_here(gs, _req(request_id="r1"), "least_outstanding") is not None
    gs._last_heartbeat -= 10.0  # nobody heard for 10 s ...
    assert admission.place_here(gs, _req(request_id="r2"), "least_outstanding") is None
    asyncio.run(gs.on_heartbeat(hb("a")))  # ... then the fleet comes back: the stall just ended
    assert admission.place_here(gs, _req(request_id="r3"), "least_outstanding") is None
    gs._silence_end -= 10.0  # a TTL later
    assert admission.place_here(gs, _req(request_id="r4"), "least_outstanding") is not None


def test_affinity_keeps_a_key_on_its_worker_until_it_is_overloaded():
    """Consistent hashing with bounded loads (routing.LocalRouter.affine): a key's requests stay on
    one worker; past factor x the mean load they spill to the key's own second choice; keys spread
    over the workers; a worker that goes away moves only the keys that ranked it first."""
    from polyserve.gateway.routing import affinity

    r = LocalRouter()
    ws = [hb(w, max_batch=64) for w in "abcd"]
    key = affinity("acme", "system-prompt-1")
    assert key == affinity("acme", "system-prompt-1") != affinity("evil", "system-prompt-1") and affinity("x", "") == ""
    home = r.affine(key, ws, 1.25)
    for i in range(7):  # within the bound: always home
        assert r.affine(key, ws, 1.25) is home
        r.assign(f"k{i}", home.worker_id)
    # home now holds 7 of 7 in flight: the bound is ceil(1.25 * 8 / 4) + AFFINITY_SLACK = 7, so the
    # key spills, and always to the same second choice
    second = r.affine(key, ws, 1.25)
    assert second is not home and r.affine(key, ws, 1.25) is second
    for i in range(7):
        r.release(f"k{i}")
    assert r.affine(key, ws, 1.25) is home  # back home once its load falls
    homes = {i: r.affine(affinity("t", f"key{i}"), ws, 1.25).worker_id for i in range(400)}
    counts = {w: list(homes.values()).count(w) for w in "abcd"}
    assert min(counts.values()) > 60, counts  # 400 keys over 4 workers: none left out
    without_b = {i: r.affine(affinity("t", f"key{i}"), [w for w in ws if w.worker_id != "b"], 1.25).worker_id
                 for i in range(400)}
    assert all(without_b[i] == homes[i] for i in range(400) if homes[i] != "b")  # only b's keys moved


def test_place_here_uses_a_requests_affinity_for_load_only_policies():
    gs = _state()
    for w in "abc":
        asyncio.run(gs.on_heartbeat(hb(w, max_batch=8)))
    placed = [admission.place_here(gs, _req(request_id=f"r{i}", affinity="k1"), "round_robin")[0] for i in range(2)]
    assert placed[0].worker_id == placed[1].worker_id and placed[0].policy == "round_robin+affinity"
    plain = [admission.place_here(gs, _req(request_id=f"p{i}"), "round_robin")[0].worker_id for i in range(3)]
    assert sorted(plain) == ["a", "b", "c"]  # without a key: the policy's own order
    assert admission.place_here(gs, _req(affinity="k1"), "aladdin") is None  # the dispatcher's policies: not here
    text = gs.metrics.render().decode()
    assert 'polyserve_affinity_placements_total{deployment="d",outcome="home"} 2.0' in text
    for i in range(2, 20):  # keep the key's requests coming: past the bound one spills, and is counted so
        if admission.place_here(gs, _req(request_id=f"r{i}", affinity="k1"), "round_robin")[0].worker_id != \
                placed[0].worker_id:
            break
    assert i < 19 and 'outcome="spilled"} 1.0' in gs.metrics.render().decode()


def test_a_keyed_request_moved_off_its_worker_goes_to_the_keys_second_choice():
    """Migration and re-dispatch exclude the worker a request died on (`DispatchRequest.exclude`):
    a keyed request then lands on its key's next worker, the same one every time, so the key's
    other requests that move with it meet again there."""
    gs = _state()
    for w in "abcd":
        asyncio.run(gs.on_heartbeat(hb(w, max_batch=8)))
    home = admission.place_here(gs, _req(request_id="r0", affinity="k9"), "least_outstanding")[0].worker_id
    moved = {admission.place_here(gs, _req(request_id=f"m{i}", affinity="k9", exclude=[home]),
                                  "least_outstanding")[0].worker_id for i in range(3)}
    assert len(moved) == 1 and home not in moved


def test_place_here_follows_a_prompts_start_until_its_worker_is_overloaded():
    """Prefix-aware placement (prefixes.py): the worker that had the prompt's start takes it while
    within the load bound; past it the policy places (spilled), and the worker it picks holds the
    start too, so the next ones go to the least loaded of the two."""
    from polyserve.gateway import prefixes

    gs = _state()
    for w in "abc":
        asyncio.run(gs.on_heartbeat(hb(w, max_batch=8)))
    start = prefixes.blocks("", "", "A long shared system prompt for the support bot. " * 10)
    first = admission.place_here(gs, _req(request_id="r0"), "round_robin", start)[0]
    assert first.policy == "round_robin"  # nothing known yet: a miss, the policy's choice
    gs.prefixes.record(start, first.worker_id)  # (the request handler records every placement)
    homes = []
    for i in range(1, 20):
        p = admission.place_here(gs, _req(request_id=f"r{i}"), "round_robin", start)[0]
        gs.prefixes.record(start, p.worker_id)
        homes.append((p.worker_id, p.policy))
        if p.worker_id != first.worker_id:
            break
    # with loads (k, 0, 0) the bound ceil(1.25 (k + 1) / 3) + 4 >= k + 1 holds up to k = 7
    assert homes[:7] == [(first.worker_id, "round_robin+prefix")] * 7 and homes[7][1] == "round_robin", homes
    spilled_to = homes[7][0]
    nxt = admission.place_here(gs, _req(request_id="n"), "round_robin", start)[0]
    assert (nxt.worker_id, nxt.policy) == (spilled_to, "round_robin+prefix")  # the least loaded holder
    text = gs.metrics.render().decode()
    assert 'polyserve_prefix_placements_total{deployment="d",outcome="hit"} 8.0' in text
    assert 'outcome="spilled"} 1.0' in text and 'outcome="miss"} 1.0' in text


def test_dispatch_hint_is_what_the_gateway_would_place_by_within_its_bound():
    """Where the dispatcher places (aladdin, a LoRA request, a fleet not heard as usual), the gateway
    sends as `DispatchRequest.prefer` what it would have placed by itself: a key's first worker
    within the affinity bound, or the holders of the prompt's start within it. The dispatcher's
    answer (`<policy>+prefer` where it followed) is counted and named as the gateway's own."""
    from polyserve.gateway import prefixes
    from polyserve.proto import Placement

    gs = _state()
    for w in "abc":
        asyncio.run(gs.on_heartbeat(hb(w, max_batch=8)))
    prefer, home, _ = admission.dispatch_hint(gs, _req(affinity="k1"), ())
    assert prefer == [home]
    for i in range(9):  # the key's home past the bound (ceil(1.25 x 10 / 3) + 4 = 9 < 10)
        gs.router.assign(f"x{i}", home)
    second, again, _ = admission.dispatch_hint(gs, _req(affinity="k1"), ())
    assert again == home and second != [home] and second[0] in "abc"
    others = sorted(set("abc") - {home})
    start = prefixes.blocks("", "", "A long shared system prompt for the support bot. " * 10)
    assert admission.dispatch_hint(gs, _req(), start) == ([], "", False)  # nobody holds it: a miss
    for w in "abc":
        gs.prefixes.record(start, w)
    assert admission.dispatch_hint(gs, _req(), start) == (others, "", True)  # the home is over the bound
    # without one of them the mean is over two workers: ceil(1.25 x 10 / 2) + 4 = 11, the home is within it
    assert admission.dispatch_hint(gs, _req(exclude=[others[0]]), start) == (sorted([home, others[1]]), "", True)

    def answered(policy: str, worker: str, req, hint) -> Placement:
        p = Placement(request_id="r", worker_id=worker, generate_subject="g", cancel_subject="c", policy=policy)
        return admission._count_hint(gs, req, p, hint)

    assert answered("aladdin+prefer", others[0], _req(), (others, "", True)).policy == "aladdin+prefix"
    assert answered("aladdin", home, _req(), (others, "", True)).policy == "aladdin"  # the SLO said no
    assert answered("aladdin+prefer", home, _req(affinity="k1"), ([home], home, False)).policy == "aladdin+affinity"
    text = gs.metrics.render().decode()
    assert 'polyserve_prefix_placements_total{deployment="d",outcome="hit"} 1.0' in text
    assert 'polyserve_prefix_placements_total{deployment="d",outcome="spilled"} 1.0' in text
    assert 'polyserve_affinity_placements_total{deployment="d",outcome="home"} 1.0' in text
