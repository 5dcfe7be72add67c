"""The `hf` engine's logprobs: raw-model log-softmax of every generated (and, with
prompt_logprobs, every prompt) token, top-k alternatives, in both KV layouts."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineRequest  # noqa: E402
from polyserve.worker.engines.hf import HfEngine  # noqa: E402
from tests.unit.test_hf_engine import settings  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]


async def run(engine, rid, prompt, **params):
    """Per choice: its logprob entries, and the prompt's (first delta), in order."""
    out: dict[int, list] = {}
    prompt_lp: dict[int, list] = {}
    async for ev in engine.generate(EngineRequest(rid, prompt, SamplingParams(**params))):
        if isinstance(ev, Delta):
            if ev.prompt_logprobs is not None:
                assert ev.index not in prompt_lp, "prompt logprobs come once, on the first delta"
                prompt_lp[ev.index] = ev.prompt_logprobs
            if ev.tokens:
                assert ev.logprobs is not None and len(ev.logprobs) == ev.tokens
                out.setdefault(ev.index, []).extend(ev.logprobs)
    return out, prompt_lp


def reference(bundle, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over `ids` ([len(ids), vocab]; row i predicts i + 1)."""
    with torch.inference_mode():
        logits = bundle.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
async def test_logprobs_are_the_raw_models_log_softmax(layout):
    engine = HfEngine(settings(kv_layout=layout))
    await engine.start()
    try:
        prompt = "the quick brown fox"
        # a busy batch: another request decodes alongside, so batched decode is what is checked
        other = engine.generate(EngineRequest("other", "something else entirely", SamplingParams(max_tokens=12)))
        first = await other.__anext__()
        choices, prompt_lp = await run(engine, "lp", prompt, max_tokens=8, temperature=0.8, seed=3, n=2,
                                       logprobs=4, prompt_logprobs=2)
        async for _ in other:
            pass
        assert isinstance(first, Delta) and first.logprobs is None  # not asked for: not computed
        ids = engine._bundle.encode(prompt)
        for index, entries in choices.items():
            gen = [e.token_id for e in entries]
            ref = reference(engine._bundle, ids + gen)
            for j, e in enumerate(entries):
                row = ref[len(ids) - 1 + j]
                assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
                # vLLM's rank: 1 + the tokens more likely (batched float sums may move a near tie by one)
                assert abs(e.rank - (int((row > row[e.token_id]).sum()) + 1)) <= 1
                assert len(e.top) == 4
                assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
                best = torch.topk(row, 4)
                assert [t.token_id for t in e.top] == best.indices.tolist()
                assert [t.logprob for t in e.top] == pytest.approx(best.values.tolist(), abs=1e-4)
                if e.token_id in [t.token_id for t in e.top]:
                    assert next(t.logprob for t in e.top if t.token_id == e.token_id) == pytest.approx(e.logprob)
                assert e.token == engine._bundle.tokenizer.decode([e.token_id], skip_special_tokens=False)
            plp = prompt_lp[index]
            assert [e.token_id for e in plp] == ids
            assert plp[0].logprob is None and plp[0].top == []
            for i, e in enumerate(plp[1:], start=1):
                assert e.logprob == pytest.approx(ref[i - 1][ids[i]].item(), abs=1e-4)
                assert abs(e.rank - (int((ref[i - 1] > ref[i - 1][ids[i]]).sum()) + 1)) <= 1
                assert len(e.top) == 2
    finally:
        await engine.stop()


async def test_logprobs_zero_gives_the_tokens_own_logprob_only():
    engine = HfEngine(settings())
    await engine.start()
    try:
        choices, prompt_lp = await run(engine, "g", "hello world", max_tokens=5, temperature=0, logprobs=0)
        assert prompt_lp == {}
        for e in choices[0]:
            assert e.top == []  # logprobs=0: the token's own logprob only
            assert e.logprob is not None and e.logprob <= 0
    finally:
        await engine.stop()
