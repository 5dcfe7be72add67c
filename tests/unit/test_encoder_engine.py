"""The encoder engine (one runtime per worker) against sentence-transformers, and the
profiler's staircase analysis."""
import asyncio
import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

import torch  # noqa: E402

from polyserve.core.encoder_text import truncate_ids  # noqa: E402
from polyserve.dispatcher.policy import WorkerView  # noqa: E402
from polyserve.dispatcher.policy_arlo import capacity  # noqa: E402
from polyserve.proto import EncoderProfile  # noqa: E402
from polyserve.worker.engine import EngineError, EngineOverloaded, EngineRequest  # noqa: E402
from polyserve.worker.engines.encoder import EncoderConfig, EncoderEngine, capacity_within_slo, replay_ms  # noqa: E402
from polyserve.worker.engines.encoder_runtime import Runtime, load_encoder  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds torch models
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-5
TEXTS = ["hello world", "Polymorphing pads each request only to its runtime's max_length.",
         "Ünïcode façade — does it tokenize the same?", "word " * 100]


@pytest.fixture(scope="module")
def enc():
    torch.set_num_threads(1)
    return load_encoder()


@pytest.fixture(scope="module")
def st(enc):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(enc.source, device="cpu")
    model.max_seq_length = 512  # its config says 256; the runtimes here go to 512
    return model


def _ref(st, texts, max_len=512):
    old = st.max_seq_length
    st.max_seq_length = max_len
    try:
        return st.encode(texts, convert_to_tensor=True, normalize_embeddings=False).cpu()
    finally:
        st.max_seq_length = old


@pytest.mark.parametrize("backend,shape,batch,max_len", [("jit", "static", 1, 128), ("jit", "static", 3, 128),
                                                         ("eager", "static", 2, 112),
                                                         ("eager", "dynamic", 4, 512)])
def test_runtime_embeddings_equal_sentence_transformers(enc, st, backend, shape, batch, max_len):
    rows = enc.tokenize(TEXTS)
    rt = Runtime(enc, batch_size=batch, max_length=max_len, shape=shape, backend=backend).prepare()
    out = torch.cat([rt.run(rows[i:i + batch]) for i in range(0, len(rows), batch)])
    assert out.shape == (len(TEXTS), 384)
    assert (out - _ref(st, TEXTS)).abs().max().item() < TOL
    assert torch.allclose(out.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_static_pads_to_its_shape_only_and_dynamic_to_the_longest_row(enc):
    static = Runtime(enc, batch_size=4, max_length=64, shape="static", backend="eager")
    ids, mask = static.tensors([[101, 7592, 102], [101, 102]])
    assert ids.shape == (4, 64) and mask.sum().item() == 3 + 2 + 2 + 2  # 2 dummy [CLS][SEP] rows
    dyn = Runtime(enc, batch_size=4, max_length=512, shape="dynamic", backend="eager")
    assert dyn.tensors([[101, 7592, 102], [101, 102]])[0].shape == (2, 3)
    with pytest.raises(Exception, match="exceeds max_length 64"):
        static.tensors([[1] * 65])


def test_truncate_keeps_the_closing_sep():
    assert truncate_ids([101, 5, 6, 7, 102], 4, 102) == [101, 5, 6, 102]
    assert truncate_ids([101, 5, 102], 4, 102) == [101, 5, 102]


def _engine(**kw) -> EncoderEngine:
    cfg = dict(max_length=64, batch_size=2, backend="eager", slo_ms=1000.0)
    cfg.update(kw)
    return EncoderEngine(EncoderConfig(**cfg))


async def test_engine_embeds_batches_and_reports_capacity(st):
    eng = _engine()
    await eng.start()
    try:
        rows = eng.tokenize(TEXTS[:3])
        res = await eng.embed("r1", rows)
        ref = _ref(st, TEXTS[:3])
        assert (torch.tensor(res.embeddings) - ref).abs().max().item() < TOL
        assert res.tokens == [len(r) for r in rows] and res.truncated == 0
        load = eng.load()
        assert load.max_input_len == 64 and load.kv_capacity == eng.capacity * 64
        view = WorkerView(worker_id="w", max_input_len=load.max_input_len, kv_capacity=load.kv_capacity)
        assert capacity(view) == eng.capacity == capacity_within_slo(1000.0, eng.batch_ms, 2)
        # concurrent requests share batches and each gets its own vectors back
        a, b = await asyncio.gather(eng.embed("a", rows[:1]), eng.embed("b", rows[1:2]))
        assert (torch.tensor(a.embeddings[0] + b.embeddings[0]) - ref[:2].flatten()).abs().max() < TOL
    finally:
        await eng.stop()


async def test_engine_refuses_too_long_unless_truncate_and_bounds_its_queue(st):
    eng = _engine(max_waiting=3)
    await eng.start()
    try:
        long_ids = eng.tokenize([TEXTS[3]])
        with pytest.raises(EngineError, match="at most 64") as err:
            await eng.embed("r", long_ids)
        assert err.value.status == 400
        res = await eng.embed("r", long_ids, truncate=True)
        assert res.truncated == 1 and res.tokens == [64]
        assert (torch.tensor(res.embeddings) - _ref(st, [TEXTS[3]], max_len=64)).abs().max().item() < TOL
        with pytest.raises(EngineOverloaded):
            await eng.embed("big", eng.tokenize(TEXTS[:2]) * 2)
        with pytest.raises(EngineError, match="embeddings"):
            eng.generate(EngineRequest(request_id="g", prompt="x", params=None))
    finally:
        await eng.stop()


def _profile(tmp_path) -> str:
    prof = EncoderProfile(model="m", device="cpu", backend="jit", slo_ms=100.0, threads=1, lengths=[1, 64, 128],
                          batches=[1, 2], static_ms=[[1.0, 4.0, 8.0], [2.0, 8.0, 16.0]],
                          dynamic_ms=[[1.5, 5.0, 10.0], [3.0, 10.0, 20.0]])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(__import__("msgspec").to_builtins(prof)))
    return str(path)


