"""frequency / presence / repetition penalties, logit_bias and min_p end to end with the official
`openai` client: a gateway and an hf worker (the small random Llama). A logit_bias of +10 makes
the greedy answer repeat one token; each penalty must make it repeat that token less, a bias of
-100 must ban a token, and a bad value is a 400 naming the field."""
from __future__ import annotations

import os

import openai
import pytest

from tests.integration.conftest import MODEL

pytestmark = [pytest.mark.integration, pytest.mark.torch]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HF = {"engine": "hf", "model": "tiny-llama-random", "deployment": MODEL}
PROMPT = "the quick brown fox"


async def _tokens(p, **kw) -> list[int]:
    """The greedy answer's token ids (its text tokenized again with the random model's tokenizer)."""
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    out = await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **kw)
    return fallback_tokenizer()(out.choices[0].text, add_special_tokens=False).input_ids


async def test_penalties_and_bias_change_a_greedy_answer_and_bad_values_are_400s(plane):
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    x = fallback_tokenizer().convert_tokens_to_ids("to")
    async with plane(worker_kw=HF) as p:
        plain = await _tokens(p)
        pushed = await _tokens(p, logit_bias={str(x): 10})
        assert pushed.count(x) >= 12 > plain.count(x), (pushed, plain)
        for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
            fewer = await _tokens(p, logit_bias={str(x): 10}, **kw)
            assert fewer.count(x) < pushed.count(x) * 0.75, (kw, fewer.count(x), pushed.count(x))
        top = plain[0]
        banned = await _tokens(p, logit_bias={str(top): -100})
        assert top not in banned and banned != plain
        assert await _tokens(p, extra_body={"min_p": 0.5}) == plain  # greedy keeps the top token anyway
        chat = await p.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                      max_tokens=8, temperature=0.7, seed=3, presence_penalty=0.5,
                                                      frequency_penalty=0.5, logit_bias={str(top): -100},
                                                      extra_body={"min_p": 0.05, "repetition_penalty": 1.2})
        assert chat.choices[0].message.content
        for kw, said in (({"frequency_penalty": 2.5}, "frequency_penalty"),
                         ({"logit_bias": {"abc": 1}}, "logit_bias"),
                         ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"logit_bias": {"10000000": -100}}, "vocabulary"),  # the worker's 400
                         ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty")):
            with pytest.raises(openai.BadRequestError) as err:
                await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **kw)
            assert said in str(err.value), (kw, err.value)


async def test_stop_token_ids_and_include_stop_str_in_output(plane):
    """hf: the answer ends at a stop token id (its text not included, finish_reason "stop");
    with include_stop_str_in_output a stop string ends the text."""
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    tok = fallback_tokenizer()
    async with plane(worker_kw=HF) as p:
        plain = await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        ids = tok(plain.choices[0].text, add_special_tokens=False).input_ids
        cut = await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                extra_body={"stop_token_ids": [ids[4]]})
        assert cut.choices[0].finish_reason == "stop"
        assert tok(cut.choices[0].text, add_special_tokens=False).input_ids == ids[:4]
        word = plain.choices[0].text.split()[3]
        kept = await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                 stop=[word], extra_body={"include_stop_str_in_output": True})
        text = kept.choices[0].text
        assert text.endswith(word) and plain.choices[0].text.startswith(text), (text, plain.choices[0].text)
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                              extra_body={"stop_token_ids": [10 ** 8]})
        assert "stop_token_ids" in str(err.value)


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(plane):
    """hf: k keeps the prompt's last k tokens; -1 its last max_input_len, where the same prompt
    without it is a 400 (context_length_exceeded); with echo it is a 400 naming the field."""
    async with plane(worker_kw=HF) as p:
        limit = p.worker.engine.max_input_len
        cut = await p.client.completions.create(model=MODEL, prompt="word " * 40, max_tokens=2,
                                                extra_body={"truncate_prompt_tokens": 7})
        assert cut.usage.prompt_tokens == 7
        long = "word " * (limit + 50)
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt=long, max_tokens=2)
        assert err.value.code == "context_length_exceeded"
        fit = await p.client.completions.create(model=MODEL, prompt=long, max_tokens=2,
                                                extra_body={"truncate_prompt_tokens": -1})
        assert fit.usage.prompt_tokens == limit
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt="a b c", max_tokens=2, echo=True, logprobs=0,
                                              extra_body={"truncate_prompt_tokens": 2})
        assert "truncate_prompt_tokens" in str(err.value)


async def test_allowed_token_ids_and_bad_words(plane):
    """vLLM's allowed_token_ids (only those are sampled) and bad_words (never generated), on chat
    and completions; an empty list, a negative id, one beyond the vocabulary (the worker's) or a
    blank word is a 400 naming the field."""
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    tok = fallback_tokenizer()
    allowed = tok.convert_tokens_to_ids(["paris", "rome"])
    async with plane(worker_kw=HF) as p:
        out = await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=4,
                                                extra_body={"allowed_token_ids": allowed})
        assert set(tok(out.choices[0].text, add_special_tokens=False).input_ids) <= set(allowed), out.choices[0].text
        plain = await _tokens(p)
        first = tok.convert_ids_to_tokens(plain[0])
        barred = await _tokens(p, extra_body={"bad_words": [first]})
        assert plain[0] not in barred and barred != plain
        chat = await p.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                      max_tokens=6, temperature=0,
                                                      extra_body={"allowed_token_ids": allowed})
        assert set(chat.choices[0].message.content.split()) <= {"paris", "rome"}
        for body, said in (({"allowed_token_ids": []}, "allowed_token_ids"),
                           ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                           ({"allowed_token_ids": [10 ** 7]}, "vocabulary"),  # the worker's 400
                           ({"bad_words": [" "]}, "bad_words")):
            with pytest.raises(openai.BadRequestError) as err:
                await p.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=body)
            assert said in str(err.value), (body, err.value)
