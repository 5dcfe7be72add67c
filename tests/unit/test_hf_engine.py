"""The `hf` engine on CPU with the small random Llama: continuous batching, sampling, limits."""
from __future__ import annotations

import asyncio
import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineError, EngineOverloaded, EngineRequest, Finished  # noqa: E402
from polyserve.worker.engines.hf import HfEngine  # noqa: E402
from polyserve.worker.engines.hf_text import IncrementalDetokenizer, StopMatcher  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds torch models


def settings(**kw):
    base = dict(model="tiny-random", model_path="", device="cpu", dtype="float32", max_waiting=32,
                max_batch=16, kv_capacity_tokens=1 << 20, max_input_len=512)
    base.update(kw)
    return types.SimpleNamespace(**base)


class Result:
    def __init__(self):
        self.text: dict[int, str] = {}
        self.tokens: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}
        self.deltas = 0
        self.stats = None


async def collect(engine, rid, prompt, adapter=None, on_delta=None, priority=0, predicted_tokens=0, length_class=-1,
                  tenant="", **params) -> Result:
    res = Result()
    req = EngineRequest(rid, prompt, SamplingParams(**params), adapter=adapter, priority=priority,
                        predicted_tokens=predicted_tokens, length_class=length_class, tenant=tenant)
    async for ev in engine.generate(req):
        if isinstance(ev, Delta):
            res.deltas += 1
            res.text[ev.index] = res.text.get(ev.index, "") + ev.text
            res.tokens[ev.index] = res.tokens.get(ev.index, 0) + ev.tokens
            if ev.finish_reason:
                res.finish[ev.index] = ev.finish_reason
            if on_delta:
                on_delta(res)
        else:
            assert isinstance(ev, Finished)
            res.stats = ev.stats
    return res


@pytest.fixture(scope="module")
async def engine():
    eng = HfEngine(settings())
    await eng.start()
    yield eng
    await eng.stop()


PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a", "serving models is fun " * 7]


async def test_greedy_alone_equals_inside_a_busy_continuous_batch(engine):
    alone = {p: (await collect(engine, f"alone{i}", p, max_tokens=24 + 8 * i, temperature=0)).text[0]
             for i, p in enumerate(PROMPTS)}
    assert len(set(alone[PROMPTS[0]].split())) > 8, "random model output should be varied"

    joined = asyncio.Event()
    late: list[asyncio.Task] = []
    busy: list[int] = []

    def join_midway(res: Result):
        busy.append(engine.load().running)
        if sum(res.tokens.values()) == 6 and not joined.is_set():  # others join while this one decodes
            joined.set()
            late.extend(asyncio.create_task(collect(engine, f"late{i}", p, max_tokens=24 + 8 * i, temperature=0))
                        for i, p in enumerate(PROMPTS) if i >= 2)

    noise = [asyncio.create_task(collect(engine, f"noise{i}", "noise " * (i + 1), max_tokens=60, temperature=0.9,
                                         top_p=0.9, seed=i, n=1 + i % 2)) for i in range(3)]
    first = await asyncio.gather(collect(engine, "b0", PROMPTS[0], max_tokens=24, temperature=0,
                                         on_delta=join_midway),
                                 collect(engine, "b1", PROMPTS[1], max_tokens=32, temperature=0))
    rest = await asyncio.gather(*late)
    await asyncio.gather(*noise)
    assert max(busy) >= 4, "the request should have shared the batch"
    assert first[0].text[0] == alone[PROMPTS[0]]
    assert first[1].text[0] == alone[PROMPTS[1]]
    for res, p in zip(rest, PROMPTS[2:]):
        assert res.text[0] == alone[p]


async def test_max_tokens_ends_exactly_with_one_delta_per_token(engine):
    res = await collect(engine, "mt", "count the tokens", max_tokens=17, temperature=0)
    assert res.tokens[0] == 17 and res.deltas == 17 and res.finish[0] == "length"
    assert res.stats.output_tokens == 17 and res.stats.input_tokens == engine.count_tokens("count the tokens")
    assert res.stats.ttft_ms > 0 and res.stats.tbt_max_ms >= res.stats.tbt_mean_ms > 0 and res.stats.atgt_ms > 0


async def test_stop_string_ends_generation_exactly_before_it(engine):
    full = (await collect(engine, "s0", "stop here please", max_tokens=40, temperature=0)).text[0]
    words = full.split()
    # a stop string spanning a token boundary: the end of word 5 and the start of word 6
    stop = words[5][-2:] + " " + words[6][:2]
    cut = full.find(stop)
    assert cut > 0
    res = await collect(engine, "s1", "stop here please", max_tokens=40, temperature=0, stop=["zzzzqx", stop])
    assert res.text[0] == full[:cut] and res.finish[0] == "stop"
    assert res.tokens[0] < 40


