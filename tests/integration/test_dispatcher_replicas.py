"""Dispatcher replicas in one queue group share their accounting through `dispatched` events
(issue 13): each replica counts the placements of the others (and of the gateway's local
fallback) as outstanding, so `least_outstanding` balances the whole load, not each replica's
half. Real nats-server and redis-server; the `dispatched` events are published as the gateway
publishes them after each placement."""
import random

import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.proto import Completed, Deployment, Dispatched, DispatchRequest, Placement
from tests.helpers import running, wait_for
from tests.integration.test_dispatcher import heartbeat

pytestmark = pytest.mark.integration

WORKERS = ("w1", "w2", "w3")


async def _setup(make_settings, bus, subjects, state, n: int, **kw) -> list[DispatcherService]:
    await state.put_deployment(Deployment(id="d", model="m", policy="least_outstanding"))
    return [DispatcherService(make_settings(DispatcherSettings, "dispatcher", **kw)) for _ in range(n)]


async def _beat(bus, subjects, svcs, wids=WORKERS):
    for wid in wids:
        await bus.publish(subjects.worker_event("heartbeat"), heartbeat(subjects, wid))
    for s in svcs:
        await wait_for(lambda s=s: {h.worker_id for h in s.view.registry.live("d")} >= set(wids),
                       what="workers live at every replica")


async def _announce(bus, subjects, p: Placement) -> None:
    """What the gateway publishes after a placement (admission.place)."""
    await bus.publish(subjects.event("dispatched"), Dispatched(request_id=p.request_id, deployment="d", model="m",
                                                               worker_id=p.worker_id, policy=p.policy,
                                                               latency_ms=0.1))


def _counts(svc: DispatcherService) -> dict[str, int]:
    return {w: svc.view.outstanding.count(w) for w in WORKERS}


@pytest.mark.parametrize("index", [True, False], ids=["index", "scan"])
async def test_two_replicas_in_a_queue_group_count_every_placement(make_settings, bus, subjects, state, index):
    a, b = await _setup(make_settings, bus, subjects, state, 2, index=index)
    async with running(a, b):
        await _beat(bus, subjects, (a, b))
        truth: dict[str, int] = dict.fromkeys(WORKERS, 0)
        n = 0
        # through the queue group (NATS picks the replica); until both replicas placed some
        while n < 12 or not (a.view.placed and b.view.placed):
            assert n < 60, "the queue group never reached the second replica"
            req = DispatchRequest(request_id=f"r{n}", deployment="d", model="m", input_tokens=10)
            p = await bus.request(subjects.dispatch, req, Placement, timeout=2)
            truth[p.worker_id] += 1
            n += 1
            await _announce(bus, subjects, p)
            await wait_for(lambda: len(a.view.outstanding) == len(b.view.outstanding) == n,
                           what=f"both replicas count all {n} placements")
        assert a.view.placed + b.view.placed == n
        assert _counts(a) == _counts(b) == truth  # each replica sees the total, not its share
        assert max(truth.values()) - min(truth.values()) <= 1, truth
        assert a.view.shared == b.view.placed and b.view.shared == a.view.placed  # own ones deduplicated

        # one completed event releases it at both; a placement by the gateway's local
        # fallback (no dispatcher made it) counts at both
        done = next(w for w in WORKERS if truth[w])
        rid = next(r for r in (f"r{i}" for i in range(n)) if a.view.outstanding.worker_of(r) == done)
        await bus.publish(subjects.event("completed"), Completed(request_id=rid, worker_id=done, input_tokens=10,
                                                                 output_tokens=1, e2e_ms=1, ttft_ms=1))
        await _announce(bus, subjects, Placement(request_id="fallback", worker_id="w3", generate_subject="x",
                                                 cancel_subject="y", policy="local"))
        truth[done] -= 1
        truth["w3"] += 1
        await wait_for(lambda: _counts(a) == _counts(b) == truth, what="completion and fallback seen at both")
        # a `dispatched` that arrives after its request's `completed` does not count it again
        await _announce(bus, subjects, Placement(request_id=rid, worker_id=done, generate_subject="x",
                                                 cancel_subject="y", policy="least_outstanding"))
        await _announce(bus, subjects, Placement(request_id="marker", worker_id="w1", generate_subject="x",
                                                 cancel_subject="y", policy="local"))
        truth["w1"] += 1
        await wait_for(lambda: _counts(a) == _counts(b) == truth, what="late dispatched ignored, marker counted")


