"""A fake of the slice of vLLM's Python API that polyserve's `vllm` engine uses.

It mirrors the SHAPES of vLLM 0.33.0 (class names, module paths, method signatures,
RequestOutput/CompletionOutput fields and their streaming semantics), not its
behaviour on a GPU: the "model" is a script of characters, one character per token.
The shapes are not hand-copied from docs: tests/unit/test_vllm_surface.py checks this
fake's classes, signatures and fields against services/worker/engines/vllm_surface.json,
which scripts/vllm-surface extracts from the 0.33.0 release's sources.
Contract tests install it with `install(monkeypatch, flavor)`, which puts these
modules in `sys.modules`: vllm, vllm.sampling_params, vllm.outputs, vllm.lora.request,
vllm.engine.arg_utils, vllm.engine.async_llm_engine, vllm.exceptions and (V1 flavors)
vllm.v1.engine.async_llm, vllm.v1.engine.exceptions. Flavors: "v1" is 0.33.0; the others
are older shapes the engine still detects ("v1-async-tokenizer": 0.11's coroutine
get_tokenizer; "v0": the pre-V1 AsyncLLMEngine) and are not checked against the JSON.

Semantics mirrored from vLLM (sources in the engine's docstring and the report):
- `SamplingParams.output_kind`: CUMULATIVE (default) gives each choice's whole text and
  token ids so far in every output; DELTA gives only what is new since the last output.
- Stop strings: the returned text never contains the stop string (it is cut there),
  and text that could still become a stop string is held back while streaming, so an
  output may carry more or fewer characters than it carries tokens.
- V1 parallel sampling (n > 1): each RequestOutput carries the CompletionOutput of the
  one child that advanced (choices identified by `.index`); `finished` is set on the
  output where the last child finishes. V0 (flavor "v0"): every output carries all choices.
- finish_reason strings: "stop" (EOS or stop string), "length" (max_tokens), "abort".
- `abort(request_id)` ends a live stream with finish_reason "abort" (every choice); a generate() task
  that is cancelled aborts its own request (as vLLM's generate() does on CancelledError).
- `LoRARequest(lora_name, lora_int_id, lora_path)`: lora_int_id must be > 0 and lora_path
  non-empty; requests with a LoRA are rejected unless the engine was built with enable_lora.
- `AsyncEngineArgs.max_lora_rank` must be one of vLLM's MaxLoRARanks (checked when the engine
  is built, as vLLM's LoRAConfig does); `max_num_queued_reqs` bounds unfinished requests
  (n counts n times): beyond it generate() raises QueueOverflowError (a GracefulHTTPError, 503).
- 0.33 validation errors are `VLLMValidationError` (a VLLMClientError, not a ValueError).
- Logprobs (`SamplingParams.logprobs` / `prompt_logprobs` = k): per position a dict token id ->
  `Logprob(logprob, rank, decoded_token)` holding the top-k by rank (1..k) plus the chosen token
  (so up to k+1 entries; its rank may be over k). `CompletionOutput.logprobs` lists one per token of
  `token_ids` (DELTA: the new ones only, as vLLM slices them); `RequestOutput.prompt_logprobs` has one
  per prompt token, the first None, and under DELTA comes once (vLLM pops it), on the first output.
  The fake's values: the chosen token has rank 1 + (position % 3) and logprob -rank/2; the other
  ranks are ids 1000 + rank.
- V0 raises ValueError for a non-zero priority unless scheduling_policy == "priority".
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

VERSION = "0.33.0"
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
EOS_ID = 0
BLOCK_SIZE = 16  # vLLM's default KV block size (tokens), the unit of its prefix cache
# TokensPrompt's keys in the 0.33.0 sources (vllm_surface.json, "vllm.inputs.llm.TokensPrompt")
_SURFACE = Path(__file__).resolve().parents[2] / "services" / "worker" / "engines" / "vllm_surface.json"
TOKENS_PROMPT_KEYS = frozenset(json.loads(_SURFACE.read_text())["classes"]["vllm.inputs.llm.TokensPrompt"]["attributes"])


# --------------------------------------------------------------------- vllm.exceptions
class VLLMError(Exception):
    pass


class VLLMClientError(VLLMError):
    pass


class VLLMServerError(VLLMError):
    pass


class VLLMValidationError(VLLMClientError):
    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter, self.value = parameter, value


class GracefulHTTPError(VLLMError):
    def __init__(self, message: str, http_status: HTTPStatus):
        super().__init__(message)
        self.message, self.http_status = message, http_status


class QueueOverflowError(GracefulHTTPError):
    def __init__(self):
        super().__init__("The engine is currently busy and cannot accept new requests. "
                         "Please try again later or on a different instance.", HTTPStatus.SERVICE_UNAVAILABLE)


class EngineDeadError(VLLMServerError):  # vllm.v1.engine.exceptions
    pass


# --------------------------------------------------------------------- vllm.sampling_params
class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one constraint, validated like vLLM's __post_init__."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        count = sum(v is not None for v in (self.json, self.regex, self.choice, self.grammar, self.json_object,
                                            self.structural_tag))
        if count != 1:
            raise VLLMValidationError("You can only use one kind of structured outputs constraint" if count else
                                      "You must use one kind of structured outputs constraint")


class SamplingParams:
    """vLLM's SamplingParams (a msgspec.Struct there): the fields the engine sets, validated like vLLM."""

    _with_output_kind = True

    def __init__(self, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: str | list[str] | None = None, max_tokens: int | None = 16,
                 min_tokens: int = 0, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                 structured_outputs: StructuredOutputsParams | None = None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, min_p: float = 0.0, logit_bias: dict[int, float] | None = None,
                 stop_token_ids: list[int] | None = None, include_stop_str_in_output: bool = False,
                 thinking_token_budget: int | None = None, allowed_token_ids: list[int] | None = None,
                 bad_words: list[str] | None = None, skip_special_tokens: bool = True, **other: Any):
        unknown = set(other) - {"ignore_eos"}
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        self.skip_special_tokens = skip_special_tokens
        if n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {n}.", parameter="n", value=n)
        if temperature < 0:
            raise VLLMValidationError(f"temperature must be non-negative, got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p)
        if top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not -2.0 <= value <= 2.0:  # vLLM's _verify_args, its messages
                raise VLLMValidationError(f"{name} must be in [-2, 2], got {value}.")
        if repetition_penalty <= 0.0:
            raise VLLMValidationError(f"repetition_penalty must be greater than zero, got {repetition_penalty}.")
        if not 0.0 <= min_p <= 1.0:
            raise VLLMValidationError(f"min_p must be in [0, 1], got {min_p}.")
        self.presence_penalty, self.frequency_penalty = presence_penalty, frequency_penalty
        self.repetition_penalty, self.min_p, self.logit_bias = repetition_penalty, min_p, logit_bias
        self.stop_token_ids, self.include_stop_str_in_output = stop_token_ids, include_stop_str_in_output
        self.thinking_token_budget = thinking_token_budget
        if allowed_token_ids is not None and not allowed_token_ids:  # vLLM's _validate_allowed_token_ids
            raise ValueError("allowed_token_ids is not None and empty!")
        if any(not w for w in bad_words or ()):
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={bad_words}")
        self.allowed_token_ids, self.bad_words = allowed_token_ids, bad_words
        if max_tokens is not None and max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {max_tokens}.")
        if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
            raise VLLMValidationError(f"min_tokens must be in [0, max_tokens], got {min_tokens}.")
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and k != -1 and k < 0:
                raise VLLMValidationError(f"{name} must be non-negative or -1, got {k}.", parameter=name, value=k)
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        self.n, self.temperature, self.top_p, self.top_k, self.seed = n, temperature, top_p, top_k, seed
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.max_tokens, self.min_tokens, self.output_kind = max_tokens, min_tokens, output_kind
        self.structured_outputs = structured_outputs


class CumulativeOnlySamplingParams(SamplingParams):
    """An older SamplingParams without `output_kind` (outputs are always cumulative)."""

    def __init__(self, *args: Any, **kw: Any):
        if "output_kind" in kw:
            raise TypeError("unexpected keyword argument 'output_kind'")
        super().__init__(*args, **kw)


# --------------------------------------------------------------------- vllm.logprobs
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def fake_position(token_id: int, position: int, k: int) -> dict[int, Logprob]:
    """The fake's logprobs at one position (see the module docstring): top-k by rank plus the chosen token."""
    own = 1 + position % 3
    out = {1000 + r: Logprob(-r / 2, r, chr(1000 + r)) for r in range(1, k + 1) if r != own}
    out[token_id] = Logprob(-own / 2, own, FakeTokenizer().decode([token_id]))
    return out


# --------------------------------------------------------------------- vllm.outputs
@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: Any, outputs: list[CompletionOutput], finished: bool, metrics: Any = None,
                 lora_request: Any = None, **kwargs: Any):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs, self.outputs, self.finished = prompt_logprobs, outputs, finished
        self.metrics, self.lora_request = metrics, lora_request
        self.num_cached_tokens = kwargs.get("num_cached_tokens")


