"""vLLM's token-level fields end to end with the official `openai` client on an hf worker (the
small random Llama). `return_token_ids`: each choice's `token_ids` (streamed: those of each chunk)
and the prompt's `prompt_token_ids` (completions: per choice; chat: on the response, streamed on
the first chunk) are the ids the worker ran (the prompt as its engine encoded it; the output
decodes to the text). `prompt_logprobs`: vLLM's per-token dicts. A sim deployment refuses them
with a 400 that names the field."""
from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import MODEL

pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.torch]
HFDEP = "tiny-hf"  # a deployment of the hf engine (the plane's own is the sim's, which refuses the field)
HF = {"engine": "hf", "model": "tiny-llama-random", "deployment": HFDEP}
IDS = {"return_token_ids": True}


async def test_token_ids_whole_and_streamed(plane, state):
    from polyserve.proto import Deployment
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    tok = fallback_tokenizer()
    await state.put_deployment(Deployment(id=HFDEP, model="tiny-llama-random", engine="hf"))
    async with plane(worker_kw=HF) as p:
        whole = await p.client.completions.create(model=HFDEP, prompt="the quick brown fox", max_tokens=8, n=2,
                                                  temperature=1.0, seed=3, extra_body=IDS)
        for c in whole.choices:
            extra = c.model_extra
            assert len(extra["token_ids"]) == 8
            assert extra["prompt_token_ids"] == p.worker.engine._bundle.encode("the quick brown fox")  # what it ran
            assert tok.decode(extra["token_ids"], skip_special_tokens=True).split() == c.text.split()
        assert whole.usage.completion_tokens == 16
        streamed = await p.client.completions.create(model=HFDEP, prompt="the quick brown fox", max_tokens=8,
                                                      temperature=0, stream=True, extra_body=IDS)
        chunks = [ch for c in [c async for c in streamed] for ch in c.choices]
        ids = [t for ch in chunks for t in (ch.model_extra.get("token_ids") or [])]
        prompts = [ch.model_extra["prompt_token_ids"] for ch in chunks if ch.model_extra.get("prompt_token_ids")]
        greedy = await p.client.completions.create(model=HFDEP, prompt="the quick brown fox", max_tokens=8,
                                                   temperature=0, extra_body=IDS)
        assert ids == greedy.choices[0].model_extra["token_ids"] and len(prompts) == 1
        chat = await p.client.chat.completions.create(model=HFDEP, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=5, temperature=0, extra_body=IDS)
        assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
        assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
        events = [c async for c in await p.client.chat.completions.create(
            model=HFDEP, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
            extra_body=IDS)]
        assert events[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
        assert [t for e in events for ch in e.choices for t in ch.model_extra.get("token_ids") or []] == \
            chat.choices[0].model_extra["token_ids"]
        plain = await p.client.completions.create(model=HFDEP, prompt="hi", max_tokens=2)
        assert "token_ids" not in plain.choices[0].model_extra


async def test_the_sim_refuses_return_token_ids(plane):
    async with plane() as p:
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=IDS)
    assert err.value.body["param"] == "return_token_ids", err.value.body


async def test_vllms_prompt_logprobs_field(plane, state):
    """vLLM's `prompt_logprobs: k`: per prompt token a dict keyed by token id holding the token (its
    logprob and rank) and its k best alternatives (ranks 1..k), the first token null; the same
    values as `echo` with `logprobs` gives; completions per choice, chat on the response; a 400
    with stream."""
    from polyserve.proto import Deployment
    await state.put_deployment(Deployment(id=HFDEP, model="tiny-llama-random", engine="hf"))
    async with plane(worker_kw=HF) as p:
        prompt = "the quick brown fox"
        out = await p.client.completions.create(model=HFDEP, prompt=prompt, max_tokens=2, temperature=0,
                                                extra_body={"prompt_logprobs": 2})
        plp = out.choices[0].model_extra["prompt_logprobs"]
        ids = p.worker.engine._bundle.encode(prompt)
        assert len(plp) == len(ids) == out.usage.prompt_tokens and plp[0] is None
        echo = await p.client.completions.create(model=HFDEP, prompt=prompt, max_tokens=1, temperature=0,
                                                 echo=True, logprobs=2)
        echoed = echo.choices[0].logprobs.token_logprobs[:len(ids)]
        for tid, pos, lp in zip(ids[1:], plp[1:], echoed[1:]):
            own = pos[str(tid)]
            assert own["logprob"] == pytest.approx(lp, abs=1e-4) and own["rank"] >= 1
            top = sorted((v for k, v in pos.items() if v["rank"] <= 2), key=lambda v: v["rank"])
            assert [v["rank"] for v in top][:2] == [1, 2] and len(pos) <= 3
        chat = await p.client.chat.completions.create(model=HFDEP, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2, extra_body={"prompt_logprobs": 0})
        assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=HFDEP, prompt=prompt, max_tokens=2, stream=True,
                                              extra_body={"prompt_logprobs": 1})
        assert err.value.body["param"] == "prompt_logprobs"


