"""Chats of the `openai-http` engine sent as chats: the upstream's `POST /v1/chat/completions`.

A chat reaches the worker as its messages (`GenerateRequest.chat`). With a chat template in the
worker's own checkpoint directory (`upstream_tokenizer` / `model_path`) the engine formats them
itself and sends a completion (`OpenAIHttpEngine.chat_prompt`). Without one, the upstream is the
only place that knows the model's template, so the messages go to its chat endpoint, as a client
of `vllm serve` would send them (`upstream_chat`, the setting):

- `auto` (default): chats go to /v1/chat/completions until the upstream shows it cannot take
  them: the endpoint is absent (404, 405, 501), its answer names a missing chat template (vLLM's
  400 "you must provide a chat template"), or it fails (5xx) before it has ever answered a chat
  (`transformers serve` answers a bare 500 for a checkpoint without a template). Then that
  request and every later chat go to /v1/completions with the gateway's transcript, logged once
  and shown in the model card. Once a chat has been answered, later errors are the request's own.
- `chat`: always the chat endpoint (its errors reach the client); `completions`: always the
  transcript (the behaviour before chats were sent as chats).

The body is the completion's, moved onto the chat wire (`chat_body`): `messages` instead of
`prompt`; `logprobs: true` + `top_logprobs: k` instead of `logprobs: k`; structured outputs under
vLLM's `structured_outputs` (JSON too: `transformers serve` ignores a chat's `response_format`
with only a logged warning, but refuses an unknown field with 422, so nothing is dropped
silently). A chat's end (`EngineRequest.chat_end`) goes as vLLM's `add_generation_prompt: false`
("closed") and `continue_final_message: true` ("continue"). A migrated stream
(`EngineRequest.continuation`) continues the assistant's message with `continue_final_message`
(after a "closed" chat too, the nearest the chat wire has); a server without those fields refuses
the request with its error, which reaches the client.
Requests with prompt logprobs (`echo`) are completions: chats have no echo.

Tool chats (tools listed, or earlier calls and results) go to the chat endpoint too, with `tools`
and `tool_choice: "auto"`, so the upstream formats them with the model's template and reads the
model's calls with its own tool parser (vLLM's `--tool-call-parser`). The upstream's `tool_calls`
come back as text in a call format the gateway reads (`CallText`: one Hermes-style
`<tool_call>{"name", "arguments"}</tool_call>` block per call, after the choice's own text) with
finish reason "stop", which the gateway turns back into tool calls and the text before them into
the message's content (gateway/tools.py). A forced call (`tool_choice` required or named: the request carries the call's
JSON schema as its structured output) stays a completion of the gateway's transcript under that
schema. In `auto`, an upstream that will not take tools on its chat endpoint (vLLM without
`--enable-auto-tool-choice`: a 400 naming tool choice; or a 5xx before any tool chat was answered)
sends tool chats as transcripts from then on, logged once and shown in the model card (`tools`).

Answers: a chunk's `delta` (a whole answer's `message`) `content`, after any `reasoning` text
(vLLM with a reasoning parser splits it off; it comes back between `<think>` and `</think>`,
`ThinkText`, as on /v1/completions);
logprobs from `logprobs.content` (openai_http_wire.entries reads both shapes).
"""
from __future__ import annotations

import json
from typing import Any

CHAT_MODES = ("auto", "chat", "completions")
_ABSENT = (404, 405, 501)


def chat_body(kw: dict, extra: dict, messages: list[dict], continuation: str, end: str = "open",
              style: str = "structured_outputs") -> tuple[dict, dict]:
    """The completion body `(kw, extra)` (OpenAIHttpEngine.request_body) as a chat's, ending as
    `end` (GenerateRequest.chat_end) says with vLLM's fields."""
    kw, extra = dict(kw), dict(extra)
    kw.pop("prompt", None)
    msgs = list(messages)
    if end != "open":
        extra["add_generation_prompt"] = False
    if end == "continue" and continuation:
        msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + continuation}
    elif continuation:
        msgs.append({"role": "assistant", "content": continuation})
    if end == "continue" or continuation:
        extra.update(continue_final_message=True, add_generation_prompt=False)
    kw["messages"] = msgs
    k = extra.pop("logprobs", None)
    if k is not None:
        kw["logprobs"], kw["top_logprobs"] = True, int(k)
    fmt = extra.get("response_format")
    if fmt is not None and style == "structured_outputs":
        del extra["response_format"]
        if fmt.get("type") == "json_object":
            extra["structured_outputs"] = {"json_object": True}
        else:
            extra["structured_outputs"] = {"json": fmt["json_schema"]["schema"]}
    return kw, extra


