"""The slice of vLLM's Python API that the `vllm` engine uses, imported lazily and
detected once, so `vllm_engine` never touches `vllm` at import time.

Everything here is written against vLLM's engine API as extracted from the release's
sources by `scripts/vllm-surface` into `vllm_surface.json` (next to this file); the
names used are listed in `SURFACE_USED`, and tests/unit/test_vllm_surface.py checks that
each of them exists in that JSON and that the fake of tests/fakes/fake_vllm.py matches it.
Detection, in order:

- engine class: `vllm.v1.engine.async_llm.AsyncLLM` (the V1 engine; from 0.11 on the
  old `AsyncLLMEngine` name is only an alias of it), else `vllm.AsyncLLMEngine`
  (the V0 engine of releases before V1 existed);
- streaming mode: `vllm.sampling_params.RequestOutputKind.DELTA` when it exists
  (each `CompletionOutput` then carries only the new text and token ids), else
  vLLM's default cumulative outputs, which the engine diffs per choice index;
- engine-args fields: only those the installed `AsyncEngineArgs` dataclass declares
  are passed (and a dropped one is logged), so a renamed knob cannot stop start-up.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyserve.proto import SamplingParams as ProtoSamplingParams
from polyserve.proto import StructuredOutput, TokenLogprob, TopLogprob
from polyserve.worker.engine import EngineError

logger = logging.getLogger(__name__)

# vLLM's CompletionOutput.finish_reason strings (vllm/v1/engine/__init__.py
# FINISH_REASON_STRINGS: "stop", "length", "abort", "error", "repetition" in 0.33).
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "repetition": "stop"}
ERROR_REASON = "error"

# vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks, a Literal in 0.33):
# a configured rank between two of them is rounded up to the next.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# Every vLLM name the `vllm` engine (this module and vllm_engine.py) uses, by where vLLM
# defines it (literals only: it is read with ast.literal_eval). Read with `ast` by scripts/vllm-surface (drift check) and checked by
# tests/unit/test_vllm_surface.py against vllm_surface.json and against the code.
SURFACE_USED = {
    "modules": {
        "vllm": ["__version__", "AsyncEngineArgs", "SamplingParams", "AsyncLLMEngine"],
        "vllm.v1.engine.async_llm": ["AsyncLLM"],
        "vllm.engine.arg_utils": ["AsyncEngineArgs"],
        "vllm.engine.async_llm_engine": ["AsyncLLMEngine"],
        "vllm.sampling_params": ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams"],
        "vllm.lora.request": ["LoRARequest"],
    },
    "methods": {  # method -> the parameters polyserve passes (by name or position)
        "vllm.v1.engine.async_llm.AsyncLLM": {
            "from_engine_args": ["engine_args"],
            "generate": ["prompt", "sampling_params", "request_id", "lora_request", "priority"],
            "abort": ["request_id"],
            "get_tokenizer": [],
            "add_lora": ["lora_request"],
            "remove_lora": ["lora_id"],
            "shutdown": [],
        },
        "vllm.tokenizers.protocol.TokenizerLike": {
            "encode": ["text"],
            "decode": ["ids", "skip_special_tokens"],
            "apply_chat_template": ["messages", "tokenize", "add_generation_prompt"],
        },
    },
    "attributes": {
        "vllm.v1.engine.async_llm.AsyncLLM": ["vllm_config", "model_config"],
        "vllm.config.vllm.VllmConfig": ["cache_config", "model_config"],
        "vllm.config.cache.CacheConfig": ["num_gpu_blocks", "block_size"],
        "vllm.config.model.ModelConfig": ["max_model_len"],
        "vllm.outputs.RequestOutput": ["outputs", "finished", "prompt_logprobs", "num_cached_tokens"],
        "vllm.outputs.CompletionOutput": ["index", "text", "token_ids", "finish_reason", "logprobs"],
        "vllm.logprobs.Logprob": ["logprob", "rank", "decoded_token"],
    },
    "fields": {  # constructor keywords
        "vllm.engine.arg_utils.AsyncEngineArgs": [
            "model", "served_model_name", "dtype", "max_num_seqs", "max_model_len", "scheduling_policy",
            "enable_lora", "max_lora_rank", "max_loras", "gpu_memory_utilization", "seed"],
        "vllm.sampling_params.SamplingParams": [
            "n", "temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "min_tokens", "output_kind",
            "structured_outputs", "logprobs", "prompt_logprobs", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "min_p", "logit_bias", "stop_token_ids", "include_stop_str_in_output",
            "thinking_token_budget", "allowed_token_ids", "bad_words", "skip_special_tokens"],
        "vllm.sampling_params.StructuredOutputsParams": ["json", "regex", "choice", "grammar", "json_object"],
        "vllm.lora.request.LoRARequest": ["lora_name", "lora_int_id", "lora_path"],
        "vllm.inputs.llm.TokensPrompt": ["prompt_token_ids", "cache_salt"],
    },
    "members": {"vllm.sampling_params.RequestOutputKind": ["DELTA"]},
    "constants": {
        "vllm.v1.engine.FINISH_REASON_STRINGS": ["abort", "error", "length", "repetition", "stop"],
        "vllm.config.lora.MaxLoRARanks": [1, 8, 16, 32, 64, 128, 256, 320, 512],
    },
    # Names tried only when the above are missing (older releases); not in 0.33, not checked.
    "legacy_fallbacks": {
        "vllm.v1.engine.async_llm.AsyncLLM": ["get_vllm_config", "shutdown_background_loop", "engine"],
    },
    "exceptions": [  # matched by class name in error_status()
        "vllm.v1.engine.exceptions.EngineDeadError", "vllm.exceptions.VLLMValidationError",
        "vllm.exceptions.VLLMClientError", "vllm.exceptions.GracefulHTTPError",
        "vllm.exceptions.QueueOverflowError", "vllm.exceptions.MaxQueuedTokensError",
    ],
}


@dataclass
class VllmApi:
    """The vLLM names the engine uses, resolved from the installed package."""

    version: str
    engine_cls: Any  # AsyncLLM (V1) or AsyncLLMEngine (V0)
    flavor: str  # "AsyncLLM" | "AsyncLLMEngine"
    AsyncEngineArgs: Any
    SamplingParams: Any
    LoRARequest: Any
    delta_kind: Any = None  # RequestOutputKind.DELTA, or None: outputs are cumulative
    StructuredOutputsParams: Any = None  # None: this vLLM has no structured outputs under that name

    @property
    def delta_outputs(self) -> bool:
        return self.delta_kind is not None


def _attr(module_name: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None


def import_vllm(target: str) -> VllmApi:
    """Import vLLM and resolve the API; EngineError (500) saying what to install when it cannot be."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name in (None, "vllm"):
            raise EngineError(f"vLLM {target} is not installed; pip install vllm=={target} on a GPU host "
                              f"(or use engine=hf)", 500) from exc
        raise EngineError(f"vLLM is installed but failed to import ({exc}); this engine targets vLLM {target}: "
                          f"pip install vllm=={target} on a GPU host", 500) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    engine_cls, flavor = _attr("vllm.v1.engine.async_llm", "AsyncLLM"), "AsyncLLM"
    if engine_cls is None:
        engine_cls = getattr(vllm, "AsyncLLMEngine", None) or _attr("vllm.engine.async_llm_engine", "AsyncLLMEngine")
        flavor = "AsyncLLMEngine"
    names = {
        "AsyncEngineArgs": getattr(vllm, "AsyncEngineArgs", None) or _attr("vllm.engine.arg_utils", "AsyncEngineArgs"),
        "SamplingParams": getattr(vllm, "SamplingParams", None) or _attr("vllm.sampling_params", "SamplingParams"),
        "LoRARequest": _attr("vllm.lora.request", "LoRARequest"),
    }
    missing = [n for n, v in (("AsyncLLM/AsyncLLMEngine", engine_cls), *names.items()) if v is None]
    if missing:
        raise EngineError(f"vLLM {version} lacks {', '.join(missing)}; this engine targets vLLM {target}: "
                          f"pip install vllm=={target}", 500)
    kind = _attr("vllm.sampling_params", "RequestOutputKind")
    if version.split(".")[:2] != target.split(".")[:2]:
        logger.warning("vLLM %s is installed; the vllm engine targets %s (the API it uses is detected, "
                       "but only %s is the version it was written against)", version, target, target)
    return VllmApi(version=version, engine_cls=engine_cls, flavor=flavor, delta_kind=getattr(kind, "DELTA", None),
                   StructuredOutputsParams=_attr("vllm.sampling_params", "StructuredOutputsParams"), **names)


