"""Serving precision of the proxy encoder (fp32 / bf16 / int8) and quantisation-aware phase 2."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from polyserve.predictor.config import PredictorSettings  # noqa: E402
from polyserve.predictor.proxy import artifact, encoder, infer, train  # noqa: E402
from polyserve.predictor.proxy import model as M  # noqa: E402
from polyserve.predictor.proxy.infer import ProxyPredictor  # noqa: E402
from polyserve.shared.settings import SettingsError, load  # noqa: E402
from tests.unit.test_proxy_train import tiny_dataset  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds torch models


def test_auto_precision_follows_the_artifact_and_the_cpu(monkeypatch):
    meta = artifact.read_meta(artifact.default_dir("minilm"))
    monkeypatch.setattr(M, "bf16_fast", lambda: True)
    assert infer.resolve_precision(meta, None) == "bf16" and infer.resolve_precision(meta, "auto") == "bf16"
    monkeypatch.setattr(M, "bf16_fast", lambda: False)
    assert infer.resolve_precision(meta, "auto") == "fp32"
    meta.precision = "int8"  # a head fitted on int8 features is served with the int8 encoder
    assert infer.resolve_precision(meta, "auto") == "int8"
    assert infer.resolve_precision(meta, "fp32") == "fp32"  # an explicit choice wins
    with pytest.raises(ValueError, match="precision 'fp8'"):
        infer.resolve_precision(meta, "fp8")
    with pytest.raises(ValueError, match="fp16"):
        M.to_precision(torch.nn.Linear(2, 2), "fp16")


def test_precision_setting_is_checked():
    assert load(PredictorSettings, "predictor", environ={}).proxy_precision == "auto"
    s = load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_PROXY_PRECISION": "bf16"})
    assert s.proxy_precision == "bf16"
    with pytest.raises(SettingsError, match="proxy_precision"):
        load(PredictorSettings, "predictor", environ={}, proxy_precision="half")


def test_phase2_on_the_quantised_encoder_is_recorded_and_served(tmp_path):
    """Quantisation-aware phase 2: the head is fitted on the int8 encoder's features; the artifact
    says so and is served with the int8 encoder by default, with answers close to the fp32 encoder's."""
    cfg = train.TrainConfig(pooling="mean", max_length=32, lora_rank=2, batch_size=8, phase1_epochs=1,
                            phase2_epochs=2, threads=1, progress=False, phase2_precision="int8")
    meta = train.train(tiny_dataset(), cfg, tmp_path / "a")
    assert meta.precision == "int8" and artifact.read_meta(tmp_path / "a").precision == "int8"

    served = ProxyPredictor.load(tmp_path / "a")  # auto: as fitted
    assert served.precision == "int8"
    assert any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in served.encoder.modules())
    full = ProxyPredictor.load(tmp_path / "a", precision="fp32")
    assert full.precision == "fp32"
    prompts = ["write a detailed essay about rivers", "answer yes or no: is 3 even", "hello"]
    a8, k8 = served.predict(prompts, ["alpha"] * 3)
    _, k32 = full.predict(prompts, ["alpha"] * 3)
    assert all(0 <= a.length_class < 5 for a in a8)
    # the quantised encoder's vectors are near the float ones (cache keys: cosine; 0.90 for "hello")
    assert float((k8 * k32).sum(1).min()) > 0.8

    # phase 2 encodes with the served encoder: the fp16-rounded adapter merged, then quantised
    _, _, lora = artifact.load(tmp_path / "a")
    enc_dir = str(encoder.resolve_encoder_dir())
    q = train.served_encoder(object(), enc_dir, cfg, lora)
    assert any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in q.modules())
    plain = object()
    assert train.served_encoder(plain, enc_dir, train.TrainConfig(), lora) is plain  # fp32: the trained one

    with pytest.raises(ValueError, match="phase2_precision"):
        train.TrainConfig(phase2_precision="fp16").validate()


@pytest.mark.skipif(not M.bf16_fast(), reason="this CPU has no native bfloat16 (AMX / AVX512-BF16)")
def test_bf16_encoder_answers_like_fp32():
    """The shipped artifact in bf16: same cache-key space, keys within rounding, values within 0.1 class."""
    enc_dir = encoder.resolve_encoder_dir()
    assert enc_dir.is_dir()
    bf = ProxyPredictor.load(artifact.default_dir("minilm"), precision="bf16")
    fp = ProxyPredictor.load(artifact.default_dir("minilm"), precision="fp32")
    assert bf.precision == "bf16" and next(bf.encoder.parameters()).dtype == torch.bfloat16
    assert bf.key_space == fp.key_space
    prompts = ["Write a haiku about autumn leaves.", "Explain quantum entanglement to a ten year old in detail.",
               "def add(a, b): return a + b  # add type hints", "List three prime numbers."]
    models = [bf.meta.models[0]] * len(prompts)
    ab, kb = bf.predict(prompts, models)
    af, kf = fp.predict(prompts, models)
    assert kb.dtype == kf.dtype == "float32" and float((kb * kf).sum(1).min()) > 0.995
    assert max(abs(x.value - y.value) for x, y in zip(ab, af)) < 0.1


