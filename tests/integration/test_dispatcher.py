import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.proto import Completed, Deployment, DispatchRequest, Failed, Heartbeat, Placement, WorkerDown
from polyserve.shared import infra
from polyserve.shared.bus import BusError
from tests.helpers import running, wait_for

pytestmark = pytest.mark.integration


def with_index(make_settings, index: bool):
    """`make_settings` whose DispatcherSettings have `index` set (unless a test sets it)."""

    def build(cls, service, **overrides):
        if cls is DispatcherSettings:
            overrides.setdefault("index", index)
        return make_settings(cls, service, **overrides)

    return build


@pytest.fixture(params=[True, False], ids=["index", "scan"])
def make_settings(make_settings, request):
    """Every dispatcher test twice: with the worker index (the default) and with the scan."""
    return with_index(make_settings, request.param)


def heartbeat(subjects, wid: str, dep: str = "d", ttl_s: float = 5.0, **kw) -> Heartbeat:
    return Heartbeat(worker_id=wid, deployment=dep, model="m", engine="sim", ttl_s=ttl_s,
                     generate_subject=subjects.generate(wid), cancel_subject=subjects.cancel(wid), **kw)


async def dispatch(bus, subjects, rid: str = "r", dep: str = "d", **kw) -> Placement:
    req = DispatchRequest(request_id=rid, deployment=dep, model="m", **{"input_tokens": 10, **kw})
    return await bus.request(subjects.dispatch, req, Placement, timeout=2)


async def dispatch_error(bus, subjects, **kw) -> BusError:
    with pytest.raises(BusError) as err:
        await dispatch(bus, subjects, **kw)
    return err.value


async def start_workers(bus, subjects, svc, *wids, dep="d", **kw):
    for wid in wids:
        await bus.publish(subjects.worker_event("heartbeat"), heartbeat(subjects, wid, dep, **kw))
    await wait_for(lambda: {h.worker_id for h in svc.view.registry.live(dep)} >= set(wids),
                   what=f"workers {wids} live at the dispatcher")


async def test_round_robin_spreads_and_placement_carries_subjects(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m", policy="round_robin"))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher"))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", "w2")
        placed = [await dispatch(bus, subjects, rid=f"r{i}", priority=2) for i in range(4)]
        assert [p.worker_id for p in placed] == ["w1", "w2", "w1", "w2"]
        p = placed[0]
        assert (p.request_id, p.policy, p.priority) == ("r0", "round_robin", 2)
        assert p.generate_subject == subjects.generate("w1") and p.cancel_subject == subjects.cancel("w1")
        assert (svc.view.outstanding.count("w1"), svc.view.outstanding.count("w2")) == (2, 2)
        assert (await dispatch(bus, subjects, rid="x", exclude=["w1"])).worker_id == "w2"


async def test_least_outstanding_accounts_completed_and_failed(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m", policy="least_outstanding"))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher"))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", "w2")
        got = [(await dispatch(bus, subjects, rid=f"r{i}")).worker_id for i in range(3)]
        assert got == ["w1", "w2", "w1"]  # ties go to the lower worker_id
        assert (await dispatch(bus, subjects, rid="r3")).worker_id == "w2"
        await bus.publish(subjects.event("completed"),
                          Completed(request_id="r0", worker_id="w1", input_tokens=10, output_tokens=5,
                                    e2e_ms=1, ttft_ms=1))
        await bus.publish(subjects.event("failed"), Failed(request_id="r2", reason="boom", worker_id="w1"))
        await wait_for(lambda: svc.view.outstanding.count("w1") == 0, what="w1's outstanding back to 0")
        assert svc.view.outstanding.count("w2") == 2
        assert [(await dispatch(bus, subjects, rid=f"s{i}")).worker_id for i in range(3)] == ["w1"] * 3
        # engine-reported waiting counts too: a queue at w1 moves work to w2
        await bus.publish(subjects.worker_event("heartbeat"), heartbeat(subjects, "w1", waiting=10))
        await wait_for(lambda: any(h.waiting == 10 for h in svc.view.registry.live("d")), what="w1 load seen")
        assert (await dispatch(bus, subjects, rid="t")).worker_id == "w2"


async def test_power_of_two_uses_both_workers(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m", policy="power_of_two"))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", seed=7))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", "w2")
        got = [(await dispatch(bus, subjects, rid=f"r{i}")).worker_id for i in range(6)]
        # with two workers both are always sampled, so p2c balances exactly like JSQ
        assert sorted(got) == ["w1"] * 3 + ["w2"] * 3