async def test_an_openai_http_upstream_gives_its_own_token_ids(plane, state):
    """openai-http: `return_token_ids` goes upstream as vLLM's field and its `token_ids` /
    `prompt_token_ids` come back through the worker (a stand-in speaking vLLM's wire: one id per
    piece, 100, 101, ...; the prompt's 1..9), whole and streamed; the token count is the upstream's."""
    from polyserve.proto import Deployment
    from tests.integration.test_openai_http_chat import StandIn, _worker
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(completion_out=[" a", " b", " c"], finish="stop") as up:
        async with plane(worker_kw=_worker(up)) as p:
            whole = await p.client.completions.create(model="up", prompt="hi", max_tokens=5, extra_body=IDS)
            events = [c async for c in await p.client.completions.create(model="up", prompt="hi", max_tokens=5,
                                                                        stream=True, extra_body=IDS)]
    x = whole.choices[0].model_extra
    assert x["token_ids"] == [100, 101, 102] and x["prompt_token_ids"] == list(range(1, 10))
    assert [t for e in events for ch in e.choices for t in ch.model_extra.get("token_ids") or []] == [100, 101, 102]
    assert [ch.model_extra["prompt_token_ids"] for e in events for ch in e.choices
            if ch.model_extra.get("prompt_token_ids")] == [list(range(1, 10))]
    assert all(body.get("return_token_ids") is True for _, body in up.posts)


async def test_logprob_tokens_as_token_ids(plane, state):
    """vLLM's `return_tokens_as_token_ids`: with `logprobs`, each token and alternative reads
    "token_id:N" (the echoed prompt's too; text offsets counted on those strings), the same ids
    `return_token_ids` gives and the same numbers as the plain request; chat's `bytes` stay the
    token's text (an alternative's: the string's), as vLLM renders them. The sim refuses it."""
    import re

    from polyserve.proto import Deployment
    await state.put_deployment(Deployment(id=HFDEP, model="tiny-llama-random", engine="hf"))
    as_ids = {"return_tokens_as_token_ids": True, **IDS}
    form = re.compile(r"token_id:\d+")
    async with plane(worker_kw=HF) as p:
        kw = dict(model=HFDEP, prompt="the quick brown fox", max_tokens=5, temperature=0, logprobs=2, echo=True)
        plain = (await p.client.completions.create(**kw)).choices[0].logprobs
        whole = (await p.client.completions.create(**kw, extra_body=as_ids)).choices[0]
        lp, x = whole.logprobs, whole.model_extra
        assert lp.tokens == [f"token_id:{t}" for t in x["prompt_token_ids"] + x["token_ids"]]
        # the same numbers up to float reduction order (1e-4: another batch shape, as in test_logprobs.py)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(plain.token_logprobs[1:], abs=1e-4)
        assert all(form.fullmatch(k) for top in lp.top_logprobs[1:] for k in top)
        for top, ref in zip(lp.top_logprobs[1:], plain.top_logprobs[1:]):
            assert sorted(top.values()) == pytest.approx(sorted(ref.values()), abs=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        streamed = [c async for c in await p.client.completions.create(
            model=HFDEP, prompt="the quick brown fox", max_tokens=5, temperature=0, logprobs=1, stream=True,
            extra_body=as_ids)]
        assert [t for e in streamed for ch in e.choices if ch.logprobs for t in ch.logprobs.tokens] == \
            [f"token_id:{t}" for t in x["token_ids"]]
        msgs = [{"role": "user", "content": "hi"}]
        chat_plain = await p.client.chat.completions.create(model=HFDEP, messages=msgs, max_tokens=4, temperature=0,
                                                            logprobs=True, top_logprobs=2)
        chat = await p.client.chat.completions.create(model=HFDEP, messages=msgs, max_tokens=4, temperature=0,
                                                      logprobs=True, top_logprobs=2, extra_body=as_ids)
        content, ref = chat.choices[0].logprobs.content, chat_plain.choices[0].logprobs.content
        assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
        assert [c.bytes for c in content] == [r.bytes for r in ref]
        assert [c.logprob for c in content] == pytest.approx([r.logprob for r in ref], abs=1e-4)
        assert all(form.fullmatch(t.token) and t.bytes == list(t.token.encode()) for c in content for t in c.top_logprobs)
    async with plane() as p:
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
                                              extra_body={"return_tokens_as_token_ids": True})
    assert err.value.body["param"] == "return_tokens_as_token_ids", err.value.body
