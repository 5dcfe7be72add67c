"""The fourth and fifth rounds of dispatch-index speed-ups (issue 15) keep every decision exact:

* `_Blocked`'s per-block maxima stay exact through inserts, moves within a block, deletes
  and splits;
* Aladdin's limits are within 1e-9 relative of the real boundary, so requests one token
  either side of it are decided without running `check`;
* CaraServe's written-out cost equals `policy_caraserve.cost_of` bit for bit, and its
  per-worker batch sums kept across placements equal those computed afresh;
* `polyserve bench dispatch` (small) runs the index and the pure scan in lockstep and
  finds every decision identical.
"""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from polyserve.bench import dispatch as bench
from polyserve.dispatcher import index as ix
from polyserve.dispatcher import index_cara as ixc
from polyserve.dispatcher import index_hints as ixh
from polyserve.dispatcher import index_structs as ixs
from polyserve.dispatcher import policy as p
from polyserve.dispatcher import policy_caraserve as cs
from tests.unit.test_dispatch_index import PERFS, random_request, random_view

pytestmark = pytest.mark.unit


def test_block_maxima_stay_exact_through_sets_moves_and_discards():
    rng = random.Random(5)
    b = ixs._Blocked()
    keys: dict[str, tuple] = {}
    for _ in range(4000):
        wid = f"w{rng.randrange(300)}"
        if rng.random() < 0.15:
            b.discard(wid)
            keys.pop(wid, None)
        else:
            # small moves (as a placement makes) and jumps (a heartbeat)
            old = keys.get(wid)
            cn = old[0] - rng.random() * 0.01 if old is not None and rng.random() < 0.5 else -rng.random()
            key = (cn, wid, *(rng.choice([0.0, 10.0, 100.0, 1e6]) for _ in range(3)), 0.0, 0.0, 0.0)
            b.set(wid, key)
            keys[wid] = key
        flat = [k for blk in b.blocks for k in blk]
        assert flat == sorted(keys.values()) and b.cur == keys
        assert b.lasts == [blk[-1] for blk in b.blocks] and all(0 < len(blk) <= 2 * b.B for blk in b.blocks)
        for blk, mx in zip(b.blocks, b.maxes):
            exact = (max(k[2] for k in blk), max(k[3] for k in blk), max(k[4] for k in blk))
            assert all(k[2] <= mx[0] and k[3] <= mx[1] and k[4] <= mx[2] for k in blk)
            assert mx == exact, (blk, mx)
    for i, blk in enumerate(b.blocks):
        b.tighten(i)
        assert b.maxes[i] == (max(k[2] for k in blk), max(k[3] for k in blk), max(k[4] for k in blk))


def test_aladdin_decides_one_token_either_side_of_the_ttft_limit_without_check(monkeypatch):
    """Before, the limits kept one whole token of margin each way: the two input lengths
    nearest a limit always went to `check`."""
    perf = PERFS[1]
    queued = tuple(p.RunningRequest(request_id=f"q{i}", input_tokens=2000, predicted_tokens=100, started=False)
                   for i in range(6))  # 12,000 prompt tokens waiting: the TTFT limit binds
    w = p.WorkerView(worker_id="w", max_batch=64, perf=perf, requests=queued, kv_capacity=10**7)
    other = p.WorkerView(worker_id="x", max_batch=64, perf=perf, kv_capacity=10**7)
    index = ix.WorkerIndex(policies=("aladdin",))
    index.upsert(w)
    index.upsert(other)
    limit = (ix.AL.DEFAULT.ttft_slo_ms - perf.base.c1) / perf.base.k1 - 12000  # 2,929.0... tokens
    calls = []
    real_check = ix.AL.check
    monkeypatch.setattr(ix.AL, "check", lambda *a: calls.append(a) or real_check(*a))
    for n in (int(limit) - 1, int(limit), int(limit) + 1, int(limit) + 2):
        req = p.RequestView(request_id="n", input_tokens=n, predicted_tokens=10)
        want = ix.AL.aladdin_best_fit([w, other], req, p.PolicyState(), None)
        calls.clear()
        assert ix.fast_aladdin(index, req, p.PolicyState(), None) == want
        assert want.worker_id == ("w" if n <= limit else "x")
        assert not calls, n


def test_caraserve_cost_written_out_equals_cost_of():
    rng = random.Random(8)
    n = 0
    for k in range(400):
        w = random_view(rng, f"w{k}")
        if rng.random() < 0.3:
            w = replace(w, requests=(), outstanding=rng.randint(0, 5))  # heartbeat-only
        state = ixc._cara_signature(w)[4]
        for i in range(10):
            req = random_request(rng, i)
            cfg = cs.config_for(req)
            want = cs.cost_of(replace(w, perf=w.perf or cs._LORA_ONLY), req, cfg)
            got = ixc._cara_cost(state, req.input_tokens, req.adapter_rank, cfg.atgt_slo_ms, cfg.penalty)
            assert got == (want.cost, want.violates), (w, req)
            n += 1
    assert n == 4000


def test_caraserve_batch_sums_kept_across_placements_equal_fresh_ones():
    rng = random.Random(9)
    index = ix.WorkerIndex(policies=("caraserve",))
    views = [random_view(rng, f"w{k}") for k in range(40)]
    for v in views:
        index.upsert(v)
    s = index._struct("caraserve")
    for i in range(400):
        wid = rng.choice(views).worker_id
        if rng.random() < 0.8:
            index.placed(wid, random_request(rng, i))
        elif index.get(wid).requests:
            index.finished(wid, index.get(wid).requests[0].request_id)
        v = index.get(wid)
        assert s.sums.get(wid) == ixc._batch_sums(v, None, None)
        assert s.state[wid] == ixc._cara_signature(v)[4]


