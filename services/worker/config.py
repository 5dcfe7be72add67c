"""Worker settings: env `POLYSERVE_WORKER_*` (or `POLYSERVE_*`) and `--flags`."""
from __future__ import annotations

import uuid
from typing import Any

import msgspec

from polyserve.core import cache_salt
from polyserve.shared import settings as settings_mod
from polyserve.shared.settings import CommonSettings, SettingsError

ENGINES = ("sim", "hf", "vllm", "encoder", "openai-http")
LORA_COLD_START = ("auto", "cpu_assisted", "on_demand")
# ssjf_refine (preemptive: pauses running requests, their KV kept): the sim and hf engines
SCHEDULING = ("fcfs", "priority", "ssjf", "ssjf_class", "ssjf_refine")


def new_worker_id() -> str:
    """A fresh worker id, `w-<hex6>`."""
    return f"w-{uuid.uuid4().hex[:6]}"


class WorkerSettings(CommonSettings, frozen=True, kw_only=True):
    worker_id: str = ""  # "" = generate w-<hex6> at start
    deployment: str = "default"
    model: str = "sim-llama2-70b"
    engine: str = "sim"
    gpu_id: str = ""
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    max_waiting: int = 256  # bounded waiting queue; beyond it requests get 429
    max_batch: int = 64  # sequences decoded together
    kv_capacity_tokens: int = 0  # 0 = from the profile
    profile: str = ""  # sim profile JSON path; "" = the shipped default
    time_scale: float = 1.0  # × simulated compute time; 0 = none (control-plane benchmarks)
    max_input_len: int = 4096
    scheduling: str = "fcfs"  # waiting-queue order, see policy.ORDERS
    # Delivery (issue 13; docs/reliability.md): the chunks of a stream stay in a replay buffer until
    # the gateway acknowledges them (at most this many when the gateway sets no credit window) ...
    replay_chunks: int = 1024
    replay_linger_s: float = 5.0  # ... or, once the stream ended, at most this long
    # A stream held because its client reads nothing (no credit from the gateway) ends with an
    # explicit error after this long.
    slow_reader_limit_s: float = 30.0
    # A non-streamed request's chunks (GenerateRequest.stream False) are merged per choice and sent
    # at most every merge_ms (a choice's first and last chunk at once); 0 = a chunk per engine delta.
    merge_ms: float = 50.0
    model_path: str = ""  # hf engine: local checkpoint directory
    device: str = "cpu"  # hf engine
    dtype: str = "float32"  # hf engine (vllm: float32 means "auto")
    kv_layout: str = "auto"  # hf engine: auto (ragged on CPU, padded on CUDA) | ragged | padded
    gpu_memory_utilization: float = 0.9  # vllm engine
    max_model_len: int = 0  # vllm engine; 0 = the model's own
    enable_lora: bool = True  # vllm engine
    max_lora_rank: int = 64  # vllm engine
    max_loras: int = 4  # vllm engine: adapters resident on the GPU at once
    # vllm engine: a JSON object of further AsyncEngineArgs fields (e.g. {"reasoning_parser": "qwen3"},
    # which `polyserve up --reasoning-parser` sets); fields this vLLM does not declare are dropped, logged
    vllm_engine_args: str = ""
    # whether the request's tenant enters the prefix-cache salt (core/cache_salt.py): auto (vllm: yes;
    # openai-http: only with a client's own cache_salt) | on | off (only a client's own salt)
    cache_salt_tenants: str = "auto"
    encoder_max_length: int = 0  # encoder engine: the runtime's static input length (0 = the model's)
    encoder_batch: int = 1  # encoder engine: static batch size
    encoder_shape: str = "static"  # encoder engine: "static" runtime or "dynamic" (DT)
    encoder_backend: str = "jit"  # encoder engine: jit | compile | eager
    encoder_slo_ms: float = 1000.0  # encoder engine: latency SLO for the capacity M_i
    encoder_capacity: int = 0  # encoder engine: 0 = from the profile
    encoder_threads: int = 1  # encoder engine: torch threads
    encoder_profile: str = ""  # encoder engine: runtime profile JSON
    # hf engine: LoRA adapter tiers (services/worker/lora_cache.py) and cold start (CaraServe §4)
    # auto (on_demand on CUDA, cpu_assisted on the CPU: measured, hf_lora.cold_start_for) | cpu_assisted |
    # on_demand (wait for the device copy)
    lora_cold_start: str = "auto"
    lora_device_slots: int = 8  # adapters installed on the device at once
    lora_device_mb: float = 0.0  # device byte budget for adapters (0 = slots only)
    lora_host_slots: int = 64  # host-memory copies (inclusive of those on the device)
    lora_host_mb: float = 0.0  # host byte budget (0 = slots only)
    lora_prefetch: bool = True  # copy adapters whose request rate rises to the device ahead of demand
    lora_half_life_s: float = 60.0  # eviction score: request count decayed with this half-life
    lora_short_window_s: float = 5.0  # prefetch: short-window rate ...
    lora_long_window_s: float = 60.0  # ... > lora_rise_factor x the long-window rate
    lora_rise_factor: float = 2.0
    lora_prefetch_min_rate: float = 0.5  # requests/s in the short window before prefetch
    # openai-http engine: an OpenAI-compatible engine server (vllm serve, SGLang, TGI, transformers serve)
    upstream_url: str = ""  # its address, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    upstream_model: str = ""  # the model name it serves; "" = the first of its GET /v1/models
    upstream_api_key: str = ""  # sent as "Authorization: Bearer ..." ("" = none)
    upstream_metrics_url: str = ""  # Prometheus text; "" = <upstream_url>/metrics, "off" = none
    upstream_metrics_interval_s: float = 1.0  # how often /metrics is read for the heartbeat load
    upstream_connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0  # read timeout: longest wait for the next bytes of an answer
    upstream_start_timeout_s: float = 60.0  # how long start-up waits for GET /v1/models to answer
    upstream_stream: bool = True  # SSE streaming (false: one non-streamed answer per request)
    upstream_include_usage: bool = True  # ask for stream_options.include_usage (token counts)
    upstream_extra_body: str = ""  # JSON object merged into every request body
    upstream_tokenizer: str = ""  # tokenizer.json (or its directory) for exact counts; "" = model_path's
    # Chats without a chat template in that directory: auto = the upstream's /v1/chat/completions
    # until it shows it cannot take them, then the transcript; chat = always; completions = never.
    upstream_chat: str = "auto"

    def validate(self) -> None:
        """Raise SettingsError naming the worker setting that cannot be used."""
        super().validate()
        if self.engine not in ENGINES:
            raise SettingsError(f"engine {self.engine!r} is unknown; choose one of {', '.join(ENGINES)}")
        if self.engine == "openai-http":
            self._validate_upstream()
        if self.vllm_engine_args:
            _check_json_object(self.vllm_engine_args, "vllm_engine_args")
        if self.cache_salt_tenants not in cache_salt.MODES:
            raise SettingsError(f"cache_salt_tenants {self.cache_salt_tenants!r} is unknown; choose one of "
                                f"{', '.join(cache_salt.MODES)}")
        if self.scheduling not in SCHEDULING:
            raise SettingsError(f"scheduling {self.scheduling!r} is unknown; choose one of {', '.join(SCHEDULING)}")
        if self.worker_id and any(c in self.worker_id for c in " .*>:"):
            raise SettingsError(f"worker_id {self.worker_id!r} must not contain spaces, '.', '*', '>' or ':'")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise SettingsError("need heartbeat_interval_s > 0 and heartbeat_ttl_s > heartbeat_interval_s")
        if self.max_waiting < 1 or self.max_batch < 1 or self.max_input_len < 1:
            raise SettingsError("max_waiting, max_batch and max_input_len must be >= 1")
        if self.replay_chunks < 1 or self.replay_linger_s <= 0 or self.slow_reader_limit_s <= 0:
            raise SettingsError("replay_chunks must be >= 1, replay_linger_s and slow_reader_limit_s > 0")
        if self.merge_ms < 0:
            raise SettingsError("merge_ms must be >= 0 (0 = a chunk per engine delta)")
        if self.kv_capacity_tokens < 0:
            raise SettingsError("kv_capacity_tokens must be >= 0 (0 = from the profile)")
        if self.time_scale < 0:
            raise SettingsError("time_scale must be >= 0 (0 = no simulated compute time)")
        if self.lora_cold_start not in LORA_COLD_START:
            raise SettingsError(f"lora_cold_start {self.lora_cold_start!r} is unknown; choose one of "
                                f"{', '.join(LORA_COLD_START)}")
        from polyserve.worker.lora_cache import CacheError, CachePolicy
        try:
            CachePolicy.from_settings(self)
        except CacheError as exc:
            raise SettingsError(f"LoRA cache (lora_* settings): {exc}") from None

    def _validate_upstream(self) -> None:
        if not self.upstream_url.startswith(("http://", "https://")):
            raise SettingsError("engine openai-http needs upstream_url, the engine server's http(s):// address "
                                "(env POLYSERVE_WORKER_UPSTREAM_URL)")
        if self.upstream_metrics_interval_s <= 0 or self.upstream_connect_timeout_s <= 0 \
                or self.upstream_timeout_s <= 0 or self.upstream_start_timeout_s < 0:
            raise SettingsError("upstream_metrics_interval_s, upstream_connect_timeout_s and upstream_timeout_s "
                                "must be > 0, upstream_start_timeout_s >= 0")
        if self.upstream_extra_body:
            _check_json_object(self.upstream_extra_body, "upstream_extra_body")
        if self.upstream_chat not in ("auto", "chat", "completions"):
            raise SettingsError(f"upstream_chat {self.upstream_chat!r} is unknown; choose auto, chat or completions")


def _check_json_object(text: str, name: str) -> None:
    import json
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SettingsError(f"{name} must be a JSON object")


def with_worker_id(settings: WorkerSettings) -> WorkerSettings:
    """`settings` with a generated worker_id when none was given."""
    if settings.worker_id:
        return settings
    return msgspec.structs.replace(settings, worker_id=new_worker_id())


def load(argv: list[str] | None = None, environ: dict[str, str] | None = None,
         **overrides: Any) -> WorkerSettings:
    """Worker settings from env, flags and overrides, with the worker_id filled in."""
    return with_worker_id(settings_mod.load(WorkerSettings, "worker", argv, environ, **overrides))
