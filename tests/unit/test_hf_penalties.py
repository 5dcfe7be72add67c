"""The hf engine's penalties, logit_bias and min_p (`hf_sampling.Shaper`, `sample`), against
vLLM's rules written out here independently: logit_bias added first, then the repetition penalty
on every token of the prompt or the output (a positive logit divided, a negative one multiplied),
then frequency x count and presence x (count > 0) subtracted; min_p after temperature."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import EngineError, EngineRequest  # noqa: E402
from polyserve.worker.engines.hf_batch import Row, sample  # noqa: E402
from polyserve.worker.engines.hf_model import fallback_tokenizer  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]
TOK = fallback_tokenizer()
V = len(TOK)
EOS = TOK.sep_token_id
PROMPT = [11, 12, 12, 40]


def _row(**params) -> Row:
    return Row(None, 0, SamplingParams(**params), None, TOK, PROMPT, {EOS}, 1000, torch.device("cpu"))


def _reference(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int]) -> list[float]:
    """vLLM's order and formulas, one token at a time in plain Python."""
    x = list(logits)
    for t, b in p.logit_bias.items():
        x[t] += b
    seen = set(prompt) | set(out)
    for t in range(len(x)):
        if t in seen and p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty * (t in out)
    return x


@pytest.mark.parametrize("params", [
    dict(frequency_penalty=0.7), dict(presence_penalty=-1.5), dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8, frequency_penalty=0.4, presence_penalty=0.9, logit_bias={12: 3.0, 99: -100.0}),
    dict(logit_bias={7: 50.0}),
])
def test_shaped_logits_equal_vllms_rule_after_each_accepted_token(params):
    gen = torch.Generator().manual_seed(0)
    row = _row(temperature=0, max_tokens=50, **params)
    out: list[int] = []
    for token in (12, 30, 30, 99, 12, 30):
        logits = torch.randn(V, generator=gen) * 3
        want = _reference(logits.tolist(), row.params, PROMPT, out)
        row.shaper.apply(logits)
        assert logits.tolist() == pytest.approx(want, rel=1e-6, abs=1e-5)
        row.accept(token)
        out.append(token)


def test_greedy_decoding_follows_the_bias_and_the_penalties():
    logits = torch.zeros(3, V)
    logits[:, 30] = 5.0  # the argmax of every row
    logits[:, 31] = 4.5
    banned = _row(temperature=0, logit_bias={30: -100.0})
    forced = _row(temperature=0, logit_bias={77: 100.0})
    repeated = _row(temperature=0, frequency_penalty=1.0)
    repeated.accept(30)  # once already: 5.0 - 1.0 < 4.5
    assert sample(logits.clone(), [banned, forced, repeated], None) == [31, 77, 31]
    plain = _row(temperature=0)
    assert sample(logits[:1].clone(), [plain], None) == [30]  # a row without them is untouched


def test_min_p_keeps_only_tokens_near_the_top_probability():
    logits = torch.full((1, V), -30.0)
    logits[0, 30], logits[0, 31], logits[0, 32] = 2.0, 1.8, 0.0  # p(32) / p(30) = e^-2 = 0.135
    kept = {sample(logits.clone(), [_row(temperature=1.0, seed=s, min_p=0.2)], None)[0] for s in range(60)}
    assert kept <= {30, 31} and kept == {30, 31}
    wider = {sample(logits.clone(), [_row(temperature=1.0, seed=s, min_p=0.1)], None)[0] for s in range(200)}
    assert 32 in wider


def test_allowed_token_ids_and_bad_words_follow_vllms_rules():
    """allowed_token_ids: nothing else is sampled; bad_words (hf_sampling.bad_word_ids, vLLM's token
    sequences): a one-token word never, a longer one's last token only after its other tokens."""
    logits = torch.zeros(1, V)
    logits[0, 30] = 5.0
    allowed = {sample(logits.clone(), [_row(temperature=1.0, seed=s, allowed_token_ids=[40, 41])], None)[0]
               for s in range(40)}
    assert allowed == {40, 41}
    hello, long = TOK.encode("hello", add_special_tokens=False), TOK.encode("unbelievably", add_special_tokens=False)
    assert len(hello) == 1 and len(long) == 5
    logits[0, hello[0]] = 9.0
    assert sample(logits.clone(), [_row(temperature=0, bad_words=["hello"])], None) == [30]
    logits[0, long[-1]] = 8.0  # the long word's last token: barred only right after its first four
    row = _row(temperature=0, bad_words=["unbelievably", "hello"])
    assert sample(logits.clone(), [row], None) == [long[-1]]
    for t in long[:-1]:
        row.accept(t)
    assert sample(logits.clone(), [row], None) == [30]


async def test_a_logit_bias_id_beyond_the_vocabulary_is_a_400_before_any_token():
    import types

    from polyserve.worker.engines.hf import HfEngine
    eng = HfEngine(types.SimpleNamespace(model="tiny-random", model_path="", device="cpu", dtype="float32",
                                         max_waiting=4, max_batch=2, kv_capacity_tokens=1 << 16, max_input_len=64))
    await eng.start()
    try:
        req = EngineRequest("b1", "hello", SamplingParams(max_tokens=2, logit_bias={10 ** 7: -100.0}))
        with pytest.raises(EngineError) as err:
            async for _ in eng.generate(req):
                pass
        assert err.value.status == 400 and "vocabulary" in str(err.value)
        with pytest.raises(EngineError) as err:
            async for _ in eng.generate(EngineRequest("b2", "hello", SamplingParams(allowed_token_ids=[10 ** 7]))):
                pass
        assert err.value.status == 400 and "allowed_token_ids" in str(err.value)
        texts = []
        for k, params in enumerate([SamplingParams(max_tokens=8, temperature=0),
                                    SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.0,
                                                   frequency_penalty=0.0)]):
            got = [ev async for ev in eng.generate(EngineRequest(f"g{k}", "hello world", params))]
            texts.append("".join(getattr(e, "text", "") for e in got))
        assert texts[0] == texts[1]  # fields at their off values change nothing
    finally:
        await eng.stop()


def test_stop_token_ids_end_a_row_like_eos_and_are_held_back_by_min_tokens():
    logits = torch.zeros(2, V)
    logits[:, 55] = 9.0  # every row's argmax: a stop token id of both rows
    early = _row(temperature=0, stop_token_ids=[55], min_tokens=2)
    free = _row(temperature=0, stop_token_ids=[55])
    first = sample(logits.clone(), [early, free], None)
    assert first[0] != 55 and first[1] == 55  # held back before min_tokens, as EOS is
    delta = free.accept(55)
    assert delta.finish_reason == "stop" and delta.text == ""  # the stop token's text is not emitted


def test_the_stop_string_is_kept_at_the_end_only_when_asked():
    from polyserve.core.queue_order import stop_span
    from polyserve.worker.engines.hf_text import StopMatcher
    assert stop_span("a END b STOP", ["STOP", "END"]) == (2, 5)
    assert stop_span("xxENDING", ["END", "ENDING"]) == (2, 8)  # the longest of those starting first
    for include, want in ((False, "one two "), (True, "one two END")):
        m = StopMatcher(["END"], include=include)
        out = [m.feed(p) for p in ("one t", "wo E", "ND and more")]
        assert "".join(t for t, _ in out) == want and out[-1][1]