async def test_one_replica_is_unchanged_by_its_own_dispatched_events(make_settings, bus, subjects, state):
    """The gateway announces every placement: a single dispatcher neither double-counts nor
    decides differently (ties to the lower worker id, as before)."""
    (a,) = await _setup(make_settings, bus, subjects, state, 1)
    async with running(a):
        await _beat(bus, subjects, (a,), ("w1", "w2"))
        got = []
        for i in range(4):
            req = DispatchRequest(request_id=f"r{i}", deployment="d", model="m", input_tokens=10)
            p = await bus.request(subjects.dispatch, req, Placement, timeout=2)
            got.append(p.worker_id)
            await _announce(bus, subjects, p)
        await _announce(bus, subjects, Placement(request_id="marker", worker_id="w2", generate_subject="x",
                                                 cancel_subject="y", policy="local"))
        await wait_for(lambda: a.view.shared == 1, what="the marker counted")
        assert got == ["w1", "w2", "w1", "w2"]
        assert (a.view.outstanding.count("w1"), a.view.outstanding.count("w2")) == (2, 3)


async def _imbalance(make_settings, bus, subjects, state, replicas: int, share: bool, steps: int = 60):
    """Requests placed alternately on each replica (what the queue group does on average), a
    random earlier one completing after about half of them; the true outstanding imbalance
    (max - min over the workers) after each placement: (worst, mean)."""
    svcs = await _setup(make_settings, bus, subjects, state, replicas)
    rng = random.Random(1)
    worst, total = 0, 0
    async with running(*svcs):
        await _beat(bus, subjects, svcs)
        live: dict[str, tuple[str, int]] = {}  # request -> (worker, replica)
        for i in range(steps):
            k = i % replicas
            p = await svcs[k].handlers.dispatch(DispatchRequest(request_id=f"r{i}", deployment="d", model="m",
                                                                input_tokens=10))
            live[p.request_id] = (p.worker_id, k)
            if share:
                await _announce(bus, subjects, p)
            per = [sum(1 for w, _ in live.values() if w == wid) for wid in WORKERS]
            worst, total = max(worst, max(per) - min(per)), total + max(per) - min(per)
            if rng.random() < 0.5:
                rid = rng.choice(sorted(live))
                wid, _ = live.pop(rid)
                await bus.publish(subjects.event("completed"), Completed(
                    request_id=rid, worker_id=wid, input_tokens=10, output_tokens=1, e2e_ms=1, ttft_ms=1))

            def settled():
                for s in svcs:  # (the last placement's bookkeeping runs after its reply: count it)
                    s.view.settle()
                return all(len(s.view.outstanding) == (len(live) if share else sum(1 for _, r in live.values()
                                                                                   if r == j))
                           for j, s in enumerate(svcs))
            await wait_for(settled, what="every replica caught up with the events")
    return worst, total / steps


async def test_measure_imbalance_one_vs_two_replicas(make_settings, bus, subjects, state):
    """The figure for docs/reliability.md (`pytest -s` prints it): shared accounting keeps two
    replicas as balanced as one; without it, each balances only its half."""
    rows = {}
    for replicas, share in ((1, True), (2, False), (2, True)):
        rows[(replicas, share)] = await _imbalance(make_settings, bus, subjects, state, replicas, share)
    for (replicas, share), (worst, mean) in rows.items():
        print(f"least_outstanding, 3 workers, 60 requests: {replicas} replica(s), "
              f"{'shared' if share else 'own-only'} accounting: imbalance worst {worst}, mean {mean:.2f}")
    assert rows[(1, True)][0] <= 1 and rows[(2, True)][0] <= 1
    assert rows[(2, False)][0] > rows[(2, True)][0]
