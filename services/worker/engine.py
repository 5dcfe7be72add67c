"""The engine interface every worker engine implements (sim, hf, vllm).

A worker owns exactly one engine. The worker service turns `generate()` events
into TokenChunks on NATS, and `load()` into heartbeats.
"""
from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from polyserve.core import chat_template
from polyserve.proto import AdapterInfo, RequestStats, SamplingParams, TokenLogprob


class EngineError(Exception):
    """A request cannot be served; `status` is the HTTP status the gateway should answer."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Withdrawn(EngineError):
    """Ends the stream of a request the engine gave back before starting it (`Engine.withdraw`)."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id!r} was withdrawn before it started", 409)


class EngineOverloaded(EngineError):
    """The bounded waiting queue or KV budget is full: retry later (429)."""

    def __init__(self, message: str):
        super().__init__(message, 429)


@dataclass
class EngineRequest:
    request_id: str
    prompt: str
    params: SamplingParams
    adapter: str | None = None
    priority: int = 0
    predicted_tokens: int = 0
    length_class: int = -1
    arrival: float = field(default_factory=time.monotonic)
    # Request migration: output another worker already streamed to the client. `prompt` then
    # already ends with it (the engine just generates on); engines that shape their first
    # token (the sim's leading space) look here.
    continuation: str = ""
    tenant: str = ""  # who sent it (GenerateRequest.tenant): queue_order.client_of reads it
    # A chat's messages (role, content) when `chat_prompt` did not format them (no chat template
    # here): `prompt` is then the gateway's transcript. An engine that can hand the messages to
    # something holding the model's template does (openai-http: the upstream's chat endpoint).
    messages: list[dict] | None = None
    chat_end: str = "open"  # how the chat's prompt ends (GenerateRequest.chat_end)
    template_kwargs: dict | None = None  # extra chat-template variables (GenerateRequest.template_kwargs)
    tools: list[dict] | None = None  # the chat's listed tools beside `messages` (GenerateRequest.tools)


@dataclass
class Delta:
    """New text of one choice; `finish_reason` set on that choice's last delta."""

    index: int
    text: str
    tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token this delta adds (params.logprobs set)
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first delta (params.prompt_logprobs)
    token_ids: list[int] | None = None  # the tokens this delta adds (params.return_token_ids)
    prompt_token_ids: list[int] | None = None  # on a choice's first delta (params.return_token_ids)


@dataclass
class Finished:
    """The whole request is done (all n choices); always the last event."""

    stats: RequestStats


@dataclass
class EngineLoad:
    running: int
    waiting: int
    kv_used: int
    kv_capacity: int
    max_input_len: int
    adapters: list[AdapterInfo] = field(default_factory=list)


class Engine(abc.ABC):
    """Base class of engines. `simulated` engines must say so in every output."""

    name: str = "engine"
    simulated: bool = False
    model_name: str = ""
    # Whether a started stream can be continued here from prompt + the output so far (request
    # migration, `EngineRequest.continuation`); advertised in heartbeats and GenerateAccepted.
    resumable: bool = False

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start the scheduling loop."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Cancel everything still running and release resources."""

    @abc.abstractmethod
    def generate(self, req: EngineRequest) -> AsyncIterator[Delta | Finished]:
        """Admit the request (raise EngineOverloaded/EngineError at once if it cannot be),
        then yield Deltas as tokens come and a Finished last."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Stop a request now, freeing its batch slot and KV; True if it was known."""

    def withdraw(self, request_id: str) -> bool:
        """Give back a request that is still waiting (not prefilled): its stream ends with
        `Withdrawn` and no output. False when it is running, unknown, or the engine cannot."""
        return False

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Current load for heartbeats and dispatch."""

    @abc.abstractmethod
    def count_tokens(self, text: str) -> int:
        """Input tokens of `text` under this engine's tokenizer."""

    def model_card(self) -> dict:
        """What /v1/models reports about the served model."""
        return {"engine": self.name, "simulated": self.simulated}

    def chat_prompt(self, messages: list[dict], end: str = "open", tools: list[dict] | None = None,
                    extra: dict | None = None) -> str | None:
        """The prompt the model's own chat template makes of a chat's `messages` (role, content,
        tool_calls, tool_call_id), `tools` and `extra` template variables (chat_template_kwargs),
        ending as `end` says (`GenerateRequest.chat_end`), or
        None when the model has none (or one that ignores tools the chat has): the gateway's
        role-prefixed transcript is used then."""
        return None

    def has_adapter(self, name: str) -> bool:
        """Whether LoRA adapter `name` is loaded on this engine."""
        return any(a.name == name for a in self.load().adapters)

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load a PEFT LoRA adapter at runtime (engines without LoRA refuse)."""
        raise EngineError(f"the {self.name} engine does not serve LoRA adapters", 501)

    async def unload_adapter(self, name: str, force: bool = False) -> None:
        """Unload an adapter; 409 while requests use it unless `force` cancels them."""
        raise EngineError(f"the {self.name} engine does not serve LoRA adapters", 501)


async def relay(queue: "asyncio.Queue", request_id: str, is_done: Callable[[], bool],
                cancel: Callable[[str], object]) -> AsyncIterator[Delta | Finished]:
    """Yield an engine request's events from its queue until Finished (an Exception in
    the queue is raised); a consumer that goes away cancels the request at once."""
    try:
        while True:
            event = await queue.get()
            if isinstance(event, Exception):
                raise event
            yield event
            if isinstance(event, Finished):
                return
    finally:
        if not is_done():
            cancel(request_id)


def kept_tokens(n: int, keep: int, limit: int) -> int:
    """How many of a prompt's `n` tokens `SamplingParams.truncate_prompt_tokens` keeps (`limit`: the
    worker's max_input_len, for -1; 0: all)."""
    keep = limit if keep == -1 else keep
    return min(n, keep) if keep > 0 else n


