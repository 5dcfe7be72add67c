"""CaraServe §4 in the `hf` engine: a request for an adapter that is not on the device runs its
prefill (and decode steps until the copy lands) with the LoRA delta computed on the CPU from
the host copy; greedy outputs equal the on-demand path's and the already-cached path's.
Also: adapter tiers (device / host / disk), eviction by the cache policy, prefetch.

On this CPU-only machine the "device" is the CPU too and the device copy is a clone, but the
code path is the one CUDA takes; a gate holds the copy so the CPU-assisted path is exercised
deterministically (`_copy_gate`)."""
from __future__ import annotations

import asyncio
import os
import threading
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineError, EngineRequest, Finished  # noqa: E402
from polyserve.worker.engines import hf_batch  # noqa: E402
from polyserve.worker.engines.hf import HfEngine  # noqa: E402
from polyserve.worker.engines.hf_lora import cold_start_for  # noqa: E402
from polyserve.worker.lora import create_random_adapter  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds torch models


def _engine(**kw) -> HfEngine:
    base = dict(model="tiny-random", model_path="", device="cpu", dtype="float32", max_waiting=32, max_batch=16,
                kv_capacity_tokens=1 << 16, max_input_len=512)
    return HfEngine(types.SimpleNamespace(**{**base, **kw}))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cold")
    return {f"a{i}": create_random_adapter("random", r, root / f"a{i}", seed=10 + i, targets=targets)
            for i, (r, targets) in enumerate([(8, ("q_proj", "v_proj")), (16, ("q_proj", "k_proj", "o_proj")),
                                              (4, ("v_proj",)), (8, ("q_proj",))])}


@pytest.fixture
def token_ids(monkeypatch):
    """Every sampled token id per (request id, choice), recorded as rows accept them."""
    ids: dict[tuple[str, int], list[int]] = {}
    accept = hf_batch.Row.accept

    def recording(row, token):
        ids.setdefault((row.owner.req.request_id, row.index), []).append(token)
        return accept(row, token)
    monkeypatch.setattr(hf_batch.Row, "accept", recording)
    return ids


async def _run(eng, rid, prompt, adapter=None, max_tokens=24, on_delta=None) -> str:
    text = ""
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), adapter=adapter)
    async for ev in eng.generate(req):
        if isinstance(ev, Delta):
            text += ev.text
            if on_delta:
                on_delta(ev)
        else:
            assert isinstance(ev, Finished)
    return text


def _tier(eng, name):
    return {a.name: a.tier for a in eng.load().adapters}[name]


async def _adapter_work_done(eng) -> None:
    """Until the engine loop has taken the adapter work that is due (noted demand, copies to start
    or install) and finished that pass: `due()` clears the demand flag and `manage()` then runs
    under the engine lock, so the flag going down and the lock coming free see the pass through."""
    await wait_for(lambda: not eng.loras.demand_seen and not eng.loras.pending(), 5, what="adapter work taken")
    async with eng._lock:
        pass


def _count_admission_passes(eng) -> list[int]:
    """Count the engine loop's admission passes (`_admit_waiting`) in the returned one-item list."""
    passes, admit = [0], eng._admit_waiting

    async def counting():
        await admit()
        passes[0] += 1
    eng._admit_waiting = counting
    return passes


PROMPT = "the adapter changes what comes next " * 3


