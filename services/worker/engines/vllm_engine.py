"""The `vllm` engine: vLLM's async engine in-process, for GPU operators.

UNTESTED ON A GPU IN THIS PROJECT SO FAR. vLLM cannot be installed where polyserve is
developed. This adapter targets vLLM TARGET_VLLM_VERSION (0.33.0, the newest release on
PyPI when checked) and is grounded in that release's sources, not in its docs:
`scripts/vllm-surface` downloads the release (no install, no import), extracts with `ast`
the API below into `vllm_surface.json` (next to this file), and reports drift for a newer
release. tests/unit/test_vllm_surface.py checks that every vLLM name this engine uses
(`vllm_api.SURFACE_USED`) exists in that JSON and that the fake the contract tests run
against (tests/fakes/fake_vllm.py; tests/unit/test_vllm_contract.py) has vLLM's
signatures and fields.

vLLM API used (as in the 0.33.0 sources; `vllm_api` detects the rest):
- `AsyncEngineArgs(model=..., served_model_name=..., dtype=..., max_num_seqs=..., max_model_len=...,
  scheduling_policy="fcfs"|"priority", enable_lora=..., max_lora_rank=..., max_loras=...,
  gpu_memory_utilization=..., seed=...)`; max_lora_rank must be one of vLLM's MaxLoRARanks
  (1, 8, 16, 32, 64, 128, 256, 320, 512): a setting in between is rounded up for vLLM;
- `AsyncLLM.from_engine_args(args)` (`vllm.v1.engine.async_llm`; `vllm.AsyncLLMEngine` is an alias
  of it; falls back to V0's `vllm.AsyncLLMEngine.from_engine_args` on releases without V1);
- `engine.generate({"prompt_token_ids": ids[, "cache_salt": salt]}, SamplingParams, request_id,
  lora_request=..., priority=...)` (a `TokensPrompt`; the salt: core/cache_salt.py): an async generator of
  `RequestOutput` (`.outputs[i]` = `CompletionOutput` with `.index`, `.text`, `.token_ids`, `.finish_reason`
  in "stop"/"length"/"abort"/"error"/"repetition"; `.finished`; `.num_cached_tokens`: the prompt tokens its prefix cache served). With n > 1 an output may carry only some
  choices, so choices are keyed by `.index`, never by position. vLLM makes the request id unique internally (a random suffix) but `abort()`
  takes the id passed to generate();
- `SamplingParams(n, temperature, top_p, top_k, seed, stop, max_tokens, min_tokens,
  output_kind=RequestOutputKind.DELTA, structured_outputs=StructuredOutputsParams(...), logprobs=k,
  prompt_logprobs=k, frequency_penalty, presence_penalty, repetition_penalty, min_p, logit_bias,
  stop_token_ids, include_stop_str_in_output: each only when the request sets it)`; without RequestOutputKind outputs are cumulative and diffed (logprobs too);
  `CompletionOutput.logprobs` / `RequestOutput.prompt_logprobs` (per position {token id: Logprob(logprob,
  rank, decoded_token)}) become TokenLogprob entries (vllm_api.token_logprobs);
- `await engine.abort(request_id)`; `engine.get_tokenizer()` (plain in 0.33, a coroutine in 0.11:
  both handled); `add_lora(lora_request)` / `remove_lora(lora_id)`; `shutdown()`;
- `LoRARequest(lora_name, lora_int_id, lora_path)`, one per request; the int id is allocated once per
  adapter name (vLLM caches adapters by it: "lora_int_id must be globally unique for a given adapter");
- errors: `EngineDeadError` -> 503, `VLLMValidationError`/`VLLMClientError`/ValueError -> 400, vLLM's
  admission rejections (`GracefulHTTPError`: QueueOverflowError, MaxQueuedTokensError) -> their
  `http_status` (503).

Mapping to polyserve: `max_batch` -> max_num_seqs; `scheduling` "priority" -> scheduling_policy "priority" and
each request's priority passed through (vLLM: lower value = earlier, as the hf engine); finish reasons stop/length
kept, "abort" -> "cancelled"; `num_cached_tokens` -> RequestStats.cached_tokens (usage's cached_tokens).

Load (heartbeats): vLLM's stat loggers are not a stable API, so running/waiting come from this engine's own
accounting: an admitted request is *waiting* until its first output arrives and *running* after (a long prompt being
prefilled therefore counts as waiting). `kv_used` is the context those running requests hold, n x input + generated
tokens (prefix sharing ignored). `kv_capacity` is vLLM's `cache_config.num_gpu_blocks * block_size` when the engine
exposes it, else 0 (unknown). `max_waiting` bounds the waiting count (429 beyond it), `max_input_len` is clamped to
the model's `max_model_len - 1`.

Settings read: model, model_path (served instead of `model` when set), max_waiting, max_batch, max_input_len,
scheduling, dtype ("float32", the hf engine's CPU default, and "" mean vLLM's "auto"). `device` is ignored (vLLM picks
its platform), `kv_capacity_tokens` too (vLLM sizes its cache from gpu_memory_utilization). Optional, read with
getattr: gpu_memory_utilization (0.9), max_model_len (0 = the model's), enable_lora (True), max_lora_rank (64),
max_loras (4), seed (0), vllm_engine_args (dict or JSON of extra AsyncEngineArgs fields; `polyserve up
--reasoning-parser` adds vLLM's `reasoning_parser`, so a constraint applies after the thinking).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from polyserve.core import cache_salt
from polyserve.proto import AdapterInfo
from polyserve.worker.engine import (
    Delta,
    Engine,
    EngineError,
    EngineLoad,
    EngineOverloaded,
    EngineRequest,
    Finished,
    Withdrawn,
    check_request,
    free_adapter,
    make_stats,
    relay,
    templated_chat,
    truncated,
)
from polyserve.worker.engines import vllm_api
from polyserve.worker.lora import AdapterError, AdapterRegistry, check_name, read_adapter

logger = logging.getLogger(__name__)

TARGET_VLLM_VERSION = "0.33.0"


class _Req:
    """One admitted request: its vLLM stream task, its event queue, per-choice progress."""

    def __init__(self, req: EngineRequest, ids: list[int], sampling: Any, lora: Any):
        self.req = req
        self.ids = ids
        self.sampling = sampling
        self.lora = lora
        self.n = req.params.n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.start = time.monotonic()  # submitted to vLLM (its own queueing is not visible here)
        self.first_output: float | None = None
        self.step_times: list[float] = []
        self.first_tokens = 0
        self.text_len = [0] * self.n  # cumulative mode: what was already emitted, per choice
        self.tok_len = [0] * self.n
        self.tokens = [0] * self.n
        self.ended: set[int] = set()
        self.done = False
        self.prompt_raw: list | None = None  # vLLM's prompt logprobs (params.prompt_logprobs set)
        self.no_think: set[int] = set()  # choices still owed an empty "<think></think>" (_admit)
        self.ids_sent: set[int] = set()  # choices whose first delta carried the prompt's token ids
        self.prompt_sent: set[int] = set()  # choices whose first delta carried them
        self.cached = 0  # prompt tokens vLLM's prefix cache served (RequestOutput.num_cached_tokens)


class VllmEngine(Engine):
    """polyserve's Engine over vLLM's AsyncLLM (or V0 AsyncLLMEngine), in this process."""

    name = "vllm"
    simulated = False
    resumable = True  # request migration: prompt + output so far as the prompt (vLLM API; not run on a GPU)

    def __init__(self, settings: Any):
        self.api = vllm_api.import_vllm(TARGET_VLLM_VERSION)  # lazy: EngineError now if vLLM is missing
        self.model_path = getattr(settings, "model_path", "") or ""
        self.model_name = getattr(settings, "model", "") or Path(self.model_path).name or "vllm-model"
        self.max_waiting = int(getattr(settings, "max_waiting", 256))
        self.max_batch = int(getattr(settings, "max_batch", 64))
        self.max_input_len = int(getattr(settings, "max_input_len", 4096))
        self.scheduling = getattr(settings, "scheduling", "fcfs") or "fcfs"
        self.salt_mode = cache_salt.mode(getattr(settings, "cache_salt_tenants", "auto"))
        if self.scheduling not in ("fcfs", "priority"):
            raise EngineError(f"scheduling {self.scheduling!r} is unknown; vLLM offers fcfs and priority", 400)
        self.enable_lora = bool(getattr(settings, "enable_lora", True))
        self.max_lora_rank = int(getattr(settings, "max_lora_rank", 64))
        dtype = getattr(settings, "dtype", "") or ""
        extra = getattr(settings, "vllm_engine_args", None) or {}
        extra = json.loads(extra) if isinstance(extra, str) else dict(extra)
        max_len = int(getattr(settings, "max_model_len", 0) or 0)
        self.engine_args: dict[str, Any] = dict(
            model=self.model_path or self.model_name,
            served_model_name=self.model_name,
            dtype="auto" if dtype in ("", "float32", "auto") else dtype,
            max_num_seqs=self.max_batch,
            max_model_len=max_len or None,
            scheduling_policy=self.scheduling,
            enable_lora=self.enable_lora,
            max_lora_rank=vllm_api.lora_rank(self.max_lora_rank),
            max_loras=int(getattr(settings, "max_loras", 4)),
            gpu_memory_utilization=float(getattr(settings, "gpu_memory_utilization", 0.9)),
            seed=int(getattr(settings, "seed", 0) or 0),
        )
        self.engine_args.update(extra)
        self.adapters = AdapterRegistry()
        self._lora_ids: dict[str, int] = {}  # name -> lora_int_id, kept across unload/reload
        self._lora_next = itertools.count(1)  # vLLM requires lora_int_id > 0
        self._loras: dict[str, Any] = {}  # loaded name -> LoRARequest
        self._engine: Any = None
        self._tokenizer: Any = None
        self._texts: dict[int, str] = {}
        self._known: dict[str, _Req] = {}
        self._background: set[asyncio.Task] = set()
        self.kv_capacity = 0
        self.max_model_len = 0
        self._stopping = False

    @classmethod
    def from_settings(cls, settings: Any) -> VllmEngine:
        return cls(settings)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        args = vllm_api.engine_args(self.api, self.engine_args)
        try:
            self._engine = self.api.engine_cls.from_engine_args(args)
            tokenizer = self._engine.get_tokenizer()
            self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM {self.api.version} could not serve {self.engine_args['model']!r}: {exc}",
                              500) from exc
        cfg = vllm_api.engine_config(self._engine)
        if cfg is None and hasattr(self._engine, "get_vllm_config"):
            cfg = await self._engine.get_vllm_config()
        self.kv_capacity = vllm_api.kv_capacity_tokens(cfg)
        self.max_model_len = vllm_api.max_model_len(self._engine, cfg)
        if self.max_model_len:
            self.max_input_len = min(self.max_input_len, self.max_model_len - 1)
        self._stopping = False
        logger.info("vllm engine (vLLM %s, %s) serving %s: %s KV tokens, max_model_len %s, scheduling %s",
                    self.api.version, self.api.flavor, self.model_name, self.kv_capacity or "unknown",
                    self.max_model_len or "unknown", self.scheduling)

    async def stop(self) -> None:
        self._stopping = True
        pumps = []
        for act in list(self._known.values()):
            self._fail(act, EngineError("the worker's engine is stopping", 503))
            if act.task is not None and not act.task.done():
                act.task.cancel()
                pumps.append(act.task)
            self._abort(act.req.request_id)
        tasks = pumps + [t for t in self._background if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        engine, self._engine = self._engine, None
        if engine is not None:
            shutdown = getattr(engine, "shutdown", None) or getattr(engine, "shutdown_background_loop", None)
            if shutdown is not None:
                result = shutdown()
                if inspect.isawaitable(result):
                    await result

    # ----------------------------------------------------------------- requests
    async def generate(self, req: EngineRequest) -> AsyncIterator[Delta | Finished]:
        act = self._admit(req)  # raises on the first __anext__, before any suspension
        async with contextlib.aclosing(relay(act.queue, req.request_id, lambda: act.done, self.cancel)) as events:
            async for event in events:
                yield event

    def _admit(self, req: EngineRequest) -> _Req:
        if self._engine is None or self._stopping:
            raise EngineError("the vllm engine is not running", 503)
        p = req.params
        check_request(req, max_batch=self.max_batch, adapters=self.adapters, known=self._known,
                      unit="sequences")
        ids = truncated(list(self._tokenizer.encode(req.prompt)), p.truncate_prompt_tokens, self.max_input_len)
        if not ids:
            raise EngineError("the prompt encodes to no tokens", 400)
        if len(ids) > self.max_input_len:
            raise EngineError(f"input is {len(ids)} tokens, over this worker's max_input_len of "
                              f"{self.max_input_len}", 400)
        if self._waiting_count() >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue full ({self.max_waiting} requests); retry later")
        sampling = vllm_api.sampling_params(self.api, p)
        act = _Req(req, ids, sampling, self._loras.get(req.adapter) if req.adapter else None)
        if p.thinking_budget is not None and not self.engine_args.get("reasoning_config"):
            raise EngineError("thinking_token_budget needs vLLM's reasoning_config on this worker (vllm_engine_args "
                              '{"reasoning_config": {"reasoning_start_str": "<think>", "reasoning_end_str": '
                              '"</think>"}}); it is not set, so vLLM would not enforce the budget', 400)
        if p.structured is not None and p.think and not self.engine_args.get("reasoning_parser"):
            # vLLM constrains from the first token without its own reasoning parser: the answer has
            # no thinking, said as an empty one so the gateway reads it as the content (reasoning.py)
            act.no_think = set(range(p.n))
        self._known[req.request_id] = act
        act.task = asyncio.create_task(self._pump(act), name=f"vllm:{req.request_id}")
        return act

    async def _pump(self, act: _Req) -> None:
        """Drive vLLM's stream for one request into its queue (a task, so cancel() can stop it at once)."""
        priority = act.req.priority if self.scheduling == "priority" else 0  # V0 rejects priority under fcfs
        out = None
        try:
            stream = self._engine.generate(cache_salt.tokens_prompt(act.ids, act.req, self.salt_mode), act.sampling,
                                           act.req.request_id, lora_request=act.lora, priority=priority)
            try:
                async for out in stream:
                    if act.done:
                        break
                    self._on_output(act, out)
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()  # vLLM's generate() aborts the request when closed early
            if not act.done:  # vLLM ended the stream without finishing every choice
                self._close_open(act, "stop" if getattr(out, "finished", False) else "cancelled")
        except asyncio.CancelledError:
            if not act.done:  # not by cancel(): e.g. the loop shutting down
                self._fail(act, EngineError("vLLM stream cancelled", 503))
            raise
        except Exception as exc:  # noqa: BLE001 - every vLLM failure must reach the client
            logger.warning("vLLM request %s failed: %s: %s", act.req.request_id, type(exc).__name__, exc)
            self._fail(act, EngineError(f"vLLM: {type(exc).__name__}: {exc}", vllm_api.error_status(exc)))

    def _delta(self, act: _Req, i: int, text: str, count: int, reason: str | None, new_ids: list[int],
               raw_lps: Any) -> Delta:
        """A choice's Delta, with its tokens' logprobs (params.logprobs) and, on its first, the prompt's."""
        if i in act.no_think:
            act.no_think.discard(i)
            text = "".join(act.req.params.think) + text
        p, delta = act.req.params, Delta(index=i, text=text, tokens=count, finish_reason=reason)
        if p.return_token_ids:  # vLLM's CompletionOutput.token_ids; the prompt's on the choice's first delta
            delta.token_ids = list(new_ids)
            delta.prompt_token_ids = list(act.ids) if i not in act.ids_sent else None
            act.ids_sent.add(i)
        if p.logprobs is not None and count:
            delta.logprobs = vllm_api.token_logprobs(raw_lps, new_ids, p.logprobs, self._token_text) or None
        if p.prompt_logprobs is not None and i not in act.prompt_sent:
            act.prompt_sent.add(i)
            delta.prompt_logprobs = vllm_api.token_logprobs(act.prompt_raw, act.ids, p.prompt_logprobs,
                                                            self._token_text)
        return delta

    def _token_text(self, token_id: int) -> str:
        """A token decoded alone (special tokens kept), cached per id."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _on_output(self, act: _Req, out: Any) -> None:
        now = time.monotonic()
        prompt_lps = getattr(out, "prompt_logprobs", None)
        if prompt_lps:  # DELTA: sent once (popped by vLLM), so kept here; cumulative: the whole list each time
            act.prompt_raw = (act.prompt_raw or []) + list(prompt_lps) if self.api.delta_outputs else list(prompt_lps)
        act.cached = int(getattr(out, "num_cached_tokens", None) or act.cached)  # None until scheduled
        new_tokens = 0
        for co in out.outputs:
            i = int(co.index)
            if i in act.ended or not 0 <= i < act.n:
                continue
            text, token_ids = co.text or "", list(co.token_ids or ())
            new_ids, raw_lps = token_ids, co.logprobs
            if not self.api.delta_outputs:  # cumulative: emit what is past the last output of this choice
                full_text, full_tokens, start = text, len(token_ids), act.tok_len[i]
                text = full_text[act.text_len[i]:] if len(full_text) >= act.text_len[i] else ""
                count = max(0, full_tokens - start)
                act.text_len[i], act.tok_len[i] = len(full_text), full_tokens
                new_ids, raw_lps = token_ids[start:], raw_lps[start:full_tokens] if raw_lps is not None else None
            else:
                count = len(token_ids)
            reason = co.finish_reason
            if reason == vllm_api.ERROR_REASON:
                self._fail(act, EngineError(f"vLLM reported an internal error on choice {i}", 500))
                return
            mapped = vllm_api.FINISH_REASONS.get(str(reason), str(reason)) if reason is not None else None
            act.tokens[i] += count
            new_tokens = max(new_tokens, count)
            if text or count or mapped:
                act.queue.put_nowait(self._delta(act, i, text, count, mapped, new_ids, raw_lps))
            if mapped:
                act.ended.add(i)
        if new_tokens:
            if act.first_output is None:
                act.first_output, act.first_tokens = now, new_tokens
            act.step_times.append(now)
        if len(act.ended) == act.n:
            self._finish(act)
        elif getattr(out, "finished", False):
            self._close_open(act, "stop")

    def _close_open(self, act: _Req, reason: str) -> None:
        for i in sorted(set(range(act.n)) - act.ended):
            act.queue.put_nowait(Delta(index=i, text="", tokens=0, finish_reason=reason))
            act.ended.add(i)
        self._finish(act)

    def cancel(self, request_id: str) -> bool:
        act = self._known.get(request_id)
        if act is None or act.done:
            return False
        self._close_open(act, "cancelled")
        if act.task is not None and not act.task.done() and act.task is not asyncio.current_task():
            act.task.cancel()  # vLLM's generate() aborts on CancelledError too
        self._abort(request_id)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Give back a request with no output yet (Aladdin Alg. 2 move): abort it in vLLM and
        end its stream with `Withdrawn`. vLLM does not say whether a request is still queued
        or in its first prefill; with no token emitted yet, aborting loses at most that
        prefill, which the new worker redoes."""
        act = self._known.get(request_id)
        if act is None or act.done or act.first_output is not None:
            return False
        self._fail(act, Withdrawn(request_id))
        if act.task is not None and not act.task.done():
            act.task.cancel()
        self._abort(request_id)
        return True

    def _abort(self, request_id: str) -> None:
        """`await engine.abort(request_id)` in the background (cancel() is synchronous)."""
        engine = self._engine
        if engine is None:
            return

        async def abort() -> None:
            try:
                await engine.abort(request_id)
            except Exception as exc:  # noqa: BLE001 - aborting a finished request may raise on some versions
                logger.debug("vLLM abort(%s): %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(abort(), name=f"vllm-abort:{request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finish(self, act: _Req) -> None:
        """All choices ended (or cancelled): release the request and send Finished."""
        act.done = True
        self._known.pop(act.req.request_id, None)
        steps = 1 + max(0, max(act.tokens, default=0) - act.first_tokens) if act.step_times else 0
        stats = make_stats(len(act.ids), steps, act.req.arrival, act.start, act.step_times, act.cached)
        act.queue.put_nowait(Finished(stats=msgspec.structs.replace(stats, output_tokens=sum(act.tokens))))

    def _fail(self, act: _Req, exc: EngineError) -> None:
        if act.done:
            return
        act.done = True
        self._known.pop(act.req.request_id, None)
        act.queue.put_nowait(exc)

    def _waiting_count(self) -> int:
        return sum(1 for a in self._known.values() if a.first_output is None)

    def load(self) -> EngineLoad:
        running = [a for a in self._known.values() if a.first_output is not None]
        kv_used = sum(a.n * len(a.ids) + sum(a.tokens) for a in running)
        return EngineLoad(running=len(running), waiting=len(self._known) - len(running), kv_used=kv_used,
                          kv_capacity=self.kv_capacity, max_input_len=self.max_input_len,
                          adapters=self.adapters.infos())

    def count_tokens(self, text: str) -> int:
        if self._tokenizer is None:
            raise EngineError("the vllm engine is not started", 503)
        return len(self._tokenizer.encode(text))

    def model_card(self) -> dict:
        return {"engine": self.name, "simulated": False, "model": self.model_name,
                "source": self.engine_args["model"], "vllm_version": self.api.version,
                "vllm_target_version": TARGET_VLLM_VERSION, "vllm_api": self.api.flavor,
                "max_input_len": self.max_input_len, "max_model_len": self.max_model_len,
                "kv_capacity_tokens": self.kv_capacity, "scheduling": self.scheduling,
                "note": "vllm adapter: untested on a GPU in this project so far"}

    def chat_prompt(self, messages: list[dict], end: str = "open", tools: list[dict] | None = None,
                    extra: dict | None = None) -> str | None:
        """The model's chat template applied to `messages` (None: its tokenizer has none). vLLM adds
        the tokenizer's special tokens to a text prompt (`encode` below), so a BOS the template writes
        is dropped."""
        tok = self._tokenizer  # vLLM's get_tokenizer(): the HF tokenizer (a cached subclass of its class)
        return None if tok is None else templated_chat(tok, messages, end=end, tools=tools, extra=extra)

    def format_chat(self, messages: list[dict]) -> str:
        """Chat messages as one prompt, with the model's chat template when it has one."""
        tok = self._tokenizer
        apply = getattr(tok, "apply_chat_template", None)
        if apply is not None:  # vLLM's TokenizerLike forwards these keywords to the HF tokenizer
            try:
                return apply(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - e.g. no chat template: fall back to plain lines
                logger.debug("apply_chat_template failed (%s); plain chat format", exc)
        return "\n".join([f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages] + ["assistant:"])

    # ----------------------------------------------------------------- adapters
    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Register a PEFT LoRA adapter; requests may name it as soon as this returns."""
        if self._engine is None:
            raise EngineError("the vllm engine is not started", 503)
        if not self.enable_lora:
            raise EngineError("LoRA is disabled on this worker (enable_lora=False)", 400)
        try:
            check_name(name)
            spec = read_adapter(path)
        except AdapterError as exc:
            raise EngineError(str(exc), exc.status) from exc
        if name in self.adapters:
            raise EngineError(f"adapter {name!r} is already loaded; unload it first", 409)
        if spec.rank > self.max_lora_rank:
            raise EngineError(f"adapter {name!r} has rank {spec.rank}, over this worker's max_lora_rank of "
                              f"{self.max_lora_rank}", 400)
        lora_id = self._lora_ids.setdefault(name, next(self._lora_next))
        lora = self.api.LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(spec.path))
        add = getattr(self._engine, "add_lora", None)
        if add is not None:  # load it now (vLLM would otherwise load it on first use), so errors show here
            try:
                await add(lora)
            except Exception as exc:
                raise EngineError(f"vLLM cannot load adapter {name!r} from {spec.path}: {exc}", 400) from exc
        self._loras[name] = lora
        info = self.adapters.add(name, spec)
        logger.info("loaded adapter %s (rank %d, lora_int_id %d) from %s", name, spec.rank, lora_id, spec.path)
        return info

    async def unload_adapter(self, name: str, force: bool = False) -> None:
        """Remove an adapter; refused (409) while requests use it, unless `force` cancels them."""
        free_adapter(name, self.adapters, list(self._known.values()), force, self.cancel)
        lora = self._loras.pop(name)
        self.adapters.remove(name)
        remove = getattr(self._engine, "remove_lora", None)
        if remove is not None:  # drop vLLM's cached weights: a reload under this name reads the path again
            try:
                await remove(lora.lora_int_id)
            except Exception as exc:  # noqa: BLE001
                logger.warning("vLLM remove_lora(%s) failed: %s", lora.lora_int_id, exc)
        logger.info("unloaded adapter %s", name)
