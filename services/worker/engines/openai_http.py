"""The `openai-http` engine: a worker in front of an OpenAI-compatible engine server.

The model runs in another process — `vllm serve`, SGLang, TGI, `transformers serve` —
and this engine drives it through its `/v1` HTTP endpoints, the way AIBrix, llm-d and
production-stack drive vLLM. Tested in this project against `transformers serve`
(tests/integration/test_openai_http_engine.py); vLLM, SGLang and TGI speak the same wire
format but were not run here.

Requests (the official `openai` async client):
- a completion, and a chat whose messages this worker formats with its own checkpoint's chat
  template, go to `POST /v1/completions`; other chats to `POST /v1/chat/completions` as
  messages, so the upstream applies the model's template (openai_http_chat.py, `upstream_chat`);
  the model is `upstream_model`, or the adapter's name when the request names a LoRA adapter
  (vLLM serves adapters as model names);
- streamed (`upstream_stream`, the default) with `stream_options.include_usage` (off with
  `upstream_include_usage=false` for servers that reject it): each SSE chunk's text becomes
  a Delta counted as one token; the upstream's `usage` (prompt and completion tokens) gives
  the Finished stats when it sends one, else the chunk count and the `count_tokens` estimate;
- sampling: max_tokens, temperature, top_p, seed, stop (when given), n (when > 1); top_k
  and min_tokens only when set (> 0), as extra body fields (vLLM and SGLang accept them; a
  server that does not, such as `transformers serve`, answers 422); `upstream_extra_body`
  (JSON) is merged into every request;
- logprobs, prompt logprobs (`echo: true`, sent unstreamed) and structured outputs:
  openai_http_wire.py; a server that ignores them is a 502 that says so, one that rejects them
  (4xx) passes its message on;
- cancel() cancels the request's task, which closes the HTTP response: the upstream sees
  the client disconnect and stops generating (vLLM aborts the request, `transformers serve`
  cancels its streamer);
- errors: an HTTP error answer becomes an EngineError with the upstream's status and
  message; a connection failure 502, a timeout 504, an error event inside the stream 502.
  The worker accepts a request before the upstream answers, so the gateway reports
  upstream errors as a 502 whose message carries the upstream status.

Load (heartbeats): the upstream's Prometheus `/metrics`, read by `openai_http_metrics`
(vLLM, SGLang and TGI gauges; requests sent since the last scrape count as waiting); a
server without usable metrics falls back to this engine's own in-flight count (a request
is waiting until its first token, then running).

LoRA: vLLM's runtime endpoints `/v1/load_lora_adapter` / `/v1/unload_lora_adapter`
(openai_http_lora.py); a server without them makes adapter loads fail with 501.

Tokens: `count_tokens` uses `upstream_tokenizer` (or `model_path`'s tokenizer.json), else 1.3 x words.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from polyserve.core import cache_salt, chat_template
from polyserve.worker.engine import (
    Delta,
    Engine,
    EngineError,
    EngineLoad,
    EngineOverloaded,
    EngineRequest,
    Finished,
    check_request,
    make_stats,
    relay,
    templated_chat,
)
from polyserve.worker.engines import openai_http_chat, openai_http_wire
from polyserve.worker.engines.openai_http_lora import UpstreamLoRA
from polyserve.worker.engines.openai_http_metrics import MetricsPoller, exact_tokenizer, server_root, words_estimate
from polyserve.worker.lora import AdapterRegistry

logger = logging.getLogger(__name__)

# "tool_calls": the upstream's calls come back as the gateway's call text (openai_http_chat.CallText)
FINISH_REASONS = {"abort": "cancelled", "eos_token": "stop", "stop_sequence": "stop", "tool_calls": "stop"}


@dataclass(eq=False)
class _Flight:
    """One request sent upstream: its task, its event queue, per-choice progress."""

    req: EngineRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    step_times: list[float] = field(default_factory=list)
    tokens: dict[int, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)
    usage: tuple[int, int, int] | None = None  # (prompt, completion, cached prompt tokens) from the upstream
    done: bool = False
    calls: Any = None  # a tool chat on the chat endpoint: openai_http_chat.CallText
    think: Any = None  # openai_http_chat.ThinkText: reasoning back in its tags

    def __post_init__(self) -> None:
        self.think = openai_http_chat.ThinkText.of(self.req.params)


class OpenAIHttpEngine(UpstreamLoRA, Engine):
    """polyserve's Engine over an OpenAI-compatible server's /v1 API."""

    name = "openai-http"
    simulated = False
    resumable = True  # request migration: prompt + output so far (a chat on the chat route: openai_http_chat)

    def __init__(self, settings: Any):
        def g(key: str, default: Any) -> Any:
            return getattr(settings, key, default)

        url = str(g("upstream_url", "") or "")
        if not url.startswith(("http://", "https://")):
            raise EngineError("the openai-http engine needs upstream_url, the engine server's address (e.g. "
                              "http://127.0.0.1:8000 for `vllm serve`; env POLYSERVE_WORKER_UPSTREAM_URL)", 400)
        self.root = server_root(url)
        self.api_url = self.root + "/v1"
        self.upstream_model = str(g("upstream_model", "") or "")
        self.salt_mode = cache_salt.mode(str(g("cache_salt_tenants", "auto")))  # core/cache_salt.py
        self.model_name = str(g("model", "") or "") or self.upstream_model or "upstream-model"
        self.api_key = str(g("upstream_api_key", "") or "")
        metrics = str(g("upstream_metrics_url", "") or "")
        self.metrics_url = None if metrics.lower() in ("off", "none", "-") else (metrics or self.root + "/metrics")
        self.metrics_interval = float(g("upstream_metrics_interval_s", 1.0))
        self.connect_timeout = float(g("upstream_connect_timeout_s", 5.0))
        self.read_timeout = float(g("upstream_timeout_s", 600.0))
        self.start_timeout = float(g("upstream_start_timeout_s", 60.0))
        self.stream = bool(g("upstream_stream", True))
        self.include_usage = bool(g("upstream_include_usage", True))
        self.structured_style = str(g("upstream_structured", "") or "structured_outputs")  # or "guided"
        self.chat_mode = str(g("upstream_chat", "auto") or "auto")
        if self.chat_mode not in openai_http_chat.CHAT_MODES:
            raise EngineError(f"upstream_chat {self.chat_mode!r} is unknown; choose one of "
                              f"{', '.join(openai_http_chat.CHAT_MODES)}", 400)
        self.chats_answered = 0  # chats the upstream's chat endpoint answered (upstream_chat auto)
        self.chat_refusal = ""  # why chats go as transcripts now (auto, after the upstream refused one)
        self.tools_answered, self.tool_refusal = 0, ""  # the same for tool chats
        extra = g("upstream_extra_body", "") or {}
        try:
            self.extra_body: dict = json.loads(extra) if isinstance(extra, str) else dict(extra)
        except ValueError as exc:
            raise EngineError(f"upstream_extra_body is not JSON: {exc}", 400) from exc
        self.max_waiting = int(g("max_waiting", 256))
        self.max_batch = int(g("max_batch", 64))
        self.max_input_len = int(g("max_input_len", 4096))
        self.kv_capacity_setting = int(g("kv_capacity_tokens", 0) or 0)
        self.tokenizer_path = str(g("upstream_tokenizer", "") or "") or str(g("model_path", "") or "")
        self.adapters = AdapterRegistry()
        self.lora_supported: bool | None = None  # unknown until the first load
        self.upstream_models: list[str] = []
        self.poller: MetricsPoller | None = None
        self._tokenizer: Any = None
        self._chat_tok: Any = None  # the HF tokenizer with a chat template; False: none (chat_prompt)
        self._client: Any = None
        self._http: httpx.AsyncClient | None = None
        self._flights: dict[str, _Flight] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    @classmethod
    def from_settings(cls, settings: Any) -> OpenAIHttpEngine:
        return cls(settings)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Connect, wait up to `upstream_start_timeout_s` for GET /v1/models, poll /metrics."""
        try:
            import openai
        except ImportError as exc:
            raise EngineError(f"the openai-http engine needs the 'openai' package ({exc}); "
                              "pip install openai", 500) from exc
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(self.read_timeout, connect=self.connect_timeout)
        limits = httpx.Limits(max_connections=self.max_batch + self.max_waiting + 8, max_keepalive_connections=32)
        self._http = httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits)
        self._client = openai.AsyncOpenAI(base_url=self.api_url, api_key=self.api_key or "EMPTY", max_retries=0,
                                          timeout=timeout, http_client=self._http)
        self._tokenizer = exact_tokenizer(self.tokenizer_path)
        await self._wait_upstream()
        self._stopping = False
        if self.metrics_url is not None:
            self.poller = MetricsPoller(self._http, self.metrics_url, self.metrics_interval,
                                        lambda: {self.upstream_model, self.model_name, *self.adapters.names()})
            await self.poller.start()
        logger.info("openai-http engine: %s serving %r at %s; load from %s", self.model_name, self.upstream_model,
                    self.api_url, self.metrics_url if self.metrics_state == "ok" else "in-flight count")

    async def _wait_upstream(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        last = ""
        while True:
            try:
                page = await self._client.models.list()
                self.upstream_models = [m.id for m in page.data]
                break
            except Exception as exc:  # noqa: BLE001 - connection refused while the server starts, 5xx, ...
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                await self._close_clients()
                raise EngineError(f"the upstream engine server at {self.api_url} did not answer GET /v1/models "
                                  f"within {self.start_timeout:g}s ({last})", 503)
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if not self.upstream_model:
            if not self.upstream_models:
                await self._close_clients()
                raise EngineError(f"{self.api_url}/models lists no model; set upstream_model", 503)
            self.upstream_model = self.upstream_models[0]
        elif self.upstream_models and self.upstream_model not in self.upstream_models:
            # Some servers (transformers serve) load models on demand and list only loaded ones.
            logger.warning("upstream_model %r is not among the models %s lists: %s", self.upstream_model,
                           self.api_url, ", ".join(self.upstream_models))

    async def stop(self) -> None:
        self._stopping = True
        if self.poller is not None:
            await self.poller.stop()
        for fl in list(self._flights.values()):
            self._fail(fl, EngineError("the worker's engine is stopping", 503))
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        await self._close_clients()

    async def _close_clients(self) -> None:
        http, self._http, self._client = self._http, None, None
        if http is not None:
            await http.aclose()

    # ----------------------------------------------------------------- requests
    async def generate(self, req: EngineRequest) -> AsyncIterator[Delta | Finished]:
        fl = self._admit(req)  # raises on the first __anext__, before any suspension
        async with contextlib.aclosing(relay(fl.queue, req.request_id, lambda: fl.done, self.cancel)) as events:
            async for event in events:
                yield event

    def _admit(self, req: EngineRequest) -> _Flight:
        if self._client is None or self._stopping:
            raise EngineError("the openai-http engine is not running", 503)
        check_request(req, max_batch=self.max_batch, adapters=self.adapters, known=self._flights,
                      unit="sequences")
        if not req.prompt:
            raise EngineError("the prompt is empty", 400)
        waiting = sum(1 for f in self._flights.values() if f.first is None)
        if len(self._flights) >= self.max_batch + self.max_waiting or waiting >= self.max_waiting:
            raise EngineOverloaded(f"{len(self._flights)} requests in flight to the upstream ({waiting} without "
                                   f"output; max_waiting {self.max_waiting}); retry later")
        fl = _Flight(req)
        self._flights[req.request_id] = fl
        fl.task = asyncio.create_task(self._pump(fl), name=f"openai-http:{req.request_id}")
        self._tasks.add(fl.task)  # kept until it has closed its HTTP response, even after cancel()
        fl.task.add_done_callback(self._tasks.discard)
        return fl

    def request_body(self, req: EngineRequest) -> tuple[dict, dict]:
        """The create() keywords and the extra body fields for one request."""
        p = req.params
        kw: dict[str, Any] = dict(model=req.adapter or self.upstream_model, prompt=req.prompt,
                                  max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p)
        if p.n > 1:
            kw["n"] = p.n
        if p.stop:
            kw["stop"] = list(p.stop)
        if p.seed is not None:
            kw["seed"] = p.seed
        kw.update(openai_http_wire.penalty_fields(p))
        extra = {**self.extra_body, **openai_http_wire.vllm_fields(p), **cache_salt.upstream(req, self.salt_mode)}
        extra.update(openai_http_wire.request_fields(p, self.structured_style))
        return kw, extra

    def _chat_messages(self, req: EngineRequest) -> list[dict] | None:
        """The messages to send to the upstream's chat endpoint, or None: a completion."""
        if req.messages is None or req.params.prompt_logprobs is not None or self.chat_mode == "completions":
            return None
        if openai_http_chat.has_tools(req.messages, req.tools) and (
                self.tool_refusal or req.params.structured is not None):  # a forced call: its schema, completed
            return None
        return None if self.chat_refusal else req.messages

    async def _pump(self, fl: _Flight) -> None:
        """Send the request and turn the upstream's answer into events (a task, so cancel() can close it)."""
        import openai

        try:
            messages = self._chat_messages(fl.req)
            if messages is None:
                await self._call(fl, *self.request_body(fl.req))
            else:
                body = openai_http_chat.chat_body(*self.request_body(fl.req), messages, fl.req.continuation,
                                                  fl.req.chat_end, self.structured_style)
                if fl.req.template_kwargs:  # vLLM's field: the upstream's template gets them
                    body[1]["chat_template_kwargs"] = dict(fl.req.template_kwargs)
                tooled = openai_http_chat.has_tools(messages, fl.req.tools)
                if tooled:
                    openai_http_chat.with_tools(body[0], fl.req.tools)
                    fl.calls = openai_http_chat.CallText()
                try:
                    await self._call(fl, *body, chat=True)
                    self.chats_answered, self.tools_answered = self.chats_answered + 1, self.tools_answered + tooled
                except openai.APIStatusError as exc:
                    if fl.seen or self.chat_mode == "chat" or not self._refused(exc, tooled):
                        raise
                    fl.calls = None
                    await self._call(fl, *self.request_body(fl.req))  # the transcript, as a completion
            if not fl.done:
                self._end(fl)
        except EngineError as exc:  # an answer without the logprobs or echo it was asked for
            self._fail(fl, exc)
        except asyncio.CancelledError:
            if not fl.done:  # not by cancel(): the loop shutting down
                self._fail(fl, EngineError("upstream request cancelled", 503))
            raise
        except openai.APIStatusError as exc:
            self._fail(fl, EngineError(f"upstream {self.api_url} answered {exc.status_code}: "
                                       f"{openai_http_wire.detail(exc)}", exc.status_code))
        except openai.APITimeoutError as exc:
            self._fail(fl, EngineError(f"upstream {self.api_url} timed out: {exc}", 504))
        except openai.APIConnectionError as exc:
            self._fail(fl, EngineError(f"upstream {self.api_url} unreachable: {exc.__cause__ or exc}", 502))
        except openai.APIError as exc:  # an error event inside the stream
            self._fail(fl, EngineError(f"upstream {self.api_url} failed mid-stream: "
                                       f"{openai_http_wire.detail(exc)}", 502))
        except Exception as exc:  # noqa: BLE001 - every upstream failure must reach the client
            logger.warning("upstream request %s failed: %s: %s", fl.req.request_id, type(exc).__name__, exc)
            self._fail(fl, EngineError(f"upstream {self.api_url}: {type(exc).__name__}: {exc}", 502))

    async def _call(self, fl: _Flight, kw: dict, extra: dict, chat: bool = False) -> None:
        """One create() call, streamed or not, its answer turned into events."""
        api = self._client.chat.completions if chat else self._client.completions
        if self.stream and fl.req.params.prompt_logprobs is None:  # echo: one answer, split at its usage
            if self.include_usage:
                kw["stream_options"] = {"include_usage": True}
            stream = await api.create(stream=True, extra_body=extra or None, **kw)
            try:
                async for chunk in stream:
                    if fl.done:
                        break
                    self._on_chunk(fl, chunk)
            finally:
                await stream.close()  # closes the HTTP response: the upstream sees the disconnect
        else:
            self._on_chunk(fl, await api.create(stream=False, extra_body=extra or None, **kw), whole=True)

    def _refused(self, exc: Any, tooled: bool) -> bool:
        """Whether the chat endpoint's error shows it cannot take (tool) chats; if so, remembered and logged."""
        status, detail = exc.status_code, openai_http_wire.detail(exc)
        why = f"the chat endpoint answered {status}: {detail[:200]}"
        if openai_http_chat.refuses_chats(status, detail, self.chats_answered > 0) and not (tooled and status >= 500):
            self.chat_refusal, what = why, "chats"
        elif tooled and openai_http_chat.refuses_tools(status, detail, self.tools_answered > 0):
            self.tool_refusal, what = why, "tool chats"
        else:
            return False
        logger.warning("upstream %s cannot take %s (%s); they go to /v1/completions as the gateway's transcript "
                       "from now on (set upstream_chat=chat to send them anyway)", self.api_url, what, why)
        return True

    def _on_chunk(self, fl: _Flight, chunk: Any, whole: bool = False) -> None:
        now = time.monotonic()
        usage = getattr(chunk, "usage", None)
        if usage is not None and getattr(usage, "completion_tokens", None) is not None:
            fl.usage = openai_http_wire.usage_of(usage)
        stepped = False
        n = fl.req.params.n
        for choice in getattr(chunk, "choices", None) or ():
            i = int(getattr(choice, "index", 0) or 0)
            if i in fl.ended or not 0 <= i < n:
                continue
            fl.seen.add(i)
            text = fl.think.text(i, choice) + (fl.calls.feed(i, choice) if fl.calls else "")
            reason = getattr(choice, "finish_reason", None)
            reason = FINISH_REASONS.get(reason, reason) if reason else None
            delta = openai_http_wire.choice_delta(fl.req, choice, text, whole, fl.usage, self.api_url, chunk)
            count = 1 if delta.text else 0
            if delta.token_ids is not None or delta.logprobs is not None:  # the upstream's own count
                count = len(delta.token_ids if delta.token_ids is not None else delta.logprobs)
            elif whole:  # one answer for the whole request: its usage counts the tokens when n == 1
                count = fl.usage[1] if fl.usage and n == 1 else words_estimate(delta.text)
            delta.tokens, delta.finish_reason = count, reason
            if fl.req.params.logprobs is None:
                delta.logprobs = None
            fl.tokens[i] = fl.tokens.get(i, 0) + count
            stepped = stepped or count > 0
            if delta.text or count or reason or delta.prompt_logprobs:
                fl.queue.put_nowait(delta)
            if reason:
                fl.ended.add(i)
        if stepped:
            if fl.first is None:
                fl.first = now
            fl.step_times.append(now)

    def _end(self, fl: _Flight) -> None:
        """The upstream's answer is complete: close open choices and finish."""
        n = fl.req.params.n
        missing = set(range(n)) - fl.seen
        if missing and fl.seen:
            self._fail(fl, EngineError(f"the upstream answered {len(fl.seen)} of n={n} choices; it does not "
                                       "serve n > 1 (send n=1)", 502))
            return
        for i in sorted(set(range(n)) - fl.ended):
            fl.queue.put_nowait(Delta(index=i, text="", tokens=0, finish_reason="stop"))
            fl.ended.add(i)
        self._finish(fl)

    def _finish(self, fl: _Flight) -> None:
        fl.done = True
        self._flights.pop(fl.req.request_id, None)
        counted = sum(fl.tokens.values())
        prompt_tokens, output_tokens, cached = fl.usage if fl.usage else (self.count_tokens(fl.req.prompt), counted, 0)
        steps = max(fl.tokens.values(), default=0)
        if fl.usage and fl.req.params.n == 1:
            steps = output_tokens
        stats = make_stats(prompt_tokens, steps, fl.req.arrival, fl.start, fl.step_times, cached)
        fl.queue.put_nowait(Finished(stats=msgspec.structs.replace(stats, output_tokens=output_tokens)))

    def _fail(self, fl: _Flight, exc: EngineError) -> None:
        if fl.done:
            return
        fl.done = True
        self._flights.pop(fl.req.request_id, None)
        fl.queue.put_nowait(exc)

    def cancel(self, request_id: str) -> bool:
        """End a request now ("cancelled") and close its HTTP stream, which the upstream sees."""
        fl = self._flights.get(request_id)
        if fl is None or fl.done:
            return False
        for i in sorted(set(range(fl.req.params.n)) - fl.ended):
            fl.queue.put_nowait(Delta(index=i, text="", tokens=0, finish_reason="cancelled"))
            fl.ended.add(i)
        self._finish(fl)
        if fl.task is not None and not fl.task.done() and fl.task is not asyncio.current_task():
            fl.task.cancel()
        return True

    # ----------------------------------------------------------------- load
    @property
    def metrics_state(self) -> str:
        """Where the load comes from: ok (the server's /metrics) | absent | failing | unknown | off."""
        return "off" if self.poller is None and self.metrics_url is None else (
            self.poller.state if self.poller is not None else "unknown")

    def load(self) -> EngineLoad:
        own_running = sum(1 for f in self._flights.values() if f.first is not None)
        own_waiting = len(self._flights) - own_running
        m = self.poller.fresh() if self.poller is not None else None
        capacity = (m.kv_capacity if m and m.kv_capacity else 0) or self.kv_capacity_setting
        if m is None:
            return EngineLoad(running=own_running, waiting=own_waiting, kv_used=0, kv_capacity=capacity,
                              max_input_len=self.max_input_len, adapters=self.adapters.infos())
        running = int(m.running or 0)
        waiting = int(m.waiting or 0)
        # Sent since that scrape, so not in it yet: count them as waiting.
        waiting += sum(1 for f in self._flights.values() if f.start > m.at)
        kv_used = 0
        if m.kv_used is not None:
            kv_used = int(m.kv_used)
        elif m.kv_fraction is not None and capacity:
            kv_used = round(m.kv_fraction * capacity)
        return EngineLoad(running=running, waiting=waiting, kv_used=kv_used, kv_capacity=capacity,
                          max_input_len=self.max_input_len, adapters=self.adapters.infos())

    # ----------------------------------------------------------------- tokens, card
    def chat_prompt(self, messages: list[dict], end: str = "open", tools: list[dict] | None = None,
                    extra: dict | None = None) -> str | None:
        """The checkpoint's chat template (the `upstream_tokenizer` or `model_path` directory), applied
        here: the upstream's /v1/completions then runs what its /v1/chat/completions would."""
        tok = self._chat_tokenizer()
        return templated_chat(tok, messages, end=end, tools=tools, extra=extra) if tok else None

    def _chat_tokenizer(self) -> Any:
        if self._chat_tok is None:
            self._chat_tok = chat_template.load_tokenizer(self.tokenizer_path) or False
        return self._chat_tok

    def count_tokens(self, text: str) -> int:
        """Exact with `upstream_tokenizer` (or model_path's tokenizer.json), else 1.3 x words."""
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text).ids)
        return words_estimate(text)

    def model_card(self) -> dict:
        return {"engine": self.name, "simulated": False, "model": self.model_name,
                "upstream": self.api_url, "upstream_model": self.upstream_model,
                "upstream_models": list(self.upstream_models), "metrics": self.metrics_url or "off",
                "metrics_state": self.metrics_state, "streaming": self.stream,
                "lora": {None: "unknown until the first load", True: "runtime endpoints",
                         False: "unsupported by the upstream"}[self.lora_supported],
                "tokenizer": "exact" if self._tokenizer is not None else "estimate (1.3 x words)",
                **openai_http_chat.routes(bool(self._chat_tokenizer()), self.chat_mode, self.chat_refusal,
                                          self.tool_refusal),
                "max_input_len": self.max_input_len}

