"""Tool calls of `tool_choice: auto` in the formats instruct models are trained to write (what
vLLM's hermes, mistral and llama3_json tool parsers read), beside the gateway's own bare JSON:
taken as calls when the answer is only calls, several as parallel calls, streamed and not;
anything else stays content."""
from __future__ import annotations

import json

import pytest

from polyserve.gateway import tools

pytestmark = pytest.mark.unit
TOOLS = tools.Tools({"get_weather": {"name": "get_weather"}, "get_time": {"name": "get_time"}}, "auto")
W = {"city": "Oslo"}


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", W)]),  # the gateway's own
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', [("get_weather", W)]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [("get_weather", W), ("get_time", {})]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [("get_weather", W)]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", W)]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", W)]),  # Llama 3.1 JSON
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', [("get_weather", W)]),  # args as a string
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     [("get_time", {}), ("get_weather", W)]),
])
def test_an_answer_that_is_only_calls_is_taken_in_each_format(text, calls):
    parsed = TOOLS.parse(text)
    assert [(n, json.loads(a)) for n, a in parsed] == calls


@pytest.mark.parametrize("text", [
    "It is sunny in Oslo.",
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> and then I checked',  # text besides
    '{"name": "delete_everything", "arguments": {}}',  # not a listed tool
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "nope"}</tool_call>',
    '{"name": "get_weather", "arguments": [1, 2]}',
    "[1] first point",
    "<b>bold</b>",
])
def test_anything_else_stays_content(text):
    assert TOOLS.parse(text) is None


def _stream(pieces: list[str]) -> list[dict]:
    ts, out = tools.ToolStream(TOOLS), []
    for j, piece in enumerate(pieces):
        last = j == len(pieces) - 1
        body = {"id": "c", "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": piece} if j == 0 else {"content": piece},
            "finish_reason": "stop" if last else None, "logprobs": None}]}
        out += ts.feed(body)
    return out


def test_streamed_native_calls_are_held_and_sent_as_parallel_tool_call_chunks():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    chunks = _stream([text[i:i + 7] for i in range(0, len(text), 7)])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    heads = [tc for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_weather"), (1, "get_time")]
    args = {tc["index"]: tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])
            if "id" not in tc}
    assert json.loads(args[0]) == W and json.loads(args[1]) == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_text_is_released_as_soon_as_it_cannot_be_a_call():
    chunks = _stream(["<t", ">bold", "</t> and more", " text"])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "<t>bold"}  # held only while "<t"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "<t>bold</t> and more text"
    assert _stream(["Sunny", " today"])[0]["choices"][0]["delta"]["content"] == "Sunny"  # prose: not held
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("text, content", [
    ("Let me look that up.\n" + CALL, "Let me look that up.\n"),
    ('I will check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "I will check. "),
    ('Checking.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "Checking."),
    (CALL, ""),
])
def test_text_then_calls_in_a_marked_format_gives_the_text_and_the_calls(text, content):
    found = TOOLS.split(text)
    assert found is not None and found[0] == content and [(n, json.loads(a)) for n, a in found[1]] == \
        [("get_weather", W)]
    choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    tools.render_message(choice, TOOLS)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == (content or None)
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == W


@pytest.mark.parametrize("text", [
    'Here is the JSON: {"name": "get_weather", "arguments": {"city": "Oslo"}}',  # bare JSON after prose: content
    "Use <tool_call> tags like this: <tool_call>not json</tool_call>",
    "Checking. " + CALL + " done",  # text after the calls
    'Sure. <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a listed tool
])
def test_text_with_no_clean_calls_after_it_stays_content(text):
    assert TOOLS.split(text) is None
    chunks = _stream([text[i:i + 5] for i in range(0, len(text), 5)])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_text_then_calls_sends_the_text_then_tool_call_chunks():
    text = "Let me look that up.\n" + CALL
    for size in (1, 3, 7, len(text)):
        chunks = _stream([text[i:i + size] for i in range(0, len(text), size)])
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant"
        sent = "".join(d.get("content") or "" for d in deltas)
        assert sent == "Let me look that up.\n" and "<" not in sent  # no piece of the marker leaks as text
        args = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
        assert [json.loads(a) for a in args] == [W]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_marker_start_that_does_not_complete_is_released_with_the_next_chunk():
    chunks = _stream(["Tags like <tool", "s are fine"])
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["Tags like ", "<tools are fine"]