async def test_seeded_sampling_is_reproducible_and_n_choices_differ(engine):
    kw = dict(max_tokens=20, temperature=1.0, top_p=0.95, top_k=100, seed=7, n=2)
    a = await collect(engine, "n0", "sample me", **kw)
    b, _ = await asyncio.gather(collect(engine, "n1", "sample me", **kw),
                                collect(engine, "n2", "something else entirely", max_tokens=30, temperature=0))
    assert a.text == b.text and set(a.text) == {0, 1}
    assert a.text[0] != a.text[1]
    assert a.finish == {0: "length", 1: "length"} and a.stats.output_tokens == 40


async def test_cancel_frees_slot_and_kv_at_once(engine):
    started = asyncio.Event()
    task = asyncio.create_task(collect(engine, "long", "go on forever", max_tokens=3000, temperature=0.5, n=2,
                                       on_delta=lambda r: started.set() if r.tokens[0] >= 3 else None))
    await asyncio.wait_for(started.wait(), 20)
    load = engine.load()
    assert load.running == 1 and load.kv_used == 2 * (engine.count_tokens("go on forever") + 3000)
    assert len(engine._batch.rows) == 2
    assert engine.cancel("long") is True
    load = engine.load()
    assert load.running == 0 and load.kv_used == 0
    res = await asyncio.wait_for(task, 10)
    assert res.finish == {0: "cancelled", 1: "cancelled"} and res.tokens[0] < 3000
    await wait_for(lambda: engine._batch.kv_columns == 0 and not engine._batch.rows, 5, what="KV freed")
    assert engine.cancel("long") is False


async def test_consumer_going_away_cancels_the_request(engine):
    agen = engine.generate(EngineRequest("gone", "hi", SamplingParams(max_tokens=3000, temperature=0)))
    await agen.__anext__()
    assert engine.load().running == 1
    await agen.aclose()
    assert engine.load().running == 0 and engine.load().kv_used == 0


async def test_admission_errors_raise_on_first_anext(engine):
    with pytest.raises(EngineError, match="max_input_len of 512") as err:
        await engine.generate(EngineRequest("big", "word " * 600, SamplingParams())).__anext__()
    assert err.value.status == 400
    with pytest.raises(EngineError) as err:
        await engine.generate(EngineRequest("ad", "hi", SamplingParams(), adapter="nope")).__anext__()
    assert err.value.status == 404 and "nope" in str(err.value)


async def test_bounded_waiting_queue_overloads():
    eng = HfEngine(settings(max_waiting=1, max_batch=1))
    await eng.start()
    try:
        started = asyncio.Event()
        running = asyncio.create_task(collect(eng, "r", "x", max_tokens=3000, temperature=0,
                                              on_delta=lambda r: started.set()))
        await asyncio.wait_for(started.wait(), 20)
        waiting = asyncio.create_task(collect(eng, "w", "y", max_tokens=2, temperature=0))
        await wait_for(lambda: eng.load().waiting == 1, 5, what="one waiting")
        with pytest.raises(EngineOverloaded) as err:
            await eng.generate(EngineRequest("o", "z", SamplingParams())).__anext__()
        assert err.value.status == 429
        eng.cancel("r")
        assert (await asyncio.wait_for(waiting, 20)).finish[0] == "length"
        await running
    finally:
        await eng.stop()


async def test_kv_budget_bounds_admission_and_queue_order_is_pluggable():
    eng = HfEngine(settings(kv_capacity_tokens=120, max_batch=8), order=lambda r: -r.priority)
    await eng.start()
    try:
        with pytest.raises(EngineError, match="kv_capacity_tokens of 120") as err:
            await eng.generate(EngineRequest("huge", "x", SamplingParams(max_tokens=200))).__anext__()
        assert err.value.status == 400
        started = asyncio.Event()
        first = asyncio.create_task(collect(eng, "a", "x", max_tokens=100, temperature=0,
                                            on_delta=lambda r: started.set()))
        await asyncio.wait_for(started.wait(), 20)
        order: list[str] = []
        low = asyncio.create_task(collect(eng, "low", "y", max_tokens=50, temperature=0, priority=0,
                                          on_delta=lambda r: order.append("low")))
        high = asyncio.create_task(collect(eng, "high", "z", max_tokens=50, temperature=0, priority=5,
                                           on_delta=lambda r: order.append("high")))
        await wait_for(lambda: eng.load().waiting == 2, 5, what="both wait for KV")
        assert eng.load().running == 1 and eng.load().kv_used == 102
        await asyncio.gather(first, low, high)
        assert order[0] == "high"
    finally:
        await eng.stop()