def test_bench_dispatch_finds_every_decision_identical(tmp_path):
    out = tmp_path / "r.json"
    rc = bench.main(["--workers", "60", "--outstanding", "120", "--decisions", "300", "--pure-decisions", "300",
                     "--policy", "aladdin,caraserve,first_fit,arlo_mlq", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert rc == 0 and len(results) == 4
    for r in results:
        assert r["identical"] == r["compared"] == 300 and r["burst_same_placements"], r["policy"]
        assert r["decision_cpu_p50_us"] > 0 and r["update_cpu_p50_us"] > 0


def test_bench_dispatch_live_times_requests_with_a_placement_hint(tmp_path):
    """`--live --prefer K`: the live handler's cost when every request names K preferred workers (the
    gateway's hint, dispatcher/prefer.py); a bad K says what to fix."""
    out = tmp_path / "live.json"
    rc = bench.main(["--live", "--no-live-scan", "--workers", "40", "--outstanding", "80", "--live-decisions", "60",
                     "--policy", "caraserve,least_outstanding", "--prefer", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert rc == 0 and [(r["policy"], r["prefer"]) for r in rows] == [("caraserve", 3), ("least_outstanding", 3)]
    assert all(r["dispatches"] == 80 + 60 and r["dispatch_cpu_p99_us"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="--prefer must be between 0 and 16"):
        bench.main(["--live", "--policy", "caraserve", "--prefer", "17"])


@pytest.mark.parametrize("same", [False, True], ids=["varied", "alike"])
@pytest.mark.parametrize("policy", ["caraserve", "aladdin"])
def test_a_policy_among_a_few_workers_is_the_pure_policy_over_their_views(policy, same):
    """`index_hints` (a placement hint's few workers, dispatcher/prefer.py) decides as the pure policy
    over those workers' views: caraserve's candidates first (KV room, the adapter resident or a free
    slot), all of them when none is; aladdin's best fit, and where none fits `scale_out`, with the
    pure policy's fallback worker when asked for it (`fallback`: the own pick was flagged too, so the
    hint stands: prefer.follows), else any of them (the hint is not followed)."""
    rng = random.Random(11)
    index = ix.WorkerIndex(policies=(policy,))
    views = [random_view(rng, f"w{k:02d}", same=PERFS[1] if same else None) for k in range(40)]
    for v in views:
        index.upsert(v)
    among = {"caraserve": ixh.caraserve_among, "aladdin": ixh.aladdin_among}[policy]
    fits = flagged = 0
    for i in range(600):
        req = random_request(rng, i)
        subset = rng.sample([v.worker_id for v in views], rng.choice([1, 2, 3, 5, 8]))
        state = p.PolicyState()
        got = among(index, req, state, subset)
        want = ix.PURE_POLICIES[policy]([index.get(w) for w in subset], req, state, random.Random(0))
        if policy == "aladdin" and want.scale_out:
            assert got.scale_out, (i, subset, req)
            assert among(index, req, state, subset, True) == want, (i, subset, req)
            flagged += 1
        else:
            assert got == want, (i, subset, req)
            fits += not want.scale_out
        if rng.random() < 0.5:  # move the cluster on: placements change what the structures hold
            index.placed(ix.FAST_POLICIES[policy](index, req, state, None).worker_id, req)
    assert fits > 100
    assert policy == "caraserve" or flagged > 20, flagged
    if policy == "caraserve":
        assert among(index, random_request(rng, 0), p.PolicyState(), ["gone"]) is None


def test_with_load_is_replace_of_the_two_fields():
    """`index_structs._with_load` is generated from WorkerView's fields (fifth round)."""
    from dataclasses import replace

    rng = random.Random(2)
    for k in range(50):
        w = random_view(rng, f"w{k}")
        reqs = w.requests[: rng.randint(0, len(w.requests))]
        assert ixs._with_load(w, k, reqs) == replace(w, outstanding=k, requests=reqs)


@pytest.mark.parametrize("policy", ["aladdin", "caraserve"])
def test_lazy_views_equal_built_ones_and_decide_the_same(policy):
    """With only aladdin's / caraserve's structures a placement leaves the WorkerView to be
    built when read (fifth round): `load`, `get`, `views` and every decision equal those of an
    index that builds each view at once (one also holding least_outstanding's structure)."""
    rng = random.Random(9)
    lazy, eager = ix.WorkerIndex(policies=(policy,)), ix.WorkerIndex(policies=(policy, "least_outstanding"))
    views = [random_view(rng, f"w{k:02d}") for k in range(30)]
    for v in views:
        lazy.upsert(v)
        eager.upsert(v)
    fast = ix.FAST_POLICIES[policy]
    pending_seen = 0
    for i in range(400):
        op = rng.random()
        if op < 0.1:
            v = eager.get(rng.choice(views).worker_id)
            lazy.upsert(v)  # a heartbeat (the caller's view includes the placements)
            eager.upsert(v)
        elif op < 0.2:
            wid = rng.choice(views).worker_id
            reqs = eager.get(wid).requests
            if reqs:
                rid = rng.choice(reqs).request_id
                assert lazy.finished(wid, rid) == eager.finished(wid, rid)
        else:
            req = random_request(rng, i)
            d = fast(lazy, req, p.PolicyState(), None)
            assert d == fast(eager, req, p.PolicyState(), None), i
            lazy.placed(d.worker_id, req)
            eager.placed(d.worker_id, req)
            pending_seen += bool(lazy._pending)
            wid = rng.choice(views).worker_id
            assert lazy.load(wid) == (eager.get(wid).outstanding, len(eager.get(wid).requests))
    assert pending_seen > 200 and not eager._pending
    assert lazy.views() == eager.views() and not lazy._pending
