"""A reasoning model's thinking, apart from its answer (vLLM's `--reasoning-parser`, the chat
message's `reasoning` field).

A deployment's `reasoning_parser` names the model's way of thinking, with vLLM's parser names:

* `qwen3` (Qwen3, QwQ, and any model that writes `<think>` ... `</think>` itself): an answer that
  starts with `<think>` is reasoning up to `</think>`, then content; any other answer is content
  (a model asked not to think: Qwen3's `enable_thinking: false` leaves the tags out);
* `deepseek_r1` (DeepSeek-R1 and its distillations, whose chat template opens `<think>` in the
  prompt): the answer is reasoning from its first token (a leading `<think>` dropped) up to
  `</think>`, then content; with no `</think>` all of it is reasoning (cut while thinking).

The content's leading newlines after `</think>` are dropped; tool calls are looked for in the
content only. Streamed, text goes out as `delta.reasoning` while thinking and as `delta.content`
after it; the first characters of a tag at a chunk's end wait for the next chunk, nothing else
waits. `include_reasoning: false` (vLLM's) leaves the reasoning out of the response. The Responses
API returns it as a `reasoning` output item ahead of the answer's items (`ThinkingItem`).
Completions (`/v1/completions`) stay raw text, as vLLM's do.

A constraint on the answer (`response_format`, `structured_outputs`, a forced tool call) applies
after the thinking (`gate`): the model thinks freely up to `</think>` and the content after it is
what matches, as vLLM's structured outputs with a reasoning parser do. A prompt that already
closed the thinking (Qwen3's `enable_thinking: false` puts `<think></think>` in it) is constrained
from the first token. Completions keep the constraint from the first token (raw text, no split).
"""
from __future__ import annotations

from typing import Any

import msgspec

from polyserve.proto import SamplingParams

from .policy import InvalidRequest
from .tools import partial_tag

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def canonical(name: str | None) -> str:
    """A `reasoning_parser` value, checked ("" = none); ValueError naming the choices."""
    key = (name or "").strip().lower()
    if key and key not in PARSERS:
        raise ValueError(f"unknown reasoning_parser {name!r}; choose one of {', '.join(PARSERS)} (or none)")
    return key


def gate(params: SamplingParams, parser: str, budget: int | None = None) -> SamplingParams:
    """`params` for a thinking model: a constraint (structured outputs, a forced tool call) applies
    after the model's thinking, not from its first token (vLLM's structured outputs with a
    reasoning parser): the worker lets the text run free up to `</think>`; with `budget` (vLLM's
    `thinking_token_budget`) the worker forces `</think>` after that many thinking tokens."""
    if budget is not None and not parser:
        raise InvalidRequest("thinking_token_budget needs a deployment with a reasoning_parser (qwen3, deepseek_r1): "
                             "without one polyserve cannot tell the thinking apart", "thinking_token_budget")
    if not parser or (params.structured is None and budget is None):
        return params
    return msgspec.structs.replace(params, think=[OPEN, CLOSE], thinking_budget=budget)


def split(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer under `parser`."""
    lead = text.lstrip()
    if lead.startswith(OPEN):
        inside = lead[len(OPEN):]
    elif parser == "deepseek_r1":
        inside = text
    else:
        return None, text
    end = inside.find(CLOSE)
    if end < 0:
        return inside, ""
    return inside[:end], inside[end + len(CLOSE):].lstrip("\n")


def render_message(choice: dict[str, Any], parser: str, include: bool) -> None:
    """A full response's chat choice with its reasoning apart (before tools read the content)."""
    message = choice["message"]
    reasoning, content = split(message.get("content") or "", parser)
    if reasoning is not None:
        message["content"] = content
        if include:
            message["reasoning"] = reasoning


class ReasoningStream:
    """Streamed chat chunks of a thinking model, per choice: `delta.content` becomes
    `delta.reasoning` while the model thinks (module docstring)."""

    def __init__(self, parser: str, include: bool = True):
        self.parser, self.include = parser, include
        self._state: dict[int, str] = {}  # choice -> "start", "think", "after" (`</think>` seen), "answer"
        self._held: dict[int, str] = {}

    def feed(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to send for `body` (a stream_chunk of one choice): its text split or held."""
        choice = body["choices"][0]
        index, done = choice["index"], choice["finish_reason"] is not None
        state = self._state.get(index, "start")
        if state == "answer":
            return [body]
        text = self._held.pop(index, "") + (choice["delta"].get("content") or "")
        reasoning = content = ""
        if state == "start":
            lead = text.lstrip()
            if lead.startswith(OPEN):
                state, text = "think", lead[len(OPEN):]
            elif OPEN.startswith(lead) and not done:  # nothing yet, or the first characters of the tag
                self._held[index] = text
                return self._out(body, "", "")
            else:
                state = "think" if self.parser == "deepseek_r1" else "answer"
                if state == "answer":
                    content = text
        if state == "think":
            end = text.find(CLOSE)
            if end >= 0:
                reasoning, text, state = text[:end], text[end + len(CLOSE):], "after"
            elif done:
                reasoning, text = text, ""
            else:
                keep = partial_tag(text, (CLOSE,))
                reasoning, self._held[index], text = text[:len(text) - keep], text[len(text) - keep:], ""
        if state == "after":  # the newlines right after `</think>` are dropped
            content = text.lstrip("\n")
            state = "answer" if content else "after"
        self._state[index] = state
        return self._out(body, reasoning, content)

    def _out(self, body: dict[str, Any], reasoning: str, content: str) -> list[dict[str, Any]]:
        choice = body["choices"][0]
        delta = {k: v for k, v in choice["delta"].items() if k != "content"}
        if reasoning and self.include:
            delta["reasoning"] = reasoning
        if content or choice["finish_reason"] is not None:
            delta["content"] = content
        if not delta and choice["finish_reason"] is None and not choice.get("logprobs"):
            return []
        return [{**body, "choices": [{**choice, "delta": delta}]}]


def response_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A Responses API reasoning output item (vLLM's shape: the text as one `reasoning_text` part)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


class ThinkingItem:
    """A streamed Response's reasoning item (output 0, ahead of the answer's items): its events as
    the thinking streams, and the content that follows it."""

    def __init__(self, parser: str, item_id: str):
        self.stream, self.item_id = ReasoningStream(parser), item_id
        self.text, self.state = "", "none"  # none | open | done

    @property
    def next_index(self) -> int:
        """The output index of the answer's first item."""
        return 0 if self.state == "none" else 1

    def feed(self, text: str, last: bool) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        """(the content in `text`, the (event type, fields) to send for its thinking)."""
        body = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop" if last else None}]}
        events, content = [], ""
        for out in self.stream.feed(body):
            delta = out["choices"][0]["delta"]
            if delta.get("reasoning"):
                if self.state == "none":
                    events.append(("response.output_item.added", {"output_index": 0, "item": response_item(
                        self.item_id, "", "in_progress")}))
                    self.state = "open"
                self.text += delta["reasoning"]
                events.append(("response.reasoning_text.delta", {"item_id": self.item_id, "output_index": 0,
                                                                 "content_index": 0, "delta": delta["reasoning"]}))
            content += delta.get("content") or ""
        return content, events + (self.close() if content or last else [])

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The item's closing events (none when it never opened or is closed)."""
        if self.state != "open":
            return []
        self.state = "done"
        return [("response.reasoning_text.done", {"item_id": self.item_id, "output_index": 0, "content_index": 0,
                                                  "text": self.text}),
                ("response.output_item.done", {"output_index": 0, "item": response_item(self.item_id, self.text)})]
