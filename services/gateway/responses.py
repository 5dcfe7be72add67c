"""OpenAI Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), text in
and text out, with function tools and JSON text formats (responses_tools.py), as vLLM and SGLang
serve it.

A response is a chat request underneath: the conversation so far (the stored turns of
`previous_response_id`, then the new `input` messages), after `instructions` as a system
message, is rendered into the transcript chat completions send (policy.render_chat) and runs
through the same admit() -> predict -> dispatch -> generate path (handlers.RequestRun).
Fields polyserve does not honour are refused with a 400 naming them (compat_table.RESPONSES).

With `store` (the default) the Response object and its conversation (without `instructions`,
which OpenAI does not carry to the next turn) are kept in Redis under `Keys.response(id)` for
the gateway's `response_ttl_s`, with its owner: the tenant of the client key that made it ("" for
a request without a key). Only the same tenant may read, continue or delete it, and the admin
key any; anyone else gets the same 404 as for an id that does not exist, so an id says nothing
about whether it is in use (issue 14, docs/security.md "Stored responses").

Streamed, the body is the Responses SSE events (`response.created` ... `response.completed`
or `response.incomplete`), each with its `sequence_number`."""
from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field

from polyserve.proto import ChatTurn, SamplingParams

from . import compat, disconnect, logprobs, policy, reasoning, tenancy, tools
from . import responses_tools as rtools
from .admission import Admission, admit
from .context import Gateway, GatewayState
from .errors import GatewayError
from .handlers import RequestRun
from .keys import ADMIN
from .schemas import MAX_SALT, ChatMessage, ReasoningEffort

logger = logging.getLogger(__name__)
ROLES = ("user", "system", "developer", "assistant")
InvalidInput = policy.InvalidRequest  # a 400 naming the field (OpenAI error body)


class Reasoning(BaseModel):
    """The Responses API's `reasoning`: its effort goes to the chat template (vLLM's); no summaries."""

    model_config = ConfigDict(extra="forbid")

    effort: ReasoningEffort | None = None


class ResponsesBody(BaseModel):
    """The fields polyserve honours; every other one stays in `model_extra` for compat.py."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # vLLM's extensions of the endpoint
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    priority: int = 0
    user: str | None = None
    reasoning: Reasoning | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT)  # vLLM's (core/cache_salt.py)
    prompt_cache_key: str | None = Field(None, max_length=MAX_SALT)  # OpenAI's: routing affinity (routing.py)


def add_response_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/responses", create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])


# ---------------------------------------------------------------------------- input
def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInput(f"input[{i}].content must be a string or a list of text parts", f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise InvalidInput(f"input[{i}].content[{j}] is a '{kind}' part; polyserve takes text parts "
                               "(input_text) only", f"input[{i}].content[{j}]", code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: str | list[dict[str, Any]] | None,
                   before: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The new turns of a request's `input` (chat-shaped dicts): a string is one user message; a
    list holds message items (role and text content) and function_call / function_call_output
    items (responses_tools.call_message; a call's output must answer a call in `before` or earlier
    in `input`). Other item types are refused."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    known = rtools.call_ids(list(before))
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind in rtools.CALL_ITEMS:
            rtools.call_message(i, item, out, known)
            continue
        if kind != "message" or "role" not in item:
            raise InvalidInput(f"input[{i}] is a '{kind}' item; polyserve takes message, function_call and "
                               "function_call_output items only", f"input[{i}]", code="unsupported_parameter")
        if item["role"] not in ROLES:
            raise InvalidInput(f"input[{i}].role must be one of {', '.join(ROLES)}", f"input[{i}].role")
        out.append({"role": item["role"], "content": _content_text(i, item.get("content"))})
    return out


def sampling(body: ResponsesBody, gs: GatewayState) -> SamplingParams:
    s = gs.settings
    max_tokens = s.default_max_tokens if body.max_output_tokens is None else body.max_output_tokens
    if max_tokens < 1:
        raise InvalidInput(f"max_output_tokens must be at least 1, got {max_tokens}", "max_output_tokens")
    if max_tokens > s.max_tokens_limit:
        raise InvalidInput(f"max_output_tokens {max_tokens} is above this deployment's limit of "
                           f"{s.max_tokens_limit}; ask for fewer", "max_output_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not x for x in stop):
        raise InvalidInput("stop takes up to 4 non-empty strings", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                          seed=body.seed, stop=stop, n=1, logprobs=logprobs_asked(body),
                          frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
                          repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                          cache_salt=body.cache_salt or "")


LOGPROBS = "message.output_text.logprobs"


def logprobs_asked(body: ResponsesBody) -> int | None:
    """k alternatives per token when `include` asks for the output text's logprobs (`top_logprobs`,
    default 0), as vLLM's Responses reads the two; None: none asked."""
    extra = body.model_extra or {}
    include, top = extra.get("include") or [], extra.get("top_logprobs")
    if not isinstance(include, list) or any(x != LOGPROBS for x in include):
        raise InvalidInput(f"include takes only {LOGPROBS!r} here (no reasoning, tool results or other extra "
                           "output data)", "include", code="unsupported_parameter")
    if top is not None:
        logprobs._bounded(top, "top_logprobs")
    if LOGPROBS not in include:
        if top:
            raise InvalidInput(f"'top_logprobs' needs include: [{LOGPROBS!r}]", "top_logprobs")
        return None
    return top or 0