async def test_event_loop_stays_responsive_while_decoding(engine):
    task = asyncio.create_task(collect(engine, "resp", "busy " * 50, max_tokens=200, temperature=0))
    loop = asyncio.get_running_loop()
    lags = []
    while not task.done():
        t = loop.time()
        await asyncio.sleep(0.005)  # the probe itself: how late a 5 ms timer fires while decoding
        lags.append(loop.time() - t - 0.005)
    await task
    assert len(lags) > 5 and sorted(lags)[len(lags) // 2] < 0.05


def test_model_card_says_untrained(engine):
    card = engine.model_card()
    assert card["engine"] == "hf" and card["simulated"] is False and card["untrained"] is True
    assert "random" in card["note"]


# ------------------------------------------------------------------ text helpers
def test_incremental_detokenizer_joins_to_the_decoded_text():
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    tok = fallback_tokenizer()
    prompt = tok.encode("once upon a", add_special_tokens=False)
    ids = tok.encode("time, there's a tokenizer-unfriendly string: unbelievably ##weird!", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt)
    pieces = [det.add(i) for i in ids] + [det.flush()]
    assert "".join(pieces).strip() == tok.decode(ids)


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["END", "xyz"])
    assert m.feed("abc E") == ("abc ", False)  # "E" may start "END"
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("EN", False)  # "EN" can no longer become "END"; "x" may start "xyz"
    m = StopMatcher(["END"])
    assert m.feed("ab") == ("ab", False)
    assert m.feed("cEN") == ("c", False)
    assert m.feed("Dtail") == ("", True) and m.text == "abc"
    m = StopMatcher(["END"])
    assert m.feed("aE") == ("a", False) and m.flush() == "E"
    m = StopMatcher(["END"])
    assert m.feed("aEND", check=False) == ("aEND", False)


def test_min_tokens_suppresses_eos():
    import torch

    from polyserve.worker.engines.hf_batch import Row, sample
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    tok = fallback_tokenizer()
    eos = tok.sep_token_id
    logits = torch.zeros(2, len(tok))
    logits[:, eos] = 10.0
    rows = [Row(None, 0, SamplingParams(temperature=0, min_tokens=3), None, tok, [1], {eos}, 100, torch.device("cpu")),
            Row(None, 0, SamplingParams(temperature=0, min_tokens=0), None, tok, [1], {eos}, 100, torch.device("cpu"))]
    first, second = sample(logits, rows, None)
    assert first != eos and second == eos
    assert rows[1].accept(second).finish_reason == "stop"


async def test_serves_a_local_checkpoint_directory(tmp_path):
    from polyserve.worker.engines.hf_model import save_random_checkpoint
    ckpt = save_random_checkpoint(tmp_path / "ckpt", seed=0)
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer_config.json").is_file()
    eng = HfEngine(settings(model="", model_path=str(ckpt)))
    await eng.start()
    try:
        card = eng.model_card()
        assert card["source"] == str(ckpt) and card["chat_template"] and "untrained" not in card
        assert eng.model_name == "ckpt"
        prompt = eng.format_chat([{"role": "user", "content": "hi"}])
        assert prompt == "user: hi\nassistant:"
        ids = eng._bundle.encode("hi there")
        assert ids[0] == eng._bundle.tokenizer.cls_token_id and ids[-1] != eng._bundle.tokenizer.sep_token_id
        res = await collect(eng, "c", prompt, max_tokens=12, temperature=0)
        assert res.tokens[0] == 12 or res.finish[0] == "stop"
    finally:
        await eng.stop()


# ------------------------------------------------------------------ KV layouts
LAYOUT_WORK = [("a", 40), ("the quick brown fox jumps over the lazy dog " * 6, 12), ("serving models " * 3, 30),
               ("x y z", 20), ("tokens " * 20, 25)]


