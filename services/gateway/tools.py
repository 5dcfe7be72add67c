"""Structured outputs and tool calls at the gateway (issue 18 item 4).

Request side: `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` become
one wire `StructuredOutput` in SamplingParams (at most one constraint per request: 400
otherwise). Engines enforce it: hf with llguidance masks, vllm with its own
StructuredOutputsParams, openai-http by passing the fields upstream, sim by generating a
schema-valid instance.

Tools (`tools`, `tool_choice`), by constrained generation of the call's JSON:
* the tools are listed in the prompt (a `system:` line with their names, descriptions and
  parameter schemas) and the model is told to answer a call with only
  `{"name": <tool>, "arguments": {...}}`;
* `required` or a named function: the output is constrained to that object (the named
  function's, or any tool's: `anyOf`), so the call always parses and its arguments
  validate against the function's `parameters` (a `strict`-style schema bounds them; an
  open one, with random weights, may run to max_tokens and end "length" as plain text);
* `auto`: the model generates freely; when its whole answer is such a call to a listed
  tool, it is returned as a tool call, else as content. With random weights that is text.
  Instruct models often answer in the format they were trained on instead, so an answer that
  is only calls in one of those is taken too (`calls_in`): Hermes / Qwen `<tool_call>{...}
  </tool_call>` blocks, Mistral's `[TOOL_CALLS] [{...}, ...]`, Llama 3.1's `<|python_tag|>`
  and `{"name": ..., "parameters": {...}}`, or a JSON list of calls: several calls are
  parallel tool calls (vLLM's hermes, mistral and llama3_json parsers read the same). Some text
  and then only calls in one of the marked formats (`<tool_call>`, `[TOOL_CALLS]`,
  `<|python_tag|>`) is the message's `content` beside the calls, as those parsers return it.
* `none` (and no tools): nothing is listed; plain text.
A call comes back as `message.tool_calls` [{id, type: "function", function: {name,
arguments (a JSON string)}}] with finish_reason "tool_calls"; streamed, as `delta.tool_calls`
chunks (the id and name first, then the arguments), as OpenAI sends them. Assistant messages
with `tool_calls` and `tool` messages are rendered into the transcript as the same JSON and
as `tool: <content>` lines.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from polyserve.proto import ChatTurn, SamplingParams, StructuredOutput

from .policy import InvalidRequest, message_text

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def _extra(body: Any) -> dict[str, Any]:
    return dict(getattr(body, "model_extra", None) or {})


def _schema_text(value: Any, name: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequest(f"'{name}' is not valid JSON: {exc}", name) from exc
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{name}' must be a JSON Schema object", name)
    return json.dumps(value)


def _from_response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict) or rf.get("type") in (None, "text"):
        if rf is None or isinstance(rf, dict):
            return None
        raise InvalidRequest("'response_format' must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest("'response_format.json_schema' needs a 'schema'", "response_format")
        return StructuredOutput(json=_schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise InvalidRequest(f"response_format type '{kind}' is not supported by polyserve (text, json_object, "
                         "json_schema)", "response_format", code="unsupported_parameter")


def _from_structured_outputs(so: Any) -> StructuredOutput | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequest("'structured_outputs' must be an object", "structured_outputs")
    other = sorted(k for k, v in so.items() if k not in _SO_KEYS and v not in (None, False))
    if other:
        raise InvalidRequest(f"structured_outputs.{other[0]} is not supported by polyserve (json, json_object, "
                             "regex, choice, grammar)", "structured_outputs", code="unsupported_parameter")
    set_ = {k: v for k, v in so.items() if k in _SO_KEYS and v not in (None, False)}
    if len(set_) != 1:
        raise InvalidRequest("'structured_outputs' takes exactly one of json, json_object, regex, choice, grammar",
                             "structured_outputs")
    (key, value), = set_.items()
    return _one(key, value, f"structured_outputs.{key}")


def _one(kind: str, value: Any, name: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput(json=_schema_text(value, name))
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"'{name}' must be a non-empty list of strings", name)
        return StructuredOutput(choice=list(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{name}' must be a non-empty string", name)
    return StructuredOutput(**{kind: value})


def structured(body: Any) -> StructuredOutput | None:
    """The one constraint the body asks for (None: none); 400 for two, or a malformed one."""
    extra = _extra(body)
    found: list[tuple[str, StructuredOutput]] = []
    rf = _from_response_format(extra.get("response_format"))
    if rf is not None:
        found.append(("response_format", rf))
    so = _from_structured_outputs(extra.get("structured_outputs"))
    if so is not None:
        found.append(("structured_outputs", so))
    for name, kind in GUIDED.items():
        if extra.get(name) is not None:
            found.append((name, _one(kind, extra[name], name)))
    if len(found) > 1:
        raise InvalidRequest(f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; send one",
                             found[1][0])
    return found[0][1] if found else None


# ---------------------------------------------------------------------------- tools
@dataclass
class Tools:
    """The tools of one chat request and how the answer may use them."""

    functions: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> its `function` object
    choice: str = "none"  # none | auto | required | the name of the forced function

    @property
    def listed(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.listed and self.choice != "auto"

    def constraint(self) -> StructuredOutput | None:
        """For `required` or a named function: the call object's JSON Schema."""
        if not self.forced:
            return None
        names = list(self.functions) if self.choice == "required" else [self.choice]
        calls = [call_schema(n, self.functions[n]) for n in names]
        return StructuredOutput(json=json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}))

    def definitions(self) -> list[dict[str, Any]] | None:
        """The listed tools as a chat template takes them (OpenAI's shape), or None."""
        return [{"type": "function", "function": fn} for fn in self.functions.values()] if self.listed else None

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """[(name, arguments as a JSON string)] when `text` is only calls to listed tools."""
        return self.checked(calls_in(text))

    def split(self, text: str) -> tuple[str, list[tuple[str, str]]] | None:
        """(the text before the calls, [(name, arguments)]) when `text` is calls to listed tools,
        alone or after some text in a marked format (`split_calls`); else None."""
        found = split_calls(text)
        calls = self.checked(found[1]) if found else None
        return (found[0], calls) if found and calls else None

    def checked(self, objs: list[dict] | None) -> list[tuple[str, str]] | None:
        """[(name, arguments)] of call objects when every one calls a listed tool with an object."""
        if not objs:
            return None
        out = []
        for obj in objs:
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # some formats carry the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if obj.get("name") not in self.functions or not isinstance(args, dict):
                return None
            out.append((obj["name"], json.dumps(args)))
        return out


