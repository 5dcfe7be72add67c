"""CaraServe rank-aware placement (`../shared/papers/caraserve-cpu-assisted-rank-aware-lora.txt`
§5) as a pure function.

Candidates: workers that can serve the request's adapter — it is loaded there, or the
worker has a free adapter slot (`max_adapters` 0 = no limit) — and have KV room for the
request's input + predicted output (when the worker reports its KV). The cost of a
candidate is the time per token it adds to its batch:

    cost = (b + 1)·t_after − b·t_before

with ``t = decode step (Aladdin Eq. 3) + LoRA share`` of the batch before and after the
request joins, the LoRA share from the worker's kernel: BGMV ∝ batch × max rank,
MBGMV ∝ Σ rank (`perf_models.WorkerPerf.lora_ms`). That is the added decode latency
of its b running requests (b·Δt) plus the new request's own time per token. When
``t_after`` exceeds the time-per-token SLO every request of that batch would break it,
and the cost gets `PENALTY` (CaraServe: "a large penalty"). The cheapest candidate wins;
ties go to a worker that already holds the adapter, then worker_id. With no candidate
(all slots taken by other adapters, or no KV room) every worker is a candidate, penalised.

Without a perf model on the view (or `CaraConfig.perf`) the base decode step is taken
as 0 and only the LoRA share counts, with the default coefficients.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from polyserve.core.perf import LORA_DEFAULTS, PerfModel, WorkerPerf
from polyserve.dispatcher.views import Decision, PolicyState, RequestView, WorkerView, require_workers
from polyserve.proto.messages import ATGT_SLO_MS  # time-per-token SLO default (Aladdin Table 2, Llama2-70B)

PENALTY = 1e6  # ms added to a candidate that would break the SLO
_LORA_ONLY = WorkerPerf(base=PerfModel(k1=0.0, c1=0.0, k2=0.0, c2=0.0, c3=0.0), lora=dict(LORA_DEFAULTS),
                        label="lora-only")


@dataclass(frozen=True)
class CaraConfig:
    atgt_slo_ms: float = ATGT_SLO_MS
    penalty: float = PENALTY
    perf: WorkerPerf | None = None  # for workers whose view carries none


DEFAULT = CaraConfig()


def config_for(req: RequestView) -> CaraConfig:
    """`DEFAULT` with the request's own time-per-token SLO, when it carries one (> 0)."""
    if req.atgt_slo_ms <= 0 or req.atgt_slo_ms == DEFAULT.atgt_slo_ms:
        return DEFAULT
    return _slo_config(req.atgt_slo_ms)


@lru_cache(maxsize=64)
def _slo_config(atgt_slo_ms: float) -> CaraConfig:
    return CaraConfig(atgt_slo_ms=atgt_slo_ms)


@dataclass(frozen=True, slots=True)
class Cost:
    worker_id: str
    cost: float
    t_before: float
    t_after: float
    violates: bool
    resident: bool


def _batch_state(w: WorkerView) -> tuple[int, float, int, int]:
    """(b, mean context, max rank, Σ rank) of the worker's batch."""
    if w.requests:
        reqs = w.requests
        b = len(reqs)
        ctx = sum(r.input_tokens + r.generated for r in reqs) / b
        ranks = [r.rank for r in reqs]
        return b, ctx, max(ranks), sum(ranks)
    b = max(w.outstanding, w.running + w.waiting)
    ctx = w.kv_used / b if b else 0.0
    return b, ctx, max(w.adapter_ranks, default=0) if b else 0, 0


def step_ms(perf: WorkerPerf, kernel: str, b: int, ctx: float, max_rank: int, sum_rank: int) -> float:
    """Modelled decode step: Aladdin's base step plus the kernel's LoRA share."""
    if b <= 0:
        return 0.0
    return perf.decode_ms(ctx, b) + perf.lora_ms(kernel, b, max_rank, sum_rank)


def cost_of(w: WorkerView, req: RequestView, cfg: CaraConfig = DEFAULT) -> Cost:
    """The added time per token of placing `req` on `w` (see the module docstring)."""
    perf = w.perf or cfg.perf or _LORA_ONLY
    b, ctx, mx, sm = _batch_state(w)
    rank = req.adapter_rank
    t0 = step_ms(perf, w.kernel, b, ctx, mx, sm)
    ctx1 = (ctx * b + req.input_tokens) / (b + 1)
    t1 = step_ms(perf, w.kernel, b + 1, ctx1, max(mx, rank), sm + rank)
    violates = t1 > cfg.atgt_slo_ms
    cost = (b + 1) * t1 - b * t0 + (cfg.penalty if violates else 0.0)
    resident = req.adapter is None or req.adapter in w.adapters
    return Cost(w.worker_id, cost, t0, t1, violates, resident)


def candidates(workers: Sequence[WorkerView], req: RequestView) -> list[WorkerView]:
    """Workers that hold the adapter or have a slot for it, and KV room for the request."""
    out = []
    need = req.input_tokens + req.predicted_tokens
    for w in workers:
        if req.adapter is not None and req.adapter not in w.adapters \
                and w.max_adapters and len(w.adapters) >= w.max_adapters:
            continue
        if w.kv_capacity > 0 and w.kv_used + need > w.kv_capacity:
            continue
        out.append(w)
    return out


def rank_aware(workers: Sequence[WorkerView], req: RequestView, cfg: CaraConfig = DEFAULT) -> Cost:
    """The cheapest candidate's cost record (all workers when none is a candidate)."""
    pool = candidates(workers, req) or list(workers)
    costs = [cost_of(w, req, cfg) for w in pool]
    return min(costs, key=lambda c: (c.cost, not c.resident, c.worker_id))


def caraserve_rank_aware(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                         rng) -> Decision:
    """`POLICIES["caraserve"]`: CaraServe §5 rank-aware placement."""
    require_workers(workers)
    best = rank_aware(workers, request, config_for(request))
    return Decision(best.worker_id, state, scale_out=best.violates)