async def _layout_run(layout: str) -> tuple[int, int, list[tuple[int, int]]]:
    """LAYOUT_WORK (plus one request joining midway) on a `layout` engine: (KV cells attended by decode
    steps, cells a ragged layout needs exactly, [(KV width, longest live row) after every reap])."""
    eng = HfEngine(settings(kv_layout=layout))
    await eng.start()
    try:
        assert eng._batch.layout == layout
        batch, reap = eng._batch, eng._batch.reap
        seen: list[tuple[int, int]] = []

        def checked_reap():  # in the step thread, right after rows leave
            dropped = reap()
            if batch.rows:
                seen.append((batch.kv_columns, max(r.pos for r in batch.rows)))
            return dropped
        batch.reap = checked_reap
        late: list[asyncio.Task] = []

        def join(res: Result):  # a row joins while others decode; the long prompt leaves first
            if sum(res.tokens.values()) == 5 and not late:
                late.append(asyncio.create_task(collect(eng, f"{layout[0]}late", "late " * 9, max_tokens=15,
                                                        temperature=0)))
        res = await asyncio.gather(*(collect(eng, f"{layout[0]}{i}", p, max_tokens=m, temperature=0,
                                             on_delta=join if i == 0 else None)
                                     for i, (p, m) in enumerate(LAYOUT_WORK)))
        res.append(await late[0])
        prompts = [p for p, _ in LAYOUT_WORK] + ["late " * 9]
        # decode step t of a row attends over its prompt + t tokens (the first token came from prefill)
        exact = sum(sum(eng.count_tokens(p) + t for t in range(1, r.tokens[0])) for p, r in zip(prompts, res))
        return batch.cells, exact, seen
    finally:
        await eng.stop()


async def test_ragged_and_padded_kv_give_the_same_greedy_tokens_and_ragged_attends_no_padding(monkeypatch):
    from polyserve.worker.engines import hf_batch
    ids: dict[tuple[str, str], list[int]] = {}
    accept = hf_batch.Row.accept

    def recording(row, token):
        rid = row.owner.req.request_id
        ids.setdefault((rid[:1], rid[1:]), []).append(token)
        return accept(row, token)
    monkeypatch.setattr(hf_batch.Row, "accept", recording)
    padded, _, padded_widths = await _layout_run("padded")
    ragged, exact, ragged_widths = await _layout_run("ragged")
    for seen in (padded_widths, ragged_widths):
        assert seen and all(w == longest for w, longest in seen), "KV width must be the longest live row's"
    assert ragged == exact, "the ragged layout attends over each row's own tokens only"
    assert ragged < 0.9 * padded, (ragged, padded)
    assert {k[1] for k in ids if k[0] == "p"} == {k[1] for k in ids if k[0] == "r"} and len(ids) == 12
    for (lay, rid), tokens in ids.items():
        if lay == "p":
            assert tokens == ids[("r", rid)], f"request {rid}: greedy tokens differ between KV layouts"


async def test_unknown_kv_layout_is_a_clear_error():
    with pytest.raises(EngineError, match="kv_layout 'paged' is unknown"):
        HfEngine(settings(kv_layout="paged"))


def test_ssjf_refine_is_offered_and_unknown_orders_are_refused():
    assert HfEngine(types.SimpleNamespace(scheduling="ssjf_refine")).preemptor is not None
    assert HfEngine(types.SimpleNamespace(scheduling="ssjf")).preemptor is None
    with pytest.raises(EngineError, match="is unknown; choose one of .*ssjf_class, ssjf_refine") as err:
        HfEngine(types.SimpleNamespace(scheduling="lifo"))
    assert err.value.status == 400


