"""CONTRACT tests of the `vllm` engine adapter against a FAKE of vLLM's API (tests/fakes/fake_vllm.py).

vLLM cannot be installed here, so these tests check that the adapter speaks vLLM's
API shape (pinned: TARGET_VLLM_VERSION; the fake's shapes are checked against the release's
sources by tests/unit/test_vllm_surface.py) and maps it onto polyserve's Engine
contract: streaming deltas, n choices, finish reasons, cancellation -> abort, LoRARequest
per request, priority scheduling, load for heartbeats, and clear errors. They say nothing
about vLLM on a GPU; the adapter is untested on a GPU in this project so far.
"""
from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

from polyserve.proto import AdapterInfo, SamplingParams
from polyserve.worker.engine import Delta, EngineError, EngineOverloaded, EngineRequest, Finished, Withdrawn
from polyserve.worker.engines import make_engine
from polyserve.worker.engines.vllm_engine import TARGET_VLLM_VERSION, VllmEngine
from tests.fakes import fake_vllm
from tests.helpers import wait_for

pytestmark = pytest.mark.unit

ALL_FLAVORS = ["v1", "v1-async-tokenizer", "v0"]  # 0.33.0, 0.11-era V1, pre-V1


def settings(**kw):
    base = dict(engine="vllm", model="test-model", model_path="", max_waiting=8, max_batch=16,
                kv_capacity_tokens=0, max_input_len=4096, scheduling="fcfs", dtype="float32", device="cpu")
    base.update(kw)
    return types.SimpleNamespace(**base)


class Result:
    def __init__(self):
        self.text: dict[int, str] = {}
        self.tokens: dict[int, int] = {}
        self.finish: dict[int, str] = {}
        self.events: list = []
        self.stats = None


async def collect(engine, rid, prompt="hello", adapter=None, priority=0, **params) -> Result:
    res = Result()
    async for ev in engine.generate(EngineRequest(rid, prompt, SamplingParams(**params), adapter=adapter,
                                                  priority=priority)):
        res.events.append(ev)
        if isinstance(ev, Delta):
            assert ev.index not in res.finish, f"choice {ev.index} got a delta after its finish"
            res.text[ev.index] = res.text.get(ev.index, "") + ev.text
            res.tokens[ev.index] = res.tokens.get(ev.index, 0) + ev.tokens
            if ev.finish_reason:
                res.finish[ev.index] = ev.finish_reason
        else:
            assert isinstance(ev, Finished)
            res.stats = ev.stats
    assert isinstance(res.events[-1], Finished), "Finished must be the last event"
    assert sum(isinstance(e, Finished) for e in res.events) == 1
    return res


@pytest.fixture
async def build(monkeypatch):
    """build(flavor, **settings) -> (started VllmEngine, FakeVllm); engines are stopped at teardown."""
    engines: list[VllmEngine] = []

    async def _build(flavor="v1", **kw):
        fake = fake_vllm.install(monkeypatch, flavor)
        engine = VllmEngine(settings(**kw))
        await engine.start()
        engines.append(engine)
        return engine, fake

    yield _build
    for engine in engines:
        await engine.stop()


