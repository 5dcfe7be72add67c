"""`openai_http_chat.CallText`: an upstream's `tool_calls` (vLLM's chat wire: whole in `message`, or
streamed as an id and name, then argument fragments, per call `index`) become call text when the
choice ends, one `<tool_call>` block per call, which the gateway reads back as the calls (after the
choice's own text too); `with_tools` puts the chat wire's JSON-string arguments on earlier calls."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from polyserve.gateway import tools
from polyserve.worker.engines.openai_http_chat import CallText, has_tools, refuses_tools, with_tools

pytestmark = pytest.mark.unit


def _chunk(calls=None, finish=None):
    return NS(delta=NS(content=None, tool_calls=calls), finish_reason=finish)


def _call(index, name=None, args=None):
    return NS(index=index, id="x" if name else None, function=NS(name=name, arguments=args))


def _blocks(text: str) -> list:
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    return tools.calls_in(text)


def test_streamed_parallel_calls_are_blocks_the_gateway_reads_back_when_the_choice_ends():
    ct = CallText()
    feed = [_chunk([_call(0, "a", "")]), _chunk([_call(0, None, '{"x": ')]), _chunk([_call(1, "b", '{}')]),
            _chunk([_call(0, None, "1}")])]
    assert all(ct.feed(0, c) == "" for c in feed)
    text = ct.feed(0, _chunk(finish="tool_calls"))
    assert _blocks(text) == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    listed = tools.Tools({"a": {"name": "a"}, "b": {"name": "b"}}, "auto")
    said, calls = listed.split("I will call two tools. " + text)  # the choice's text, then its calls
    assert said == "I will call two tools. " and [n for n, _ in calls] == ["a", "b"]
    whole = NS(message=NS(tool_calls=[_call(None, "a", '{"y": 2}')]), finish_reason="tool_calls")
    assert _blocks(ct.feed(3, whole)) == [{"name": "a", "arguments": {"y": 2}}]
    assert ct.feed(1, _chunk(finish="stop")) == ""  # a choice without calls: its text only
    bad = CallText()
    bad.feed(0, _chunk([_call(0, "a", "{not json")]))
    text = bad.feed(0, _chunk(finish="tool_calls"))
    assert _blocks(text) == [{"name": "a", "arguments": "{not json"}]
    assert listed.split(text) is None  # arguments that are not JSON: the gateway returns it as text


def test_the_chat_wire_carries_arguments_as_strings_and_the_tools_with_auto():
    kw = {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c"}]}
    assert has_tools(kw["messages"], None) and not has_tools([{"role": "user", "content": "x"}], [])
    with_tools(kw, [{"type": "function", "function": {"name": "f"}}])
    assert kw["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert kw["tool_choice"] == "auto" and kw["tools"][0]["function"]["name"] == "f"
    no_tools = {"messages": [{"role": "user", "content": "x"}]}
    with_tools(no_tools, None)
    assert "tools" not in no_tools and "tool_choice" not in no_tools


def test_what_counts_as_an_upstream_without_tools():
    msg = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert refuses_tools(400, msg, answered_before=True)
    assert refuses_tools(500, "Internal Server Error", answered_before=False)
    assert not refuses_tools(500, "Internal Server Error", answered_before=True)
    assert not refuses_tools(400, "max_tokens is too large", answered_before=False)