# ---------------------------------------------------------------------------- storage
def not_found(response_id: str, param: str | None = None) -> policy.InvalidRequest:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return policy.InvalidRequest(f"{what} with id '{response_id}' not found.", param, 404,
                                 "previous_response_not_found" if param else None)


def requester() -> str | None:
    """The tenant the request runs as: "" without a key, None for the admin key (reads every tenant's)."""
    t = tenancy.current()
    if t is None or t.record is None:
        return ""
    return None if t.record is ADMIN else t.record.tenant


def _owner(record: dict[str, Any]) -> str:
    return record.get("owner", {}).get("tenant", "")


async def load(gs: GatewayState, response_id: str, param: str | None = None) -> dict[str, Any]:
    """The stored record {response, conversation, owner} of `response_id`; 404 when there is none
    or it belongs to another tenant (the same answer: existence is not revealed)."""
    try:
        raw = await gs.state.r.get(gs.state.keys.response(response_id))
    except Exception as exc:
        raise GatewayError(503, f"cluster state (Redis) unavailable: {exc}", retry_after=1) from exc
    if not raw:
        raise not_found(response_id, param)
    record = msgspec.json.decode(raw)
    who = requester()
    if who is not None and _owner(record) != who:
        gs.metrics.rejected.labels("response_not_owned").inc()
        raise not_found(response_id, param)
    return record


async def save(gs: GatewayState, turn: Turn, response: dict[str, Any], said: dict[str, Any]) -> None:
    """Keep the response, its conversation (this answer, `said`, included) and its owner for `response_ttl_s`."""
    if not turn.store:
        return
    record = {"response": response, "conversation": [*turn.conversation, said], "owner": turn.owner}
    try:
        await gs.state.r.set(gs.state.keys.response(turn.rid), msgspec.json.encode(record),
                             px=max(1, int(gs.settings.response_ttl_s * 1000)))
    except Exception as exc:  # noqa: BLE001 - the answer is still given; a later turn gets a 404
        logger.warning("could not store response %s: %s", turn.rid, exc)