def test_bench_prints_what_the_targets_need():
    """`polyserve predictor bench` output: p50/p99 at 32/128/256/512 tokens, pred/s at 16 and 64
    concurrent, the padding gain, and the side-by-side ratio of several precisions."""
    from polyserve.predictor.proxy import bench

    def run(p50: float, rate: float, prec: str) -> dict:
        b1 = [{"prompt_tokens": n, "p50_ms": p50 * n / 32, "p99_ms": 2 * p50} for n in (32, 128, 256, 512)]
        mb = [{"concurrency": c, "predictions_per_s": rate, "p50_ms": 1.0, "p99_ms": 2.0} for c in (1, 16, 64)]
        return {"artifact": "a", "torch_threads": 1, "max_length": 128, "precision": prec, "cache_keys": "tuned",
                "max_batch": 16, "batch_wait_ms": 2.0, "bucket_step": 64, "batch1": b1,
                "batch1_unclipped_512": dict(b1[-1], p50_ms=99.0), "micro_batching_bucketed": mb,
                "micro_batching_pad_to_max": [dict(r, predictions_per_s=rate / 2) for r in mb],
                "cache_lookup": [{"entries": 1000, "p50_ms": 0.02, "p99_ms": 0.04}]}

    gpu = dict(run(4.0, 300.0, "bf16"), device="cuda:0 NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, CUDA 13.0)")
    text = bench.render({"runs": {"fp32": run(8.0, 100.0, "fp32"), "bf16": gpu}})
    assert "encoder bf16 on cuda:0 NVIDIA H100 80GB HBM3" in text and "encoder fp32 on cpu" in text
    assert " 16 concurrent    300.0 predictions/s" in text and " 64 concurrent    100.0 predictions/s" in text
    assert "256 tokens  p50    64.0 ms" in text
    assert "padding gain (bucketed / pad to max, predictions/s): 1 concurrent 2.00x" in text
    assert "bf16: 32 tok 2.00x, 128 tok 2.00x" in text


def test_openmp_threads_sleep_when_idle_unless_configured(monkeypatch):
    """The model thread sets OMP_WAIT_POLICY=PASSIVE before torch loads (not over the user's choice)."""
    import sys

    from polyserve.predictor.proxy.runtime import passive_openmp

    monkeypatch.delitem(sys.modules, "torch")  # as before the first import (restored afterwards)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert passive_openmp() is True and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert passive_openmp() is False and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_device_is_resolved_or_refused_with_what_to_give():
    assert infer.resolve_device(None) == torch.device("cpu") and infer.resolve_device("cpu").type == "cpu"
    for bad in ("tpu", "gpu0", "cuda:x"):
        with pytest.raises(ValueError, match="give cpu, cuda or cuda:N"):
            infer.resolve_device(bad)
    if not torch.cuda.is_available():  # this project's machines: a CUDA device is refused, not crashed on
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            infer.resolve_device("cuda")


def test_on_a_gpu_auto_is_fp32_and_int8_is_refused(monkeypatch):
    meta = artifact.read_meta(artifact.default_dir("minilm"))
    cuda = torch.device("cuda")  # only named: nothing runs on it
    monkeypatch.setattr(M, "bf16_fast", lambda: True)  # the CPU's bf16 says nothing about the GPU
    assert infer.resolve_precision(meta, "auto", cuda) == "fp32"
    assert infer.resolve_precision(meta, "bf16", cuda) == "bf16"
    meta.precision = "int8"
    assert infer.resolve_precision(meta, "auto", cuda) == "fp32"
    with pytest.raises(ValueError, match="CPU only"):
        infer.resolve_precision(meta, "int8", cuda)


def test_proxy_device_setting(monkeypatch):
    assert load(PredictorSettings, "predictor", environ={}).proxy_device == "cpu"
    s = load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_PROXY_DEVICE": "cuda:1"})
    assert s.proxy_device == "cuda:1"
    with pytest.raises(SettingsError, match="proxy_device"):
        load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_PROXY_DEVICE": "gpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without a GPU")
async def test_a_cuda_predictor_without_a_gpu_falls_back_to_the_mean():
    from polyserve.predictor.proxy.runtime import ModelRunner

    runner = ModelRunner(str(artifact.default_dir("minilm")), device="cuda")
    await runner.start()  # fails in the model thread, never raises: the historical mean answers
    assert runner.state == "failed" and "sees no CUDA GPU" in runner.error
    await runner.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_predictor_bench_on_cuda_without_a_gpu_says_so():
    from polyserve.predictor import cli

    with pytest.raises(SystemExit, match="--device: device 'cuda': torch .* sees no CUDA GPU"):
        cli.main(["bench", "--artifact", "minilm", "--device", "cuda"])