def engine_args(api: VllmApi, wanted: dict[str, Any]) -> Any:
    """`AsyncEngineArgs(**wanted)` keeping only the fields this vLLM declares."""
    cls = api.AsyncEngineArgs
    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls)}
        dropped = sorted(k for k in wanted if k not in known)
        if dropped:
            logger.warning("vLLM %s has no engine args %s; ignored", api.version, ", ".join(dropped))
        wanted = {k: v for k, v in wanted.items() if k in known}
    return cls(**wanted)


def sampling_params(api: VllmApi, p: ProtoSamplingParams) -> Any:
    """vLLM SamplingParams for a polyserve request (top_k 0 = off becomes vLLM's -1 = off,
    which every release accepts; 0 is only accepted by newer ones)."""
    kw: dict[str, Any] = dict(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
                              seed=p.seed, stop=list(p.stop) or None, max_tokens=p.max_tokens,
                              min_tokens=p.min_tokens)
    if api.delta_kind is not None:
        kw["output_kind"] = api.delta_kind
    if p.logprobs is not None:  # k alternatives per sampled token (vLLM adds the sampled one: up to k+1)
        kw["logprobs"] = p.logprobs
    if p.prompt_logprobs is not None:
        kw["prompt_logprobs"] = p.prompt_logprobs
    # Only what the request asks for (every release keeps its own defaults otherwise).
    if p.frequency_penalty:
        kw["frequency_penalty"] = p.frequency_penalty
    if p.presence_penalty:
        kw["presence_penalty"] = p.presence_penalty
    if p.repetition_penalty != 1.0:
        kw["repetition_penalty"] = p.repetition_penalty
    if p.min_p:
        kw["min_p"] = p.min_p
    if p.logit_bias:
        kw["logit_bias"] = dict(p.logit_bias)
    if p.stop_token_ids:
        kw["stop_token_ids"] = list(p.stop_token_ids)
    if p.include_stop:
        kw["include_stop_str_in_output"] = True
    if not p.skip_special_tokens:
        kw["skip_special_tokens"] = False
    if p.allowed_token_ids:
        kw["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.bad_words:  # vLLM tokenizes them itself (SamplingParams.update_from_tokenizer)
        kw["bad_words"] = list(p.bad_words)
    if p.thinking_budget is not None:  # vLLM forces the end of thinking itself (its engine's reasoning_config)
        kw["thinking_token_budget"] = p.thinking_budget
    try:
        if p.structured is not None:
            kw["structured_outputs"] = structured_outputs(api, p.structured)
        return api.SamplingParams(**kw)
    except Exception as exc:  # vLLM validates in __post_init__ (ValueError / VLLMValidationError)
        raise EngineError(f"sampling parameters rejected by vLLM: {exc}", 400) from exc


def structured_outputs(api: VllmApi, spec: StructuredOutput) -> Any:
    """vLLM's StructuredOutputsParams for a polyserve constraint (the one field that is set)."""
    if api.StructuredOutputsParams is None:
        raise EngineError(f"vLLM {api.version} has no StructuredOutputsParams; structured outputs need vLLM "
                          "0.33", 400)
    if spec.json_object:
        return api.StructuredOutputsParams(json_object=True)
    kind = spec.kind()
    return api.StructuredOutputsParams(**{kind: getattr(spec, kind)})


def token_logprob(position: Any, token_id: int, k: int, decode: Callable[[int], str]) -> TokenLogprob:
    """One vLLM logprobs position (dict token id -> Logprob(logprob, rank, decoded_token), holding the
    chosen token and the top-k by rank 1..k; None for the first prompt token) as polyserve's entry for
    `token_id` with its `k` best alternatives, most likely first. A token's text is vLLM's
    `decoded_token` (the token decoded alone), else `decode(token_id)`."""
    def text(tid: int, lp: Any) -> str:
        decoded = getattr(lp, "decoded_token", None)
        return decoded if isinstance(decoded, str) else decode(tid)

    if not position:
        return TokenLogprob(token=decode(token_id), logprob=None, token_id=token_id)
    ranked = sorted(position.items(), key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 40,
                                                        -float(item[1].logprob)))
    top = [TopLogprob(token=text(int(tid), lp), logprob=float(lp.logprob), token_id=int(tid))
           for tid, lp in ranked[:k]] if k > 0 else []
    own = position.get(token_id)
    rank = getattr(own, "rank", None) if own is not None else None
    return TokenLogprob(token=text(token_id, own) if own is not None else decode(token_id),
                        logprob=float(own.logprob) if own is not None else None, token_id=token_id, top=top,
                        rank=int(rank) if rank is not None else 0)