def test_ssjf_orders_the_queue_at_each_admission_and_an_overtaken_request_goes_first(monkeypatch):
    """scheduling ssjf (no pauses): the queue is ordered by `queue_order.speculative_sjf` on the queued
    entries, not by a static key, so a long request overtaken past the overtake bound (more than
    ⌈ε × the completions of the last P99 JCT⌉ completions beyond where FCFS would have started it,
    from GUARD_MIN completions on) goes ahead of shorter later arrivals."""
    import time

    from polyserve.core import queue_order as policy
    from polyserve.worker.engines.hf import _Active
    rule = policy.SizeRule(tail_guard=policy.TAIL_GUARD, overtake_bound=policy.OVERTAKE_BOUND)  # the live settings
    monkeypatch.setattr(policy, "DEFAULT_RULE", rule)
    eng = HfEngine(settings(scheduling="ssjf"))
    assert eng.preemptor is None
    for k in range(40):  # recent sizes 10..400 tokens: 5,000 ranks last, 5 first
        rule.key(types.SimpleNamespace(request_id=f"seen{k}", arrival=-200.0 + k, priority=0,
                                       predicted_tokens=10 * (k + 1)))
    for _ in range(policy.GUARD_MIN - 1):
        rule.observe(10.0)  # now: time.monotonic(), the clock of `arrival`
    now = time.monotonic()

    def queued(rid: str, waited: float, tokens: int, seq: int) -> _Active:
        req = EngineRequest(rid, "p", SamplingParams(max_tokens=tokens), predicted_tokens=tokens, arrival=now - waited)
        return _Active(req, [1, 2], seq, 0)
    def order() -> list[str]:
        return [a.req.request_id for a in eng._ordered()]
    eng._waiting = [queued("short1", 3.0, 5, 1), queued("long", 15.0, 5000, 0), queued("short2", 2.0, 5, 2)]
    assert order() == ["short1", "short2", "long"]  # not before GUARD_MIN completions: by size (and noted)
    for _ in range(10):
        rule.observe(10.0)
    # 59 completions: "long" was due at 49 (first by arrival), the bound is ⌈0.15 × 59⌉ = 9
    assert order() == ["long", "short1", "short2"]
    eng.set_order(policy.ORDER_KEYS["ssjf"])  # a static key replaces the order: no promotion
    assert order() == ["short1", "short2", "long"]


# ------------------------------------------------------------------ ssjf_refine: pause keeping the KV
LONG = dict(max_tokens=64, temperature=0, predicted_tokens=64, length_class=3)
SHORT = dict(max_tokens=3, temperature=0, predicted_tokens=3, length_class=0)


def _fresh_rule(monkeypatch):
    """A fresh live rule (no window, no length tables from other runs): before any completion its
    sizes are the predictions and W is WINDOW_S."""
    from polyserve.core import queue_order as policy
    rule = policy.SizeRule(estimator=policy.RemainingEstimator(by_client=True))
    monkeypatch.setattr(policy, "REFINE_RULE", rule)
    return rule


@pytest.fixture
def fresh_refine_rule(monkeypatch):
    return _fresh_rule(monkeypatch)


def _count(eng, name: str) -> list[int]:
    """Count calls of the engine batch's method `name` (they run in the step thread)."""
    calls = [0]
    method = getattr(eng._batch, name)

    def counted(*args):
        calls[0] += 1
        return method(*args)
    setattr(eng._batch, name, counted)
    return calls


async def _overtake(eng, longs: dict[str, tuple[str, dict]]) -> tuple[list[str], list[tuple[int, int, int]]]:
    """The `longs` ({id: (prompt, params)}) fill the batch; once the first has run past the
    Preemptor's quantum a short request arrives. Returns the order they finished in and, at each
    delta of the short one, the engine's (running, waiting, kv_used)."""
    done: list[str] = []
    seen: list[tuple[int, int, int]] = []
    going = asyncio.Event()

    async def run(rid, prompt, on_delta=None, **kw):
        res = await collect(eng, rid, prompt, on_delta=on_delta, **kw)
        done.append(rid)
        return res

    def past_quantum(res: Result):
        if res.tokens[0] >= 20:
            going.set()
    tasks = [asyncio.create_task(run(rid, prompt, past_quantum if i == 0 else None, **kw))
             for i, (rid, (prompt, kw)) in enumerate(longs.items())]
    await asyncio.wait_for(going.wait(), 20)
    assert eng.load().running == len(longs) and eng.load().waiting == 0
    await asyncio.gather(run("short", "quick one", lambda res: seen.append(astuple(eng.load())), **SHORT), *tasks)
    return done, seen


def astuple(load) -> tuple[int, int, int]:
    return load.running, load.waiting, load.kv_used