async def test_silent_worker_expires_after_ttl_and_down_removes_at_once(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m", policy="round_robin"))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", sweep_s=0.1))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", "w2", "w3", ttl_s=0.5)

        beating = {"w2", "w3"}

        async def keep_alive():
            while True:
                for wid in sorted(beating):
                    await bus.publish(subjects.worker_event("heartbeat"), heartbeat(subjects, wid, ttl_s=5))
                await asyncio.sleep(0.1)

        beater = asyncio.create_task(keep_alive())
        try:
            # w1 is silent: after its 0.5 s TTL it is never chosen again
            await wait_for(lambda: "w1" not in {h.worker_id for h in svc.view.registry.live("d")}, timeout=3,
                           what="w1 expired")
            got = {(await dispatch(bus, subjects, rid=f"r{i}")).worker_id for i in range(6)}
            assert got == {"w2", "w3"}
            beating.discard("w2")  # killed and announced: removed at once, not after its 5 s TTL
            await bus.publish(subjects.worker_event("down"), WorkerDown(worker_id="w2", reason="killed"))
            await wait_for(lambda: "w2" not in {h.worker_id for h in svc.view.registry.live("d")}, timeout=2,
                           what="w2 removed by worker_down")
            got = {(await dispatch(bus, subjects, rid=f"s{i}")).worker_id for i in range(4)}
            assert got == {"w3"}
        finally:
            beater.cancel()
            await asyncio.gather(beater, return_exceptions=True)
        await bus.publish(subjects.worker_event("down"), WorkerDown(worker_id="w3", reason="stopped"))
        await wait_for(lambda: not svc.view.registry.live("d"), timeout=3, what="no live worker left")
        err = await dispatch_error(bus, subjects, rid="late")
        assert err.code == 503 and "no worker available for deployment 'd'" in err.description


async def test_unknown_deployment_no_worker_and_bad_input(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="empty", model="m"))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher"))
    async with running(svc):
        err = await dispatch_error(bus, subjects, dep="nope")
        assert err.code == 404 and "unknown deployment 'nope'" in err.description
        assert "POST /v1/deployments" in err.description
        err = await dispatch_error(bus, subjects, dep="empty")
        assert err.code == 503 and "deployment 'empty'" in err.description and "none is running" in err.description
        await start_workers(bus, subjects, svc, "w1", dep="empty")
        err = await dispatch_error(bus, subjects, dep="empty", exclude=["w1"])
        assert err.code == 503 and "1 registered" in err.description and "excluded" in err.description
        err = await dispatch_error(bus, subjects, dep="", rid="x")
        assert err.code == 400
        # a deployment created after the first miss is found at once (misses are not cached)
        await state.put_deployment(Deployment(id="nope", model="m"))
        await start_workers(bus, subjects, svc, "w9", dep="nope")
        assert (await dispatch(bus, subjects, dep="nope")).worker_id == "w9"


async def test_seeded_from_redis_and_capped(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m"))
    await state.put_worker(heartbeat(subjects, "seeded", ttl_s=30))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", max_outstanding=1))
    async with running(svc):
        assert (await dispatch(bus, subjects, rid="a")).worker_id == "seeded"  # no heartbeat yet
        err = await dispatch_error(bus, subjects, rid="b")
        assert err.code == 429 and "max_outstanding" in err.description


@contextlib.contextmanager
def private_redis():
    run_dir = Path(tempfile.mkdtemp(prefix="dr-", dir="/tmp"))
    proc, url = infra.start_redis(run_dir, unix_socket=str(run_dir / "r.sock"))
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_cached_deployment_serves_through_redis_outage(make_settings, bus, subjects, prefix):
    from polyserve.proto import Keys
    from polyserve.shared.state import State, connect

    with private_redis() as (proc, url):
        st = State(connect(url), Keys(prefix))
        await st.put_deployment(Deployment(id="d", model="m"))
        await st.close()
        svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", redis_url=url,
                                              deployment_cache_s=0.05, redis_timeout_s=0.2))
        async with running(svc):
            await start_workers(bus, subjects, svc, "w1")
            assert (await dispatch(bus, subjects, rid="a")).worker_id == "w1"
            infra.stop_pid(proc.pid)
            proc.wait(5)
            await asyncio.sleep(0.1)  # let the cached copy go stale (deployment_cache_s=0.05)
            assert (await dispatch(bus, subjects, rid="b")).worker_id == "w1"
            err = await dispatch_error(bus, subjects, rid="c", dep="never-seen")
            assert err.code == 503 and "Redis" in err.description


LIVE_POLICIES = ["round_robin", "least_outstanding", "power_of_two", "random", "least_loaded", "first_fit",
                 "aladdin", "caraserve", "arlo_mlq", "arlo_ig"]