_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")
_OPENERS = ("{", "[") + _PREFIXES + ("<tool_call>",)  # how an answer that is calls begins


def calls_in(text: str) -> list[dict] | None:
    """The call objects of an answer that is only tool calls (see the module docstring), else None."""
    t = text.strip()
    try:
        if t.startswith("<tool_call>"):
            if _BLOCK.sub("", t).strip():
                return None  # text besides the calls: an answer, not a call
            objs = [json.loads(b) for b in _BLOCK.findall(t)]
        else:
            for prefix in _PREFIXES:
                t = t.removeprefix(prefix).lstrip()
            obj = json.loads(t)
            objs = obj if isinstance(obj, list) else [obj]
    except ValueError:
        return None
    return objs if objs and all(isinstance(o, dict) for o in objs) else None


# What opens calls that follow some text: a model often says a sentence, then calls (vLLM's hermes,
# mistral and llama3_json parsers return that text as content beside the calls). Only these marked
# formats count there: a bare JSON object at the end of prose may well be part of the answer.
_MARKERS = ("<tool_call>",) + _PREFIXES


def marker_at(text: str) -> int:
    """Where the first call marker of `text` begins, or -1."""
    hits = [i for i in (text.find(m) for m in _MARKERS) if i >= 0]
    return min(hits) if hits else -1


def partial_tag(text: str, tags: tuple[str, ...] = _MARKERS) -> int:
    """How many of `text`'s last characters may begin one of `tags` (to hold while streaming)."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


def releasable(text: str) -> int:
    """How much of `text`, streamed after an answer began as text, may go out now: up to a call
    marker (calls may follow some text), or short of a marker's first characters at its end."""
    at = marker_at(text)
    return at if at >= 0 else len(text) - partial_tag(text)


def split_calls(text: str) -> tuple[str, list[dict]] | None:
    """(the text before the calls, the call objects) of an answer that is only calls, or some text
    and then only calls in a marked format (`_MARKERS`); None otherwise."""
    objs = calls_in(text)
    if objs:
        return "", objs
    at = marker_at(text)
    objs = calls_in(text[at:]) if at > 0 else None
    return (text[:at], objs) if objs else None


def may_be_calls(held: str) -> bool:
    """Whether a streamed answer that starts with `held` may still turn out to be only calls."""
    h = held.lstrip()
    return not h or any(h.startswith(o) or o.startswith(h) for o in _OPENERS)


