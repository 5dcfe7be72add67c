"""Events: what every service publishes under `<prefix>.v1.events.>` (request life cycle,
heartbeats, worker up/down, scale and clock decisions, GPU telemetry, energy, runtime plans).
Frozen msgspec structs, tagged by `event`; re-exported by `polyserve.proto`."""
from __future__ import annotations

import msgspec

from polyserve.proto.base import Msg, now


# --------------------------------------------------------------------- events
class Event(Msg, tag_field="event", kw_only=True):
    """Base of events published on `<prefix>.v1.events.>`."""

    ts: float = msgspec.field(default_factory=now)


class RequestEvent(Event, kw_only=True):
    request_id: str
    deployment: str = ""
    model: str = ""


class Admitted(RequestEvent, tag="admitted", kw_only=True):
    input_tokens: int
    max_tokens: int
    stream: bool = False
    n: int = 1


class Predicted(RequestEvent, tag="predicted", kw_only=True):
    length_class: int
    tokens_estimate: int
    source: str
    latency_ms: float


class Dispatched(RequestEvent, tag="dispatched", kw_only=True):
    worker_id: str
    policy: str
    latency_ms: float


class FirstToken(RequestEvent, tag="first_token", kw_only=True):
    worker_id: str
    ttft_ms: float


class Completed(RequestEvent, tag="completed", kw_only=True):
    worker_id: str
    input_tokens: int
    output_tokens: int
    e2e_ms: float
    ttft_ms: float
    queue_ms: float = 0.0
    tbt_mean_ms: float = 0.0
    tbt_max_ms: float = 0.0
    atgt_ms: float = 0.0
    predicted_tokens: int = 0
    finish_reason: str = "stop"
    simulated: bool = False
    migrations: int = 0  # times the request moved to another worker after its worker died (request migration)
    cached_tokens: int = 0  # of input_tokens, those the engine took from its prefix cache (RequestStats)


class Failed(RequestEvent, tag="failed", kw_only=True):
    reason: str
    status: int = 500
    worker_id: str = ""
    e2e_ms: float = 0.0


class AdapterInfo(Msg, kw_only=True):
    name: str
    rank: int
    tier: str = "gpu"  # "gpu" | "loading" (copy to the device under way) | "host" | "disk"


class Heartbeat(Event, tag="heartbeat", kw_only=True):
    worker_id: str
    deployment: str
    model: str
    engine: str
    gpu_id: str = ""
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    max_input_len: int = 0
    adapters: list[AdapterInfo] = []
    simulated: bool = False
    ttl_s: float = 3.0
    generate_subject: str = ""
    cancel_subject: str = ""
    max_batch: int = 0  # engine batch limit (0 = unknown)
    kernel: str = ""  # LoRA kernel cost model: "bgmv" | "mbgmv" ("" = unknown)
    profile: str = ""  # engine profile (core/profiles/<name>.json or a path) the dispatcher starts its fits from
    max_adapters: int = 0  # adapter slots on the device (0 = no limit)
    resumable: bool = False  # the engine continues a started stream from prompt + output (request migration)


class WorkerUp(Event, tag="worker_up", kw_only=True):
    worker_id: str
    deployment: str
    model: str
    engine: str
    gpu_id: str = ""


class WorkerDown(Event, tag="worker_down", kw_only=True):
    worker_id: str
    reason: str
    deployment: str = ""
    gpu_id: str = ""


class ServiceState(Event, tag="service", kw_only=True):
    service: str
    instance: str
    state: str  # "ready" | "draining" | "stopped"
    pid: int = 0


class Refused(Event, tag="refused", kw_only=True):
    """A service refused a request on security grounds (on `<prefix>.v1.events.service.refused`),
    e.g. a StartWorker whose `extra_env` sets variables outside the gpu-agent's allowlist."""

    service: str
    instance: str
    action: str  # e.g. "start_worker"
    reason: str
    keys: list[str] = []  # the offending names, never their values
    deployment: str = ""


class ScaleDecision(Event, tag="scale", kw_only=True):
    deployment: str
    scaler: str  # "pertoken" | "request"
    current: int
    desired: int
    metric_ms: float | None = None
    threshold_ms: float
    samples: int = 0
    reason: str = ""


class GpuTelemetry(Event, tag="gpu", kw_only=True):
    gpu_id: str
    name: str
    simulated: bool
    power_w: float
    energy_j: float
    sm_clock_mhz: int
    mem_clock_mhz: int
    max_sm_clock_mhz: int = 0
    util_gpu_pct: float = 0.0
    util_mem_pct: float = 0.0
    mem_used_mb: float = 0.0
    mem_total_mb: float = 0.0
    workers: list[str] = []


class ClockDecision(Event, tag="clock", kw_only=True):
    """MIAD (µ-Serve Alg. 3): what a gpu-agent set, or would set, on its GPU."""

    gpu_id: str
    simulated: bool
    applied: bool  # False: computed and published only (no --allow-clock-control)
    freq_mhz: int
    previous_mhz: int
    action: str  # "up" | "down" | "same"
    reason: str
    scale_out: bool = False  # at max clock and still missing the SLO: ask for another worker
    missing: list[str] = []  # workers below their SLO slack
    workers: dict[str, float] = {}  # worker -> latency the decision saw (ms)


class ScaleSignal(Event, tag="scale_signal", kw_only=True):
    """A request for one more worker from outside the planner: Aladdin Alg. 1 found no
    feasible worker (dispatcher), or MIAD is at max clock and still misses (gpu-agent)."""

    deployment: str
    source: str  # "aladdin" | "caraserve" | "miad"
    reason: str = ""
    request_id: str = ""
    gpu_id: str = ""


class EnergyReport(Event, tag="energy", kw_only=True):
    """Energy of one GPU over a window, split over the requests its workers completed."""

    gpu_id: str
    window_s: float
    energy_j: float
    source: str  # "nvml" (the GPU's energy counter) | "model" (simulated GPU power model: estimated)
    simulated: bool
    requests: int = 0
    tokens: int = 0  # input + output tokens of those requests
    output_tokens: int = 0
    j_per_request: float | None = None
    j_per_token: float | None = None  # per output token
    per_worker_j: dict[str, float] = {}


class RuntimePlan(Event, tag="runtime_plan", kw_only=True):
    """Arlo §3.3/§4: the planner's re-solved runtime allocation for a deployment."""

    deployment: str
    gpus: int
    counts: dict[str, int]  # runtime -> instances
    previous: dict[str, int] = {}
    changes: int = 0  # instances re-purposed by the replacement plan
    rates: dict[str, float] = {}  # per-bin request rate the solve used (req/s)
    objective: float | None = None
    solve_ms: float = 0.0
    applied: bool = False
    reason: str = ""


AnyEvent = (
    Admitted | Predicted | Dispatched | FirstToken | Completed | Failed | Heartbeat
    | WorkerUp | WorkerDown | ServiceState | Refused | ScaleDecision | GpuTelemetry
    | ClockDecision | ScaleSignal | EnergyReport | RuntimePlan
)
