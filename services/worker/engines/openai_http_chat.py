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
Requests with prompt logprobs (`echo`) are completions: chats have no echo. Chats with tools or
earlier tool calls are completions too, of the gateway's transcript (`EngineRequest.messages` is
None): this engine reads only text from the upstream, not its `tool_calls`.

Answers: a chunk's `delta` (a whole answer's `message`) `content`, after any `reasoning` text
(vLLM with a reasoning parser splits it off; it is part of the output, as on /v1/completions);
logprobs from `logprobs.content` (openai_http_wire.entries reads both shapes).
"""
from __future__ import annotations

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


def choice_text(choice: Any) -> str:
    """The text of a completion choice, a chat chunk's delta or a whole chat answer's message."""
    text = getattr(choice, "text", None)
    if text is not None:
        return text
    part = getattr(choice, "delta", None) or getattr(choice, "message", None)
    if part is None:
        return ""
    reasoning = getattr(part, "reasoning", None) or getattr(part, "reasoning_content", None) or ""
    return reasoning + (getattr(part, "content", None) or "")


def refuses_chats(status: int, message: str, answered_before: bool) -> bool:
    """Whether an error answer of the chat endpoint means this upstream cannot take chats."""
    low = message.lower()
    if status in _ABSENT or "chat template" in low or "chat_template" in low:
        return True
    return status >= 500 and not answered_before
