"""A thinking model's structured output is constrained after its thinking, not from its first
token (vLLM's structured outputs with a reasoning parser; gateway/reasoning.py `gate`, the hf
engine's hf_grammar.ThinkGate), end to end with the official `openai` client on an hf worker.

The checkpoint is the small random Llama with `<think>` and `</think>` added to its vocabulary (as
DeepSeek-R1's and Qwen3's are); `logit_bias` on `</think>` makes the random model end its thinking
at once, so what follows is certain: the grammar's text, read as the message's content. A prompt that
already closed the thinking (a template that writes `<think></think>` when `enable_thinking` is
false, as Qwen3's does) is constrained from the first token: the biased `</think>` is masked out.
Otherwise the template opens the thinking in the prompt, as DeepSeek-R1's does."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from polyserve.proto import Deployment  # noqa: E402
from tests.helpers import checkpoint_with_tokens  # noqa: E402
from tests.integration.test_structured_outputs import MESSAGES, SCHEMA, WEATHER  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant> "
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
            "{% endif %}")
RF = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer
    out = checkpoint_with_tokens(tmp_path_factory.mktemp("ckpt") / "thinker", ["<think>", "</think>"],
                                 chat_template=TEMPLATE)
    return out, AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids("</think>")


async def _plane(plane, state, checkpoint, parser: str):
    path, _ = checkpoint
    await state.put_deployment(Deployment(id="thinker", model=str(path), engine="hf", reasoning_parser=parser))
    return plane(worker_kw={"engine": "hf", "model": "thinker", "model_path": str(path), "deployment": "thinker"})


async def test_json_schema_and_a_forced_call_after_the_thinking(plane, state, checkpoint):
    close = checkpoint[1]
    kw = dict(model="thinker", messages=MESSAGES, max_tokens=60, temperature=0, logit_bias={str(close): 100})
    async with await _plane(plane, state, checkpoint, "deepseek_r1") as p:
        whole = (await p.client.chat.completions.create(response_format=RF, **kw)).choices[0]
        jsonschema.validate(json.loads(whole.message.content), SCHEMA)
        assert (whole.message.model_extra or {}).get("reasoning", "").strip() == "" and whole.finish_reason == "stop"
        content, thought = "", ""
        async for chunk in await p.client.chat.completions.create(response_format=RF, stream=True, **kw):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                thought += (ch.delta.model_extra or {}).get("reasoning") or ""
        assert content == whole.message.content and not thought.strip()
        # a forced tool call: the call after the thinking, its arguments valid
        call = (await p.client.chat.completions.create(tools=[WEATHER], tool_choice="required", **kw)).choices[0]
        assert call.finish_reason == "tool_calls", call
        jsonschema.validate(json.loads(call.message.tool_calls[0].function.arguments),
                            WEATHER["function"]["parameters"])
        # /v1/responses (no logit_bias there): the random model never closes its thinking in 30 tokens,
        # so the reasoning item holds free text and the message is empty and incomplete; constrained
        # from the first token (as before the gate) it would have been JSON at once
        r = await p.client.responses.create(model="thinker", input="what is the weather in paris?", temperature=0,
                                            max_output_tokens=30, text={"format": {"type": "json_schema",
                                                                                   "name": "thing", "schema": SCHEMA}})
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "incomplete", r.output
        assert r.output[0].content[0].text.strip() and r.output_text == ""
        # the raw answer (no parser) shows the thinking's end, then the JSON: it was not constrained at first
        raw = await p.client.completions.create(model="thinker", prompt="<user> hi <assistant> ", max_tokens=6,
                                                temperature=0, logit_bias={str(close): 100},
                                                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert raw.choices[0].text in ("yes", "no")  # completions: constrained from the first token, as before


async def test_a_prompt_that_closed_the_thinking_is_constrained_at_once(plane, state, checkpoint):
    close = checkpoint[1]
    async with await _plane(plane, state, checkpoint, "qwen3") as p:
        out = (await p.client.chat.completions.create(
            model="thinker", messages=MESSAGES, max_tokens=60, temperature=0, logit_bias={str(close): 100},
            response_format=RF, extra_body={"chat_template_kwargs": {"enable_thinking": False}})).choices[0]
        jsonschema.validate(json.loads(out.message.content), SCHEMA)  # `</think>` was masked: JSON from token 1
        assert "reasoning" not in (out.message.model_extra or {})


async def test_a_thinking_budget_closes_the_thinking_and_the_answer_follows(plane, state, checkpoint):
    """vLLM's thinking_token_budget: the random model would think to max_tokens; with a budget of 5
    the worker forces `</think>` after 5 thinking tokens and the JSON follows, whole and streamed."""
    async with await _plane(plane, state, checkpoint, "deepseek_r1") as p:
        kw = dict(model="thinker", messages=MESSAGES, max_tokens=80, temperature=0, response_format=RF,
                  extra_body={"thinking_token_budget": 5})
        out = await p.client.chat.completions.create(**kw)
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        assert out.choices[0].message.model_extra["reasoning"].strip()
        content = "".join([ch.delta.content or "" async for c in await p.client.chat.completions.create(
            stream=True, **kw) for ch in c.choices])
        assert content == out.choices[0].message.content
        free = await p.client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                                      extra_body={"thinking_token_budget": 3})
        assert free.choices[0].message.model_extra["reasoning"].strip() and free.choices[0].message.content is not None


async def test_a_thinking_budget_without_a_parser_is_a_400(plane, state, checkpoint):
    import openai
    async with await _plane(plane, state, checkpoint, "") as p:
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=4,
                                                   extra_body={"thinking_token_budget": 3})
        assert err.value.body["param"] == "thinking_token_budget", err.value.body
        with pytest.raises(openai.BadRequestError) as err:  # completions: not served (raw text)
            await p.client.completions.create(model="thinker", prompt="hi", max_tokens=4,
                                              extra_body={"thinking_token_budget": 3})
        assert err.value.body["param"] == "thinking_token_budget", err.value.body
