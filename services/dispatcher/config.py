"""Dispatcher settings: env `POLYSERVE_DISPATCHER_<FIELD>` or flags `--field-name`."""
from __future__ import annotations

from polyserve.shared.settings import CommonSettings, SettingsError, load


class DispatcherSettings(CommonSettings, frozen=True, kw_only=True):
    deployment_cache_s: float = 2.0
    """How long a deployment read from Redis is used before it is read again."""
    redis_timeout_s: float = 0.25
    """Longest wait for one Redis call before falling back to the cached deployment."""
    redis_retry_s: float = 1.0
    """After a Redis failure, serve cached deployments for this long before trying Redis again."""
    placement_ttl_s: float = 600.0
    """A placement with no completed/failed event within this time stops counting as outstanding."""
    max_tracked: int = 100_000
    """Most placements tracked at once; the oldest is forgotten beyond it (no unbounded growth)."""
    max_outstanding: int = 0
    """Per-worker cap on this dispatcher's outstanding requests; 0 = no cap. All capped -> 429."""
    sweep_s: float = 0.5
    """How often expired workers and placements are removed from memory."""
    seed: int = -1
    """Seed of the random policies (power_of_two, random); negative = from the OS."""
    ttft_slo_ms: float = 0.0
    """Override, when > 0, of every deployment's TTFT SLO (aladdin places against it); 0 = each
    deployment's own `Deployment.ttft_slo_ms` (default Aladdin Table 2, 1600 ms)."""
    atgt_slo_ms: float = 0.0
    """Override, when > 0, of every deployment's time-per-output-token SLO (aladdin, caraserve);
    0 = each deployment's own `Deployment.atgt_slo_ms` (default Aladdin Table 2, 75 ms)."""
    rebalance_s: float = 1.0
    """Aladdin Alg. 2: how often not-yet-started requests are moved on prediction error; 0 = never."""
    rebalance_max_moves: int = 8
    """Most requests one re-balancing round moves."""
    scale_signal_interval_s: float = 5.0
    """At most one ScaleSignal per deployment in this time (aladdin/caraserve found no feasible worker)."""
    gc_gen0: int = 20_000
    """The interpreter's first garbage-collection threshold in this process (`gc.set_threshold(
    gc_gen0, 10, 10)`, applied at start with `gc.freeze()` of what start-up made; 0 = Python's
    (700, 10, 10)). With Python's, a young collection ran every ~10 dispatches and an older one
    every ~100: most of the handler's p99, and a full collection of the fleet's views (up to
    60 ms) now and then (docs/benchmarks/dispatch.md, 2026-11-26 evening)."""
    index: bool = True
    """Keep each deployment's workers in an incremental index (`dispatcher/index.py`) and place
    with the policy's fast twin; false = every decision scans freshly built views."""

    def validate(self) -> None:
        """Raise SettingsError on values the dispatcher cannot run with."""
        super().validate()
        if min(self.deployment_cache_s, self.redis_timeout_s, self.placement_ttl_s, self.sweep_s) <= 0:
            raise SettingsError("deployment_cache_s, redis_timeout_s, placement_ttl_s and sweep_s must be > 0")
        if self.redis_retry_s < 0:
            raise SettingsError("redis_retry_s must be >= 0")
        if self.max_tracked < 1:
            raise SettingsError("max_tracked must be >= 1")
        if min(self.ttft_slo_ms, self.atgt_slo_ms, self.rebalance_s, self.scale_signal_interval_s) < 0:
            raise SettingsError("ttft_slo_ms, atgt_slo_ms, rebalance_s and scale_signal_interval_s must be >= 0")
        if self.rebalance_max_moves < 1:
            raise SettingsError("rebalance_max_moves must be >= 1")
        if self.max_outstanding < 0:
            raise SettingsError("max_outstanding must be >= 0 (0 = no cap)")
        if self.gc_gen0 < 0:
            raise SettingsError("gc_gen0 must be >= 0 (0 = Python's garbage-collection thresholds)")


def tune_gc(settings: DispatcherSettings) -> tuple[int, int, int]:
    """Apply `gc_gen0` to this process (see its doc); the thresholds before, to restore them."""
    import gc

    before = gc.get_threshold()
    if settings.gc_gen0:
        gc.freeze()  # what start-up made (modules, settings, the loop) is never traversed again
        gc.set_threshold(settings.gc_gen0, 10, 10)
    return before


def load_settings(argv: list[str] | None = None, **overrides) -> DispatcherSettings:
    """Settings of the dispatcher from env, flags and overrides."""
    return load(DispatcherSettings, "dispatcher", argv, **overrides)
