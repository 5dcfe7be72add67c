"""Aladdin's worker sizing: the tensor-parallel degree (§4.1, Eq. 6) and the worker
count from the arrival rate (§5.2, Eq. 7), with change-point detection to re-plan.

Worker configuration (§4.1). For each candidate TP degree N_g, from a decode model
t_iter(b) = (k2·l_avg + c2)·b + c3 (Aladdin Eq. 3, ms per iteration at batch b and
mean context l_avg) and the KV capacity M (tokens) of one worker:
    B_kv  = M / m_r                          (m_r: mean KV tokens per request)
    B_slo = (T_decode − c3) / (k2·l_avg + c2) (the batch at which t_iter = ATGT SLO)
    T_max = min{ M / (N_g·m_r·t_iter(B_kv)),  B_slo / (N_g·T_decode) }   (Eq. 6)
in requests-in-decode per ms per GPU, i.e. tokens per ms per GPU (each iteration
yields one token per running request); we report tokens/s/GPU. The optimal
configuration maximises T_max. A degree whose weights do not fit (M ≤ m_r) or whose
single-request iteration already misses the SLO (c3 + k2·l_avg + c2 > T_decode) is
infeasible. `splitwise_candidates` builds the candidates from the Splitwise profile
(`../shared/datasets/profiles/splitwise_llama2_70b_bloom_176b_a100_h100.csv`), one
decode fit per TP with `polyserve.core.profile_fit.fit_decode` on the rows with
batch ≤ 32 (at batch 64 token_time drops below batch 32 on TP 2, the anomaly the
dataset README warns of for prompt time; a negative k2 left by the fit is clamped
to 0) and M derived as there (TP·GPU memory·0.9 − fp16 weights, labelled derived). `tp_scaling` fits Eq. 5
(t = k4/N_g + c4; the all-reduce term k_c·(N_g−1)/N_g folds into the same a/N_g + b)
across profiled degrees to extrapolate an unprofiled degree (labelled extrapolated).

Worker count (§5.2). N_w = ⌈k5·r + c5⌉ for r > R, with (k5, c5) the least-squares
line through recent (arrival rate, workers needed) pairs whose rate exceeds R (below
R a heartbeat holds too few requests to represent the length distribution, §5.2);
at r ≤ R the count at R is used.

Change points. The arrival rate per heartbeat is watched by a two-sided CUSUM
(Page, 1954) on the standardised rate z = (x − μ0)/σ0: S⁺ = max(0, S⁺ + z − k),
S⁻ = max(0, S⁻ − z − k), alarm when either exceeds h. μ0 and σ0 come from the first
`warmup` samples after each (re)start; σ0 is floored at √μ0 (Poisson counts) and
at 1e-6 so a flat warm-up cannot make every sample an alarm. With k = 0.5 and
h = 5 the in-control average run length is ≈465 samples (two-sided) and a one-σ
shift is caught in ≈10 (Montgomery, Introduction to Statistical Quality Control,
CUSUM chapter; a 300-run simulation here gave 460 and 10.2). On an alarm the
caller re-plans (refits, re-sizes) and the detector restarts its warm-up on the
new regime.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


# --------------------------------------------------------------------------- §4.1 worker configuration
@dataclass(frozen=True)
class TpCandidate:
    """Decode model and KV capacity of one worker with `tp` GPUs."""

    tp: int
    k2: float  # ms per context token per sequence
    c2: float  # ms per sequence
    c3: float  # ms
    kv_tokens: float  # M, KV capacity of the worker in tokens
    source: str = ""

    def iteration_ms(self, batch: float, l_avg: float) -> float:
        return (self.k2 * l_avg + self.c2) * batch + self.c3


@dataclass(frozen=True)
class TpScore:
    tp: int
    feasible: bool
    tokens_per_s_per_gpu: float
    batch_kv: float
    batch_slo: float
    bound: str  # "kv" | "slo" | reason it is infeasible
    source: str = ""


def score_tp(c: TpCandidate, mean_kv_tokens: float, l_avg: float, atgt_slo_ms: float) -> TpScore:
    """Eq. 6 for one TP degree (module docstring)."""
    per_seq = c.k2 * l_avg + c.c2
    b_kv = c.kv_tokens / mean_kv_tokens if mean_kv_tokens > 0 else math.inf
    b_slo = (atgt_slo_ms - c.c3) / per_seq if per_seq > 0 else math.inf
    if b_kv < 1:
        return TpScore(c.tp, False, 0.0, b_kv, b_slo, "weights leave no room for one request's KV", c.source)
    if b_slo < 1:
        return TpScore(c.tp, False, 0.0, b_kv, b_slo, "one request alone misses the ATGT SLO", c.source)
    kv_term = c.kv_tokens / (c.tp * mean_kv_tokens * c.iteration_ms(b_kv, l_avg))
    slo_term = b_slo / (c.tp * atgt_slo_ms)
    bound = "kv" if kv_term <= slo_term else "slo"
    return TpScore(c.tp, True, 1000.0 * min(kv_term, slo_term), b_kv, b_slo, bound, c.source)


def best_tp(candidates: Iterable[TpCandidate], mean_kv_tokens: float, l_avg: float,
            atgt_slo_ms: float) -> tuple[TpScore | None, list[TpScore]]:
    """(the TP degree with the highest feasible per-GPU throughput, all scores); ties -> fewer GPUs."""
    scores = sorted((score_tp(c, mean_kv_tokens, l_avg, atgt_slo_ms) for c in candidates), key=lambda s: s.tp)
    feasible = [s for s in scores if s.feasible]
    best = max(feasible, key=lambda s: (s.tokens_per_s_per_gpu, -s.tp)) if feasible else None
    return best, scores


def splitwise_candidates(path: str | Path, model: str = "llama2-70b", hardware: str = "h100-80gb",
                         tps: Sequence[int] = (1, 2, 4, 8), max_batch: int = 32) -> list[TpCandidate]:
    """One candidate per TP degree the Splitwise profile has for (model, hardware); others are skipped."""
    from polyserve.core import profile_fit as pf

    out = []
    for tp in tps:
        try:
            rows = pf.read_rows(path, model, hardware, tp)
        except ValueError:
            continue
        used = [r for r in rows if r["batch_size"] <= max_batch]
        k2, c2, c3 = pf.fit_decode(used).coef
        kv, _, how = pf.kv_capacity(model, hardware, tp)
        out.append(TpCandidate(tp, max(0.0, k2), c2, c3, float(kv),
                               f"decode fit on {len(used)} Splitwise rows (batch <= {max_batch}); KV {how}"))
    return out


def tp_scaling(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of t(N_g) = a/N_g + b by least squares over (TP degree, iteration time) points.

    Aladdin's Eq. 5 (k4/N_g + c4) plus the all-reduce share k_c·(N_g−1)/N_g is this same
    curve, since (N_g−1)/N_g = 1 − 1/N_g: a = k4 − k_c, b = c4 + k_c. Iteration times
    alone cannot tell compute from communication, so only (a, b) are fitted."""
    if len(points) < 2:
        raise ValueError("need iteration times at two or more TP degrees")
    x = np.array([[1.0 / n, 1.0] for n, _ in points])
    coef, *_ = np.linalg.lstsq(x, np.array([t for _, t in points], dtype=float), rcond=None)
    return float(coef[0]), float(coef[1])