def adapter_dir(tmp_path, name, rank):
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": rank, "peft_type": "LORA",
                                                          "target_modules": ["q_proj", "v_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


# --------------------------------------------------------------------- streaming
@pytest.mark.parametrize("flavor", ALL_FLAVORS)
async def test_contract_streaming_deltas_rebuild_the_text_exactly(build, flavor):
    engine, fake = await build(flavor)
    res = await collect(engine, "r1", "hi there", max_tokens=200, stop=["xyz"], temperature=0)
    call = fake.engine.calls[0]
    if flavor == "v0":  # no RequestOutputKind: cumulative outputs, diffed per choice
        assert not hasattr(call["params"], "output_kind") or \
            call["params"].output_kind == fake_vllm.RequestOutputKind.CUMULATIVE
    else:
        assert call["params"].output_kind == fake_vllm.RequestOutputKind.DELTA
    assert call["prompt"] == {"prompt_token_ids": [ord(c) for c in "hi there"]}
    expected = "choice0:abcdefghijklmnopqrstuvw"  # cut before the stop string, as vLLM does
    assert res.text == {0: expected} and res.finish == {0: "stop"}
    assert res.tokens == {0: len(expected) + 3}  # the stop string's tokens were generated
    assert len([e for e in res.events if isinstance(e, Delta)]) > 10, "streams token by token"
    assert res.stats.input_tokens == len("hi there") and res.stats.output_tokens == len(expected) + 3
    assert engine.load().running == engine.load().waiting == 0


@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_contract_n_choices_are_keyed_by_index(build, flavor):
    engine, _ = await build(flavor)
    res = await collect(engine, "n3", n=3, max_tokens=9)
    assert res.text == {i: f"choice{i}:a" for i in range(3)}
    assert res.finish == {i: "length" for i in range(3)}
    assert res.tokens == {i: 9 for i in range(3)} and res.stats.output_tokens == 27


async def test_contract_n_over_max_batch_is_400(build):
    engine, fake = await build(max_batch=2)
    with pytest.raises(EngineError) as err:
        await collect(engine, "big-n", n=3)
    assert err.value.status == 400 and not fake.engine.calls


# --------------------------------------------------------------------- finish reasons
async def test_contract_finish_reasons_are_mapped(build):
    engine, fake = await build()
    assert (await collect(engine, "len", max_tokens=4)).finish == {0: "length"}
    fake.engine.script = lambda ids, i, lora: "ok"
    eos = await collect(engine, "eos", max_tokens=50)
    assert eos.text == {0: "ok"} and eos.finish == {0: "stop"} and eos.tokens == {0: 3}  # EOS counted, not shown
    fake.engine.script = fake_vllm.default_script
    fake.engine.inject["aborted"] = "abort"  # vLLM aborted it (e.g. its own shutdown)
    assert (await collect(engine, "aborted", n=2)).finish == {0: "cancelled", 1: "cancelled"}
    fake.engine.inject["broken"] = "error"
    with pytest.raises(EngineError) as err:
        await collect(engine, "broken")
    assert err.value.status == 500


async def test_contract_min_tokens_holds_off_eos(build):
    engine, fake = await build()
    fake.engine.script = lambda ids, i, lora: "ok"
    res = await collect(engine, "min", min_tokens=6, max_tokens=50)
    assert fake.engine.calls[0]["params"].min_tokens == 6
    assert res.tokens[0] == 7 and res.finish[0] == "stop"


# --------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_contract_cancel_calls_abort_and_ends_cancelled(build, flavor):
    engine, fake = await build(flavor)
    fake.engine.step_delay = 0.01
    stream = engine.generate(EngineRequest("c1", "hello", SamplingParams(n=2, max_tokens=500)))
    events = [await stream.__anext__()]
    assert engine.load().running == 1
    assert engine.cancel("c1") is True
    async for ev in stream:
        events.append(ev)
    tail = [e for e in events if isinstance(e, Delta) and e.finish_reason]
    assert sorted((e.index, e.finish_reason) for e in tail) == [(0, "cancelled"), (1, "cancelled")]
    assert isinstance(events[-1], Finished)
    await wait_for(lambda: "c1" in fake.engine.aborted and "c1" not in fake.engine.live, timeout=2,
                   what="vLLM abort")
    assert engine.cancel("c1") is False
    load = engine.load()
    assert load.running == load.waiting == load.kv_used == 0


async def test_contract_consumer_going_away_aborts_in_vllm(build):
    engine, fake = await build()
    fake.engine.step_delay = 0.01
    stream = engine.generate(EngineRequest("gone", "hello", SamplingParams(max_tokens=500)))
    await stream.__anext__()
    await stream.aclose()
    await wait_for(lambda: "gone" in fake.engine.aborted, timeout=2, what="vLLM abort")
    assert engine.load().running == 0


async def test_contract_withdraw_gives_back_only_a_request_without_output(build):
    """Aladdin Alg. 2 moves: a request with no token yet is aborted in vLLM and its stream ends
    with Withdrawn; one that has produced output stays."""
    engine, fake = await build()
    fake.engine.step_delay = 0.01
    started = engine.generate(EngineRequest("s", "hello", SamplingParams(max_tokens=500)))
    await started.__anext__()
    assert engine.withdraw("s") is False
    fake.engine.gate = asyncio.Event()  # later requests wait inside "vLLM"
    queued = engine.generate(EngineRequest("q", "hello", SamplingParams(max_tokens=5)))
    first = asyncio.ensure_future(queued.__anext__())
    await wait_for(lambda: engine.load().waiting == 1, timeout=2, what="q waiting in vLLM")
    assert engine.load().waiting == 1
    assert engine.withdraw("q") is True
    with pytest.raises(Withdrawn):
        await first
    await wait_for(lambda: "q" in fake.engine.aborted, timeout=2, what="vLLM abort of the withdrawn request")
    assert engine.load().waiting == 0 and engine.withdraw("unknown") is False
    engine.cancel("s")
    await started.aclose()


# --------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_contract_lora_request_per_request_with_stable_ids_and_ranks(build, tmp_path, flavor):
    engine, fake = await build(flavor, max_lora_rank=16)
    assert fake.engine.engine_args.enable_lora is True and fake.engine.engine_args.max_lora_rank == 16
    path_a, path_b = adapter_dir(tmp_path, "a", 8), adapter_dir(tmp_path, "b", 16)
    assert await engine.load_adapter("a", str(path_a)) == AdapterInfo(name="a", rank=8)
    assert engine.has_adapter("a") and not engine.has_adapter("b")
    await engine.load_adapter("b", str(path_b))
    assert engine.load().adapters == [AdapterInfo(name="a", rank=8), AdapterInfo(name="b", rank=16)]

    results = await asyncio.gather(collect(engine, "ra1", adapter="a", max_tokens=20),
                                   collect(engine, "ra2", adapter="a", max_tokens=20),
                                   collect(engine, "rb", adapter="b", max_tokens=20),
                                   collect(engine, "base", max_tokens=20))
    assert [r.text[0][:3] for r in results] == ["[a]", "[a]", "[b]", "cho"]
    loras = {c["request_id"]: c["lora_request"] for c in fake.engine.calls}
    assert loras["base"] is None
    assert (loras["ra1"].lora_name, loras["ra1"].lora_path) == ("a", str(path_a))
    assert loras["ra1"].lora_int_id == loras["ra2"].lora_int_id != loras["rb"].lora_int_id
    id_a = loras["ra1"].lora_int_id
    assert id_a >= 1 and fake.engine.loras[id_a].lora_name == "a"  # loaded up front with add_lora

    await engine.unload_adapter("a")
    assert fake.engine.removed_loras == [id_a] and engine.load().adapters == [AdapterInfo(name="b", rank=16)]
    await engine.load_adapter("a", str(path_a))  # the same name keeps its id
    await collect(engine, "ra3", adapter="a", max_tokens=3)
    assert fake.engine.calls[-1]["lora_request"].lora_int_id == id_a


async def test_contract_adapter_errors(build, tmp_path):
    engine, fake = await build(max_lora_rank=8)
    with pytest.raises(EngineError) as err:
        await collect(engine, "unknown", adapter="nope")
    assert err.value.status == 404 and "nope" in str(err.value) and not fake.engine.calls
    with pytest.raises(EngineError) as err:
        await engine.load_adapter("big", str(adapter_dir(tmp_path, "big", 32)))
    assert err.value.status == 400 and "max_lora_rank" in str(err.value)
    with pytest.raises(EngineError) as err:
        await engine.load_adapter("missing", str(tmp_path / "nothing-here"))
    assert err.value.status == 404
    await engine.load_adapter("a", str(adapter_dir(tmp_path, "a", 4)))
    with pytest.raises(EngineError) as err:
        await engine.load_adapter("a", str(tmp_path / "a"))
    assert err.value.status == 409
    with pytest.raises(EngineError) as err:
        await engine.unload_adapter("nope")
    assert err.value.status == 404


async def test_contract_unload_in_use_is_409_unless_forced(build, tmp_path):
    engine, fake = await build()
    fake.engine.step_delay = 0.01
    await engine.load_adapter("a", str(adapter_dir(tmp_path, "a", 8)))
    stream = engine.generate(EngineRequest("busy", "hi", SamplingParams(max_tokens=500), adapter="a"))
    await stream.__anext__()
    with pytest.raises(EngineError) as err:
        await engine.unload_adapter("a")
    assert err.value.status == 409
    await engine.unload_adapter("a", force=True)
    events = [ev async for ev in stream]
    assert events[-2].finish_reason == "cancelled" and isinstance(events[-1], Finished)


# --------------------------------------------------------------------- priority
@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_contract_priority_scheduling_passes_priority_through(build, flavor):
    engine, fake = await build(flavor, scheduling="priority")
    assert fake.engine.engine_args.scheduling_policy == "priority"
    await collect(engine, "p3", priority=3, max_tokens=2)
    await collect(engine, "pm2", priority=-2, max_tokens=2)
    assert [c["priority"] for c in fake.engine.calls] == [3, -2]  # vLLM: lower value = earlier


@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_contract_fcfs_sends_priority_zero(build, flavor):
    engine, fake = await build(flavor, scheduling="fcfs")
    assert fake.engine.engine_args.scheduling_policy == "fcfs"
    await collect(engine, "p5", priority=5, max_tokens=2)  # V0 would raise on priority 5 under fcfs
    assert fake.engine.calls[0]["priority"] == 0


# --------------------------------------------------------------------- admission and errors
async def test_contract_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ModuleNotFoundError
    with pytest.raises(EngineError) as err:
        VllmEngine(settings())
    msg = str(err.value)
    assert f"vLLM {TARGET_VLLM_VERSION} is not installed" in msg and f"pip install vllm=={TARGET_VLLM_VERSION}" in msg
    with pytest.raises(EngineError) as err:
        make_engine(settings())
    assert "is not installed" in str(err.value)


async def test_contract_over_long_input_is_400_on_first_anext(build):
    engine, fake = await build(max_input_len=10)
    stream = engine.generate(EngineRequest("long", "x" * 11, SamplingParams()))
    with pytest.raises(EngineError) as err:
        await stream.__anext__()
    assert err.value.status == 400 and "max_input_len" in str(err.value) and not fake.engine.calls
    engine2, _ = await build(max_input_len=100_000)
    assert engine2.max_input_len == 2047  # clamped to vLLM's max_model_len - 1


async def test_contract_invalid_sampling_params_are_400(build):
    engine, fake = await build()
    with pytest.raises(EngineError) as err:
        await collect(engine, "bad", top_p=0.0)  # vLLM: top_p must be in (0, 1]
    assert err.value.status == 400 and not fake.engine.calls


async def test_contract_sampling_params_mapping(build):
    engine, fake = await build()
    await collect(engine, "s1", max_tokens=3, temperature=0.5, top_p=0.9, top_k=0, seed=7, stop=["zz"],
                  min_tokens=1)
    await collect(engine, "s2", max_tokens=3, top_k=5)
    p1, p2 = (c["params"] for c in fake.engine.calls)
    assert (p1.n, p1.max_tokens, p1.min_tokens, p1.temperature, p1.top_p, p1.seed, p1.stop) == \
        (1, 3, 1, 0.5, 0.9, 7, ["zz"])
    assert p1.top_k == -1 and p2.top_k == 5  # polyserve 0 = off -> vLLM -1 = off


async def test_contract_waiting_queue_bound_is_429(build):
    engine, fake = await build(max_waiting=2)
    fake.engine.gate = asyncio.Event()  # vLLM produces nothing yet: admitted requests stay waiting
    firsts = []
    for rid in ("w1", "w2"):
        stream = engine.generate(EngineRequest(rid, "hi", SamplingParams(max_tokens=3)))
        firsts.append((stream, asyncio.ensure_future(stream.__anext__())))
    await wait_for(lambda: engine.load().waiting == 2, timeout=2, what="both requests admitted")
    assert (engine.load().running, engine.load().waiting) == (0, 2)
    with pytest.raises(EngineOverloaded) as err:
        await engine.generate(EngineRequest("w3", "hi", SamplingParams())).__anext__()
    assert err.value.status == 429
    fake.engine.gate.set()
    for stream, first in firsts:
        assert isinstance(await first, Delta)
        assert isinstance([ev async for ev in stream][-1], Finished)
    assert (engine.load().running, engine.load().waiting) == (0, 0)


async def test_contract_duplicate_request_id_is_409(build):
    engine, fake = await build()
    fake.engine.gate = asyncio.Event()
    first = engine.generate(EngineRequest("dup", "hi", SamplingParams(max_tokens=2)))
    pending = asyncio.ensure_future(first.__anext__())
    await wait_for(lambda: engine.load().waiting == 1, timeout=2, what="the first 'dup' admitted")
    with pytest.raises(EngineError) as err:
        await engine.generate(EngineRequest("dup", "hi", SamplingParams())).__anext__()
    assert err.value.status == 409
    fake.engine.gate.set()
    await pending
    await first.aclose()


# --------------------------------------------------------------------- load, config, lifecycle
async def test_contract_load_reports_running_and_kv(build):
    engine, fake = await build()
    assert engine.load().kv_capacity == 1000 * 16  # num_gpu_blocks * block_size
    fake.engine.step_delay = 0.01
    stream = engine.generate(EngineRequest("k1", "hello", SamplingParams(n=2, max_tokens=500)))
    await stream.__anext__()
    await wait_for(lambda: engine.load().kv_used >= 2 * 5 + 2, timeout=2, what="kv accounting")
    load = engine.load()
    assert (load.running, load.waiting) == (1, 0) and load.max_input_len == 2047
    engine.cancel("k1")
    await stream.aclose()


async def test_contract_kv_capacity_unknown_is_zero(monkeypatch):
    fake = fake_vllm.install(monkeypatch, "v1")
    original = fake_vllm.FakeAsyncLLM.__init__

    def no_blocks(self, args):
        original(self, args)
        self.vllm_config.cache_config.num_gpu_blocks = None

    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "__init__", no_blocks)
    engine = VllmEngine(settings())
    await engine.start()
    assert engine.load().kv_capacity == 0 and fake.engine is not None
    await engine.stop()


