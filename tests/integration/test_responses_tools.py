"""Function tools and structured text on `/v1/responses` (services/gateway/responses_tools.py),
with the official `openai` client against a real gateway and sim worker: a forced call comes back
as a `function_call` item whose arguments match the tool's schema, its `function_call_output`
continues the stored conversation (the worker's prompt holds the call and the result), the
streamed call events in order (also through the client's `responses.stream` helper), a
stateless history with calls, `text.format` json_schema, and the 400s that name what to fix."""
from __future__ import annotations

import asyncio
import json
import os

import openai
import pytest

from tests.integration.conftest import MODEL
from tests.integration.test_responses import _prompts

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


def _city(arguments: str) -> str:
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12, args
    return args["city"]


async def test_a_forced_call_and_its_output_continue_the_conversation(plane, bus, subjects):
    prompts, sub = await _prompts(bus, subjects)
    async with plane() as p:
        r1 = await p.client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER, CLOCK],
                                             tool_choice={"type": "function", "name": "get_weather"},
                                             max_output_tokens=64)
        assert r1.status == "completed" and [o.type for o in r1.output] == ["function_call"], r1.output
        call = r1.output[0]
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
        _city(call.arguments)
        assert [t.name for t in r1.tools] == ["get_weather", "get_time"] and r1.output_text == ""
        assert (await p.client.responses.retrieve(r1.id)).output[0].call_id == call.call_id

        r2 = await p.client.responses.create(
            model=MODEL, previous_response_id=r1.id, tools=[WEATHER, CLOCK], max_output_tokens=8,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        assert r2.output[0].type == "message" and r2.output_text
        await bus.nc.flush()
        assert len(prompts) == 2
        listed = prompts[0].split("\n")[0]
        assert listed.startswith("system: To call a tool") and "get_weather" in listed and "get_time" in listed
        assert f'assistant: {{"name": "get_weather", "arguments": {call.arguments}}}' in prompts[1]
        assert prompts[1].endswith("user: Weather in Paris?\n" f'assistant: {{"name": "get_weather", "arguments": '
                                   f"{call.arguments}}}\ntool: sunny, 21 C\nassistant:")

        # `required` with one tool: the same kind of call; a result for a call never made: a 400 naming it
        r3 = await p.client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                             store=False, max_output_tokens=64)
        assert r3.output[0].type == "function_call" and _city(r3.output[0].arguments) is not None
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.responses.create(model=MODEL, previous_response_id=r1.id, input=[
                {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
        assert err.value.body["param"] == "input[0].call_id" and "call_nope" in err.value.body["message"]
    await sub.unsubscribe()


async def test_a_streamed_call_sends_the_call_events_in_order(plane):
    async with plane() as p:
        stream = await p.client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                                 tool_choice="required", stream=True, max_output_tokens=64)
        events = [e async for e in stream]
        assert [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        added, delta, done, item_done, final = events[2], events[3], events[4], events[5], events[6].response
        assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
        assert delta.delta == done.arguments == item_done.item.arguments == final.output[0].arguments
        assert delta.item_id == added.item.id == final.output[0].id
        _city(final.output[0].arguments)
        stored = await p.client.responses.retrieve(final.id)
        assert stored.output[0].call_id == final.output[0].call_id

        # the client's own stream helper accumulates the same call
        async with p.client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                             tool_choice="required", max_output_tokens=64) as s:
            async for _ in s:
                pass
            got = await s.get_final_response()
        assert got.output[0].type == "function_call" and got.output[0].name == "get_weather"

        # with tools listed but text answered (auto, the sim's words): the message events, text intact
        stream = await p.client.responses.create(model=MODEL, input="Hello", tools=[WEATHER], stream=True,
                                                 max_output_tokens=16, extra_body={"seed": 1})
        events = [e async for e in stream]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[2].type == "response.output_item.added" and events[2].item.type == "message"
        assert deltas and deltas == events[-1].response.output_text


async def test_a_stateless_history_with_calls_and_a_json_schema_format(plane, bus, subjects):
    prompts, sub = await _prompts(bus, subjects)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    async with plane() as p:
        r = await p.client.responses.create(model=MODEL, store=False, max_output_tokens=64, tools=[WEATHER],
                                            text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
                                            input=[{"role": "user", "content": "Weather in Lima?"},
                                                   {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                    "arguments": '{"city": "Lima"}'},
                                                   {"type": "function_call_output", "call_id": "c1",
                                                    "output": [{"type": "input_text", "text": "fog"}]}])
        answer = json.loads(r.output_text)
        assert set(answer) == {"answer"} and len(answer["answer"]) <= 20
        assert r.text.format.type == "json_schema"
        await bus.nc.flush()
        assert prompts[0].endswith('user: Weather in Lima?\nassistant: {"name": "get_weather", "arguments": '
                                   '{"city": "Lima"}}\ntool: fog\nassistant:')
    await sub.unsubscribe()


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
])
async def test_what_is_wrong_is_a_400_naming_it(plane, fields, param):
    async with plane() as p:
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.responses.create(model=MODEL, **{"input": "hi", **fields})
        assert err.value.body["param"] == param, err.value.body
        await asyncio.sleep(0)
        assert p.gateway.gs.inflight == 0


BAD_BODIES = [
    {"tools": "get_weather"}, {"tools": [1]}, {"tools": [{"type": "function"}]},
    {"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, {"tools": [WEATHER], "tool_choice": 5},
    {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}},
    {"text": "json"}, {"text": {"format": "json"}}, {"text": {"format": {"type": "grammar"}}},
    {"include": "message.output_text.logprobs"}, {"top_logprobs": "2", "include": ["message.output_text.logprobs"]},
    {"input": ["hi"]}, {"input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": 1}}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": 7}]},
    {"input": [{"type": "function_call_output", "output": "x"}]},
]


async def test_malformed_tool_fields_are_400s_never_500s(plane):
    """Each malformed body is a 400 with a `param` (OpenAI's error shape), and leaves no slot taken."""
    async with plane() as p:
        for fields in BAD_BODIES:
            with pytest.raises(openai.BadRequestError) as err:
                await p.client.responses.create(model=MODEL, **{"input": "hi", "max_output_tokens": 3, **fields})
            assert err.value.body.get("param"), (fields, err.value.body)
        await asyncio.sleep(0)
        assert p.gateway.gs.inflight == 0
        ok = await p.client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        assert ok.output_text