def token_logprobs(positions: Any, token_ids: list[int], k: int, decode: Callable[[int], str]) -> list[TokenLogprob]:
    """Entries for `token_ids`, one per position of vLLM's logprobs (a list of dicts or FlatLogprobs,
    which reads as one); a missing position gives an entry without a logprob."""
    seq = list(positions) if positions is not None else []
    return [token_logprob(seq[j] if j < len(seq) else None, tid, k, decode) for j, tid in enumerate(token_ids)]


def lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that is at least `rank` (LORA_RANKS)."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def error_status(exc: BaseException) -> int:
    """HTTP status for an exception out of vLLM's generate(): 400 for validation, 503 for a dead
    engine, and the status vLLM attaches to its admission rejections (GracefulHTTPError's
    `http_status`: 503 for QueueOverflowError / MaxQueuedTokensError in 0.33)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"EngineDeadError", "AsyncEngineDeadError"}:
        return 503
    if "GracefulHTTPError" in names:
        try:
            return int(getattr(exc, "http_status", 503))
        except (TypeError, ValueError):
            return 503
    if isinstance(exc, (ValueError, TypeError)) or names & {"VLLMValidationError", "VLLMClientError"}:
        return 400
    return 500


def engine_config(engine: Any) -> Any:
    """The engine's VllmConfig when reachable without a call (AsyncLLM.vllm_config; V0: engine.engine)."""
    cfg = getattr(engine, "vllm_config", None)
    if cfg is None:
        cfg = getattr(getattr(engine, "engine", None), "vllm_config", None)
    return cfg


def kv_capacity_tokens(cfg: Any) -> int:
    """`cache_config.num_gpu_blocks * block_size`: the KV tokens vLLM allocated (the V1 front end learns
    num_gpu_blocks from the engine core's READY handshake); 0 when either is not known."""
    cache = getattr(cfg, "cache_config", None)
    blocks, block = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    try:
        return int(blocks) * int(block) if blocks and block else 0
    except (TypeError, ValueError):
        return 0


def max_model_len(engine: Any, cfg: Any) -> int:
    """The model's context length as vLLM resolved it (0 when not reachable)."""
    for mc in (getattr(cfg, "model_config", None), getattr(engine, "model_config", None)):
        value = getattr(mc, "max_model_len", None)
        if isinstance(value, int) and value > 0:
            return value
    return 0