# --------------------------------------------------------------------- vllm.lora.request
class LoRARequest:
    """vLLM's LoRARequest (msgspec.Struct): equality and hash by lora_name, as in vLLM."""

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "", base_model_name: str | None = None,
                 load_inplace: bool = False, is_3d_lora_weight: bool = False):
        if lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")
        assert lora_path, "lora_path cannot be empty"
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
        self.base_model_name, self.load_inplace, self.is_3d_lora_weight = base_model_name, load_inplace, \
            is_3d_lora_weight

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return f"LoRARequest({self.lora_name!r}, {self.lora_int_id}, {self.lora_path!r})"


# --------------------------------------------------------------------- vllm.engine.arg_utils
@dataclass
class AsyncEngineArgs:
    model: str = "Qwen/Qwen3-0.6B"
    served_model_name: str | list[str] | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_queued_reqs: int | None = None
    gpu_memory_utilization: float = 0.92
    tensor_parallel_size: int = 1
    scheduling_policy: str = "fcfs"
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None
    enable_prefix_caching: bool | None = None
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    reasoning_parser: str = ""  # the fake has no thinking: structured outputs are constrained from token 1
    reasoning_config: Any = None  # vLLM's ReasoningConfig (thinking_token_budget); the fake only records it


# --------------------------------------------------------------------- the tokenizer
class FakeTokenizer:
    """One token per character (ids are code points; 0 is EOS)."""

    chat_template = None
    eos_token_id = EOS_ID

    def encode(self, text: str, truncation: bool | None = None, max_length: int | None = None,
               add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i != EOS_ID)

    def apply_chat_template(self, messages: list, tools: list | None = None, **kwargs: Any) -> str:
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")


