"""Predictor settings: env `POLYSERVE_PREDICTOR_<FIELD>` or flags `--field-name`."""
from __future__ import annotations

from polyserve.predictor import policy
from polyserve.shared.settings import CommonSettings, SettingsError, load


class PredictorSettings(CommonSettings, frozen=True, kw_only=True):
    min_samples: int = policy.DEFAULT_MIN_SAMPLES
    """Samples a bucket (else the model) needs before its mean replaces the prior."""
    prior_tokens: int = policy.PRIOR_TOKENS
    """Estimate before any history: median output of the Azure LLM 2023 conversation trace."""
    class_bounds: str = ",".join(str(b) for b in policy.DEFAULT_CLASS_BOUNDS)
    """Comma-separated, strictly increasing token bounds of the length classes."""
    refresh_s: float = 2.0
    """How often the in-memory copy of the statistics is refreshed from Redis."""
    redis_timeout_s: float = 0.25
    """Longest wait for one Redis call before answering from the in-memory copy."""
    redis_retry_s: float = 1.0
    """After a Redis failure, answer from memory for this long before trying Redis again."""
    max_models: int = 1024
    """Models whose statistics are kept in memory (least recently used dropped first)."""

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


def load_settings(argv: list[str] | None = None, **overrides) -> PredictorSettings:
    """Settings of the predictor from env, flags and overrides."""
    return load(PredictorSettings, "predictor", argv, **overrides)