async def test_cpu_assisted_equals_on_demand_equals_cached(adapter_dirs, token_ids):
    eng = _engine()
    await eng.start()
    try:
        await eng.load_adapter("a1", str(adapter_dirs["a1"]), wait=True)
        assert _tier(eng, "a1") == "gpu"
        base = await _run(eng, "base", PROMPT)
        cached = await _run(eng, "cached", PROMPT, "a1")
        assert cached != base and token_ids[("cached", 0)] != token_ids[("base", 0)], "the LoRA delta must matter"

        # on_demand: the request waits (no token) until the held copy is released
        await eng.demote_adapter("a1")
        assert _tier(eng, "a1") == "host" and eng.cache.tier("a1") == "host"
        eng.cold_start, eng._copy_gate = "on_demand", threading.Event()
        passes = _count_admission_passes(eng)
        task = asyncio.create_task(_run(eng, "ondemand", PROMPT, "a1"))
        await wait_for(lambda: _tier(eng, "a1") == "loading", 5, what="copy started")
        await wait_for(lambda: eng.load().waiting == 1, 5, what="the request queued")
        seen = passes[0]  # the engine must look at the queued request and leave it waiting
        await wait_for(lambda: passes[0] > seen, 5, what="an admission pass while the copy is held")
        assert eng.load().waiting == 1 and ("ondemand", 0) not in token_ids
        del eng._admit_waiting  # the engine's own method again
        eng._copy_gate.set()
        assert await asyncio.wait_for(task, 30) == cached
        assert token_ids[("ondemand", 0)] == token_ids[("cached", 0)]
        assert eng.lora_stats["cpu_assisted_requests"] == 0 and _tier(eng, "a1") == "gpu"

        # cpu_assisted: tokens flow while the copy is held; the switch to the device copy happens mid-request
        await eng.demote_adapter("a1")
        eng.cold_start, eng._copy_gate = "cpu_assisted", threading.Event()
        steps0 = eng._batch.cpu_steps
        got: list[int] = []
        seen = asyncio.Event()

        def count(ev):
            got.append(ev.tokens)
            if len(got) == 6:
                seen.set()
        task = asyncio.create_task(_run(eng, "assisted", PROMPT, "a1", max_tokens=64, on_delta=count))
        await asyncio.wait_for(seen.wait(), 30)
        assert _tier(eng, "a1") == "loading" and "a1" in eng._batch.cpu_lora
        assisted_steps = eng._batch.cpu_steps - steps0
        assert assisted_steps >= 6  # prefill + decode steps, all with the CPU delta
        eng._copy_gate.set()
        text = await asyncio.wait_for(task, 30)
        assert eng._batch.cpu_steps - steps0 < 64, "later steps must run on the device copy"
        assert _tier(eng, "a1") == "gpu" and "a1" not in eng._batch.cpu_lora
        assert eng.lora_stats["cpu_assisted_requests"] == 1
        long_cached = await _run(eng, "cached64", PROMPT, "a1", max_tokens=64)
        assert text == long_cached
        assert token_ids[("assisted", 0)] == token_ids[("cached64", 0)]
        assert token_ids[("assisted", 0)][:24] == token_ids[("cached", 0)]
    finally:
        await eng.stop()


async def test_cpu_assisted_rows_share_a_batch_with_device_adapters_and_base(adapter_dirs, token_ids):
    eng = _engine()
    await eng.start()
    try:
        for name in ("a0", "a1"):
            await eng.load_adapter(name, str(adapter_dirs[name]), wait=True)
        mix = [("p0", "hello there " * 3, "a0"), ("p1", "a short one", None), ("p2", "mixed rows " * 4, "a1"),
               ("p3", "a short one", "a1")]
        alone = {rid: await _run(eng, f"alone-{rid}", p, a) for rid, p, a in mix}
        await eng.demote_adapter("a1")  # a1 cold, held on the host: its two rows run CPU-assisted
        eng._copy_gate = threading.Event()
        together = await asyncio.gather(*[_run(eng, rid, p, a) for rid, p, a in mix])
        assert "a1" in eng._batch.cpu_lora and eng._batch.cpu_steps > 0
        assert dict(zip([m[0] for m in mix], together)) == alone
        for rid, _, _ in mix:
            assert token_ids[(rid, 0)] == token_ids[(f"alone-{rid}", 0)]
        eng._copy_gate.set()
        await wait_for(lambda: _tier(eng, "a1") == "gpu", 10, what="a1 lands")
    finally:
        await eng.stop()