@pytest.mark.parametrize("policy_name", LIVE_POLICIES)
async def test_indexed_dispatcher_places_like_the_scan(make_settings, bus, subjects, state, policy_name):
    """The live dispatcher with its worker index, over real NATS/Redis, against the scan it
    replaces: before each dispatch the scan's decision is computed from the same live view
    (fresh views of the live workers, a copy of the rng and policy state); the placement the
    dispatcher returns must be that worker. Heartbeats, completions, failures, first tokens,
    a worker leaving and one joining happen in between (the model book's clock is frozen so
    that time-based estimates are alike on both sides)."""
    from random import Random

    from polyserve.dispatcher import policy as pol
    from polyserve.proto import AdapterInfo, FirstToken

    dep = Deployment(id="d", model="m", policy=policy_name)
    await state.put_deployment(dep)
    settings = make_settings(DispatcherSettings, "dispatcher", rebalance_s=0, seed=5, sweep_s=30)
    if not settings.index and policy_name != "least_outstanding":
        pytest.skip("with the index off both sides are the scan: one policy checks the switch")
    svc = DispatcherService(settings)
    rng = Random(policy_name)
    arlo = policy_name.startswith("arlo")
    ranks = {"a": 8, "b": 64, "c": 16}

    def beat(wid: str, **kw) -> Heartbeat:
        names = rng.sample(sorted(ranks), rng.randint(0, 2))
        base = {"kv_used": rng.randint(0, 6000), "kv_capacity": 8000, "running": rng.randint(0, 3),
                "adapters": [AdapterInfo(name=a, rank=ranks[a]) for a in names], "max_adapters": 2,
                "max_batch": rng.choice([4, 16]), "kernel": rng.choice(["bgmv", "mbgmv"]),
                "profile": "sim-llama2-70b-h100-tp4"}
        if arlo:
            n = rng.choice([64, 128, 512])
            base = {"max_input_len": n, "kv_capacity": n * rng.choice([4, 8])}
        base.update(kw)
        return heartbeat(subjects, wid, ttl_s=30, **base)

    async def send(subject: str, msg, done) -> None:
        await bus.publish(subject, msg)
        await wait_for(done, timeout=3, what=f"{type(msg).__name__} handled")

    async with running(svc):
        v = svc.view
        v.models.clock = lambda: 1000.0
        wids = [f"w{i}" for i in range(6)]
        for wid in wids:
            hb = beat(wid)
            await send(subjects.worker_event("heartbeat"), hb, lambda hb=hb: svc.view.registry.get(hb.worker_id) == hb)
        placed: list[tuple[str, str]] = []
        compared = 0
        for i in range(40):
            op = rng.random()
            if op < 0.15:
                hb = beat(rng.choice(wids))
                await send(subjects.worker_event("heartbeat"), hb, lambda hb=hb: svc.view.registry.get(hb.worker_id) == hb)
            elif op < 0.3 and placed:
                wid, rid = placed.pop(rng.randrange(len(placed)))
                ev = (Completed(request_id=rid, worker_id=wid, input_tokens=100, output_tokens=rng.randint(1, 80),
                                e2e_ms=500, ttft_ms=80, queue_ms=5, atgt_ms=30.0, predicted_tokens=50)
                      if rng.random() < 0.7 else Failed(request_id=rid, worker_id=wid, reason="test"))
                subject = subjects.event("completed" if isinstance(ev, Completed) else "failed")
                await send(subject, ev, lambda rid=rid: rid not in v.outstanding._placed)
            elif op < 0.4 and placed:
                wid, rid = rng.choice(placed)
                await send(subjects.event("first_token"), FirstToken(request_id=rid, worker_id=wid, ttft_ms=50),
                           lambda rid=rid: rid not in v.models.requests._by_id
                           or v.models.requests._by_id[rid].first_token is not None)
            elif op < 0.43 and i > 10:  # one worker leaves, a new one joins
                gone = wids.pop(rng.randrange(len(wids)))
                await send(subjects.worker_event("down"), WorkerDown(worker_id=gone, reason="test"),
                           lambda gone=gone: svc.view.registry.get(gone) is None)
                placed = [(w, r) for w, r in placed if w != gone]
                wids.append(f"n{i}")
                hb = beat(wids[-1])
                await send(subjects.worker_event("heartbeat"), hb, lambda hb=hb: svc.view.registry.get(hb.worker_id) == hb)
            else:
                adapter = rng.choice([None, "a", "b", "c"])
                kw = {"input_tokens": rng.choice([10, 100, 600, 3000]) if not arlo else rng.randint(1, 512),
                      "predicted_tokens": rng.choice([1, 50, 400]), "adapter": adapter,
                      "adapter_rank": ranks[adapter] if adapter else 0}
                req = DispatchRequest(request_id=f"r{i}", deployment="d", model="m", **kw)
                modelled = policy_name in ("aladdin", "caraserve")
                views = v.views(v.registry.live("d"), modelled)
                views = [w for w in views if w.max_input_len <= 0 or req.input_tokens <= w.max_input_len]
                if not views:  # no runtime long enough: the dispatcher says so
                    err = await dispatch_error(bus, subjects, rid=req.request_id, **kw)
                    assert err.code == 503 and "max_input_len" in err.description
                    continue
                r_copy = Random()
                r_copy.setstate(v.rng.getstate())
                want = pol.get_policy(policy_name)(views, v.request_view(dep, req),
                                                   v.policy_state.get("d", pol.PolicyState()), r_copy)
                got = await bus.request(subjects.dispatch, req, Placement, timeout=2)
                assert got.worker_id == want.worker_id, (i, req)
                placed.append((got.worker_id, req.request_id))
                compared += 1
        assert compared >= 15
        if settings.index:
            assert v.indexed_decisions == compared  # every decision came from the index
        else:
            assert v.indexed_decisions == 0