# ---------------------------------------------------------------------------- the Response object
@dataclass
class Turn:
    """One request: its ids, the conversation it continues (without instructions) and its echo fields."""

    body: ResponsesBody
    model: str
    conversation: list[dict[str, Any]]
    params: SamplingParams
    tl: tools.Tools = field(default_factory=tools.Tools)
    rid: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    item_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    thinking: str = ""  # the deployment's reasoning_parser (reasoning.py; a constraint applies after it)
    reasoning_id: str = field(default_factory=lambda: "rs_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    owner: dict[str, str] = field(default_factory=lambda: owner_now())

    @property
    def store(self) -> bool:
        return self.body.store is not False

    def messages(self) -> list[ChatMessage]:
        head = [ChatMessage(role="system", content=self.body.instructions)] if self.body.instructions else []
        return head + [ChatMessage(**m) for m in self.conversation]

    @property
    def with_tools(self) -> bool:
        """Tools listed, or calls and results in the conversation: the tools transcript (tools.py)."""
        return self.tl.listed or rtools.has_calls(self.conversation)

    def prompt(self) -> str:
        if self.with_tools:
            return tools.render_chat(self.messages(), self.tl)
        return policy.render_chat(self.messages())

    def turns(self) -> list[ChatTurn]:
        """The messages for a worker whose model has a chat template (GenerateRequest.chat)."""
        return (tools.chat_turns if self.with_tools else policy.chat_turns)(self.messages())

    def message(self, text: str | None, status: str, entries: list | None = None) -> dict[str, Any]:
        content = [] if text is None else [part(text, entries)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def answer(self, text: str, finish: str | None, entries: list | None = None) \
            -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """(status, output items, the stored assistant turn) of a finished answer: calls where it is
        calls to listed tools (after a message item for the text before them, when some text came
        first in a marked format), else one message (with its tokens' logprobs, `entries`, if asked)."""
        thought, text = reasoning.split(text, self.thinking) if self.thinking else (None, text)
        head = [reasoning.response_item(self.reasoning_id, thought)] if thought else []
        found = rtools.calls_of(text, finish, self.tl)
        if found:
            said, calls = found
            said_lps = logprobs.split_at(entries, len(said))[0] if entries else None
            items = ([self.message(said, "completed", said_lps)] if said else []) + rtools.call_items(calls)
            return "completed", head + items, rtools.assistant_turn(items, said)
        status = status_of(finish)
        return status, head + [self.message(text, status, entries)], {"role": "assistant", "content": text}

    def obj(self, status: str, output: list[dict[str, Any]] | None = None, usage: tuple[int, int, int] | None = None,
            simulated: bool = False) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output or [],
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort, "summary": None} if b.reasoning else None,
            "store": self.store, "temperature": self.params.temperature, **rtools.echo(b, self.tl),
            "top_p": self.params.top_p, "truncation": "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": usage[2]},
                "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage[0] + usage[1]},
            "user": b.user, "metadata": b.metadata or {},
        }
        if simulated:
            out["simulated"] = True
        return out


ADMIN_OWNER = "*admin"  # no client tenant can be named this (schemas.TENANT has no '*')


def owner_now() -> dict[str, str]:
    """Who owns a response made now: the key's tenant and id ("" for no key; the admin key a name no
    client key's tenant can take, so a tenant called "admin" does not read the admin's responses)."""
    t = tenancy.current()
    rec = None if t is None else t.record
    if rec is None:
        return {"tenant": "", "key": ""}
    return {"tenant": ADMIN_OWNER if rec is ADMIN else rec.tenant, "key": rec.id}


def part(text: str, entries: list | None = None) -> dict[str, Any]:
    """An output_text part; `entries`: its tokens' logprobs (TokenLogprob), in chat's entry shape."""
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs.chat_content(entries) if entries else []}


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


