"""OpenAI-compatible request bodies (pydantic, as FastAPI validates them) and
the management API's deployment and adapter bodies (thesis §6.2)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from polyserve.core.bounds import ATGT_SLO_RANGE_MS, THRESHOLD_MS, TTFT_SLO_RANGE_MS, WINDOW_S
from polyserve.core.cache_salt import MAX_CHARS as MAX_SALT
from polyserve.core.names import DEFAULT_SCALER, canonical_scaler
from polyserve.proto import ATGT_SLO_MS, TTFT_SLO_MS

from . import limits

# Admin input bounds (issue 14): core/bounds.py, shared with `polyserve up --config`. Replica
# counts are also capped by the gateway setting max_replicas_limit (admin.py).
# A model name: a Hugging Face id, a local path or a served name; printable, no spaces or quotes.
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,199}$"
DEPLOYMENT_ID = r"^[A-Za-z0-9_\-]{1,64}$"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # ignored: usage comes once, in the final chunk


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's values
BAD_WORDS_MAX = 128  # words in `bad_words` (vLLM sets no limit; each costs a check per token)


class _Sampling(BaseModel):
    """Fields polyserve honours; every other field stays in `model_extra` and compat.py
    (the table in compat_table.py) refuses it, lets it pass or logs it."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)  # None: 1.0
    n: int | None = Field(None, ge=1)  # None: 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # up to max_stop strings of max_stop_chars (limits.py)
    seed: int | None = None
    user: str | None = None
    # extensions (vLLM-style)
    top_k: int | None = Field(None, ge=-1)  # None, 0 or -1: off
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # OpenAI's range; None: 0
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # vLLM: > 0; None: 1 (off)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # vLLM's; ids checked by the engine
    include_stop_str_in_output: bool | None = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep the last k (-1: the worker's limit)
    allowed_token_ids: list[int] | None = Field(None, max_length=1 << 18)  # vLLM's; policy.allowed_token_ids
    bad_words: list[str] | None = Field(None, max_length=BAD_WORDS_MAX)  # vLLM's; policy.bad_words
    skip_special_tokens: bool | None = True  # vLLM's: False keeps special tokens in the text
    return_token_ids: bool | None = False  # vLLM's: the prompt's and the output's token ids (policy.whole_token_ids)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and k alternatives (logprobs.py)
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprob tokens as "token_id:N" (logprobs.py)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT)  # vLLM's (core/cache_salt.py)
    prompt_cache_key: str | None = Field(None, max_length=MAX_SALT)  # OpenAI's: routing affinity (routing.py)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool | None = False
    priority: int = 0
    adapter: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        lim = limits.current()
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > lim.max_stop:
            raise ValueError(f"{len(stops)} stop strings; the limit is {lim.max_stop}")
        if any(len(s) > lim.max_stop_chars for s in stops):
            raise ValueError(f"a stop string is longer than the limit of {lim.max_stop_chars} characters")
        return value


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top alternatives per token (0-20); logprobs.py
    echo: bool | None = False  # the prompt leads each choice's text (and its logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # logprobs.py
    top_logprobs: int | None = None  # 0-20, with logprobs
    add_generation_prompt: bool = True  # vLLM's: how the prompt ends (policy.chat_end)
    continue_final_message: bool = False
    include_reasoning: bool | None = True  # vLLM's: False leaves a thinking model's reasoning out
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more chat-template variables (policy.template_kwargs)
    thinking_token_budget: int | None = Field(None, ge=0)  # vLLM's: at most this many thinking tokens (reasoning.py)
    reasoning_effort: ReasoningEffort | None = None  # to the chat template, as vLLM (policy.template_kwargs)

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value: Any) -> Any:
        limit = limits.current().max_messages
        if isinstance(value, list) and len(value) > limit:  # checked before any message is validated
            raise ValueError(f"{len(value)} messages in one request; the limit is {limit} (setting max_messages)")
        return value


class ScalerBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # a name of polyserve.core.names.SCALERS (aliases accepted, stored canonical)
    type: str = Field(DEFAULT_SCALER, max_length=64)
    min_replicas: int = Field(1, ge=0)  # both <= the setting max_replicas_limit (admin.py)
    max_replicas: int = Field(4, ge=1)
    window_s: float = Field(30.0, ge=WINDOW_S[0], le=WINDOW_S[1])
    threshold_ms: float = Field(50.0, ge=THRESHOLD_MS[0], le=THRESHOLD_MS[1])

    @field_validator("type")
    @classmethod
    def _known_scaler(cls, value: str) -> str:
        return canonical_scaler(value)  # UnknownName (a ValueError) lists the choices


class DeploymentBody(BaseModel):
    """A deployment to create; the SLOs default to Aladdin Table 2 (proto TTFT_SLO_MS / ATGT_SLO_MS)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, pattern=DEPLOYMENT_ID)
    model: str = Field(min_length=1, max_length=200, pattern=MODEL_NAME)
    engine: Literal["sim", "hf", "vllm", "encoder", "openai-http"] = "sim"
    policy: str = Field("least_outstanding", max_length=64)
    scaler: ScalerBody = ScalerBody()
    ttft_slo_ms: float = Field(TTFT_SLO_MS, ge=TTFT_SLO_RANGE_MS[0], le=TTFT_SLO_RANGE_MS[1])  # time to first token
    atgt_slo_ms: float = Field(ATGT_SLO_MS, ge=ATGT_SLO_RANGE_MS[0], le=ATGT_SLO_RANGE_MS[1])  # per generated token
    reasoning_parser: Literal["", "qwen3", "deepseek_r1"] = ""  # chat answers' `reasoning` (reasoning.py)


class AdapterBody(BaseModel):
    """Register a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    path: str = Field(min_length=1, max_length=4096)  # under one of the gateway's adapter_roots
    deployment: str = Field(pattern=DEPLOYMENT_ID)
    load: bool = False  # load on every worker of the deployment now (else on first use)


TENANT = r"^[A-Za-z0-9_.@\-]{1,64}$"


class KeyBody(BaseModel):
    """A client API key to create (POST /v1/keys, admin): its tenant, the models it may use
    ([] = all), its limits per minute (0 = none) and priority class under contention."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(pattern=TENANT)
    name: str = Field("", max_length=200)
    models: list[str] = Field([], max_length=256)  # deployment ids, model names or adapter names; "*" = all
    rpm: int = Field(0, ge=0, le=10**9)  # requests per minute
    tpm: int = Field(0, ge=0, le=10**12)  # prompt + completion tokens per minute
    priority: Literal["high", "normal", "low"] = "normal"

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: list[str]) -> list[str]:
        for m in value:
            if not isinstance(m, str) or not (m == "*" or 0 < len(m) <= 200) or any(c.isspace() for c in m):
                raise ValueError(f"model {m!r} is not a model name (1-200 characters, no spaces) or '*'")
        return value