def chat_turns(messages: list) -> list[ChatTurn]:
    """The messages as the worker receives them for its chat template: role, text, an assistant's
    calls (arguments as an object, as templates read them), and a tool result's call id and function
    name (the client's, else that of the call it answers: OpenAI's tool messages carry none, and
    Hermes-style templates refuse a result without one)."""
    turns, names = [], {}
    for m in messages:
        extra = getattr(m, "model_extra", None) or {}
        calls = [_template_call(c) for c in extra.get("tool_calls") or []] or None
        names.update((c["id"], c["function"]["name"]) for c in calls or ())
        call_id = extra.get("tool_call_id") if isinstance(extra.get("tool_call_id"), str) else None
        name = None
        if m.role == "tool":
            name = extra.get("name") if isinstance(extra.get("name"), str) else names.get(call_id)
        turns.append(ChatTurn(role=m.role, content=message_text(m), tool_calls=calls, tool_call_id=call_id,
                              name=name))
    return turns


def _template_call(call: Any) -> dict[str, Any]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # the template gets the string as the client sent it
    return {"id": call.get("id", "") if isinstance(call, dict) else "", "type": "function",
            "function": {"name": fn.get("name", ""), "arguments": args}}


def call_schema(name: str, fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tools_field(body: Any) -> tuple[list, Any]:
    """A body's `tools` list (400 when it is not one) and its `tool_choice` as sent."""
    extra = _extra(body)
    raw = extra.get("tools") or []
    if not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", "tools")
    return raw, extra.get("tool_choice")


def with_choice(functions: dict[str, dict[str, Any]], choice: Any, named: str | None, shape: str) -> Tools:
    """`Tools` of `functions` under `tool_choice` (`named`: the function a dict choice names; `shape`:
    how that dict is written on this endpoint), 400s naming tool_choice."""
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        if named not in functions:
            raise InvalidRequest(f"tool_choice names {named!r}, which is not in 'tools'", "tool_choice")
        choice = named
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice must be none, auto, required or {shape}", "tool_choice")
    elif choice == "required" and not functions:
        raise InvalidRequest("tool_choice 'required' needs 'tools'", "tool_choice")
    return Tools(functions, choice)


def parse_tools(body: Any) -> Tools:
    """`tools` and `tool_choice` of a chat body, validated (400 naming the field)."""
    raw, choice = tools_field(body)
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                 "'parameters': ...}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        functions[fn["name"]] = fn
    named = (choice.get("function") or {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" else None
    return with_choice(functions, choice, named, "{'type': 'function', 'function': {'name': ...}}")


def _call_text(call: Any) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return json.dumps({"name": fn.get("name"), "arguments": args})


def render_chat(messages: list, tools: Tools, end: str = "open") -> str:
    """The role-prefixed transcript (policy.render_chat's format) with the tools listed and
    tool calls and results rendered; without the assistant's opening unless `end` is "open"."""
    lines = []
    if tools.listed:
        listed = [{"name": n, "description": f.get("description", ""), "parameters": f.get("parameters") or {}}
                  for n, f in tools.functions.items()]
        lines.append('system: To call a tool, answer with only {"name": <tool name>, "arguments": <its '
                     f"arguments>}}. Tools: {json.dumps(listed)}")
    for m in messages:
        calls = getattr(m, "model_extra", None) and m.model_extra.get("tool_calls")
        text = message_text(m)
        if calls:
            text = "\n".join(([text] if text else []) + [_call_text(c) for c in calls])
        lines.append(f"{m.role}: {text}")
    return "\n".join(lines) + ("\nassistant:" if end == "open" else "")


def _call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name,
                                                                                   "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def render_message(choice: dict[str, Any], tools: Tools) -> None:
    """A full response's chat choice: its text becomes tool calls when it is calls (after some
    text in a marked format: that text stays the message's content)."""
    message = choice["message"]
    found = tools.split(message.get("content") or "") if tools.listed and choice.get("finish_reason") == "stop" \
        else None
    if found is not None:
        message["content"] = found[0] or None
        message["tool_calls"] = [_call(*call) for call in found[1]]
        choice["finish_reason"] = "tool_calls"


def keep_markers(params: SamplingParams, tl: Tools | None, engine: str) -> SamplingParams:
    """`params` with special tokens kept in the text where the gateway reads free-text calls (tools
    listed, `auto`) from an hf or vllm worker: calls marked by a special token (Llama 3.1's
    `<|python_tag|>`, Mistral's `[TOOL_CALLS]`) must reach `split_calls`, as vLLM's tool parsers turn
    skip_special_tokens off the same way. An openai-http upstream parses its calls itself."""
    if tl is None or not tl.listed or tl.forced or engine not in ("hf", "vllm"):
        return params
    return msgspec.structs.replace(params, skip_special_tokens=False)


class ToolStream:
    """Streamed chat chunks with tools listed: a choice's text is held while it may still be a
    call (forced: always; auto: while it is empty or starts as calls do, `may_be_calls`), then
    sent as `delta.tool_calls` chunks (per call its id and name, then its arguments) ending with
    finish_reason "tool_calls", or released as content. Released text is still watched for a
    call marker (`_MARKERS`): from one on, the rest is held, and sent as calls when it is only
    calls, else as content; a marker's first characters at a chunk's end wait for the next."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self._held: dict[int, str] = {}
        self._role: set[int] = set()  # choices whose held first chunk carried the role
        self._passed: set[int] = set()  # auto choices that turned out to be text
        self._tail: dict[int, str] = {}  # text of a passed choice held back: a marker, or its start

    def feed(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to send for `body` (a stream_chunk of one choice): none while held."""
        choice = body["choices"][0]
        index, delta, reason = choice["index"], choice["delta"], choice["finish_reason"]
        if not self.tools.listed:
            return [body]
        if index in self._passed:
            return self._after_text(body)
        thought = []
        if delta.get("reasoning"):  # a thinking model's reasoning (reasoning.py) goes out as it comes, with
            # the role; calls are read from the content only
            said = {"reasoning": delta.pop("reasoning")}
            role = delta.pop("role", None)
            thought = [{**body, "choices": [{"index": index, "delta": {"role": role, **said} if role else said,
                                             "finish_reason": None}]}]
            if not delta.get("content") and reason is None:
                return thought
        if delta.pop("role", None):
            self._role.add(index)
        held = self._held[index] = self._held.get(index, "") + (delta.get("content") or "")
        if reason is None and (self.tools.forced or may_be_calls(held)):
            return thought
        self._held.pop(index)
        parsed = self.tools.parse(held) if reason == "stop" else None
        if parsed is not None:
            return thought + self._calls(self._with_role(body, index), parsed, 0)
        delta["content"] = held
        if reason is None:
            self._passed.add(index)
        return thought + (self._after_text(self._with_role(body, index)) if not self.tools.forced else
                          [self._with_role(body, index)])

    def _after_text(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """A chunk of a choice whose answer began as text: calls may still follow a marker."""
        choice = body["choices"][0]
        index, delta, reason = choice["index"], choice["delta"], choice["finish_reason"]
        text = self._tail.pop(index, "") + (delta.get("content") or "")
        if reason is None:
            n = releasable(text)
            self._tail[index], text = text[n:], text[:n]
            delta["content"] = text
            return [body] if text or "role" in delta or choice.get("logprobs") else []
        self._passed.discard(index)
        at = marker_at(text)
        parsed = self.tools.parse(text[at:]) if at >= 0 and reason == "stop" else None
        if parsed is None:
            delta["content"] = text
            return [body]
        before = [_like(body, {**delta, "content": text[:at]})] if text[:at] or "role" in delta else []
        return before + self._calls(_like(body, {}), parsed, len(before))

    @staticmethod
    def _calls(body: dict[str, Any], parsed: list[tuple[str, str]], after: int) -> list[dict[str, Any]]:
        """`parsed` as tool-call chunks shaped like `body` (its delta's role kept on the first),
        ending with finish_reason "tool_calls"; `after`: chunks of text were sent before them."""
        out = []
        for i, (name, arguments) in enumerate(parsed):
            head = {"tool_calls": [_call(name, "", index=i)]}
            out += [_like(body, {"content": None, **head} if i == 0 and not after else head),
                    _like(body, {"tool_calls": [{"index": i, "function": {"arguments": arguments}}]})]
        if "role" in body["choices"][0]["delta"]:
            out[0]["choices"][0]["delta"] = {"role": "assistant", **out[0]["choices"][0]["delta"]}
        return out + [_like(body, {}, "tool_calls")]

    def _with_role(self, body: dict[str, Any], index: int) -> dict[str, Any]:
        if index in self._role:
            self._role.discard(index)
            body["choices"][0]["delta"] = {"role": "assistant", **body["choices"][0]["delta"]}
        return body


def _like(body: dict[str, Any], delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    choice = {**body["choices"][0], "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return {**body, "choices": [choice]}
