"""Structured outputs and tool calls end to end with the official `openai` client: an hf
worker (the small random Llama: constrained decoding makes valid output certain even with
random weights), and the sim worker's simulated JSON."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tests.integration.conftest import MODEL  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]
HF = {"engine": "hf", "model": "tiny-llama-random", "deployment": MODEL}
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "what is the weather in paris?"}]


async def test_hf_json_schema_strict_validates_100_of_100(plane):
    async with plane(worker_kw=HF) as p:
        rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

        async def five(i: int):
            return await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, n=5,
                                                          temperature=1.0, seed=i, response_format=rf)
        outs = await asyncio.gather(*(five(i) for i in range(20)))
        choices = [c for out in outs for c in out.choices]
        assert len(choices) == 100
        for c in choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
            assert c.finish_reason == "stop"


async def test_hf_forced_tool_call_streamed_and_not(plane):
    async with plane(worker_kw=HF) as p:
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, tools=[WEATHER, OTHER], seed=3,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        out = await p.client.chat.completions.create(**kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        name, args, finish, role = "", "", None, None
        async for chunk in await p.client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                role = role or c.delta.role
                for tc in c.delta.tool_calls or []:
                    name += tc.function.name or ""
                    args += tc.function.arguments or ""
                finish = c.finish_reason or finish
        assert (role, name, finish) == ("assistant", "get_weather", "tool_calls")
        assert json.loads(args) == json.loads(call.function.arguments)  # the same seed, the same call

        out = await p.client.chat.completions.create(**{**kw, "tool_choice": "required"})
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "noop")
        # the call and its result go back into the conversation
        follow = await p.client.chat.completions.create(model=MODEL, max_tokens=3, tools=[WEATHER], messages=[
            *MESSAGES, {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        assert follow.choices[0].message.content is not None


async def test_hf_json_object_regex_and_choice(plane):
    async with plane(worker_kw=HF) as p:
        out = await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, n=4,
                                                     response_format={"type": "json_object"})
        for c in out.choices:  # random weights rarely close an open object: valid when it ends, else cut
            assert c.message.content.startswith("{")
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.message.content), dict)
        out = await p.client.completions.create(model=MODEL, prompt="pick", max_tokens=8, n=4,
                                                extra_body={"guided_choice": ["yes", "no"]})
        assert {c.text for c in out.choices} <= {"yes", "no"}
        out = await p.client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                                extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
        assert len(out.choices[0].text) == 3 and out.choices[0].text.isdigit()
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                              extra_body={"guided_regex": "a", "guided_choice": ["a"]})
        assert err.value.body["param"] == "guided_choice"
        with pytest.raises(openai.BadRequestError):
            await p.client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                              extra_body={"guided_regex": "(unclosed"})


async def test_sim_json_schema_and_tool_call(plane):
    async with plane() as p:
        rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        out = await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, n=3,
                                                     response_format=rf)
        for c in out.choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
        out = await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                                     tools=[WEATHER], tool_choice="required")
        (call,) = out.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        text = ""
        async for chunk in await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                                                  response_format={"type": "json_object"},
                                                                  stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        assert json.loads(text) == {"simulated": True}
