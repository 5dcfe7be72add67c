"""Settings of the gpu-agent (env POLYSERVE_GPU_AGENT_<FIELD>, flags --field-name)."""
from __future__ import annotations

import shlex

from polyserve.shared.settings import CommonSettings, SettingsError


class GpuAgentSettings(CommonSettings, frozen=True, kw_only=True):
    """One agent per GPU.

    gpu_id: the id in subjects and keys; "" = "gpu<N>" when NVML has device N,
        else "sim<N>" (N = gpu_index).
    gpu_index: the NVML device index this agent reads.
    force_simulated: use the simulated GPU even when NVML is present (tests,
        demos on a shared machine).
    telemetry_interval_s: how often GpuTelemetry is published and AgentInfo refreshed.
    agent_ttl_s: TTL of AgentInfo in Redis; an agent silent that long is gone.
    watch_interval_s: how often worker processes are checked for exit.
    worker_log_dir: where worker stdout/stderr go (one file per worker);
        "" = a fresh temporary directory.
    worker_module: the module run as `python -m <worker_module>`.
    worker_cmd: a full command line (shlex-split) that replaces the module
        invocation, e.g. a test double; "" = use worker_module. An operator's setting
        only: a StartWorker message cannot change the command.
    worker_nats_url / worker_redis_url: the connections (with the worker's own
        credentials) given to the workers; "" = the agent's own nats_url / redis_url.
    worker_env_allow: comma-separated extra variable names a StartWorker's
        `extra_env` may set besides `POLYSERVE_WORKER_*` settings (for a custom
        `worker_cmd`); everything else is refused (policy.check_extra_env).
    worker_time_scale: passed to workers as POLYSERVE_WORKER_TIME_SCALE when
        not "" (sim engine pace; "0" = no compute time).
    max_workers: the most worker processes this agent runs at once.

    MIAD frequency control (µ-Serve §3.4; `polyserve.gpu_agent.miad`):
    miad_enabled: run the controller: every `miad_interval_s` compute the SM clock
        from the hosted workers' latency against their SLO and publish it
        (ClockDecision on `<prefix>.v1.telemetry.clock.<gpu_id>`).
    allow_clock_control: APPLY the decision. Off by default: the agent then only
        publishes what it would set. On a simulated GPU it sets the simulated
        clock limit; on a real GPU it locks clocks through NVML
        (nvmlDeviceSetGpuLockedClocks). Never turn it on for a lent or shared GPU.
    miad_interval_s: control period (µ-Serve: 500 ms).
    miad_window_s: completed requests of this many seconds make a worker's latency.
    miad_step_mhz: STEP of the additive decrease.
    miad_min_clock_mhz: the lowest clock MIAD sets (MIN); the maximum is the GPU's.
    miad_threshold: the slack threshold (µ-Serve: 0.05).
    miad_slo_ms: the latency target; 0 = the deployment's scaler threshold
        (per token for a `pertoken` scaler, per request for `request`).
    miad_down_requires_all: lower the clock only when every worker can afford it
        (False = Alg. 3 as printed: when any can; see miad.py).
    miad_scale_out_after: consecutive UP requests at maximum clock before the
        decision carries the scale-out signal.
    """

    gpu_id: str = ""
    gpu_index: int = 0
    force_simulated: bool = False
    telemetry_interval_s: float = 1.0
    agent_ttl_s: float = 5.0
    watch_interval_s: float = 0.2
    worker_log_dir: str = ""
    worker_module: str = "polyserve.worker"
    worker_cmd: str = ""
    worker_nats_url: str = ""
    worker_redis_url: str = ""
    worker_env_allow: str = ""
    worker_time_scale: str = ""
    max_workers: int = 16
    miad_enabled: bool = True
    allow_clock_control: bool = False
    miad_interval_s: float = 0.5
    miad_window_s: float = 2.0
    miad_step_mhz: int = 100
    miad_min_clock_mhz: int = 210
    miad_threshold: float = 0.05
    miad_slo_ms: float = 0.0
    miad_down_requires_all: bool = True
    miad_scale_out_after: int = 4

    def validate(self) -> None:
        super().validate()
        if self.gpu_id and any(c in self.gpu_id for c in " .*>:"):
            raise SettingsError(f"gpu_id {self.gpu_id!r} must not contain spaces, '.', '*', '>' or ':'")
        if self.gpu_index < 0:
            raise SettingsError("gpu_index must be >= 0")
        if self.telemetry_interval_s <= 0 or self.watch_interval_s <= 0:
            raise SettingsError("telemetry_interval_s and watch_interval_s must be > 0")
        if self.agent_ttl_s <= self.telemetry_interval_s:
            raise SettingsError("agent_ttl_s must exceed telemetry_interval_s, or the agent flickers out of Redis")
        if self.max_workers < 1:
            raise SettingsError("max_workers must be >= 1")
        if self.miad_interval_s <= 0 or self.miad_window_s <= 0 or self.miad_step_mhz <= 0:
            raise SettingsError("miad_interval_s, miad_window_s and miad_step_mhz must be > 0")
        if self.miad_min_clock_mhz <= 0 or self.miad_slo_ms < 0 or not 0 <= self.miad_threshold < 1:
            raise SettingsError("miad_min_clock_mhz must be > 0, miad_slo_ms >= 0, miad_threshold in [0, 1)")
        if self.miad_scale_out_after < 1:
            raise SettingsError("miad_scale_out_after must be >= 1")
        bad = [n for n in self.extra_env_allowed() if not n.replace("_", "").isalnum()]
        if bad:
            raise SettingsError(f"worker_env_allow names {bad} are not environment variable names")
        try:
            shlex.split(self.worker_cmd)
        except ValueError as exc:
            raise SettingsError(f"worker_cmd cannot be parsed: {exc}") from exc

    def extra_env_allowed(self) -> frozenset[str]:
        """The names of `worker_env_allow`."""
        return frozenset(n.strip() for n in self.worker_env_allow.split(",") if n.strip())