async def test_contract_engine_args_from_settings(build, caplog):
    _, fake = await build(model="served-name", model_path="/models/llama", max_batch=12, dtype="float32",
                               gpu_memory_utilization=0.5, max_model_len=1024,
                               vllm_engine_args={"tensor_parallel_size": 2, "no_such_arg": 1})
    args = fake.engine.engine_args
    assert (args.model, args.served_model_name, args.max_num_seqs, args.dtype) == \
        ("/models/llama", "served-name", 12, "auto")
    assert (args.gpu_memory_utilization, args.max_model_len, args.tensor_parallel_size) == (0.5, 1024, 2)
    assert "no_such_arg" in caplog.text
    _, fake2 = await build(dtype="bfloat16")
    assert fake2.engine.engine_args.dtype == "bfloat16" and fake2.engine.engine_args.model == "test-model"


async def test_contract_start_failure_is_engine_error(monkeypatch):
    fake_vllm.install(monkeypatch, "v1")
    engine = VllmEngine(settings(model_path="/nonexistent/model"))
    with pytest.raises(EngineError) as err:
        await engine.start()
    assert err.value.status == 500 and "/nonexistent/model" in str(err.value)


@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_contract_stop_fails_in_flight_and_shuts_vllm_down(build, flavor):
    engine, fake = await build(flavor)
    fake.engine.step_delay = 0.01
    stream = engine.generate(EngineRequest("s", "hi", SamplingParams(max_tokens=500)))
    await stream.__anext__()
    await engine.stop()
    with pytest.raises(EngineError) as err:
        async for _ in stream:
            pass
    assert err.value.status == 503 and fake.engine.shut_down and "s" in fake.engine.aborted
    with pytest.raises(EngineError):
        await engine.generate(EngineRequest("after", "hi", SamplingParams())).__anext__()