def default_script(prompt_ids: list[int], index: int, lora: LoRARequest | None) -> str:
    """What the fake model "generates" for a choice: deterministic per prompt, choice and adapter."""
    tag = f"[{lora.lora_name}]" if lora is not None else ""
    return f"{tag}choice{index}:" + "abcdefghijklmnopqrstuvwxyz" * 4


# --------------------------------------------------------------------- the engines
class _Child:
    def __init__(self, index: int, script: str):
        self.index, self.script = index, script
        self.text, self.token_ids = "", []
        self.logprobs: list[dict[int, Logprob]] = []  # one per token id (params.logprobs set)
        self.finish_reason: str | None = None
        self.sent_text, self.sent_tokens = 0, 0  # delta mode bookkeeping
        self.reported = False  # its finish_reason went out in an output


class FakeAsyncLLM:
    """vllm.v1.engine.async_llm.AsyncLLM (0.33): from_engine_args, generate, abort, get_tokenizer (a plain
    method), add_lora/remove_lora/list_loras, shutdown; vllm_config.cache_config / .model_config."""

    per_child_outputs = True  # V1 parallel sampling: one child per RequestOutput
    last: FakeAsyncLLM | None = None

    def __init__(self, engine_args: AsyncEngineArgs):
        self.engine_args = engine_args
        self.vllm_config = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(num_gpu_blocks=1000, block_size=16),
            model_config=types.SimpleNamespace(max_model_len=engine_args.max_model_len or 2048),
            scheduler_config=types.SimpleNamespace(policy=engine_args.scheduling_policy))
        self.model_config = self.vllm_config.model_config
        self.tokenizer = FakeTokenizer()
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.loras: dict[int, LoRARequest] = {}
        self.removed_loras: list[int] = []
        self.script: Callable[[list[int], int, LoRARequest | None], str] = default_script
        self.step_delay = 0.0
        self.gate: asyncio.Event | None = None  # when set, generate() waits on it before the first token
        self.inject: dict[str, str] = {}  # request_id -> finish_reason forced on its first token ("abort", "error")
        self.live: dict[str, list[_Child]] = {}
        self._prompt_sent: dict[str, bool] = {}
        self.cached_blocks: set[int] = set()  # automatic prefix caching: hashes of the full blocks computed
        self.shut_down = False

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, start_engine_loop: bool = True,
                         usage_context: Any = None, stat_loggers: Any = None) -> FakeAsyncLLM:
        if not isinstance(engine_args, AsyncEngineArgs):
            raise TypeError("engine_args must be AsyncEngineArgs")
        if engine_args.enable_lora and engine_args.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank {engine_args.max_lora_rank} is not one of {MAX_LORA_RANKS}")
        if str(engine_args.model).startswith("/nonexistent"):
            raise OSError(f"{engine_args.model} is not a local folder and is not a valid model identifier")
        engine = cls(engine_args)
        type(engine).last = engine
        FakeAsyncLLM.last = engine
        return engine

    def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    def _validate(self, prompt: Any, params: SamplingParams, lora_request: Any, priority: int) -> list[int]:
        if lora_request is not None and not self.engine_args.enable_lora:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
        if isinstance(prompt, dict):  # a TokensPrompt: its keys (vllm_surface.json), a salt non-empty
            unknown = set(prompt) - TOKENS_PROMPT_KEYS
            if unknown:
                raise TypeError(f"TokensPrompt has no keys {sorted(unknown)}")
            if "cache_salt" in prompt and not (isinstance(prompt["cache_salt"], str) and prompt["cache_salt"]):
                raise VLLMValidationError("Parameter 'cache_salt' must be a non-empty string if provided.")
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        if len(ids) > self.model_config.max_model_len:
            raise VLLMValidationError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                             f"of {self.model_config.max_model_len}.")
        return ids

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, *,
                       prompt_text: str | None = None, lora_request: LoRARequest | None = None,
                       tokenization_kwargs: dict | None = None, trace_headers: Any = None, priority: int = 0,
                       data_parallel_rank: int | None = None, session_id: str | None = None,
                       kv_hints: Any = None, reasoning_ended: bool | None = None,
                       reasoning_parser_kwargs: dict | None = None):
        async for out in self._generate(prompt, sampling_params, request_id, lora_request, priority):
            yield out

    async def _generate(self, prompt, params, request_id, lora_request, priority):
        ids = self._validate(prompt, params, lora_request, priority)
        limit = self.engine_args.max_num_queued_reqs
        if limit is not None and sum(len(c) for c in self.live.values()) + params.n > limit:
            raise QueueOverflowError()  # AsyncLLM.check_admission
        self.calls.append(dict(prompt=prompt, params=params, request_id=request_id, lora_request=lora_request,
                               priority=priority))
        children = [_Child(i, self.script(ids, i, lora_request)) for i in range(params.n)]
        self.live[request_id] = children
        cached = self._prefix_cache(ids, prompt, lora_request)
        delta = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE) == RequestOutputKind.DELTA
        holdback = max((len(s) for s in params.stop), default=1) - 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            while any(c.finish_reason is None for c in children):
                if request_id in self.aborted:
                    for c in children:
                        c.finish_reason = c.finish_reason or "abort"
                    yield self._output(request_id, ids, children, children, delta, holdback, lora_request, params,
                                       cached)
                    return
                stepped, forced = [], self.inject.pop(request_id, None)
                for c in children:
                    if c.finish_reason is None:
                        self._step(c, params, forced)
                        stepped.append(c)
                groups = [[c] for c in stepped] if self.per_child_outputs else [stepped]
                for group in groups:
                    yield self._output(request_id, ids, children, group, delta, holdback, lora_request, params,
                                       cached)
                await asyncio.sleep(self.step_delay)
        except asyncio.CancelledError:
            await self.abort(request_id)  # vLLM's generate() aborts its request when cancelled
            raise
        finally:
            self.live.pop(request_id, None)
            self._prompt_sent.pop(request_id, None)

    @staticmethod
    def _step(c: _Child, params: SamplingParams, forced: str | None) -> None:
        n_out = len(c.token_ids)
        if forced:
            c.finish_reason = forced
            return
        if n_out >= len(c.script) and n_out >= params.min_tokens:  # EOS: in token_ids, not in text
            c.token_ids.append(EOS_ID)
            if params.logprobs is not None:
                c.logprobs.append(fake_position(EOS_ID, n_out, params.logprobs))
            c.finish_reason = "stop"
            return
        ch = c.script[n_out] if n_out < len(c.script) else " "
        c.token_ids.append(ord(ch))
        if params.logprobs is not None:
            c.logprobs.append(fake_position(ord(ch), n_out, params.logprobs))
        c.text += ch
        if len(c.token_ids) >= params.min_tokens:
            for s in params.stop:
                at = c.text.find(s)
                if at >= 0:
                    c.text = c.text[:at]
                    c.finish_reason = "stop"
                    return
        if params.max_tokens is not None and len(c.token_ids) >= params.max_tokens:
            c.finish_reason = "length"

    def _prefix_cache(self, ids: list[int], prompt: Any, lora_request: LoRARequest | None) -> int:
        """vLLM's automatic prefix caching, by its rules: the prompt in blocks of BLOCK_SIZE tokens, each
        block's hash chained on its parent's with the LoRA and (first block) the TokensPrompt's
        cache_salt as extra keys; the cached tokens are those of the longest run of known full blocks,
        short of the last prompt token (always computed, for its logits). The blocks join the cache."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        parent, hit, counting = hash((salt, lora_request.lora_name if lora_request else None)), 0, True
        for start in range(0, len(ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash((parent, tuple(ids[start:start + BLOCK_SIZE])))
            if counting and parent in self.cached_blocks and start + BLOCK_SIZE <= len(ids) - 1:
                hit += BLOCK_SIZE
            else:
                counting = False
            self.cached_blocks.add(parent)
        return hit

    def _output(self, request_id, ids, children, group, delta, holdback, lora_request, params,
                cached: int = 0) -> RequestOutput:
        outs = []
        for c in group:
            visible = len(c.text) if c.finish_reason is not None else max(c.sent_text, len(c.text) - holdback)
            if delta:
                text, toks = c.text[c.sent_text:visible], c.token_ids[c.sent_tokens:]
                lps = c.logprobs[c.sent_tokens:]
            else:
                text, toks, lps = c.text[:visible], list(c.token_ids), list(c.logprobs)
            c.sent_text, c.sent_tokens = visible, len(c.token_ids)
            c.reported = c.finish_reason is not None
            outs.append(CompletionOutput(index=c.index, text=text, token_ids=list(toks), cumulative_logprob=None,
                                         logprobs=lps if params.logprobs is not None else None,
                                         finish_reason=c.finish_reason, lora_request=lora_request))
        finished = all(c.reported for c in children)  # set on the output of the last child to finish
        prompt_lps = None
        if params.prompt_logprobs is not None and not (delta and self._prompt_sent.get(request_id)):
            prompt_lps = [None] + [fake_position(t, j, params.prompt_logprobs) for j, t in enumerate(ids[1:], 1)]
            self._prompt_sent[request_id] = True  # DELTA: vLLM pops them, so they come once
        return RequestOutput(request_id, None, ids, prompt_lps, outs, finished, lora_request=lora_request,
                             num_cached_tokens=cached)

    async def abort(self, request_id: str | list[str], internal: bool = False) -> None:
        self.aborted += [request_id] if isinstance(request_id, str) else list(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        if not self.engine_args.enable_lora:
            raise ValueError("LoRA is not enabled")
        if not Path(lora_request.lora_path).is_dir():
            raise ValueError(f"Loading lora {lora_request.lora_name} failed: No adapter found for "
                             f"{lora_request.lora_path}")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed_loras.append(lora_id)
        return self.loras.pop(lora_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self.loras)

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut_down = True


class FakeAsyncLLMAsyncTokenizer(FakeAsyncLLM):
    """0.11-era V1: get_tokenizer() is a coroutine."""

    async def get_tokenizer(self) -> FakeTokenizer:  # type: ignore[override]
        return self.tokenizer


class FakeAsyncLLMEngine(FakeAsyncLLM):
    """V0's vllm.AsyncLLMEngine: positional lora_request/priority, get_tokenizer(lora_request) coroutine,
    shutdown_background_loop(), config under `.engine`, every output carrying all choices, and a
    ValueError for a non-zero priority without priority scheduling."""

    per_child_outputs = False

    def __init__(self, engine_args: AsyncEngineArgs):
        super().__init__(engine_args)
        self.engine = types.SimpleNamespace(vllm_config=self.vllm_config)
        del self.vllm_config
        del self.model_config
        self.model_config = self.engine.vllm_config.model_config

    async def get_tokenizer(self, lora_request: Any = None) -> FakeTokenizer:  # type: ignore[override]
        return self.tokenizer

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,  # type: ignore[override]
                       lora_request: LoRARequest | None = None, trace_headers: Any = None,
                       prompt_adapter_request: Any = None, priority: int = 0):
        if priority != 0 and self.engine_args.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        async for out in self._generate(prompt, sampling_params, request_id, lora_request, priority):
            yield out

    async def abort(self, request_id: str) -> None:  # type: ignore[override]
        self.aborted.append(request_id)

    shutdown = None  # type: ignore[assignment]  # V0 has shutdown_background_loop() instead

    def shutdown_background_loop(self) -> None:
        self.shut_down = True


FLAVORS = {
    "v1": FakeAsyncLLM,  # 0.33.0: AsyncLLM, DELTA outputs, plain get_tokenizer (checked against the JSON)
    "v1-async-tokenizer": FakeAsyncLLMAsyncTokenizer,  # 0.11.x V1: async get_tokenizer
    "v0": FakeAsyncLLMEngine,  # pre-V1 AsyncLLMEngine, cumulative outputs only
}


@dataclass
class FakeVllm:
    flavor: str
    engine_cls: type
    modules: dict[str, types.ModuleType] = field(default_factory=dict)

    @property
    def engine(self) -> FakeAsyncLLM:
        assert self.engine_cls.last is not None, "no engine was built"
        return self.engine_cls.last


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def install(monkeypatch, flavor: str = "v1", version: str = VERSION) -> FakeVllm:
    """Put the fake `vllm` package into sys.modules (undone by monkeypatch at test end)."""
    engine_cls = FLAVORS[flavor]
    engine_cls.last = None
    cumulative_only = flavor == "v0"
    sp_cls = CumulativeOnlySamplingParams if cumulative_only else SamplingParams
    sp_mod = _module("vllm.sampling_params", SamplingParams=sp_cls, StructuredOutputsParams=StructuredOutputsParams)
    if not cumulative_only:
        sp_mod.RequestOutputKind = RequestOutputKind
    mods = {
        "vllm": _module("vllm", __version__=version, AsyncEngineArgs=AsyncEngineArgs, SamplingParams=sp_cls,
                        RequestOutput=RequestOutput, CompletionOutput=CompletionOutput,
                        AsyncLLMEngine=engine_cls, __path__=[]),
        "vllm.sampling_params": sp_mod,
        "vllm.outputs": _module("vllm.outputs", RequestOutput=RequestOutput, CompletionOutput=CompletionOutput),
        "vllm.logprobs": _module("vllm.logprobs", Logprob=Logprob),
        "vllm.lora": _module("vllm.lora", __path__=[]),
        "vllm.lora.request": _module("vllm.lora.request", LoRARequest=LoRARequest),
        "vllm.engine": _module("vllm.engine", __path__=[]),
        "vllm.engine.arg_utils": _module("vllm.engine.arg_utils", AsyncEngineArgs=AsyncEngineArgs),
        "vllm.engine.async_llm_engine": _module("vllm.engine.async_llm_engine", AsyncLLMEngine=engine_cls),
        "vllm.exceptions": _module("vllm.exceptions", VLLMError=VLLMError, VLLMClientError=VLLMClientError,
                                   VLLMServerError=VLLMServerError, VLLMValidationError=VLLMValidationError,
                                   GracefulHTTPError=GracefulHTTPError, QueueOverflowError=QueueOverflowError),
    }
    if flavor != "v0":
        mods.update({
            "vllm.v1": _module("vllm.v1", __path__=[]),
            "vllm.v1.engine": _module("vllm.v1.engine", __path__=[]),
            "vllm.v1.engine.async_llm": _module("vllm.v1.engine.async_llm", AsyncLLM=engine_cls),
            "vllm.v1.engine.exceptions": _module("vllm.v1.engine.exceptions", EngineDeadError=EngineDeadError),
        })
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return FakeVllm(flavor=flavor, engine_cls=engine_cls, modules=mods)


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