def truncated(ids: list[int], keep: int, limit: int) -> list[int]:
    """A prompt's token ids cut on the left to `kept_tokens`."""
    k = kept_tokens(len(ids), keep, limit)
    return ids[len(ids) - k:]


def check_request(req: EngineRequest, *, max_batch: int, adapters, known, unit: str = "rows") -> None:
    """Admission checks every engine makes, as EngineErrors saying what to fix."""
    p = req.params
    if p.n < 1 or p.max_tokens < 1:
        raise EngineError(f"n ({p.n}) and max_tokens ({p.max_tokens}) must be >= 1", 400)
    if p.n > max_batch:
        raise EngineError(f"n={p.n} exceeds this worker's max batch of {max_batch} {unit}", 400)
    if req.adapter and req.adapter not in adapters:
        raise EngineError(adapters.unknown_message(req.adapter), 404)
    if req.request_id in known:
        raise EngineError(f"request {req.request_id!r} is already running on this worker", 409)


def free_adapter(name: str, adapters, requests, force: bool, cancel: Callable[[str], object]) -> None:
    """Before unloading adapter `name`: 404 if unknown; 409 while unfinished `requests`
    (objects with `.req` and `.done`) use it, unless `force` cancels them."""
    if name not in adapters:
        raise EngineError(adapters.unknown_message(name), 404)
    users = [r for r in requests if r.req.adapter == name and not r.done]
    if users and not force:
        raise EngineError(f"adapter {name!r} is in use by {len(users)} request(s)", 409)
    for r in users:
        cancel(r.req.request_id)


def make_stats(input_tokens: int, output_tokens: int, arrival: float, start: float,
               token_times: list[float], cached_tokens: int = 0) -> RequestStats:
    """RequestStats from monotonic timestamps: arrival, start of prefill, each token's emission;
    `cached_tokens`: of the input, those the engine's prefix cache served.

    ATGT = decode time / (output tokens - 1) (Aladdin §2.2). Engines with n > 1 choices
    pass one timestamp per decode step and correct `output_tokens` afterwards."""
    first = token_times[0] if token_times else start
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    decode_s = (token_times[-1] - token_times[0]) if len(token_times) > 1 else 0.0
    return RequestStats(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        queue_ms=(start - arrival) * 1e3,
        ttft_ms=(first - arrival) * 1e3,
        tbt_mean_ms=(sum(gaps) / len(gaps) * 1e3) if gaps else 0.0,
        tbt_max_ms=(max(gaps) * 1e3) if gaps else 0.0,
        atgt_ms=(decode_s / (output_tokens - 1) * 1e3) if output_tokens > 1 else 0.0,
        prefill_ms=(first - start) * 1e3,
        decode_ms=decode_s * 1e3,
        cached_tokens=cached_tokens,
    )


def templated_chat(tokenizer, messages: list[dict], adds_bos: bool | None = None, end: str = "open",
                   tools: list[dict] | None = None, extra: dict | None = None) -> str | None:
    """`core.chat_template.render` for an engine: a template that refuses the messages is the
    client's 400 (EngineError)."""
    try:
        return chat_template.render(tokenizer, messages, adds_bos=adds_bos, end=end, tools=tools, extra=extra)
    except chat_template.TemplateRefused as exc:
        raise EngineError(str(exc), 400) from exc

