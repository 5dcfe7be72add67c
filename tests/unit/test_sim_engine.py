"""The sim engine and the worker's pure policy: batching, stops, lengths, cancel,
overload, limits, and iteration times that follow Aladdin's models (simulated
time is read from the engine, so nothing here depends on wall-clock luck)."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from polyserve.core import perf as core_perf
from polyserve.core import queue_order as policy
from polyserve.proto import SamplingParams
from polyserve.worker.config import WorkerSettings
from polyserve.worker.engine import Delta, EngineError, EngineOverloaded, EngineRequest, Finished
from polyserve.worker.engines import make_engine
from polyserve.worker.engines.sim import DEFAULT_PROFILE, SimEngine, SimProfile, load_profile

pytestmark = pytest.mark.unit

PERF = core_perf.PerfModel(k1=1.0, c1=10.0, k2=0.5, c2=2.0, c3=5.0)


def profile(median: int = 100_000, sigma: float = 0.0, kv: int = 1_000_000) -> SimProfile:
    """A small hand-made profile; a huge median means max_tokens decides the length."""
    return SimProfile(perf=PERF, kv_capacity_tokens=kv, median_output_tokens=median, output_log_sigma=sigma,
                      label="test")


@contextlib.asynccontextmanager
async def engine(prof: SimProfile | None = None, **kw):
    kw.setdefault("time_scale", 0.0)
    e = SimEngine(prof or profile(), **kw)
    await e.start()
    try:
        yield e
    finally:
        await e.stop()


def req(rid: str = "r", prompt: str = "one two three four five six seven eight nine ten", **params):
    params.setdefault("seed", 7)
    return EngineRequest(request_id=rid, prompt=prompt, params=SamplingParams(**params))


async def collect(stream) -> tuple[dict[int, str], dict[int, str], dict[int, int], Finished]:
    """Text, finish reason and token count per choice, and the Finished event."""
    text: dict[int, str] = {}
    reasons: dict[int, str] = {}
    tokens: dict[int, int] = {}
    async for ev in stream:
        if isinstance(ev, Delta):
            assert ev.index not in reasons, "no delta after a choice's finish"
            text[ev.index] = text.get(ev.index, "") + ev.text
            tokens[ev.index] = tokens.get(ev.index, 0) + ev.tokens
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
        else:
            return text, reasons, tokens, ev
    raise AssertionError("stream ended without Finished")


async def test_max_tokens_ends_with_length_and_seed_is_deterministic():
    async with engine() as e:
        text, reasons, tokens, fin = await collect(e.generate(req("a", max_tokens=12)))
        again, *_ = await collect(e.generate(req("b", max_tokens=12)))
        other, *_ = await collect(e.generate(req("c", max_tokens=12, seed=8)))
    assert reasons == {0: "length"} and tokens == {0: 12}
    assert len(text[0].split()) == 12
    assert again == text and other != text
    assert fin.stats.output_tokens == 12 and fin.stats.input_tokens == 13  # ceil(10 words × 1.3)


async def test_natural_length_ends_with_stop_and_respects_min_tokens():
    async with engine(profile(median=5, sigma=0.0)) as e:
        _, reasons, tokens, _ = await collect(e.generate(req("a", max_tokens=50)))
        _, reasons2, tokens2, _ = await collect(e.generate(req("b", max_tokens=50, min_tokens=9)))
    assert reasons == {0: "stop"} and tokens == {0: 5}
    assert reasons2 == {0: "stop"} and tokens2 == {0: 9}


async def test_stop_string_ends_generation_exactly():
    async with engine() as e:
        full, *_ = await collect(e.generate(req("a", max_tokens=30)))
        full = full[0]
        # a stop string that spans a token boundary, starting mid-way through the text
        start = full.index(" ", len(full) // 2) - 2
        stop = full[start:start + 5]
        expected = full[:full.index(stop)]
        text, reasons, tokens, fin = await collect(e.generate(req("b", max_tokens=30, stop=["zzz", stop])))
    assert text[0] == expected
    assert reasons == {0: "stop"}
    assert tokens[0] < 30 and fin.stats.output_tokens == tokens[0]
    async with engine() as e:  # include_stop_str_in_output: the same text, the stop string kept at its end
        kept, reasons, *_ = await collect(e.generate(req("c", max_tokens=30, stop=["zzz", stop], include_stop=True)))
    assert kept[0] == expected + stop and reasons == {0: "stop"}


async def test_truncate_prompt_tokens_counts_the_prompts_last_tokens_only():
    async with engine() as e:
        *_, whole = await collect(e.generate(req("w", max_tokens=2)))
        *_, cut = await collect(e.generate(req("t", max_tokens=2, truncate_prompt_tokens=4)))
        *_, over = await collect(e.generate(req("o", prompt="w " * (e.max_input_len + 9), max_tokens=2,
                                                truncate_prompt_tokens=-1)))
    assert whole.stats.input_tokens > 4 and cut.stats.input_tokens == 4
    assert over.stats.input_tokens == e.max_input_len  # -1: the worker's limit, where it was a 400


async def test_n_choices_are_independent_and_batched_together():
    async with engine() as e:
        text, reasons, tokens, fin = await collect(e.generate(req("a", max_tokens=6, n=3)))
        decode_sizes = {it.size for it in e.iterations if it.kind == "decode"}
    assert set(text) == {0, 1, 2} and len(set(text.values())) == 3
    assert reasons == {0: "length", 1: "length", 2: "length"} and tokens == {0: 6, 1: 6, 2: 6}
    assert fin.stats.output_tokens == 18
    assert decode_sizes == {3}


async def test_cancel_frees_the_slot_and_kv_and_ends_cancelled():
    async with engine(max_batch=1) as e:
        a = e.generate(req("a", max_tokens=100_000))
        b = e.generate(req("b", max_tokens=5))
        first = await a.__anext__()
        assert isinstance(first, Delta)
        demand_a = core_perf.kv_demand(PERF, 13, 100_000)
        assert e.load().running == 1 and e.load().waiting == 1 and e.load().kv_used == demand_a
        assert e.cancel("a") is True
        assert e.load().running == 0 and e.load().kv_used == 0
        _, reasons, _, fin = await collect(a)
        assert reasons == {0: "cancelled"} and fin.stats.output_tokens >= 1
        assert e.cancel("a") is False
        _, reasons_b, tokens_b, _ = await collect(b)  # b gets the slot
        assert reasons_b == {0: "length"} and tokens_b == {0: 5}
        assert e.load().kv_used == 0 and e.open_requests() == []


async def test_cancel_of_a_waiting_request():
    async with engine(max_batch=1) as e:
        a = e.generate(req("a", max_tokens=100_000))
        b = e.generate(req("b", max_tokens=5))
        await a.__anext__()
        assert e.load().waiting == 1
        assert e.cancel("b") and e.load().waiting == 0 and e.load().running == 1
        _, reasons, tokens, fin = await collect(b)
        assert reasons == {0: "cancelled"} and tokens == {0: 0} and fin.stats.output_tokens == 0
        e.cancel("a")


async def test_full_queue_raises_overloaded():
    async with engine(max_batch=1, max_waiting=2) as e:
        e.generate(req("a"))
        e.generate(req("b"))
        with pytest.raises(EngineOverloaded, match="queue is full") as err:
            e.generate(req("c"))
        assert err.value.status == 429
        e.cancel("a"), e.cancel("b")


async def test_input_and_kv_limits_are_400():
    async with engine(profile(kv=100), max_input_len=10) as e:
        with pytest.raises(EngineError, match="max_input_len=10") as err:
            e.generate(req("a", prompt="word " * 20))
        assert err.value.status == 400
        with pytest.raises(EngineError, match="KV") as err:
            e.generate(req("b", prompt="a b", max_tokens=200))
        assert err.value.status == 400
        with pytest.raises(EngineError, match="n=99") as err:
            e.generate(req("c", prompt="a b", max_tokens=2, n=99))
        assert err.value.status == 400
        with pytest.raises(EngineError, match="in flight") as err:
            e.generate(req("d", prompt="a b", max_tokens=50))
            e.generate(req("d", prompt="a b", max_tokens=50))
        assert err.value.status == 409
        e.cancel("d")


async def test_kv_budget_holds_a_request_back_until_capacity_frees():
    # each request reserves 13 input + 10 output = 23 KV tokens; 30 fit one at a time
    async with engine(profile(kv=30)) as e:
        a = e.generate(req("a", max_tokens=10))
        b = e.generate(req("b", max_tokens=10))
        await a.__anext__()
        assert e.load().running == 1 and e.load().waiting == 1 and e.load().kv_used == 23
        await collect(a)
        await collect(b)
        prefills = [it for it in e.iterations if it.kind == "prefill"]
    assert [p.size for p in prefills] == [13, 13]


async def test_iteration_times_follow_aladdin_models():
    async with engine() as e:
        await collect(e.generate(req("a", max_tokens=4)))
        its = list(e.iterations)
        total = e.sim_time_ms
    # prefill of 13 tokens samples token 1; decode steps 2..4 have context 14, 15, 16
    assert [(it.kind, it.size) for it in its] == [("prefill", 13), ("decode", 1), ("decode", 1), ("decode", 1)]
    expected = [1.0 * 13 + 10.0] + [(0.5 * l + 2.0) * 1 + 5.0 for l in (14, 15, 16)]
    assert [it.ms for it in its] == pytest.approx(expected)
    assert total == pytest.approx(sum(expected))


async def test_requests_arriving_together_share_prefill_and_decode():
    async with engine() as e:
        a = e.generate(req("a", max_tokens=3))
        b = e.generate(req("b", prompt="x y", max_tokens=3))  # 3 tokens
        await asyncio.gather(collect(a), collect(b))
        its = [(it.kind, it.size, it.l_avg) for it in e.iterations]
    assert its[0] == ("prefill", 16, 0.0)
    assert its[1] == ("decode", 2, pytest.approx((14 + 4) / 2))


async def test_time_scale_paces_the_stream_by_simulated_time():
    async with engine(time_scale=0.2) as e:
        t0 = time.monotonic()
        _, _, _, fin = await collect(e.generate(req("a", max_tokens=4)))
        wall_ms = (time.monotonic() - t0) * 1e3
        sim_ms = e.sim_time_ms
    assert wall_ms >= 0.9 * 0.2 * sim_ms  # sleeping is a lower bound, never flaky
    assert fin.stats.ttft_ms >= 0.9 * 0.2 * 23.0


async def test_engine_stop_fails_open_streams_and_refuses_new_work():
    e = SimEngine(profile(), time_scale=0)
    await e.start()
    a = e.generate(req("a", max_tokens=100_000))
    await a.__anext__()
    await e.stop()
    with pytest.raises(EngineError, match="stopped"):
        async for _ in a:
            pass
    with pytest.raises(EngineError, match="not running") as err:
        e.generate(req("b"))
    assert err.value.status == 503


async def test_consumer_closing_the_stream_frees_its_slot():
    async with engine() as e:
        a = e.generate(req("a", max_tokens=100_000))
        await a.__anext__()
        await a.aclose()
        assert e.load().running == 0 and e.load().kv_used == 0 and e.open_requests() == []


def test_tokens_profile_card_and_factory():
    prof = load_profile()
    e = SimEngine(prof)
    assert e.count_tokens("a b c") == 4 and e.count_tokens("") == 0
    assert e.model_card()["simulated"] is True and e.model_card()["profile"] == "sim-llama2-70b-h100-tp4"
    assert e.kv_capacity == prof.kv_capacity_tokens > 0 and DEFAULT_PROFILE.exists()
    s = WorkerSettings(engine="sim", kv_capacity_tokens=1234, time_scale=0.0)
    made = make_engine(s)
    assert isinstance(made, SimEngine) and made.kv_capacity == 1234 and made.simulated
    with pytest.raises(EngineError, match="cannot read sim profile"):
        load_profile("/nonexistent/profile.json")
    with pytest.raises(EngineError, match="vllm"):
        make_engine(WorkerSettings(engine="vllm"))


def test_policy_admission_is_head_of_line_and_orders_are_pure():
    class C:
        def __init__(self, seqs, kv, arrival=0.0, priority=0):
            self.seqs, self.kv_demand, self.arrival, self.priority = seqs, kv, arrival, priority

    cands = [C(1, 10), C(2, 10), C(1, 1)]
    assert policy.admit_count(cands, running_seqs=0, kv_used=0, max_batch=8, kv_capacity=100) == 3
    assert policy.admit_count(cands, running_seqs=6, kv_used=0, max_batch=8, kv_capacity=100) == 1
    assert policy.admit_count(cands, running_seqs=0, kv_used=85, max_batch=8, kv_capacity=100) == 1
    a, b, c = C(1, 1, arrival=3.0), C(1, 1, arrival=1.0, priority=5), C(1, 1, arrival=2.0)
    assert policy.fcfs([a, b, c]) == [b, c, a]
    assert policy.priority_fcfs([a, b, c]) == [c, a, b]
    assert policy.find_stop("hello world", ["wor", "lo"]) == 3
    assert core_perf.decode_ms(PERF, 10.0, 0) == 0.0 and core_perf.prefill_ms(PERF, 0) == 0.0
    assert core_perf.kv_demand(PERF, 10, 5, n=2) == 30


async def test_ssjf_refine_pauses_a_long_request_for_a_short_one_and_resumes_it_without_a_prefill(monkeypatch):
    """scheduling ssjf_refine, batch of 1: a short request arriving behind a long one that has run
    past its quantum takes the slot; the long one keeps its KV and goes on where it stopped."""
    monkeypatch.setattr(policy, "REFINE_RULE", policy.SizeRule(estimator=policy.RemainingEstimator()))
    prompt = "one two three four five six seven eight nine ten"  # 13 tokens
    async with engine(max_batch=1, order=policy.ORDERS["ssjf_refine"]) as e:
        long = e.generate(EngineRequest("long", prompt, SamplingParams(max_tokens=400, seed=7),
                                        predicted_tokens=400, length_class=3))
        got = 0
        while got < 20:  # past the 16-step quantum
            ev = await long.__anext__()
            got += ev.tokens
        short = e.generate(EngineRequest("short", prompt, SamplingParams(max_tokens=3, seed=7),
                                         predicted_tokens=3, length_class=0))
        done: list[str] = []

        async def run(name, stream):
            out = await collect(stream)
            done.append(name)
            return out

        (_, _, long_tokens, _), (_, _, short_tokens, _) = await asyncio.gather(run("long", long), run("short", short))
        prefills = [it.size for it in e.iterations if it.kind == "prefill"]
        assert e.load().kv_used == 0 and e.load().running == 0
    assert done == ["short", "long"]
    assert long_tokens[0] + got == 400 and short_tokens[0] == 3
    assert prefills == [13, 13]  # the long request was not prefilled again
    assert policy.REFINE_RULE.estimator.samples(None) == 2  # both completions taught the estimator


async def test_ssjf_refine_does_not_pause_without_a_waiting_request_or_a_full_batch(monkeypatch):
    monkeypatch.setattr(policy, "REFINE_RULE", policy.SizeRule(estimator=policy.RemainingEstimator()))
    async with engine(max_batch=2, order=policy.ORDERS["ssjf_refine"]) as e:
        a = e.generate(req("a", max_tokens=60))
        b = e.generate(req("b", max_tokens=3))
        await asyncio.gather(collect(a), collect(b))
        assert [it.size for it in e.iterations if it.kind == "prefill"] == [26]
    assert policy.Preemptor().quantum == policy.PREEMPT_QUANTUM


def test_ssjf_refine_is_a_worker_setting_for_the_sim_engine():
    e = make_engine(WorkerSettings(engine="sim", scheduling="ssjf_refine"))
    assert e.order is policy.ORDERS["ssjf_refine"] and e.preemptor is not None
    assert make_engine(WorkerSettings(engine="sim", scheduling="ssjf")).preemptor is None


async def test_ssjf_refine_orders_a_queue_by_what_each_client_sent_before(monkeypatch):
    """The live rule keeps its length tables per client too (EngineRequest.tenant, from the API
    key): two requests alike in every other way (same class, same prediction) queue behind a
    running one; the one of the client whose requests ran short is sized short and starts
    first. Without client tables the two are sized alike."""
    est = policy.RemainingEstimator(min_samples=4, by_client=True)
    monkeypatch.setattr(policy, "REFINE_RULE", policy.SizeRule(estimator=est))

    def ask(rid, tenant, max_tokens):
        return EngineRequest(rid, "one two three", SamplingParams(max_tokens=max_tokens, seed=7),
                             predicted_tokens=50, length_class=1, tenant=tenant)

    async with engine(max_batch=1, order=policy.ORDERS["ssjf_refine"]) as e:
        for i in range(40):  # history: tenant "slow" ran 120 tokens, "quick" 4 (tables rebuild every 32)
            await collect(e.generate(ask(f"s{i}", "slow", 120)))
            await collect(e.generate(ask(f"q{i}", "quick", 4)))
        slow, quick = ask("slow", "slow", 120), ask("quick", "quick", 4)
        assert est.remaining(1, 50, 0, "slow") > 1.5 * est.remaining(1, 50, 0, "quick")  # shrunk towards the pool
        pooled = policy.SizeRule(estimator=est)
        est.by_client = False  # the same history without client tables: one size for both
        assert pooled.size(slow) == pooled.size(quick)
        est.by_client = True
        first = e.generate(ask("first", "", 40))
        await first.__anext__()  # running: the next two queue behind it, "slow" first
        started: list[str] = []  # by first token: which queued request got the slot first

        async def run(name, stream):
            async for ev in stream:
                if isinstance(ev, Delta) and name not in started:
                    started.append(name)

        await asyncio.gather(run("first", first), run("slow", e.generate(slow)), run("quick", e.generate(quick)))
    assert started[1:] == ["quick", "slow"]
