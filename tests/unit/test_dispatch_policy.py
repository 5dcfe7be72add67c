import random

import pytest

from polyserve.dispatcher import policy as p
from polyserve.dispatcher.registry import Outstanding, WorkerRegistry
from polyserve.proto import Heartbeat, WorkerDown

pytestmark = pytest.mark.unit

REQ = p.RequestView(request_id="r")


def views(*loads: tuple[int, int]) -> list[p.WorkerView]:
    return [p.WorkerView(worker_id=f"w{i}", outstanding=o, waiting=w) for i, (o, w) in enumerate(loads)]


def test_round_robin_cycles_and_survives_membership_changes():
    ws = views((0, 0), (5, 5), (9, 9))
    state, seen = p.PolicyState(), []
    for _ in range(6):
        d = p.round_robin(ws, REQ, state, random.Random(0))
        seen.append(d.worker_id)
        state = d.state
    assert seen == ["w0", "w1", "w2", "w0", "w1", "w2"]
    # w1 leaves after w0 was chosen: the next is w2, not a skip back to w0
    state = p.PolicyState(last_worker="w0")
    assert p.round_robin([ws[0], ws[2]], REQ, state, random.Random(0)).worker_id == "w2"


def test_least_outstanding_picks_min_with_deterministic_ties():
    ws = views((3, 0), (1, 1), (0, 1), (2, 2))
    assert p.least_outstanding(ws, REQ, p.PolicyState(), random.Random(0)).worker_id in {"w1", "w2"}
    # (1+1) vs (0+1): w2 has the shortest queue
    assert p.least_outstanding(ws, REQ, p.PolicyState(), random.Random(0)).worker_id == "w2"
    tie = views((1, 0), (0, 1), (1, 0))
    assert p.least_outstanding(tie, REQ, p.PolicyState(), random.Random(0)).worker_id == "w0"
    assert p.least_outstanding(list(reversed(tie)), REQ, p.PolicyState(), random.Random(0)).worker_id == "w0"
    # engine running breaks ties in queue length
    busy = [p.WorkerView(worker_id="a", outstanding=1, running=4), p.WorkerView(worker_id="b", outstanding=1)]
    assert p.least_outstanding(busy, REQ, p.PolicyState(), random.Random(0)).worker_id == "b"


def test_power_of_two_never_picks_the_worse_of_its_two_samples():
    ws = views(*[(i, 0) for i in range(8)])  # distinct loads
    load = {w.worker_id: w.outstanding for w in ws}
    picks = set()
    for seed in range(500):
        sa, sb = random.Random(seed).sample(ws, 2)  # the two the policy will draw with this seed
        chosen = p.power_of_two(ws, REQ, p.PolicyState(), random.Random(seed)).worker_id
        assert chosen == min(sa, sb, key=lambda w: w.outstanding).worker_id
        assert load[chosen] < max(load[sa.worker_id], load[sb.worker_id])
        picks.add(chosen)
    assert "w7" not in picks  # the most loaded worker always loses its comparison
    assert len(picks) > 3  # but load is spread, unlike JSQ
    assert p.power_of_two(ws[:1], REQ, p.PolicyState(), random.Random(0)).worker_id == "w0"


def test_registry_is_frozen_explicit_and_the_vocabulary():
    import ast
    from pathlib import Path

    from polyserve import dispatcher
    from polyserve.core.names import DISPATCH_POLICIES
    from polyserve.dispatcher import index as ix
    from polyserve.dispatcher import policy_aladdin, policy_arlo, policy_caraserve

    assert tuple(p.POLICIES) == DISPATCH_POLICIES and set(ix.FAST_POLICIES) == set(DISPATCH_POLICIES)
    assert p.POLICIES["aladdin"] is policy_aladdin.aladdin_best_fit
    assert p.POLICIES["caraserve"] is policy_caraserve.caraserve_rank_aware
    assert all(p.POLICIES[n] is fn for n, fn in policy_arlo.ARLO_POLICIES.items())
    with pytest.raises(TypeError):
        p.POLICIES["mine"] = p.round_robin  # type: ignore[index]
    # the policy modules see the views only: no import of the registry, no registration on import
    # (their sources: with the compiled build loaded, a module's __file__ is its .so)
    src = Path(dispatcher.__path__[0])
    for mod in (policy_aladdin, policy_caraserve, policy_arlo):
        text = (src / (mod.__name__.rsplit(".", 1)[1] + ".py")).read_text()
        tree = ast.parse(text)
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not {"polyserve.dispatcher.policy", "polyserve.dispatcher.index"} & names, mod.__name__
        assert "POLICIES.setdefault" not in text


def test_registry_and_unknown_policy():
    assert set(p.POLICIES) >= {"round_robin", "least_outstanding", "power_of_two"}
    assert p.DEFAULT_POLICY in p.POLICIES
    assert p.get_policy("power_of_two") is p.power_of_two
    with pytest.raises(p.UnknownPolicy, match="unknown dispatch policy 'fastest'.*least_outstanding"):
        p.get_policy("fastest")
    assert isinstance(p.UnknownPolicy("x"), ValueError)
    with pytest.raises(ValueError):
        p.choose("round_robin", [], REQ, p.PolicyState(), random.Random(0))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_outstanding_accounting_is_bounded_and_expires():
    clock = FakeClock()
    acc = Outstanding(max_tracked=3, ttl_s=10, clock=clock)
    acc.place("r1", "a")
    acc.place("r2", "a")
    acc.place("r3", "b")
    assert (acc.count("a"), acc.count("b")) == (2, 1)
    acc.place("r2", "b")  # retry moved to b
    assert (acc.count("a"), acc.count("b")) == (1, 2)
    assert acc.finish("r1") == "a" and acc.finish("r1") is None and acc.count("a") == 0
    acc.place("r4", "c")
    acc.place("r5", "c")  # over max_tracked: the oldest (r3) is dropped
    assert len(acc) == 3 and acc.evicted == 1 and acc.count("b") == 1
    clock.t += 11
    assert acc.expire() == 3 and len(acc) == 0 and acc.count("c") == 0
    acc.place("r6", "d")
    assert acc.forget_worker("d") == 1 and acc.count("d") == 0


def test_registry_ttl_and_late_heartbeat_after_down():
    clock = FakeClock()
    reg = WorkerRegistry(clock=clock)
    hb = Heartbeat(worker_id="w", deployment="d", model="m", engine="sim", ttl_s=1.0, ts=50.0)
    assert reg.heartbeat(hb)
    assert [h.worker_id for h in reg.live("d")] == ["w"] and reg.live("other") == []
    clock.t += 1.5
    assert reg.live("d") == [] and reg.known("d") == 1
    assert reg.sweep() == ["w"] and reg.known("d") == 0
    assert reg.heartbeat(hb)
    assert reg.down(WorkerDown(worker_id="w", reason="killed", ts=60.0))
    assert not reg.heartbeat(hb)  # in flight before the down: ignored
    assert reg.heartbeat(Heartbeat(worker_id="w", deployment="d", model="m", engine="sim", ts=61.0))
