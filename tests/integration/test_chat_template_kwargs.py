"""vLLM's `chat_template_kwargs` with the official `openai` client, on an hf worker whose checkpoint's
chat template reads a variable of its own (`enable_thinking`, as Qwen3's does): the worker renders
the chat with it, the gateway's `/tokenize` counts the same prompt, and the keywords of
apply_chat_template itself are a 400 naming the field."""
from __future__ import annotations

import copy

import httpx
import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.torch]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </{{ m['role'] }}> {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no_think> {% endif %}"
            "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": "name a colour"}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    from polyserve.worker.engines.hf_model import save_random_checkpoint
    out = save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "thinking", seed=0)
    tok = copy.deepcopy(AutoTokenizer.from_pretrained(str(out)))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


async def test_chat_template_kwargs_reach_the_template_on_the_worker_and_in_tokenize(plane, state, checkpoint):
    from polyserve.proto import Deployment
    await state.put_deployment(Deployment(id="thinking", model=str(checkpoint), engine="hf"))
    worker = {"engine": "hf", "model": "thinking", "model_path": str(checkpoint), "deployment": "thinking"}
    async with plane(worker_kw=worker) as p:
        engine = p.worker.engine
        plain, off = engine.chat_prompt(MESSAGES), engine.chat_prompt(MESSAGES, extra=OFF)
        assert "<no_think>" not in plain and off.endswith("<no_think> <assistant>")
        with_kw = await p.client.chat.completions.create(model="thinking", messages=MESSAGES, max_tokens=4,
                                                         temperature=0, extra_body={"chat_template_kwargs": OFF})
        without = await p.client.chat.completions.create(model="thinking", messages=MESSAGES, max_tokens=4,
                                                         temperature=0)
        assert with_kw.usage.prompt_tokens == len(engine._bundle.encode(off))
        assert without.usage.prompt_tokens == len(engine._bundle.encode(plain)) < with_kw.usage.prompt_tokens
        same = await p.client.completions.create(model="thinking", prompt=off, max_tokens=4, temperature=0)
        assert with_kw.choices[0].message.content == same.choices[0].text  # the worker ran exactly that prompt
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as http:
            counted = await http.post("/tokenize", json={"model": "thinking", "messages": MESSAGES,
                                                         "chat_template_kwargs": OFF})
        assert counted.status_code == 200 and counted.json()["count"] == with_kw.usage.prompt_tokens
        for bad in ({"add_generation_prompt": False}, {"tools": []}):
            with pytest.raises(openai.BadRequestError) as err:
                await p.client.chat.completions.create(model="thinking", messages=MESSAGES, max_tokens=2,
                                                       extra_body={"chat_template_kwargs": bad})
            assert err.value.body["param"] == "chat_template_kwargs", err.value.body


async def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(plane, state, checkpoint):
    """vLLM's reasoning_effort (chat) and reasoning.effort (Responses): the template gets
    `reasoning_effort`, and `enable_thinking` false for "none" unless chat_template_kwargs sets it."""
    from polyserve.proto import Deployment
    await state.put_deployment(Deployment(id="thinking", model=str(checkpoint), engine="hf"))
    worker = {"engine": "hf", "model": "thinking", "model_path": str(checkpoint), "deployment": "thinking"}
    async with plane(worker_kw=worker) as p:
        engine = p.worker.engine

        async def counted(**extra) -> int:
            out = await p.client.chat.completions.create(model="thinking", messages=MESSAGES, max_tokens=2,
                                                         temperature=0, extra_body=extra)
            return out.usage.prompt_tokens

        def expect(kw: dict) -> int:
            return len(engine._bundle.encode(engine.chat_prompt(MESSAGES, extra=kw)))

        assert await counted(reasoning_effort="none") == expect({"enable_thinking": False, "reasoning_effort": "none"})
        assert await counted(reasoning_effort="high") == expect({"enable_thinking": True, "reasoning_effort": "high"})
        assert await counted(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == \
            expect({"enable_thinking": True, "reasoning_effort": "none"})  # the request's kwargs win on that one
        r = await p.client.responses.create(model="thinking", input="name a colour", max_output_tokens=2,
                                            reasoning={"effort": "none"})
        assert r.reasoning.effort == "none"
        assert r.usage.input_tokens == expect({"enable_thinking": False, "reasoning_effort": "none"})
        with pytest.raises(openai.BadRequestError):
            await counted(reasoning_effort="extreme")
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.responses.create(model="thinking", input="hi", max_output_tokens=2,
                                            reasoning={"effort": "low", "summary": "auto"})
        assert "summary" in str(err.value)