class ThinkText:
    """The text of a completion choice, a chat chunk's delta or a whole chat answer's message. An
    upstream's `reasoning` (vLLM with a reasoning parser splits it off) goes back between `<think>`
    and `</think>`, ahead of the content, as the model wrote it: a deployment with a
    `reasoning_parser` splits it off again at the gateway (gateway/reasoning.py), one without one
    shows the model's raw text. `gated` (a constraint after the thinking: proto SamplingParams.think):
    an answer with no reasoning gets an empty `<think></think>` ahead of its content, so the gateway
    reads the constrained content as content (the upstream's parser took the thinking, or there was none)."""

    def __init__(self, gated: str = "") -> None:
        self._open: set[int] = set()  # choices whose reasoning has begun and not ended
        self._empty = gated  # gated: the empty thinking ("<think></think>") owed to an answer without one
        self._fresh: set[int] = set()  # gated: choices that have sent text

    @classmethod
    def of(cls, params: Any) -> "ThinkText":
        return cls(gated="".join(params.think) if params.structured else "")

    def text(self, index: int, choice: Any) -> str:
        text = getattr(choice, "text", None)
        if text is not None:
            return text
        part = getattr(choice, "delta", None) or getattr(choice, "message", None)
        reasoning = (getattr(part, "reasoning", None) or getattr(part, "reasoning_content", None) or "") if part else ""
        content = (getattr(part, "content", None) or "") if part else ""
        out = ""
        if self._empty and index not in self._fresh and (reasoning or content):
            self._fresh.add(index)
            out = "" if reasoning else self._empty
        if reasoning:
            out += reasoning if index in self._open else "<think>" + reasoning
            self._open.add(index)
        if index in self._open and (content or getattr(choice, "finish_reason", None)):
            out += "</think>"
            self._open.discard(index)
        return out + content


def refuses_chats(status: int, message: str, answered_before: bool) -> bool:
    """Whether an error answer of the chat endpoint means this upstream cannot take chats."""
    low = message.lower()
    if status in _ABSENT or "chat template" in low or "chat_template" in low:
        return True
    return status >= 500 and not answered_before


def has_tools(messages: list[dict] | None, tools: list[dict] | None) -> bool:
    """Whether a chat lists tools or holds earlier calls or results."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages or ())


def with_tools(kw: dict, tools: list[dict] | None) -> None:
    """A chat body (`chat_body`'s kw) as a tool chat: its tools with tool_choice auto, and the
    earlier calls' arguments as the JSON strings the chat wire carries (a template takes objects)."""
    kw["messages"] = [_wire_message(m) for m in kw["messages"]]
    if tools:
        kw["tools"], kw["tool_choice"] = tools, "auto"


def _wire_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c.get("function") or {})
        if not isinstance(fn.get("arguments"), str):
            fn["arguments"] = json.dumps(fn.get("arguments", {}))
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}


def refuses_tools(status: int, message: str, answered_before: bool) -> bool:
    """Whether an error answer to a tool chat means this upstream takes no tools on its chat
    endpoint (vLLM: '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')."""
    return (400 <= status < 500 and "tool" in message.lower()) or (status >= 500 and not answered_before)


class CallText:
    """The upstream's `tool_calls` of each choice, gathered (streamed: the id and name, then
    fragments of the arguments) and given back as the gateway's call text when the choice ends."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[int, list]] = {}  # choice -> call index -> [name, argument fragments]

    def feed(self, index: int, choice: Any) -> str:
        part = getattr(choice, "delta", None) or getattr(choice, "message", None)
        for k, tc in enumerate(getattr(part, "tool_calls", None) or ()):
            at = getattr(tc, "index", None)
            entry = self._calls.setdefault(index, {}).setdefault(k if at is None else at, ["", []])
            fn = getattr(tc, "function", None)
            if getattr(fn, "name", None):
                entry[0] = fn.name
            if getattr(fn, "arguments", None):
                entry[1].append(fn.arguments)
        if getattr(choice, "finish_reason", None) is None or index not in self._calls:
            return ""
        calls = []
        for name, parts in (v for _, v in sorted(self._calls.pop(index).items())):
            raw = "".join(parts) or "{}"
            try:
                args = json.loads(raw)
            except ValueError:
                args = raw  # the gateway then sees text that is not a call, and returns it as text
            calls.append({"name": name, "arguments": args})
        # Hermes-style blocks: the gateway takes them as calls alone or after the choice's text
        # (`tools.split_calls`), so an upstream answer with both content and calls keeps both.
        return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


def routes(templated: bool, mode: str, chat_refusal: str, tool_refusal: str) -> dict[str, str]:
    """The model card's `chat` and `tools`: where chats and tool chats go, and why when not as asked."""
    if templated:
        here = "the checkpoint's chat template here, then /v1/completions"
        return {"chat": here, "tools": here}
    transcript = "the gateway's transcript to /v1/completions"
    if mode == "completions" or chat_refusal:
        chat = transcript + (f" ({chat_refusal})" if chat_refusal else "")
        return {"chat": chat, "tools": chat}
    tools = f"{transcript} ({tool_refusal})" if tool_refusal else \
        "/v1/chat/completions with tools (a forced call: the transcript to /v1/completions under its schema)"
    return {"chat": "/v1/chat/completions", "tools": tools}
