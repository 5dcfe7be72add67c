"""Function tools and structured text on `/v1/responses`: the Responses API's shapes over the
chat path's machinery (tools.py), so a call is listed, forced, parsed and streamed the same way.

Request side:
* `tools`: function tools, `{"type": "function", "name", "description", "parameters", "strict"}`
  (flat, where chat nests them under `function`). A built-in tool (web search, file search, code
  interpreter, MCP, ...) is a 400 naming `tools[i]`: polyserve runs no tool itself.
* `tool_choice`: none, auto, required, or `{"type": "function", "name": ...}`; as on chat, a forced
  call's JSON is generated under its schema.
* `text.format`: `json_object` or `json_schema` (its `schema`) constrain the output, as chat's
  `response_format`.
* input items besides messages: `function_call` (the model's earlier call, with its `call_id`) and
  `function_call_output` (the result for a `call_id`). They become an assistant turn with
  `tool_calls` and a `tool` turn, as chat sends them; an output whose `call_id` matches no call in
  the conversation is a 400 naming it (as OpenAI answers).

Answer side: when the whole answer is calls to listed tools, the output is one `function_call`
item per call (`call_id`, `name`, `arguments` as a JSON string) instead of a message; streamed,
each call is `response.output_item.added`, `response.function_call_arguments.delta` / `.done` and
`response.output_item.done`. The stored conversation keeps the calls, so the next turn can send
only `function_call_output` items with `previous_response_id`."""
from __future__ import annotations

import json
import uuid
from typing import Any

from polyserve.proto import StructuredOutput

from . import tools
from .policy import InvalidRequest

CALL_ITEMS = ("function_call", "function_call_output")


def _extra(body: Any) -> dict[str, Any]:
    return dict(getattr(body, "model_extra", None) or {})


def parse_tools(body: Any) -> tools.Tools:
    """`tools` and `tool_choice` of a Responses body, validated (a 400 naming the field)."""
    raw, choice = tools.tools_field(body)
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise InvalidRequest(f"tools[{i}] is a '{kind}' tool; polyserve runs function tools only (it has no "
                                 "built-in tools: web search, file search, code interpreter, MCP, ...)", f"tools[{i}]",
                                 code="unsupported_parameter")
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        if name in functions:
            raise InvalidRequest(f"tools[{i}]: two tools are named {name!r}", f"tools[{i}].name")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].parameters must be a JSON Schema object", f"tools[{i}].parameters")
        functions[name] = {"name": name, "description": tool.get("description") or "",
                           "parameters": params or {"type": "object", "properties": {}}}
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise InvalidRequest(f"tool_choice of type {choice.get('type')!r} is not supported by polyserve (none, "
                             "auto, required or {'type': 'function', 'name': ...})", "tool_choice",
                             code="unsupported_parameter")
    named = choice.get("name") if isinstance(choice, dict) else None
    return tools.with_choice(functions, choice, named, "{'type': 'function', 'name': ...}")


def text_format(body: Any) -> StructuredOutput | None:
    """The constraint `text.format` asks for (None: plain text)."""
    text = _extra(body).get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequest("'text' must be an object", "text")
    if text.get("verbosity") is not None:
        raise InvalidRequest("text.verbosity is not supported by polyserve (no verbosity control)", "text",
                             code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format of type json_schema needs a 'schema' object", "text")
        return StructuredOutput(json=json.dumps(fmt["schema"]))
    raise InvalidRequest(f"text.format type {kind!r} is not supported by polyserve (text, json_object, "
                         "json_schema)", "text", code="unsupported_parameter")


def constraint(body: Any, tl: tools.Tools) -> StructuredOutput | None:
    """The one output constraint: `text.format`'s or a forced call's (both: a 400)."""
    spec, forced = text_format(body), tl.constraint()
    if spec is not None and forced is not None:
        raise InvalidRequest("a forced tool call (tool_choice) cannot be combined with a JSON text.format",
                             "tool_choice")
    return spec or forced


def _output_text(i: int, output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise InvalidRequest(f"input[{i}].output must be a string or a list of text parts", f"input[{i}].output")


def call_message(i: int, item: dict[str, Any], turns: list[dict[str, Any]], known: set[str]) -> None:
    """Append a `function_call` / `function_call_output` input item to `turns` (chat-shaped dicts):
    consecutive calls share one assistant turn, as parallel calls do on chat."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"input[{i}].call_id must be a non-empty string", f"input[{i}].call_id")
    if item["type"] == "function_call_output":
        if call_id not in known:
            raise InvalidRequest(f"No tool call found for function call output with call_id {call_id}.",
                                 f"input[{i}].call_id")
        turns.append({"role": "tool", "content": _output_text(i, item.get("output")), "tool_call_id": call_id})
        return
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(arguments, str):
        raise InvalidRequest(f"input[{i}] (a function_call) needs a 'name' and its 'arguments' as a JSON string",
                             f"input[{i}]")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = turns[-1] if turns else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
        last["tool_calls"].append(call)
    else:
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
    known.add(call_id)


def call_ids(conversation: list[dict[str, Any]]) -> set[str]:
    """The call ids of every call the conversation holds."""
    return {c["id"] for m in conversation for c in m.get("tool_calls") or ()}


def has_calls(conversation: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)


def calls_of(text: str, finish: str | None, tl: tools.Tools) -> tuple[str, list[tuple[str, str]]] | None:
    """(the text before them, [(name, arguments)]) when a finished answer is calls to listed tools,
    alone or after some text in a marked format (`tools.split_calls`); else None."""
    return tl.split(text) if tl.listed and finish == "stop" else None


def call_items(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The output items of an answer that is calls."""
    return [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": "call_" + uuid.uuid4().hex[:24],
             "name": name, "arguments": arguments, "status": "completed"} for name, arguments in calls]


def assistant_turn(items: list[dict[str, Any]], text: str = "") -> dict[str, Any]:
    """The stored conversation's assistant turn for call items, and the text said before them (what
    the next turn answers)."""
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items if it["type"] == "function_call"]}


def holds(tl: tools.Tools, held: str) -> bool:
    """Whether a streamed answer that starts with `held` must wait: it may still be only calls."""
    return tl.listed and (tl.forced or tools.may_be_calls(held))


def release(tl: tools.Tools, text: str) -> int:
    """How much of `text`, streamed after the answer began as text, may go out now: up to a call
    marker (calls may follow some text), or short of a marker's first characters at its end."""
    return tools.releasable(text) if tl.listed else len(text)


def echo(body: Any, tl: tools.Tools) -> dict[str, Any]:
    """The Response object's echo of the tool and text fields."""
    extra = _extra(body)
    listed = [{"type": "function", "name": n, "description": f["description"], "parameters": f["parameters"],
               "strict": next((t.get("strict") for t in extra.get("tools") or () if t.get("name") == n), None)}
              for n, f in tl.functions.items()]
    choice = extra.get("tool_choice") or tl.choice
    ptc = extra.get("parallel_tool_calls")
    fmt = (extra.get("text") or {}).get("format") or {"type": "text"}
    return {"tools": listed, "tool_choice": choice, "parallel_tool_calls": True if ptc is None else bool(ptc),
            "text": {"format": fmt}}
