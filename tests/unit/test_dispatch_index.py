"""The incremental WorkerIndex: every fast policy returns the pure policy's decision.

Random clusters (heartbeat-only and request-tracking views, several perf models, LoRA
adapters with full and free slots, Arlo runtimes), with upserts, removals, placements and
completions interleaved with decisions; each decision is compared with the pure policy
run on `index.views()` with the same rng state and policy state.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from polyserve.core.perf import BGMV, MBGMV, PerfModel, WorkerPerf
from polyserve.dispatcher import index as ix
from polyserve.dispatcher import index_cara as ixc
from polyserve.dispatcher import index_models as ixm
from polyserve.dispatcher import native
from polyserve.dispatcher import policy as p

pytestmark = pytest.mark.unit

PERFS = [
    None,
    WorkerPerf(base=PerfModel(k1=0.1066, c1=8.46, k2=9.4e-5, c2=0.2825, c3=28.8)),  # the 70B sim profile
    WorkerPerf(base=PerfModel(k1=0.05, c1=5.0, k2=2e-4, c2=0.5, c3=20.0, h=1.0, j=16.0)),
    WorkerPerf(base=PerfModel(k1=0.1, c1=10.0, k2=0.0, c2=0.0, c3=31.8)),  # CaraServe Fig. 5: flat base step
    # a bad online fit (negative slopes): no pruning / ordering may be assumed for it
    WorkerPerf(base=PerfModel(k1=-0.05, c1=900.0, k2=-1e-3, c2=0.3, c3=30.0, h=1.0, j=-8.0)),
]
NEEDS = [250, 320, 1200, 5000]  # input + predicted of common requests: KV exactly full for them
ADAPTERS = [f"lora{i}" for i in range(12)]
RANKS = {a: random.Random(i).choice([8, 16, 32, 64]) for i, a in enumerate(ADAPTERS)}
RUNTIMES = [64, 128, 256, 512]


def random_request(rng: random.Random, i: int, arlo: bool = False) -> p.RequestView:
    adapter = rng.choice(ADAPTERS + [None, None]) if not arlo else None
    slo = rng.random()
    size = rng.choice([(0, 0), (1, 1), (200, 50), (20, 300), (900, 300), (3000, 2000), (900, 2000)])
    return p.RequestView(request_id=f"r{i}", input_tokens=size[0] if not arlo else rng.randint(1, 700),
                         predicted_tokens=size[1], adapter=adapter,
                         adapter_rank=RANKS[adapter] if adapter else 0,
                         atgt_slo_ms=0.0 if slo < 0.75 else rng.choice([30.0, 40.0, 60.0]),
                         ttft_slo_ms=0.0 if slo < 0.9 else 800.0)


def random_view(rng: random.Random, wid: str, arlo: bool = False, same: WorkerPerf | None = None) -> p.WorkerView:
    """A random worker; `same`: every worker alike but for its load (large cost groups)."""
    if arlo:
        n = rng.choice(RUNTIMES + [0])  # 0: a dynamic-shape runtime
        m = rng.choice([0, 4, 8, 20])  # 17/20 == 0.85 == λ: Alg. 1's strict threshold
        return p.WorkerView(worker_id=wid, outstanding=rng.randint(0, 20), max_input_len=n,
                            kv_capacity=m * n, max_batch=rng.choice([0, 6]))
    perf = rng.choice(PERFS) if same is None else same
    reqs = ()
    if same is not None:
        reqs = tuple(p.RunningRequest(request_id=f"{wid}-{k}", input_tokens=rng.choice([100, 500]),
                                      predicted_tokens=200, generated=rng.randint(0, 3), rank=16, started=k > 0)
                     for k in range(rng.choice([0, 1, 2])))
        held = tuple(rng.sample(ADAPTERS[:3], rng.randint(0, 2)))
        return p.WorkerView(worker_id=wid, outstanding=len(reqs), kv_used=rng.choice([0, 1000, 19000]),
                            kv_capacity=20000, adapters=held, adapter_ranks=(16,) * len(held), max_adapters=2,
                            kernel=BGMV, max_batch=8, requests=reqs, perf=perf)
    if rng.random() < 0.7:
        reqs = tuple(p.RunningRequest(request_id=f"{wid}-{k}", input_tokens=rng.choice([10, 100, 500, 2000]),
                                      predicted_tokens=rng.choice([0, 20, 200, 800]), generated=rng.choice([0, rng.randint(0, 300)]),
                                      decode_ms=rng.random() * 3000, started=rng.random() < 0.7,
                                      rank=rng.choice([0, 8, 16, 64]))
                     for k in range(rng.choice([0, 1, 2, 3, 5, 8])))
    cap = rng.choice([0, 3000, 20000, 200000])
    used = rng.randint(0, cap) if rng.random() < 0.6 else max(0, cap - rng.choice(NEEDS))
    held = tuple(rng.sample(ADAPTERS, rng.randint(0, 4)))
    return p.WorkerView(worker_id=wid, outstanding=rng.randint(0, 6), running=rng.randint(0, 6),
                        waiting=rng.choice([0, 0, 1, 3]), kv_used=used if cap else rng.randint(0, 50),
                        kv_capacity=cap, adapters=held, adapter_ranks=tuple(RANKS[a] for a in held),
                        max_adapters=rng.choice([0, 2, 4]), kernel=rng.choice([BGMV, MBGMV]),
                        max_batch=rng.choice([0, 4, 8, 64]), requests=reqs, perf=perf)


def run_equivalence(policy: str, seed: int, steps: int = 160, same: WorkerPerf | None = None,
                    atgt_slo_ms: float = 0.0) -> int:
    """Random ops on an index; returns how many decisions were compared. `atgt_slo_ms`: every
    request carries this ATGT SLO (a tight one leaves Aladdin no fit: its fallback decides)."""
    rng = random.Random(seed)
    arlo = policy.startswith("arlo")

    def view(wid: str) -> p.WorkerView:
        return random_view(rng, wid, arlo, same)

    index = ix.WorkerIndex(policies=(policy,) if seed % 2 else ())  # odd seeds: built up front
    ids = [f"w{rng.randint(0, 999):03d}" for _ in range(rng.randint(1, 40))]
    for wid in ids:
        index.upsert(view(wid))
    fast, pure = ix.FAST_POLICIES[policy], ix.PURE_POLICIES[policy]
    state = p.PolicyState(last_worker=rng.choice(["", "w500"]))
    placed: list[tuple[str, str]] = []
    compared = 0
    for i in range(steps):
        op = rng.random()
        if op < 0.12:
            index.upsert(view(f"w{rng.randint(0, 999):03d}"))
        elif op < 0.17 and len(index) > 1:
            index.remove(rng.choice(index.views()).worker_id)
        elif op < 0.32 and placed:
            wid, rid = placed.pop(rng.randrange(len(placed)))
            index.finished(wid, rid)
        else:
            req = random_request(rng, i, arlo)
            if atgt_slo_ms:
                req = replace(req, atgt_slo_ms=atgt_slo_ms)
            seed_rng = rng.random()
            r1, r2 = random.Random(seed_rng), random.Random(seed_rng)
            got = fast(index, req, state, r2)  # first: it sees the placements not built into views yet
            want = pure(index.views(), req, state, r1)
            assert got == want, (policy, seed, i, req)
            assert r1.getstate() == r2.getstate()
            state = got.state
            index.placed(got.worker_id, req)
            placed.append((got.worker_id, req.request_id))
            compared += 1
    return compared


@pytest.mark.parametrize("policy", sorted(ix.FAST_POLICIES))
def test_fast_policy_returns_the_pure_policys_decision(policy):
    compared = sum(run_equivalence(policy, seed) for seed in range(6))
    assert compared > 400


@pytest.mark.parametrize("perf", PERFS, ids=["no-perf", "70b", "j16", "flat", "negative"])
@pytest.mark.parametrize("policy", ["aladdin", "caraserve", "first_fit"])
def test_fast_policy_on_clusters_of_alike_workers(policy, perf):
    """Many workers with the same perf model, kernel and rank: big CaraServe cost groups,
    many capacity_norm ties."""
    assert sum(run_equivalence(policy, seed, steps=80, same=perf) for seed in range(3)) > 100


@pytest.mark.parametrize("narrow", [0, 1, 2, 100])
def test_caraserve_groups_visited_as_wide_or_through_their_adapters(monkeypatch, narrow):
    """CaraServe groups holding more than `index_cara.NARROW` adapters are visited through
    the `wide` list, the others through their adapters' lists and `narrow_free`: with every
    split (all wide, mixed, all narrow) the pure policy's decision; the filing stays in line
    with the groups."""
    monkeypatch.setattr(ixc, "NARROW", narrow)
    compared = sum(run_equivalence("caraserve", seed) for seed in range(6))
    compared += sum(run_equivalence("caraserve", seed, steps=80, same=PERFS[1]) for seed in range(3))
    assert compared > 400
    index = ix.WorkerIndex(policies=("caraserve",))
    rng = random.Random(narrow)
    for k in range(60):
        index.upsert(random_view(rng, f"w{rng.randint(0, 30):02d}"))
    s = index._struct("caraserve")
    entries = sorted(s.bounds)
    assert entries == sorted({e for lst in (s.wide, *s.by_adapter.values(), s.narrow_free) for e in lst})
    for g in (e[2] for e in entries):
        in_adapters = {a for a, lst in s.by_adapter.items() if any(e[2] is g for e in lst)}
        assert (g.bound, g.gid, g) in s.wide if len(g.holders) > narrow else in_adapters == set(g.holders)


def test_aladdin_fallback_twin_on_clusters_where_nothing_fits(monkeypatch):
    """A 29 ms ATGT SLO (the 70B profile's single step is 28.8 ms + 0.28 ms per sequence)
    leaves no worker passing Alg. 1: every decision is the least-harm fallback, and many
    differ from the emptiest worker's; a 30 ms one on mixed perf models leaves some."""
    calls = {"fallback": 0, "not_emptiest": 0}
    real = ix.AL.fallback

    def counting(workers, req, cfg):
        workers = list(workers)
        got = real(workers, req, cfg)
        calls["fallback"] += 1
        emptiest = min(workers, key=lambda w: (ix.AL.capacity_norm(w, cfg), w.worker_id)).worker_id
        calls["not_emptiest"] += got != emptiest
        return got

    monkeypatch.setattr(ix.AL, "fallback", counting)
    compared = sum(run_equivalence("aladdin", seed, steps=80, atgt_slo_ms=30.0) for seed in range(4))
    compared += sum(run_equivalence("aladdin", seed, steps=80, same=PERFS[1], atgt_slo_ms=29.0) for seed in range(4))
    assert compared > 400
    if native.is_native():  # compiled modules call each other directly: the patch above is not seen
        return
    assert calls["fallback"] > 2 * 200  # pure and fast each call it
    assert calls["not_emptiest"] > 2 * 60


def test_every_registered_policy_has_a_fast_twin():
    assert set(ix.FAST_POLICIES) >= set(p.POLICIES)
    assert set(ix.PURE_POLICIES) == set(ix.FAST_POLICIES)
    for name, fn in ix.PURE_POLICIES.items():
        if name in p.POLICIES:
            assert p.POLICIES[name] is fn


def test_updates_track_outstanding_and_requests():
    index = ix.WorkerIndex(policies=("least_outstanding", "aladdin"))
    index.upsert(p.WorkerView(worker_id="a", outstanding=0))
    index.upsert(p.WorkerView(worker_id="b", outstanding=1))
    req = p.RequestView(request_id="r1", input_tokens=10, predicted_tokens=5)
    d = ix.choose_fast("least_outstanding", index, req, p.PolicyState(), random.Random(0))
    assert d.worker_id == "a"
    index.placed("a", req)
    v = index.get("a")
    assert v.outstanding == 1 and [r.request_id for r in v.requests] == ["r1"] and not v.requests[0].started
    # a tie now: load_key breaks it by worker id
    assert ix.fast_least_outstanding(index, req, p.PolicyState(), None).worker_id == "a"
    index.placed("a", p.RequestView(request_id="r2"))
    assert ix.fast_least_outstanding(index, req, p.PolicyState(), None).worker_id == "b"
    assert index.finished("a", "r1").requests[0].request_id == "r2"
    assert index.finished("a", req).outstanding == 1  # r1 again: a duplicate event, no change
    plain = ix.WorkerIndex(track_requests=False)
    plain.upsert(p.WorkerView(worker_id="a", outstanding=2))
    plain.placed("a", req)
    assert plain.get("a").requests == () and plain.finished("a", "r9").outstanding == 2
    assert index.finished("gone", "r2") is None
    assert index.remove("b") and not index.remove("b")
    assert [v.worker_id for v in index.views()] == ["a"]


def test_aladdin_skips_workers_no_request_can_fit():
    perf = PERFS[1]
    full = p.WorkerView(worker_id="full", max_batch=2, perf=perf,
                        requests=(p.RunningRequest(request_id="x", input_tokens=10, predicted_tokens=10),) * 2)
    ok = p.WorkerView(worker_id="ok", max_batch=8, perf=perf, kv_capacity=100000)
    index = ix.WorkerIndex(policies=("aladdin",))
    index.upsert(full)
    index.upsert(ok)
    s = index._aladdin_for(ix.AL.DEFAULT)
    assert sorted(s.norms, key=lambda wid: (s.norms[wid], wid)) == ["full", "ok"]  # full is the fullest...
    assert [k[1] for k in s.live.keys] == ["ok"]  # ...but never checked
    req = p.RequestView(request_id="n", input_tokens=100, predicted_tokens=100)
    assert ix.fast_aladdin(index, req, p.PolicyState(), None).worker_id == "ok"


def test_aladdin_limits_never_skip_a_feasible_worker():
    # "busy" has banked 5 ms of slack: no prompt fits it (prefill >= c1 = 8.5 ms)... but an
    # empty one (0 ms), and "busy" is the fullest: the pre-filter must not skip it
    perf = PERFS[1]
    started = p.RunningRequest(request_id="s", input_tokens=500, predicted_tokens=100, generated=1, decode_ms=70.0)
    busy = p.WorkerView(worker_id="busy", max_batch=8, perf=perf, requests=(started,), kv_capacity=100000)
    idle = p.WorkerView(worker_id="idle", max_batch=8, perf=perf, kv_capacity=100000)
    index = ix.WorkerIndex(policies=("aladdin",))
    index.upsert(busy)
    index.upsert(idle)
    for size, want in ((0, "busy"), (1, "idle"), (200, "idle")):
        req = p.RequestView(request_id="n", input_tokens=size, predicted_tokens=10)
        assert ix.AL.aladdin_best_fit([busy, idle], req, p.PolicyState(), None).worker_id == want
        assert ix.fast_aladdin(index, req, p.PolicyState(), None).worker_id == want


def last_fitting(w: p.WorkerView, make, lo: int) -> int | None:
    """The largest n with `check(w, make(n))` passing, by bisection from `lo` (None: not even lo)."""
    if ix.AL.check(w, make(lo)):
        return None
    hi = 1 << 20
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not ix.AL.check(w, make(mid)) else (lo, mid)
    return lo


def test_aladdin_limits_at_the_boundary_of_feasibility():
    """Requests one token either side of where a worker stops fitting (TTFT, slack, ATGT or
    KV binds): the index must agree with `check` on every one of them."""
    rng = random.Random(3)
    cases = 0
    # TTFT binds: 14,400 prompt tokens in the prefill under way (started, no token yet)
    prefill = tuple(p.RunningRequest(request_id=f"s{i}", input_tokens=1800, predicted_tokens=100, started=True)
                    for i in range(8))
    views = [p.WorkerView(worker_id="pre", max_batch=64, perf=PERFS[1], requests=prefill, kv_capacity=10**6)]
    views += [random_view(rng, f"w{k}") for k in range(150)]
    for k, w in enumerate(views):
        if rng.random() < 0.5:  # a KV cache that binds
            w = replace(w, kv_capacity=w.kv_used + rng.choice([300, 2000, 9000]) + 3 * sum(
                r.input_tokens + r.generated for r in w.requests))
        index = ix.WorkerIndex(policies=("aladdin",))
        index.upsert(w)
        pred = rng.choice([0, 1, 100, 1000])
        lo = last_fitting(w, lambda n, pred=pred: p.RequestView(input_tokens=n, predicted_tokens=pred), 0)
        if lo is None:
            continue
        for n in (lo - 1, lo, lo + 1, lo + 2):
            req = p.RequestView(request_id="n", input_tokens=max(0, n), predicted_tokens=pred)
            want = ix.AL.aladdin_best_fit([w], req, p.PolicyState(), None)
            assert ix.fast_aladdin(index, req, p.PolicyState(), None) == want, (k, n, w)
            cases += 1
        if w.requests:  # the other way round: the last predicted length that fits a given input
            n_in = rng.choice([0, 50])
            lo = last_fitting(w, lambda q, n_in=n_in: p.RequestView(input_tokens=n_in, predicted_tokens=q), 1)
            if lo is not None:
                for q in (lo, lo + 1):
                    req = p.RequestView(request_id="n", input_tokens=n_in, predicted_tokens=q)
                    want = ix.AL.aladdin_best_fit([w], req, p.PolicyState(), None)
                    assert ix.fast_aladdin(index, req, p.PolicyState(), None) == want, (k, q, w)
    assert cases > 200


def test_aladdin_sufficient_limits_imply_check_and_placements_keep_keys_exact():
    """A request within a worker's sufficient limits passes `check` (so `fast_aladdin` may
    skip it), one beyond its necessary limits fails it; and the keys an index keeps
    incrementally across placements equal those computed from scratch."""
    rng = random.Random(11)
    sure = beyond = 0
    cfgs = [ix.AL.DEFAULT, ix.AL.config_for(p.RequestView(ttft_slo_ms=800.0, atgt_slo_ms=40.0))]
    for k in range(300):
        cfg = rng.choice(cfgs)
        w = random_view(rng, f"w{k}")
        if rng.random() < 0.5 and w.requests:  # a KV cache that binds
            w = replace(w, kv_capacity=w.kv_used + rng.choice([300, 2000, 9000]) + 3 * sum(
                r.input_tokens + r.generated for r in w.requests))
        index = ix.WorkerIndex()
        index.upsert(w)
        s = index._aladdin_for(cfg)
        for i in range(rng.randint(0, 6)):  # placements update the keys incrementally
            index.placed(w.worker_id, random_request(rng, i))
            w = index.get(w.worker_id)
            fresh = ix._Aladdin(cfg)
            fresh.update(None, w)
            assert s.norms == fresh.norms and s.live.cur == fresh.live.cur, (k, i)
        lim = ixm._aladdin_limits(w, cfg)
        for i in range(25):
            n_in, pred = rng.choice([0, 1, 10, 100, 500, 2000, 8000]), rng.choice([0, 1, 50, 300, 2000])
            req = p.RequestView(request_id="n", input_tokens=n_in, predicted_tokens=pred)
            need = (n_in, n_in + cfg.gamma * max(1, pred), n_in + max(1, pred))
            why = ix.AL.check(w, req, cfg)
            if lim is None or any(x > m for x, m in zip(need, lim[:3])):
                assert why, (k, req, w)
                beyond += 1
            elif all(x <= m for x, m in zip(need, lim[3:])):
                assert not why, (k, req, w, why)
                sure += 1
    assert sure > 300 and beyond > 300


def test_aladdin_fallback_takes_the_lowest_id_among_the_emptiest():
    # no worker can take a request this long: Alg. 1 would scale out; the emptiest takes it
    ws = [p.WorkerView(worker_id=w, kv_capacity=1000, perf=PERFS[1]) for w in ("c", "a", "b")]
    ws.append(p.WorkerView(worker_id="d", kv_capacity=1000, kv_used=10, perf=PERFS[1]))
    index = ix.WorkerIndex(policies=("aladdin",))
    for w in ws:
        index.upsert(w)
    req = p.RequestView(request_id="n", input_tokens=900, predicted_tokens=900)
    want = ix.AL.aladdin_best_fit(ws, req, p.PolicyState(), None)
    assert want.worker_id == "a" and ix.fast_aladdin(index, req, p.PolicyState(), None) == want


def test_aladdin_fallback_goes_where_the_request_does_the_least_harm():
    """Nothing fits: the fast twin takes the pure policy's least-harm worker (not the emptiest),
    also after placements change the workers' queues."""
    from tests.unit.test_policies_aladdin import CFG, no_fit_cluster
    ws, req = no_fit_cluster()
    req = replace(req, ttft_slo_ms=CFG.ttft_slo_ms, atgt_slo_ms=CFG.atgt_slo_ms)
    index = ix.WorkerIndex(policies=("aladdin",))
    for w in ws:
        index.upsert(w)
    seen = []
    for i in range(4):
        r = replace(req, request_id=f"n{i}")
        want = ix.AL.aladdin_best_fit(index.views(), r, p.PolicyState(), None)
        assert want.scale_out and ix.fast_aladdin(index, r, p.PolicyState(), None) == want
        index.placed(want.worker_id, r)
        seen.append(want.worker_id)
    assert seen[0] == "old"  # the emptiest ("fresh") has a request whose slack the prefill would eat


@pytest.mark.parametrize("policy", ["caraserve", "first_fit", "aladdin"])
def test_no_worker_has_room_falls_back_like_the_pure_policy(policy):
    """Every worker KV-full or out of adapter slots: CaraServe lets every worker compete,
    first_fit takes the least loaded, Aladdin the emptiest (and wants a new worker)."""
    rng = random.Random(7)
    index = ix.WorkerIndex(policies=(policy,))
    for i in range(30):
        index.upsert(p.WorkerView(worker_id=f"w{i:02d}", outstanding=rng.randint(0, 3), kv_capacity=4000,
                                  kv_used=rng.randint(3500, 4000), adapters=("x", "y"), max_adapters=2,
                                  adapter_ranks=(8, 64), kernel=rng.choice([BGMV, MBGMV]), max_batch=8,
                                  perf=rng.choice(PERFS[:3])))
    for i, adapter in enumerate(["x", "z", None]):
        req = p.RequestView(request_id=f"r{i}", input_tokens=600, predicted_tokens=100, adapter=adapter,
                            adapter_rank=32 if adapter else 0)
        want = ix.PURE_POLICIES[policy](index.views(), req, p.PolicyState(), random.Random(0))
        assert ix.FAST_POLICIES[policy](index, req, p.PolicyState(), random.Random(0)) == want
        index.placed(want.worker_id, req)


def test_bad_input_says_what_to_fix():
    index = ix.WorkerIndex()
    with pytest.raises(ValueError, match="at least one candidate"):
        ix.fast_least_outstanding(index, p.RequestView(), p.PolicyState(), None)
    with pytest.raises(KeyError, match="upsert its view first"):
        index.placed("nope", p.RequestView())
    with pytest.raises(TypeError, match="WorkerView"):
        index.upsert({"worker_id": "a"})
    with pytest.raises(p.UnknownPolicy, match="choose one of"):
        ix.WorkerIndex(policies=("fastest",))
    with pytest.raises(p.UnknownPolicy):
        ix.choose_fast("fastest", index, p.RequestView(), p.PolicyState(), None)