# ---------------------------------------------------------------------------- routes
async def create(body: ResponsesBody, request: Request, gs: Gateway) -> Response:
    """Validate, admit and run one response; a stream keeps the in-flight slot until it ends."""
    params = sampling(body, gs)
    tl = rtools.parse_tools(body)
    spec = rtools.constraint(body, tl)
    if spec is not None:
        params = msgspec.structs.replace(params, structured=spec)
    conversation = []
    if body.previous_response_id:
        conversation = (await load(gs, body.previous_response_id, "previous_response_id"))["conversation"]
    new = input_messages(body.input, conversation)
    if not new:
        raise InvalidInput("input is empty: send a string or a list of items", "input")
    adm = await admit(gs, body.model)
    engine = adm.deployment.engine
    if engine not in compat.ENDPOINTS["responses"][1] and engine in compat.ENGINES:
        raise policy.InvalidRequest(f"'{adm.deployment.id}' is an embedding model (engine {engine}); it serves "
                                    "/v1/embeddings, not responses", "model")
    headers = compat.ignored_header(compat.check("responses", body, engine))
    params = tools.keep_markers(reasoning.gate(params, adm.deployment.reasoning_parser), tl, engine)
    turn = Turn(body=body, model=adm.deployment.id, conversation=conversation + new, params=params, tl=tl,
                thinking=adm.deployment.reasoning_parser)
    if turn.thinking and params.logprobs is not None:
        raise InvalidInput("output logprobs are not served with a reasoning_parser deployment on /v1/responses "
                           "(chat completions serve both)", "include")
    prompt = turn.prompt()
    if len(prompt) > gs.settings.max_prompt_chars:
        raise InvalidInput(f"the conversation is {len(prompt)} characters; the limit is "
                           f"{gs.settings.max_prompt_chars}", "input")
    run = RequestRun(gs=gs, deployment=adm.deployment, prompt=prompt, params=params, stream=bool(body.stream),
                     adapter=adm.adapter, priority=body.priority, request_id=turn.rid, chat=turn.turns(),
                     cache_key=body.prompt_cache_key or "",
                     tools=tl.definitions(), template_kwargs=policy.template_kwargs(
                         None, body.reasoning.effort if body.reasoning else None))
    span = adm.begin("gateway response", request.headers)
    span.set_attribute("polyserve.request_id", turn.rid)
    handed_off = False
    try:
        with trace.use_span(span, end_on_exit=False):
            await run.start()
        if body.stream:
            handed_off = True
            if engine == "sim":
                headers["X-Polyserve-Simulated"] = "true"
            return disconnect.EventStream(_events(gs, adm, turn, run), request, headers=headers)
        with trace.use_span(span, end_on_exit=False):
            out = await disconnect.collect(request, run)
        status, items, said = turn.answer(out.texts[0], out.finish[0], out.logprobs[0] if out.logprobs else None)
        final = turn.obj(status, items, (out.prompt_tokens, out.completion_tokens, out.cached_tokens), out.simulated)
        await save(gs, turn, final, said)
        if out.simulated:
            headers["X-Polyserve-Simulated"] = "true"
        return JSONResponse(final, headers=headers)
    except GatewayError as exc:
        adm.failed(exc)
        raise
    finally:
        if not handed_off:
            adm.end()


async def retrieve(response_id: str, gs: Gateway) -> dict[str, Any]:
    return (await load(gs, response_id))["response"]


async def delete(response_id: str, gs: Gateway) -> dict[str, Any]:
    await load(gs, response_id)  # 404 unless it exists and is the caller's
    try:
        removed = await gs.state.r.delete(gs.state.keys.response(response_id))
    except Exception as exc:
        raise GatewayError(503, f"cluster state (Redis) unavailable: {exc}", retry_after=1) from exc
    if not removed:
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


