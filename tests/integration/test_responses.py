"""`/v1/responses` (services/gateway/responses.py) with the official `openai` client against a
real gateway and sim worker: a two-turn conversation through previous_response_id (the
worker's prompt of the second turn holds the first), retrieve and delete, the streamed
events in order, max_output_tokens -> incomplete, store=false, unknown ids (404 in OpenAI's
error shape) and the compatibility table of the endpoint (refused fields: 400 naming them)."""
from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any

import openai
import pytest

from polyserve.gateway.compat_table import REFUSED, TABLES
from polyserve.proto import GenerateRequest
from polyserve.shared.bus import decode
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def _prompts(bus, subjects) -> tuple[list[str], Any]:
    """The prompts the worker receives (a copy of every GenerateRequest sent to w-test)."""
    seen: list[str] = []

    async def grab(msg) -> None:
        seen.append(decode(msg.data, GenerateRequest).prompt)

    sub = await bus.nc.subscribe(subjects.generate("w-test"), cb=grab)
    await bus.nc.flush()
    return seen, sub


async def test_two_turn_conversation_retrieve_and_delete(plane, bus, subjects):
    prompts, sub = await _prompts(bus, subjects)
    async with plane() as p:
        r1 = await p.client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                             max_output_tokens=5, metadata={"k": "v"})
        assert r1.id.startswith("resp_") and r1.object == "response" and r1.model == MODEL
        assert r1.status in ("completed", "incomplete")
        item = r1.output[0]
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        assert r1.output_text and r1.metadata == {"k": "v"}
        assert r1.usage.total_tokens == r1.usage.input_tokens + r1.usage.output_tokens > 0

        got = await p.client.responses.retrieve(r1.id)
        assert (got.id, got.output_text, got.metadata) == (r1.id, r1.output_text, {"k": "v"})

        r2 = await p.client.responses.create(model=MODEL, previous_response_id=r1.id, max_output_tokens=5, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}])
        assert r2.previous_response_id == r1.id and r2.output_text
        # the second turn's prompt holds the first turn (input and answer), not its instructions
        await bus.nc.flush()
        assert len(prompts) == 2, prompts
        assert "system: Be brief." in prompts[0]
        assert f"user: My name is Ada.\nassistant: {r1.output_text}\nuser: What is my name?\nassistant:" \
            == prompts[1]
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens - 4

        await p.client.responses.delete(r2.id)
        with pytest.raises(openai.NotFoundError):
            await p.client.responses.retrieve(r2.id)
        with pytest.raises(openai.NotFoundError):
            await p.client.responses.delete(r2.id)
    await sub.unsubscribe()


async def test_streamed_events(plane):
    async with plane() as p:
        stream = await p.client.responses.create(model=MODEL, input="Tell me about GPUs.", stream=True,
                                                 max_output_tokens=4096, extra_body={"seed": 3})
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert deltas
        assert kinds == STREAM_ORDER + ["response.output_text.delta"] * len(deltas) + STREAM_END + \
            ["response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        text = "".join(deltas)
        assert events[-4].text == text and final.output_text == text and final.status == "completed"
        assert final.usage.output_tokens > 0
        assert (await p.client.responses.retrieve(final.id)).output_text == text

        # cut at max_output_tokens: incomplete, streamed and not
        stream = await p.client.responses.create(model=MODEL, input="hi", stream=True, max_output_tokens=1)
        events = [e async for e in stream]
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"
        r = await p.client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete" and r.usage.output_tokens == 1


async def test_store_false_and_unknown_ids(plane):
    async with plane() as p:
        r = await p.client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=3)
        assert r.store is False and r.output_text
        with pytest.raises(openai.NotFoundError):
            await p.client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError) as err:
            await p.client.responses.create(model=MODEL, input="again", previous_response_id=r.id)
        assert err.value.body == {"message": f"Previous response with id '{r.id}' not found.",
                                  "type": "not_found_error", "param": "previous_response_id",
                                  "code": "previous_response_not_found"}
        with pytest.raises(openai.NotFoundError):
            await p.client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
        with pytest.raises(openai.NotFoundError) as err:
            await p.client.responses.create(model="no-such-model", input="x")
        assert err.value.body["param"] == "model"


def _rows() -> list[tuple[str, Any, str]]:
    out = []
    for name, rule in TABLES["responses"].items():
        if rule.example is not None:
            out.append((name, rule.example, rule.status_for("sim")))
        out += [(name, v, "honoured") for v in rule.noop if v is not None]
    return out


async def _try(create, name: str, value: Any, status: str) -> str | None:
    """One field against the gateway: what is wrong, or None."""
    kw: dict[str, Any] = {name: value}
    if name not in inspect.signature(create).parameters:
        kw = {"extra_body": kw}
    kw.setdefault("max_output_tokens", 3)
    try:
        out = await create(model=MODEL, input="hello", **kw)
    except openai.BadRequestError as err:
        if status != REFUSED:
            return f"{name}={value!r}: 400 ({err.message}), but the table says {status}"
        return None if err.body.get("param") == name else f"{name}={value!r}: 400 names {err.body.get('param')!r}"
    if isinstance(out, openai.AsyncStream):
        out = [e async for e in out][-1].response
    if status == REFUSED:
        return f"{name}={value!r}: accepted, but the table says refused"
    return None if out.output_text else f"{name}={value!r}: no text"


async def test_fields_walk_the_matrix(plane):
    async with plane() as p:
        failures = [f for name, value, status in _rows()
                    if (f := await _try(p.client.responses.create, name, value, status))]
        assert not failures, "\n".join(failures)


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call_output", "call_id": "c", "output": "x"}, "input[0].call_id"),  # answers no call
    ({"type": "computer_call_output", "call_id": "c", "output": {}}, "input[0]"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input[0].content[0]"),
    ({"role": "critic", "content": "x"}, "input[0].role"),
])
async def test_refused_input_items(plane, item, param):
    async with plane() as p:
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.responses.create(model=MODEL, input=[item])
        assert err.value.body["param"] == param
        # a refused request leaves no slot taken
        await asyncio.sleep(0)
        assert p.gateway.gs.inflight == 0


async def test_output_logprobs_whole_and_streamed(plane):
    """include message.output_text.logprobs (+ top_logprobs): one entry per output token in the
    output_text part, streamed in the deltas, whose entries add up to the done event's."""
    async with plane() as p:
        r = await p.client.responses.create(model=MODEL, input="hi", max_output_tokens=6, top_logprobs=2,
                                            include=["message.output_text.logprobs"])
        lps = r.output[0].content[0].logprobs
        assert len(lps) == r.usage.output_tokens == 6 and "".join(e.token for e in lps) == r.output_text
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)
        stream = await p.client.responses.create(model=MODEL, input="hi", max_output_tokens=6, stream=True,
                                                 include=["message.output_text.logprobs"])
        events = [e async for e in stream]
        streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        done = next(e for e in events if e.type == "response.output_text.done")
        assert len(streamed) == 6 and [x.token for x in streamed] == [x.token for x in done.logprobs]
        assert events[-1].response.output[0].content[0].logprobs[0].token == streamed[0].token
        plain = await p.client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        assert plain.output[0].content[0].logprobs == []
        for kw, param in (({"top_logprobs": 2}, "top_logprobs"), ({"include": ["reasoning.encrypted_content"]},
                                                                    "include"),
                          ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs")):
            with pytest.raises(openai.BadRequestError) as err:
                await p.client.responses.create(model=MODEL, input="hi", **kw)
            assert err.value.body["param"] == param