async def test_contract_make_engine_tokens_and_card(monkeypatch):
    from polyserve.worker.config import WorkerSettings

    fake_vllm.install(monkeypatch, "v1")
    engine = make_engine(WorkerSettings(engine="vllm", model="m", scheduling="priority"))
    assert isinstance(engine, VllmEngine) and engine.name == "vllm" and not engine.simulated
    await engine.start()
    assert engine.count_tokens("hello") == 5
    card = engine.model_card()
    assert card["vllm_target_version"] == TARGET_VLLM_VERSION and card["engine"] == "vllm"
    assert card["simulated"] is False and card["kv_capacity_tokens"] == 16000
    assert engine.format_chat([{"role": "user", "content": "hi"}]).endswith("assistant:")
    await engine.stop()


async def test_contract_vllm_queue_overflow_is_its_http_status(build):
    """0.33's admission control (max_num_queued_reqs) raises QueueOverflowError, a GracefulHTTPError
    carrying 503: the client gets that status, not a generic 500."""
    engine, fake = await build(vllm_engine_args={"max_num_queued_reqs": 2})
    fake.engine.gate = asyncio.Event()
    held = engine.generate(EngineRequest("q1", "hi", SamplingParams(n=2, max_tokens=2)))
    first = asyncio.ensure_future(held.__anext__())
    await wait_for(lambda: "q1" in fake.engine.live, timeout=2, what="q1 inside vLLM")
    with pytest.raises(EngineError) as err:
        await collect(engine, "q2", max_tokens=2)
    assert err.value.status == 503 and "busy" in str(err.value)
    fake.engine.gate.set()
    await first
    await held.aclose()


async def test_contract_max_lora_rank_is_rounded_up_to_a_rank_vllm_accepts(build, tmp_path):
    engine, fake = await build(max_lora_rank=48)  # vLLM accepts only 1, 8, 16, 32, 64, ... (MaxLoRARanks)
    assert fake.engine.engine_args.max_lora_rank == 64
    with pytest.raises(EngineError) as err:  # polyserve still enforces the configured 48
        await engine.load_adapter("big", str(adapter_dir(tmp_path, "big", 56)))
    assert err.value.status == 400 and "max_lora_rank of 48" in str(err.value)