# ---------------------------------------------------------------------------- streaming
async def _events(gs: GatewayState, adm: Admission, turn: Turn, run: RequestRun) -> AsyncIterator[bytes]:
    """The Responses SSE body; an error after the first byte goes out as an `error` event."""
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": next(seq), **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    at = {"item_id": turn.item_id, "output_index": 0, "content_index": 0}
    opened = False  # the message item has begun: text flows as deltas

    def open_message() -> list[bytes]:
        return [event("response.output_item.added", output_index=at["output_index"],
                      item=turn.message(None, "in_progress")),
                event("response.content_part.added", **at, part=part(""))]

    think = reasoning.ThinkingItem(turn.thinking, turn.reasoning_id) if turn.thinking else None

    try:
        yield event("response.created", response=turn.obj("in_progress"))
        yield event("response.in_progress", response=turn.obj("in_progress"))
        texts, finish, usage, held, raw = [], None, (0, 0, 0), "", []
        lps: list = []  # the logprobs of every token so far; held_lp: of the held text
        held_lp: list = []
        with trace.use_span(adm.span, end_on_exit=False):
            async for chunk in run.chunks():
                if chunk.done:
                    st = chunk.stats
                    usage = (st.input_tokens, st.output_tokens, st.cached_tokens) if st else usage
                    continue
                finish = chunk.finish_reason or finish
                piece = chunk.text or ""
                raw.append(piece)
                if think is not None:  # the thinking as a reasoning item first, the content after it
                    piece, thought = think.feed(piece, chunk.finish_reason is not None)
                    for kind, fields in thought:
                        yield event(kind, **fields)
                    at["output_index"] = think.next_index
                held += piece
                held_lp += chunk.logprobs or []
                if not opened and held and not rtools.holds(turn.tl, held):  # not (or no longer possibly) a call
                    opened = True
                    for e in open_message():
                        yield e
                if opened and held:  # up to a call marker: calls may still follow the text
                    n = rtools.release(turn.tl, held)
                    if n:
                        out_lp, held_lp = (held_lp, []) if n == len(held) else logprobs.split_at(held_lp, n)
                        texts.append(held[:n])
                        yield event("response.output_text.delta", **at, delta=held[:n],
                                    logprobs=logprobs.chat_content(out_lp))
                        held, lps = held[n:], lps + out_lp
        for kind, fields in think.close() if think is not None else ():
            yield event(kind, **fields)
        sent, lps = "".join(texts), lps + held_lp
        status, items, said = turn.answer("".join(raw), finish, lps)
        m = next((k for k, it in enumerate(items) if it["type"] == "message"), None)
        if m is not None:  # the text, alone or before calls (after the reasoning item, if any)
            shown = items[m]["content"][0]["text"] if items[m]["content"] else ""
            alone = len(items) == 1  # the whole answer: every token's logprobs, as they came
            shown_lps = lps if alone else logprobs.split_at(lps, len(shown))[0]
            if not opened:
                for e in open_message():
                    yield e
            if len(shown) > len(sent):
                rest_lps = held_lp if alone else logprobs.split_at(shown_lps, len(sent))[1]
                yield event("response.output_text.delta", **at, delta=shown[len(sent):],
                            logprobs=logprobs.chat_content(rest_lps))
            yield event("response.output_text.done", **at, text=shown, logprobs=logprobs.chat_content(shown_lps))
            yield event("response.content_part.done", **at, part=part(shown, shown_lps))
            yield event("response.output_item.done", output_index=m, item=items[m])
        for k, item in enumerate(items):
            if item["type"] == "function_call":
                for e in _call_events(event, k, item):
                    yield e
        final = turn.obj(status, items, usage, run.simulated)
        await save(gs, turn, final, said)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
    except GatewayError as exc:
        adm.failed(exc)
        yield event("error", code=str(exc.status), message=exc.message, param=None)
    finally:
        adm.end()


def _call_events(event, k: int, item: dict[str, Any]) -> list[bytes]:
    """The stream's events of one function call, output item `k` (its arguments in one delta)."""
    at = {"item_id": item["id"], "output_index": k}
    started = {**item, "arguments": "", "status": "in_progress"}
    return [event("response.output_item.added", output_index=k, item=started),
            event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            event("response.function_call_arguments.done", **at, arguments=item["arguments"]),
            event("response.output_item.done", output_index=k, item=item)]
