"""LoRA adapters: PEFT directories, the registry, random adapters, and the `hf` engine's
mixed-adapter batches with adapters loaded and unloaded at runtime (CaraServe §2.2)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyserve.proto import AdapterInfo, SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineError, EngineRequest  # noqa: E402
from polyserve.worker.lora import AdapterError, AdapterRegistry, check_name, main, read_adapter  # noqa: E402

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ directories and registry (no torch)
def _fake_adapter(path, rank=4, **extra):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
           "base_model_name_or_path": "random-llama", **extra}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    (path / "adapter_model.safetensors").write_bytes(b"x")
    return path


def test_read_adapter_reports_rank_and_rejects_what_is_not_an_adapter(tmp_path):
    spec = read_adapter(_fake_adapter(tmp_path / "a", rank=16))
    assert spec.rank == 16 and spec.alpha == 32 and spec.target_modules == ("q_proj", "v_proj")
    with pytest.raises(AdapterError, match="no adapter_config.json") as err:
        read_adapter(tmp_path / "missing")
    assert err.value.status == 404
    with pytest.raises(AdapterError, match="positive integer"):
        read_adapter(_fake_adapter(tmp_path / "b", rank=0))
    with pytest.raises(AdapterError, match="not LoRA"):
        read_adapter(_fake_adapter(tmp_path / "c", peft_type="IA3"))


def test_registry_lists_ranks_and_names_loaded_adapters_when_one_is_unknown(tmp_path):
    reg = AdapterRegistry()
    assert reg.add("sql", read_adapter(_fake_adapter(tmp_path / "s", rank=8))) == AdapterInfo(name="sql", rank=8)
    reg.add("chat", read_adapter(_fake_adapter(tmp_path / "c", rank=64)))
    assert reg.infos() == [AdapterInfo(name="chat", rank=64), AdapterInfo(name="sql", rank=8)]
    assert "sql" in reg and reg.rank("chat") == 64
    assert "loaded adapters: chat, sql" in reg.unknown_message("nope")
    with pytest.raises(AdapterError) as err:
        reg.remove("nope")
    assert err.value.status == 404
    for bad in ("__base__", "", "a/b", "x" * 65):
        with pytest.raises(AdapterError):
            check_name(bad)


# ------------------------------------------------------------------ random adapters and the engine
_torch_missing = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft")),
    reason="the hf engine's libraries (torch, transformers, peft) are not installed")


def needs_torch(test):
    """A test that builds torch models (marked `torch`); skipped without torch, transformers, peft."""
    return pytest.mark.torch(_torch_missing(test))


def _engine(**kw):
    from polyserve.worker.engines.hf import HfEngine
    base = dict(model="tiny-random", model_path="", device="cpu", dtype="float32", max_waiting=32, max_batch=16,
                kv_capacity_tokens=1 << 16, max_input_len=512)
    return HfEngine(types.SimpleNamespace(**{**base, **kw}))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    from polyserve.worker.lora import create_random_adapter
    root = tmp_path_factory.mktemp("adapters")
    return {"r4": create_random_adapter("random", 4, root / "r4", seed=1),
            "r16": create_random_adapter("random", 16, root / "r16", seed=2),
            "late": create_random_adapter("random", 8, root / "late", seed=3)}


@needs_torch
def test_create_random_adapter_writes_a_peft_adapter_with_nonzero_b(adapter_dirs):
    from safetensors.torch import load_file
    spec = read_adapter(adapter_dirs["r16"])
    assert spec.rank == 16 and set(spec.target_modules) == {"q_proj", "v_proj"}
    weights = load_file(str(adapter_dirs["r16"] / "adapter_model.safetensors"))
    b = [t for k, t in weights.items() if k.endswith("lora_B.weight")]
    assert len(b) == 4 and all(t.abs().sum() > 0 and t.shape[1] == 16 for t in b)  # 2 layers x (q, v)


@needs_torch
def test_cli_creates_an_adapter(tmp_path, capsys):
    assert main(["create", "--base", "random", "--rank", "2", "--out", str(tmp_path / "cli"), "--seed", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == 2
    assert read_adapter(tmp_path / "cli").rank == 2
    assert main(["--base", str(tmp_path), "--rank", "2", "--out", str(tmp_path / "x")]) == 2


async def _run(engine, rid, prompt, adapter=None, max_tokens=24) -> str:
    text = ""
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), adapter=adapter)
    async for ev in engine.generate(req):
        if isinstance(ev, Delta):
            text += ev.text
    return text


@pytest.fixture(scope="module")
async def lora_engine(adapter_dirs):
    eng = _engine()
    await eng.start()
    assert await eng.load_adapter("r4", str(adapter_dirs["r4"]), wait=True) == AdapterInfo(name="r4", rank=4)
    await eng.load_adapter("r16", str(adapter_dirs["r16"]), wait=True)
    yield eng
    await eng.stop()


MIX = [("a cat sat", "r4"), ("a cat sat", "r16"), ("a cat sat", None), ("on the mat " * 4, "r4"),
       ("the end", None), ("the end", "r16")]


@needs_torch
async def test_mixed_batch_of_two_adapters_and_base_equals_each_alone(lora_engine):
    eng = lora_engine
    assert eng.load().adapters == [AdapterInfo(name="r16", rank=16), AdapterInfo(name="r4", rank=4)]
    alone = [await _run(eng, f"alone{i}", p, a) for i, (p, a) in enumerate(MIX)]
    assert len({alone[0], alone[1], alone[2]}) == 3, "each adapter must change the output vs base"
    assert alone[4] != alone[5]
    together = await asyncio.gather(*[_run(eng, f"mix{i}", p, a) for i, (p, a) in enumerate(MIX)])
    assert list(together) == alone


@needs_torch
async def test_adapter_loaded_at_runtime_serves_the_next_request_and_unloads(lora_engine, adapter_dirs):
    eng = lora_engine
    with pytest.raises(EngineError) as err:
        await eng.generate(EngineRequest("u", "hi", SamplingParams(), adapter="late")).__anext__()
    assert err.value.status == 404 and "late" in str(err.value) and "r16, r4" in str(err.value)
    base = await _run(eng, "b", "runtime load")
    info = await eng.load_adapter("late", str(adapter_dirs["late"]))  # host copy now, device copy in background
    assert info.name == "late" and info.rank == 8 and info.tier in ("host", "loading", "gpu")
    assert "late" in {a.name for a in eng.load().adapters}
    tuned = await _run(eng, "l", "runtime load", adapter="late")
    assert tuned != base
    with pytest.raises(EngineError) as err:
        await eng.load_adapter("late", str(adapter_dirs["late"]))
    assert err.value.status == 409

    started = asyncio.Event()

    async def long_one():
        req = EngineRequest("busy", "x", SamplingParams(max_tokens=3000, temperature=0), adapter="late")
        reasons = []
        async for ev in eng.generate(req):
            started.set()
            if isinstance(ev, Delta) and ev.finish_reason:
                reasons.append(ev.finish_reason)
        return reasons

    task = asyncio.create_task(long_one())
    await asyncio.wait_for(started.wait(), 20)
    with pytest.raises(EngineError) as err:
        await eng.unload_adapter("late")
    assert err.value.status == 409
    await eng.unload_adapter("late", force=True)
    assert await asyncio.wait_for(task, 10) == ["cancelled"]
    assert "late" not in {a.name for a in eng.load().adapters}
    assert await _run(eng, "b2", "runtime load") == base
    with pytest.raises(EngineError) as err:
        await eng.load_adapter("bad", "/nonexistent/adapter")
    assert err.value.status == 404


@needs_torch
async def test_unloading_every_adapter_restores_the_base_model(adapter_dirs):
    eng = _engine(model="m", max_batch=4, kv_capacity_tokens=4096, max_input_len=256, max_waiting=4)
    await eng.start()
    try:
        base = await _run(eng, "b", "plain")
        await eng.load_adapter("r4", str(adapter_dirs["r4"]))
        assert await _run(eng, "a", "plain", adapter="r4") != base
        assert await _run(eng, "b1", "plain") == base
        await eng.unload_adapter("r4")
        assert eng.load().adapters == [] and eng._batch.lora is False
        assert await _run(eng, "b2", "plain") == base
    finally:
        await eng.stop()