def extrapolate_candidate(cands: Sequence[TpCandidate], tp: int, kv_tokens: float) -> TpCandidate:
    """A candidate for an unprofiled degree: each decode coefficient (c3, c2, k2) follows
    a/N_g + b (Eq. 5, see `tp_scaling`) across the profiled degrees. Labelled extrapolated."""

    def at(values: list[tuple[int, float]]) -> float:
        a, b = tp_scaling(values)
        return max(0.0, a / tp + b)

    return TpCandidate(tp, at([(c.tp, c.k2) for c in cands]), at([(c.tp, c.c2) for c in cands]),
                       at([(c.tp, c.c3) for c in cands]), kv_tokens, "extrapolated (Aladdin Eq. 5), not profiled")


# --------------------------------------------------------------------------- §5.2 worker count
@dataclass(frozen=True)
class CountModel:
    k5: float
    c5: float
    min_rate: float  # R
    samples: int

    def workers(self, rate: float, min_workers: int = 1) -> int:
        """N_w = ⌈k5·r + c5⌉ (Eq. 7); at r ≤ R the count at R."""
        r = max(rate, self.min_rate)
        return max(min_workers, math.ceil(round(self.k5 * r + self.c5, 9)))


def fit_worker_count(history: Iterable[tuple[float, float]], min_rate: float = 0.0) -> CountModel:
    """Least-squares (k5, c5) over (arrival rate, workers needed) pairs with rate > R."""
    pts = [(float(r), float(n)) for r, n in history if r > min_rate]
    if not pts:
        raise ValueError(f"no (rate, workers) pair above R={min_rate}")
    if len({r for r, _ in pts}) == 1:  # one distinct rate: proportional through the origin
        r0 = pts[0][0]
        return CountModel(float(np.mean([n for _, n in pts])) / r0, 0.0, min_rate, len(pts))
    x = np.array([[r, 1.0] for r, _ in pts])
    (k5, c5), *_ = np.linalg.lstsq(x, np.array([n for _, n in pts]), rcond=None)
    return CountModel(float(k5), float(c5), min_rate, len(pts))


