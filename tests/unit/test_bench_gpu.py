"""`polyserve bench gpu`: refuses cleanly without a GPU; its energy arithmetic checked against a
contract fake of pynvml (the real function names and units: mJ for the energy counter, mW for
power), since no GPU runs here."""
from __future__ import annotations

import sys
import time
import types

import pytest

from polyserve.bench import gpu

pytestmark = pytest.mark.unit


def test_no_gpu_is_a_clear_exit_2(monkeypatch, capsys):
    fake = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(RuntimeError("NVML Shared Library Not Found")))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert gpu.main(["energy", "--seconds", "0.1"]) == 2
    assert "no NVIDIA GPU" in capsys.readouterr().out


def contract_nvml(watts: float):
    """pynvml's read API as polyserve uses it: the counter in mJ grows at `watts`, power in mW."""
    t0 = time.monotonic()
    return types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetName=lambda h: "Contract GPU",
        nvmlDeviceGetTotalEnergyConsumption=lambda h: int((time.monotonic() - t0) * watts * 1000),
        nvmlDeviceGetPowerUsage=lambda h: int(watts * 1000),
    )


def test_energy_counter_and_integrated_power_agree_on_a_constant_load(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", contract_nvml(200.0))
    monkeypatch.setattr(gpu, "_burn", lambda seconds, index: time.sleep(seconds))
    res = gpu.energy(types.SimpleNamespace(index=0, seconds=0.3, interval=0.02))
    assert res["device"] == "Contract GPU" and [w["window"] for w in res["windows"]] == ["idle", "load"]
    for w in res["windows"]:
        assert w["samples"] >= 5 and w["counter_j"] == pytest.approx(60, rel=0.2)
        assert w["integrated_over_counter"] == pytest.approx(1.0, rel=0.15)


@pytest.mark.torch
def test_decode_rate_times_one_forward_per_token():
    """The roofline's decode loop (run here on the CPU with the small random Llama): one model call
    per token after the prefill, each fed the previous step's cache."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from polyserve.worker.engines.hf_model import build_random_model

    model = build_random_model(0)
    calls: list[int] = []

    def count(module, args, kwargs):
        calls.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1])

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        rate = gpu.decode_rate(model, torch.ones(1, 5, dtype=torch.long), 6)
    finally:
        hook.remove()
    assert rate > 0 and calls == [5] + [1] * 6


@pytest.mark.torch
def test_static_decode_gives_the_dynamic_caches_tokens():
    """The roofline's static-cache path (whose decode step a GPU replays as a CUDA graph) writes each
    token's KV where its mask and position say: on the CPU in float32 it decodes the very tokens the
    engine's `DynamicCache` loop does."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from polyserve.worker.engines.hf_model import build_random_model

    model = build_random_model(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        out = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        want = []
        for _ in range(13):
            nxt = out.logits[:, -1:].argmax(-1)
            want.append(int(nxt))
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    rate, got = gpu.static_decode(model, ids, 12)
    assert rate > 0 and got[0].tolist() == want[1:]  # the tokens after the prefill's own


def test_a_cuda_engine_keeps_attention_off_cudnn_and_a_cpu_one_leaves_it():
    """cuDNN's attention plans each new KV length on first sight (88 vs 17 ms/token on an H200,
    docs/benchmarks/gpu.md): a CUDA device turns that backend off, a CPU device touches nothing."""
    import torch

    from polyserve.core.torch_cuda import planless_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        planless_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        planless_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
