"""A thinking model's reasoning apart from its answer (gateway/reasoning.py), end to end with the
official `openai` client: gateway -> openai-http worker -> an upstream speaking vLLM's wire.

* `qwen3`: the upstream's own reasoning parser sent `reasoning` beside `content`; the worker passes
  it on between `<think>` tags and the gateway splits it off again into `message.reasoning`
  (streamed: `delta.reasoning`), or leaves it out with `include_reasoning: false`;
* `deepseek_r1`: a raw answer (a transcript completed on /v1/completions) that starts inside the
  thinking, `</think>` ending it;
* no parser: the model's text as it came, tags and all."""
from __future__ import annotations

import pytest

from polyserve.proto import Deployment
from tests.integration.test_openai_http_chat import CHAT_OUT, StandIn, _worker

pytestmark = pytest.mark.integration
ASK = [{"role": "user", "content": "hi"}]


async def _both(p) -> tuple[tuple, tuple]:
    """(reasoning, content) of a whole answer and of the same answer streamed."""
    whole = (await p.client.chat.completions.create(model="up", messages=ASK, max_tokens=8)).choices[0].message
    stream = await p.client.chat.completions.create(model="up", messages=ASK, max_tokens=8, stream=True)
    r, c = "", ""
    async for chunk in stream:
        for ch in chunk.choices:
            r += (ch.delta.model_extra or {}).get("reasoning") or ""
            assert not (c and (ch.delta.model_extra or {}).get("reasoning")), "reasoning after the content"
            c += ch.delta.content or ""
    return ((whole.model_extra or {}).get("reasoning"), whole.content), (r or None, c)


async def test_qwen3_reasoning_from_the_upstreams_parser_is_the_messages_reasoning(plane, state):
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http", reasoning_parser="qwen3"))
    with StandIn(reasoning=True) as up:
        async with plane(worker_kw=_worker(up)) as p:
            whole, streamed = await _both(p)
            assert whole == streamed == (CHAT_OUT[0], "".join(CHAT_OUT[1:]))
            quiet = await p.client.chat.completions.create(model="up", messages=ASK, max_tokens=8,
                                                           extra_body={"include_reasoning": False})
            assert "reasoning" not in (quiet.choices[0].message.model_extra or {})
            assert quiet.choices[0].message.content == "".join(CHAT_OUT[1:])
            raw = await p.client.completions.create(model="up", prompt="hi", max_tokens=3)
            assert "reasoning" not in (raw.choices[0].model_extra or {})  # completions stay raw text


async def test_deepseek_r1_answers_start_inside_the_thinking(plane, state):
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http",
                                          reasoning_parser="deepseek_r1"))
    out = ["add the ", "digits</th", "ink>\n\n", "It is ", "7."]
    with StandIn(completion_out=out, finish="stop") as up:
        async with plane(worker_kw={**_worker(up), "upstream_chat": "completions"}) as p:
            whole, streamed = await _both(p)
    assert whole == streamed == ("add the digits", "It is 7.")


async def test_without_a_parser_the_answer_is_the_models_text(plane, state):
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(reasoning=True) as up:
        async with plane(worker_kw=_worker(up)) as p:
            whole, streamed = await _both(p)
    assert whole == streamed == (None, f"<think>{CHAT_OUT[0]}</think>" + "".join(CHAT_OUT[1:]))


async def test_a_forced_call_comes_after_the_thinking(plane, state):
    """deepseek_r1 reads an answer as thinking from its first token; a constraint (here a forced tool
    call: a completion of the transcript under the call's schema) applies after the thinking, as an
    upstream vLLM with its own reasoning parser enforces it: the raw text thinks, closes the thinking,
    then holds the call, which is read from the content only."""
    import json

    from tests.integration.test_openai_http_chat import WEATHER
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http",
                                          reasoning_parser="deepseek_r1"))
    out = ["I should ask", " for Oslo</th", "ink>\n\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}']
    with StandIn(completion_out=out, finish="stop") as up:
        async with plane(worker_kw=_worker(up)) as p:
            for stream in (False, True):
                out = await p.client.chat.completions.create(model="up", messages=ASK, tools=[WEATHER],
                                                             tool_choice="required", max_tokens=30, stream=stream)
                if stream:
                    chunks = [ch.delta async for c in out for ch in c.choices]
                    args = "".join(tc.function.arguments or "" for d in chunks for tc in d.tool_calls or [])
                    thought = "".join((d.model_extra or {}).get("reasoning") or "" for d in chunks)
                else:
                    args = out.choices[0].message.tool_calls[0].function.arguments
                    thought = out.choices[0].message.model_extra["reasoning"]
                assert json.loads(args) == {"city": "Oslo"} and thought == "I should ask for Oslo"


async def test_the_responses_api_returns_the_thinking_as_a_reasoning_item(plane, state):
    """/v1/responses: a reasoning output item (its text one `reasoning_text` part) ahead of the
    message, whole and streamed: the reasoning item's events end before the message's begin (the
    stand-in's answers end "length": the response is `incomplete`)."""
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http", reasoning_parser="qwen3"))
    with StandIn(reasoning=True) as up:
        async with plane(worker_kw=_worker(up)) as p:
            whole = await p.client.responses.create(model="up", input="hi", max_output_tokens=8)
            events = [e async for e in await p.client.responses.create(model="up", input="hi", max_output_tokens=8,
                                                                         stream=True)]
    streamed = events[-1].response
    for r in (whole, streamed):
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == CHAT_OUT[0] and r.output_text == "".join(CHAT_OUT[1:])
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == CHAT_OUT[0]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "".join(CHAT_OUT[1:])


async def test_a_forced_call_on_the_responses_api_follows_a_reasoning_item(plane, state):
    """/v1/responses with a forced function call on a deepseek_r1 deployment: a reasoning item, then
    the function_call item with the arguments written after the thinking, whole and streamed."""
    import json

    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http",
                                          reasoning_parser="deepseek_r1"))
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    out = ["Oslo, then", "</think>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}']
    with StandIn(completion_out=out, finish="stop") as up:
        async with plane(worker_kw=_worker(up)) as p:
            kw = dict(model="up", input="weather in Oslo?", tools=[tool], tool_choice="required",
                      max_output_tokens=30)
            whole = await p.client.responses.create(**kw)
            events = [e async for e in await p.client.responses.create(stream=True, **kw)]
    for r in (whole, events[-1].response):
        assert [o.type for o in r.output] == ["reasoning", "function_call"], r.output
        assert r.output[0].content[0].text == "Oslo, then" and json.loads(r.output[1].arguments) == {"city": "Oslo"}