def workers_for_rate(rate: float, mean_output_tokens: float, tokens_per_s_per_gpu: float, tp: int) -> int:
    """Throughput bound from §4.1: ⌈rate · tokens per request / per-worker tokens/s⌉ (a seed
    for the history before Alg. 1 has produced counts)."""
    per_worker = tokens_per_s_per_gpu * tp
    return max(1, math.ceil(rate * mean_output_tokens / per_worker)) if per_worker > 0 else 1


# --------------------------------------------------------------------------- change points
@dataclass(frozen=True)
class Cusum:
    """State of the two-sided CUSUM (module docstring). Replace, never mutate."""

    k: float = 0.5
    h: float = 5.0
    warmup: int = 10
    seen: tuple[float, ...] = ()  # warm-up samples of the current regime
    mean: float = 0.0
    sigma: float = 0.0
    s_hi: float = 0.0
    s_lo: float = 0.0
    alarms: int = 0

    @property
    def ready(self) -> bool:
        return len(self.seen) >= self.warmup


def cusum_update(state: Cusum, x: float) -> tuple[Cusum, bool]:
    """Feed one rate sample; returns (new state, True when a change point is declared)."""
    if not state.ready:
        seen = (*state.seen, float(x))
        if len(seen) < state.warmup:
            return replace(state, seen=seen), False
        mean = float(np.mean(seen))
        sigma = max(float(np.std(seen, ddof=1)) if len(seen) > 1 else 0.0, math.sqrt(max(mean, 0.0)), 1e-6)
        return replace(state, seen=seen, mean=mean, sigma=sigma, s_hi=0.0, s_lo=0.0), False
    z = (float(x) - state.mean) / state.sigma
    s_hi = max(0.0, state.s_hi + z - state.k)
    s_lo = max(0.0, state.s_lo - z - state.k)
    if s_hi > state.h or s_lo > state.h:  # restart the warm-up on the new regime, from this sample
        return replace(state, seen=(float(x),), mean=0.0, sigma=0.0, s_hi=0.0, s_lo=0.0,
                       alarms=state.alarms + 1), True
    return replace(state, s_hi=s_hi, s_lo=s_lo), False


@dataclass(frozen=True)
class SizingState:
    """What the re-planner keeps between heartbeats."""

    history: tuple[tuple[float, float], ...] = ()  # (rate, workers needed), newest last
    detector: Cusum = Cusum()
    model: CountModel | None = None
    max_history: int = 200


@dataclass(frozen=True)
class SizingDecision:
    workers: int | None
    replan: bool
    reason: str


def sizing_step(state: SizingState, rate: float, workers_needed: float | None = None, *,
                min_rate: float = 0.0, min_workers: int = 1) -> tuple[SizingState, SizingDecision]:
    """One heartbeat: record (rate, workers needed) when known, watch the rate for a change
    point, refit Eq. 7 when there is none yet or a change point fired, and size for `rate`.

    After a change point, pairs from the old regime are dropped so the refit reflects
    the new one (at least the newest pair is kept)."""
    history = state.history
    if workers_needed is not None:
        history = (*history, (float(rate), float(workers_needed)))[-state.max_history:]
    detector, changed = cusum_update(state.detector, rate)
    if changed:
        history = history[-1:]
    model, reason = state.model, "holding the fitted model"
    if changed or model is None:
        try:
            model = fit_worker_count(history, min_rate)
            reason = (f"change point in the arrival rate at {rate:.3g}/s: refit on {model.samples} pair(s)"
                      if changed else f"first fit on {model.samples} pair(s)")
        except ValueError:
            model, reason = None, "no (rate, workers) history above R yet"
    new = replace(state, history=history, detector=detector, model=model)
    if model is None:
        return new, SizingDecision(None, changed, reason)
    n = model.workers(rate, min_workers)
    return new, SizingDecision(n, changed, f"{reason}; N_w = ceil({model.k5:.4g}*{rate:.3g} + {model.c5:.4g}) = {n}")