async def test_tiers_evict_by_score_and_disk_adapters_come_back(adapter_dirs):
    eng = _engine(lora_device_slots=2, lora_host_slots=3)
    await eng.start()
    try:
        for name in ("a0", "a1"):
            await eng.load_adapter(name, str(adapter_dirs[name]), wait=True)
        await eng.load_adapter("a2", str(adapter_dirs["a2"]))  # device full: stays on the host
        await _adapter_work_done(eng)
        assert [(a.name, a.tier) for a in eng.load().adapters] == [("a0", "gpu"), ("a1", "gpu"), ("a2", "host")]
        hot = await _run(eng, "hot1", "x", "a0", max_tokens=2)
        await _run(eng, "hot2", "x", "a0", max_tokens=2)
        # a2 is requested: the coldest device adapter (a1, never used) goes back to the host
        cold = await _run(eng, "cold", "y", "a2", max_tokens=4)
        await wait_for(lambda: _tier(eng, "a2") == "gpu", 10, what="a2 promoted")
        assert _tier(eng, "a0") == "gpu" and _tier(eng, "a1") == "host" and eng.lora_stats["evictions"] == 1
        # a fourth adapter fills the host tier past 3: the host-only one (a1) drops to disk
        await eng.load_adapter("a3", str(adapter_dirs["a3"]))
        assert _tier(eng, "a1") == "disk" and eng._loras["a1"].host is None
        assert eng.lora_stats["host_evictions"] == 1
        # a request for the disk adapter reads it back (disk -> host -> device) and is served
        eng.cold_start = "on_demand"
        again = await asyncio.wait_for(_run(eng, "back", "y", "a1", max_tokens=4), 30)
        assert _tier(eng, "a1") == "gpu" and again
        assert await _run(eng, "cold2", "y", "a2", max_tokens=4) == cold
        assert await _run(eng, "hot3", "x", "a0", max_tokens=2) == hot
        assert sum(a.tier == "gpu" for a in eng.load().adapters) <= 2
        await eng.unload_adapter("a1")
        assert "a1" not in eng.cache and "a1" not in {a.name for a in eng.load().adapters}
    finally:
        await eng.stop()


async def test_prefetch_moves_an_adapter_whose_rate_rises(adapter_dirs):
    eng = _engine(lora_device_slots=1, lora_short_window_s=1.0, lora_long_window_s=30.0,
                  lora_prefetch_min_rate=2.0)
    await eng.start()
    try:
        await eng.load_adapter("a0", str(adapter_dirs["a0"]), wait=True)
        await eng.load_adapter("a2", str(adapter_dirs["a2"]))
        assert _tier(eng, "a2") == "host"
        eng.note_demand("a2")  # one request's worth: 1 req/s in the short window, below min_rate 2
        await _adapter_work_done(eng)  # the prefetch pass that demand triggers has run
        assert _tier(eng, "a2") == "host" and eng.lora_stats["prefetches"] == 0
        for _ in range(3):  # a burst: the short-window rate rises over 2/s and over 2x the long-window rate
            eng.note_demand("a2")
        await wait_for(lambda: _tier(eng, "a2") == "gpu", 10, what="a2 prefetched")
        assert eng.lora_stats["prefetches"] == 1 and _tier(eng, "a0") == "host"
        with pytest.raises(EngineError) as err:
            eng.note_demand("nope")
        assert err.value.status == 404
    finally:
        await eng.stop()


async def test_an_adapter_that_does_not_fit_the_model_is_a_400_and_leaves_nothing(adapter_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dirs["a0"], bad)
    weights = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("lora_B.weight"))
    weights[key] = weights[key][:-1].contiguous()  # one output row short
    save_file(weights, str(bad / "adapter_model.safetensors"))
    eng = _engine()
    await eng.start()
    try:
        with pytest.raises(EngineError, match="do not fit") as err:
            await eng.load_adapter("bad", str(bad))
        assert err.value.status == 400
        assert eng.load().adapters == [] and "bad" not in eng.cache and eng.max_adapters == 8
    finally:
        await eng.stop()


async def test_auto_cold_start_is_on_demand_on_cuda_and_cpu_assisted_on_the_cpu():
    torch = pytest.importorskip("torch")
    assert cold_start_for("auto", torch.device("cuda")) == "on_demand"  # only named: nothing runs on it
    assert cold_start_for("auto", torch.device("cpu")) == "cpu_assisted"
    assert cold_start_for("cpu_assisted", torch.device("cuda")) == "cpu_assisted"  # a setting is kept
    eng = _engine()  # the default setting, resolved when the engine knows its device
    assert eng.cold_start == "auto"
    await eng.start()
    try:
        assert eng.cold_start == "cpu_assisted"
    finally:
        await eng.stop()


def test_bad_cold_start_and_cache_settings_are_clear_errors():
    with pytest.raises(EngineError, match="lora_cold_start 'eager' is unknown"):
        _engine(lora_cold_start="eager")
    with pytest.raises(EngineError, match="host_slots >= device_slots"):
        _engine(lora_device_slots=4, lora_host_slots=2)