def test_replay_latency_static_costs_its_shape_dynamic_its_input(tmp_path):
    import msgspec

    prof = msgspec.json.decode(open(_profile(tmp_path), "rb").read(), type=EncoderProfile)
    assert replay_ms(prof, "static", 1, 1, 128, 10) == 8.0  # padded to 128 whatever the input
    assert replay_ms(prof, "static", 1, 2, 64, 10) == 8.0  # a static batch of 2 always runs 2 rows
    assert replay_ms(prof, "dynamic", 1, 1, 128, 64) == 5.0


async def test_replay_engine_says_it_is_simulated(tmp_path):
    eng = _engine(profile=_profile(tmp_path), max_length=128, batch_size=1, time_scale=0.0)
    await eng.start()
    try:
        res = await eng.embed("r", [[101, 5, 102]])
        assert eng.simulated and "replay" in eng.runtime_name
        assert abs(sum(x * x for x in res.embeddings[0]) - 1.0) < 1e-6
        assert eng.capacity == capacity_within_slo(1000.0, 8.0, 1) == 125  # the engine's SLO setting
    finally:
        await eng.stop()


def test_staircase_analysis():
    from polyserve.profiler.encoder import choose_runtimes, find_steps

    lengths = list(range(8, 513, 8))
    gpu = [1.0 + 0.5 * ((n - 1) // 64) + 0.001 * n for n in lengths]  # flat plateaus, a jump every 64
    steps = find_steps(lengths, gpu)
    assert steps == [64, 128, 192, 256, 320, 384, 448]
    assert choose_runtimes(lengths, gpu, steps) == [64, 128, 192, 256, 320, 384, 448, 512]
    cpu = [2.0 + 0.2 * n for n in lengths]  # proportional to length: no staircase
    assert find_steps(lengths, cpu) == []
    noisy = list(cpu)
    noisy[40] += 8.0  # one burst of noise on a smooth curve is no staircase
    assert find_steps(lengths, noisy) == []
    rts = choose_runtimes(lengths, cpu, [], max_runtimes=4)
    assert rts[-1] == 512 and len(rts) == 4 and all(r % 8 == 0 for r in rts)
