"""Engine profiling: the fits recover known coefficients, profiles round-trip into the sim
engine, a tiny grid runs against the sim engine, the batching benchmark's feeding modes."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from polyserve.core.perf import PerfModel
from polyserve.profiler import bench_batching, cli, fit
from polyserve.profiler.grid import GridRunner, GridSpec, PromptMaker, rank_mixes
from polyserve.worker.config import WorkerSettings
from polyserve.worker.engines import make_engine
from polyserve.worker.engines.sim import SimEngine, SimProfile, count_words_as_tokens, load_profile
from tests.conftest import DATASETS

pytestmark = pytest.mark.unit

SPLITWISE = DATASETS / "profiles" / "splitwise_llama2_70b_bloom_176b_a100_h100.csv"
TRACE = DATASETS / "traces" / "azure_llm_2023_conv.csv"
# a made-up engine whose decode cost clearly grows with the batch, so a short timed grid can see it
TOY = PerfModel(k1=0.5, c1=5.0, k2=0.01, c2=2.0, c3=5.0)


def synthetic(noise: float = 0.0, seed: int = 0) -> dict:
    """Measurements generated from known coefficients (times in ms)."""
    rng = random.Random(seed)

    def jitter(v: float) -> float:
        return v * (1 + rng.uniform(-noise, noise))

    prefill = [{"n_prompts": n, "l_in_total": n * l, "ms": jitter(0.02 * n * l + 4.0)}
               for n in (1, 2, 4) for l in (32, 128, 512, 1024)]
    decode = [{"b": b, "l_avg": l, "ms": jitter((3e-4 * l + 0.2) * b + 2.5)}
              for b in (1, 2, 4, 8, 16, 32) for l in (72, 520, 1544)]
    kv = [{"seqs": b, "tokens": b * (l + 16), "kv_used": b * (l + 16) + 3 * b} for b in (1, 4, 16) for l in (64, 512)]
    lora = []  # base step 0.25·b + 3 ms; the LoRA share follows BGMV: 0.01·b·max_rank + 0.5 ms with adapters
    for b in (2, 4, 8, 16):
        for mix, ranks in rank_mixes((4, 8, 16, 32), b).items():
            share = 0.01 * b * max(ranks) + 0.5 if max(ranks) else 0.0
            lora.append({"mix": mix, "ranks": ranks, "b": b, "max_rank": max(ranks), "sum_rank": sum(ranks),
                         "l_avg": 136, "ms": jitter(share + 0.25 * b + 3.0)})
    return {"prefill": prefill, "decode": decode, "kv": kv, "lora": lora}


def test_fits_recover_known_coefficients():
    fits = fit.fit_all(synthetic())
    assert fits["prefill"].coef == pytest.approx([0.02, 4.0], rel=1e-9)
    assert fits["decode"].coef == pytest.approx([3e-4, 0.2, 2.5], rel=1e-9)
    assert fits["kv"].coef == pytest.approx([1.0, 3.0], rel=1e-9)
    assert fits["lora_bgmv_share"].coef == pytest.approx([0.01, 0.5], rel=1e-9)
    for key in ("prefill", "decode", "kv", "lora_bgmv_share"):
        assert fits[key].r2 == pytest.approx(1.0) and fits[key].max_rel_err < 1e-9
    assert fits["lora_bgmv"].rows == 4 * 7  # base-only rows are not fitted
    assert fits["prefill_per_request"].coef == pytest.approx([0.02, 0.0, 4.0], abs=1e-9)
    # MBGMV on data made by BGMV: a worse fit, and the quality figures say so
    assert fits["lora_mbgmv_share"].r2 < 0.99 and fits["lora_bgmv"].r2 < 1.0


def test_fits_with_noise_stay_close_and_report_error():
    fits = fit.fit_all(synthetic(noise=0.03, seed=1))
    assert fits["prefill"].coef[0] == pytest.approx(0.02, rel=0.05)
    k2, c2, _ = fits["decode"].coef
    assert k2 == pytest.approx(3e-4, rel=0.25) and c2 == pytest.approx(0.2, rel=0.25)
    assert 0.95 < fits["decode"].r2 < 1.0 and 0.0 < fits["decode"].max_rel_err < 0.15


def test_too_few_points_is_no_fit_not_an_error():
    assert fit.fit_decode([{"b": 1, "l_avg": 10, "ms": 1.0}]) is None
    assert fit.fit_lora([], "bgmv") is None


def write_profile(tmp_path, meas=None, **kw) -> tuple[dict, object]:
    prof = fit.build_profile(meas or synthetic(), name="test-profile", source={"engine": "test"},
                             kv_capacity_tokens=50_000, kv_bytes_per_token=1024, **kw)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    return prof, path


async def test_profile_round_trips_and_the_sim_engine_loads_it(tmp_path):
    prof, path = write_profile(tmp_path)
    back = fit.read_profile(path)
    assert back.perf == PerfModel(k1=prof["k1"], c1=prof["c1"], k2=prof["k2"], c2=prof["c2"], c3=prof["c3"],
                                  h=prof["h"], j=prof["j"])
    assert back.perf.k1 == pytest.approx(0.02) and back.kv_capacity_tokens == 50_000 and back.measured
    assert back.lora["bgmv_share"].ms([32, 4]) == pytest.approx(0.01 * 2 * 32 + 0.5) and back.lora["bgmv_share"].share
    assert back.lora["bgmv_share"].ms([0, 0]) == 0.0
    assert back.lora["mbgmv"].kernel == "mbgmv" and back.fit["decode"]["r2"] == pytest.approx(1.0)
    raw = json.loads(path.read_text())
    assert raw["points"]["decode"][0]["b"] == 1  # raw points kept
    assert raw["lora_bgmv_alpha"] == pytest.approx(0.01) and raw["lora_bgmv_beta"] == pytest.approx(0.5)

    sim = load_profile(path)
    assert sim.perf.k2 == pytest.approx(3e-4) and sim.kv_capacity_tokens == 50_000 and sim.label == "test-profile"
    engine = make_engine(WorkerSettings(engine="sim", profile=str(path), time_scale=0.0))
    assert isinstance(engine, SimEngine) and engine.kv_capacity == 50_000
    await engine.start()
    try:
        runner = bench_batching.Runner(engine)
        assert await runner.one("hello there", 5) == 5
    finally:
        await engine.stop()


def test_shipped_profiles_are_listed_with_fit_quality():
    profiles = {p.name: p for p in fit.list_profiles()}
    assert {"sim-llama2-70b-h100-tp4", "hf-tiny-llama-random-cpu"} <= set(profiles)
    for p in profiles.values():
        for phase in ("prefill", "decode"):
            assert 0 < p.fit[phase]["r2"] <= 1 and p.fit[phase]["max_rel_err"] >= 0 and p.fit[phase]["rows"] > 2
        load_profile(p.path)  # every shipped profile drives the sim
    cpu = profiles["hf-tiny-llama-random-cpu"]
    assert cpu.measured and cpu.source["measured_on"] == "CPU" and cpu.source["engine"] == "hf"
    assert {"bgmv", "mbgmv", "bgmv_share", "mbgmv_share"} <= set(cpu.lora)
    assert json.loads(Path(cpu.path).read_text())["command"].startswith("polyserve profile run --engine hf")


def test_prompt_maker_hits_token_targets_with_the_engines_tokenizer():
    maker = PromptMaker(count_words_as_tokens, seed=3)
    for target in (7, 64, 500):
        prompt, n = maker.make(target)
        assert n == count_words_as_tokens(prompt) and target - 2 <= n <= target
    assert maker.make(1)[1] == 2  # one word is the least there is


async def test_tiny_grid_against_the_sim_engine_completes_and_fits():
    scale = 0.2  # sleeps long enough that the event loop's own time per step (~0.1-0.2 ms on the EPYC) stays small
    engine = SimEngine(SimProfile(perf=TOY, kv_capacity_tokens=1 << 20), max_batch=16, time_scale=scale)
    await engine.start()
    spec = GridSpec(prefill_lengths=(32, 256), prefill_counts=(1, 2), decode_batches=(1, 4, 8),
                    decode_contexts=(64, 256), decode_steps=6, lora_ranks=(4, 16), lora_batches=(2,),
                    lora_context=32, repeats=2, warmup=1)  # fastest of 2: robust to a busy host
    lines: list[str] = []
    try:
        meas = await GridRunner(engine, spec, progress=lines.append).run()
    finally:
        await engine.stop()
    assert len(meas.prefill) == 4 and len(meas.decode) == 6 and len(meas.lora) == 5 and len(lines) > 15
    assert meas.adapters == {"profile-r4": 4, "profile-r16": 16} and not meas.notes
    prof = fit.build_profile(fit.scale_times(meas.as_dict(), 1 / scale), name="sim-replay", source={},
                             kv_capacity_tokens=engine.kv_capacity, kv_bytes_per_token=0)
    assert prof["fit"]["kv"]["coef"]["h"] == pytest.approx(1.0)  # the sim reserves l_in + l_out per sequence
    assert prof["k1"] == pytest.approx(TOY.k1, rel=0.35)  # slope survives the event loop's overhead
    assert prof["fit"]["prefill"]["r2"] > 0.9
    assert prof["c2"] + prof["k2"] * 100 == pytest.approx(TOY.c2 + TOY.k2 * 100, rel=0.5)
    assert {"lora_bgmv", "lora_mbgmv"} <= set(prof["fit"])


def test_cli_run_against_sim_writes_a_labelled_profile(tmp_path, capsys):
    out = tmp_path / "replay.json"
    rc = cli.main(["run", "--engine", "sim", "--time-scale", "0.01", "--out", str(out), "--quiet", "--no-lora",
                   "--prefill-lengths", "16,128", "--prefill-counts", "1,2", "--decode-batches", "1,4",
                   "--decode-contexts", "32,128", "--decode-steps", "5", "--repeats", "1"])
    assert rc == 0
    raw = json.loads(out.read_text())
    assert raw["simulated"] is True and not raw["measured"] and "SIMULATED" in raw["note"]
    assert raw["command"].startswith("polyserve profile run --engine sim") and raw["source"]["grid"]["repeats"] == 1
    assert "decode" in capsys.readouterr().out
    load_profile(out)


@pytest.mark.skipif(not SPLITWISE.is_file(), reason="reference datasets not present")
def test_fit_splitwise_reproduces_the_shipped_gpu_profile(tmp_path):
    out = tmp_path / "gpu.json"
    assert cli.main(["fit-splitwise", "--splitwise", str(SPLITWISE), "--output-trace", str(TRACE),
                     "--out", str(out)]) == 0
    made, shipped = json.loads(out.read_text()), json.loads((fit.PROFILES_DIR / "sim-llama2-70b-h100-tp4.json")
                                                            .read_text())
    for k in ("k1", "c1", "k2", "c2", "c3", "kv_capacity_tokens"):
        assert made[k] == pytest.approx(shipped[k])
    assert made["fit"] == shipped["fit"] and made["source"]["filter"]["tensor_parallel"] == 4


@pytest.mark.skipif(not TRACE.is_file(), reason="reference datasets not present")
def test_bench_lengths_are_seeded_and_capped():
    a = bench_batching.draw_lengths(TRACE, 50, seed=7, out_cap=256, in_cap=128)
    assert a == bench_batching.draw_lengths(TRACE, 50, seed=7, out_cap=256, in_cap=128)
    assert all(1 <= i <= 128 and 1 <= o <= 256 for i, o in a) and len({o for _, o in a}) > 10


async def test_static_batches_gate_admission_and_continuous_refills():
    engine = SimEngine(SimProfile(perf=TOY, kv_capacity_tokens=1 << 20), max_batch=16, time_scale=0.0)
    await engine.start()
    seen: list[int] = []
    original = engine.generate

    def spy(req):
        seen.append(len(engine.open_requests()))  # requests in flight when this one arrives
        return original(req)

    engine.generate = spy
    items = [(f"prompt {i}", 2, out) for i, out in enumerate([3, 9, 3, 9, 3, 9, 3, 9])]
    try:
        runner = bench_batching.Runner(engine)
        static = await runner.run(items, "static", 4)
        assert static["tokens"] == sum(o for *_, o in items)
        assert seen == [0, 1, 2, 3] * 2  # the second batch starts only once the first has drained
        seen.clear()
        await runner.run(items, "continuous", 4)
        assert max(seen) == 3 and seen[4] > 0  # the first short request is replaced while the batch still runs
        seen.clear()
        await runner.run(items[:3], "sequential", 4)
        assert seen == [0, 0, 0]
    finally:
        await engine.stop()


@pytest.mark.torch
def test_bench_batching_names_a_device_it_cannot_use_before_loading_anything():
    pytest.importorskip("torch")
    with pytest.raises(SystemExit, match="--device tpu: "):
        bench_batching.main(["--device", "tpu"])
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: device 'cuda' asked but CUDA is not available"):
            bench_batching.main(["--device", "cuda"])