@pytest.mark.parametrize("layout", ["ragged", "padded"])
async def test_ssjf_refine_pauses_keeping_kv_and_the_greedy_output_is_unchanged(layout, monkeypatch):
    """Batch of 2: a short request arriving behind a long one and a neighbour (a longer prompt, so
    padded, the long one's rows are left-padded) takes the long one's row; the long one leaves the
    batch with its KV, resumes next to the neighbour with no prefill, and the greedy tokens of both
    are exactly those of the same requests run alone; the KV reservations stay exact throughout."""
    from polyserve.worker.engines import hf_batch
    ids: dict[str, list[int]] = {}
    accept = hf_batch.Row.accept

    def recording(row, token):
        ids.setdefault(row.owner.req.request_id, []).append(token)
        return accept(row, token)
    monkeypatch.setattr(hf_batch.Row, "accept", recording)
    longs = {"long": ("tell me a long story", {**LONG, "tenant": "acme"}),  # predicted longer: the one paused
             "neighbour": ("the quick brown fox jumps over the lazy dog " * 3, {**LONG, "predicted_tokens": 16,
                                                                                "length_class": 1})}
    eng = HfEngine(settings(max_batch=2, scheduling="ssjf_refine", kv_layout=layout))
    await eng.start()
    try:
        assert eng._batch.layout == layout
        _fresh_rule(monkeypatch)  # the process's own rule is left as it was
        for rid, (prompt, kw) in longs.items():
            await collect(eng, f"alone-{rid}", prompt, **kw)
        rule = _fresh_rule(monkeypatch)  # after the runs alone, which moved W
        pauses, resumes, prefills = _count(eng, "pause"), _count(eng, "resume"), _count(eng, "prefill")
        done, seen = await _overtake(eng, longs)
        assert done[0] == "short" and pauses == resumes == [1]
        assert prefills == [3], "the paused request must not be prefilled again"
        for rid in longs:
            assert ids[rid] == ids[f"alone-{rid}"] and len(ids[rid]) == 64, f"{rid}: greedy tokens changed"
        kv = {rid: eng.count_tokens(prompt) + kw["max_tokens"] for rid, (prompt, kw) in longs.items()}
        # while the short one runs, the long one is paused (waiting) and keeps its reservation
        assert seen[0] == (2, 1, kv["long"] + kv["neighbour"] + eng.count_tokens("quick one") + 3), seen
        assert astuple(eng.load()) == (0, 0, 0) and not eng._batch.rows
        est = rule.estimator  # completions teach the tables, the client's too
        assert est.samples(None) == 3 and est.samples(("client", "acme")) == 1 and est.samples(("class", 0)) == 1
    finally:
        await eng.stop()


@pytest.mark.parametrize("scheduling", ["fcfs", "ssjf_refine"])
async def test_a_short_request_behind_a_full_batch_of_long_ones_finishes_first_only_under_ssjf_refine(
        scheduling, fresh_refine_rule):
    eng = HfEngine(settings(max_batch=2, scheduling=scheduling))
    await eng.start()
    try:
        done, _ = await _overtake(eng, {f"long{i}": (f"tell me a long story number {i}", LONG) for i in range(2)})
        assert eng.load().kv_used == 0 and eng.load().running == eng.load().waiting == 0
    finally:
        await eng.stop()
    if scheduling == "ssjf_refine":
        assert done[0] == "short"
    else:
        assert done.index("short") > 0


async def test_a_paused_request_cancelled_frees_its_kv_and_is_not_withdrawn(fresh_refine_rule):
    eng = HfEngine(settings(max_batch=1, scheduling="ssjf_refine"))
    await eng.start()
    try:
        started = asyncio.Event()
        long = asyncio.create_task(collect(eng, "long", "tell me a long story", on_delta=lambda r: started.set()
                                           if r.tokens[0] >= 20 else None, **{**LONG, "max_tokens": 200}))
        await asyncio.wait_for(started.wait(), 20)
        long_kv, short_kv = eng.count_tokens("tell me a long story") + 200, eng.count_tokens("quick one") + 10
        seen: list = []

        def at_first_token(res: Result):  # the short request took the row: the long one is paused now
            if not seen:
                seen.append((eng._known["long"].paused is not None, eng.load().kv_used, eng.withdraw("long"),
                             eng.cancel("long"), astuple(eng.load())))
        await collect(eng, "short", "quick one", on_delta=at_first_token, **{**SHORT, "max_tokens": 10})
        # paused with its reservation; not given back (it has streamed output); cancelled, its KV is freed
        assert seen == [(True, long_kv + short_kv, False, True, (1, 0, short_kv))]
        res = await asyncio.wait_for(long, 10)
        assert res.finish == {0: "cancelled"} and 20 <= res.tokens[0] < 200
        assert astuple(eng.load()) == (0, 0, 0) and not eng._batch.rows
    finally:
        await eng.stop()


def test_special_tokens_stay_in_the_text_when_asked():
    """skip_special_tokens (vLLM's): the default drops them from the text, False keeps them."""
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    from polyserve.worker.engines.hf_text import IncrementalDetokenizer
    tok = fallback_tokenizer()
    words = [tok.encode(w, add_special_tokens=False) for w in ("hello", "world")]
    ids = words[0] + [tok.sep_token_id] + words[1]
    for skip, want in ((True, "hello world"), (False, "hello [SEP] world")):
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(d.add(t) for t in ids) + d.flush() == want
