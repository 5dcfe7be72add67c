"""OpenAI-compatible request bodies (pydantic, as FastAPI validates them) and
the management API's deployment and adapter bodies (thesis §6.2)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from polyserve.core.names import DEFAULT_SCALER, canonical_scaler
from polyserve.proto import ATGT_SLO_MS, TTFT_SLO_MS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # ignored: usage comes once, in the final chunk


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
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # extensions (vLLM-style)
    top_k: int | None = Field(None, ge=-1)  # None, 0 or -1: off
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool | None = False
    priority: int = 0
    adapter: str | None = None


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


class ScalerBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = DEFAULT_SCALER  # a name of polyserve.core.names.SCALERS (aliases accepted, stored canonical)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    window_s: float = Field(30.0, gt=0)
    threshold_ms: float = Field(50.0, gt=0)

    @field_validator("type")
    @classmethod
    def _known_scaler(cls, value: str) -> str:
        return canonical_scaler(value)  # UnknownName (a ValueError) lists the choices


class DeploymentBody(BaseModel):
    """A deployment to create; the SLOs default to Aladdin Table 2 (proto TTFT_SLO_MS / ATGT_SLO_MS)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    model: str = Field(min_length=1, max_length=200)
    engine: Literal["sim", "hf", "vllm", "encoder", "openai-http"] = "sim"
    policy: str = "least_outstanding"
    scaler: ScalerBody = ScalerBody()
    ttft_slo_ms: float = Field(TTFT_SLO_MS, gt=0)  # time-to-first-token SLO
    atgt_slo_ms: float = Field(ATGT_SLO_MS, gt=0)  # average time-per-generated-token SLO


class AdapterBody(BaseModel):
    """Register a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    path: str = Field(min_length=1)
    deployment: str
    load: bool = False  # load on every worker of the deployment now (else on first use)
