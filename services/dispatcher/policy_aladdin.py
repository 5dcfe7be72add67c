"""Aladdin placement (`../shared/papers/aladdin-joint-placement-scaling.txt` §4.2–4.3) as
pure functions: best-fit bin packing under SLO and KV constraints (Alg. 1) and
re-balancing of not-yet-started requests on prediction error (Alg. 2).

A worker `w` may take request `j` when, with `j` added to the requests it holds
(ongoing ones with l_in, l_pred, generated so far and decode time so far; "new"
ones placed but not yet prefilled), all of these hold:

* batch: b ≤ max_batch (when the worker reports one);
* (b) ATGT: Σ(l_in + γ·l_out) ≤ θ·l_d(b), l_d(b) = (T_dec − c3 − c2·b)/k2 (Eq. 4), with
  l_out the predicted output (re-predicted once a request outlives its prediction);
* (c) TTFT: t_pre(Σ l_in of new requests) ≤ T_pre, "new" counting every prompt not
  prefilled yet, including one in the prefill under way (a prompt whose own prefill is
  over T_pre can never meet it: it only needs to be the only new request there);
* (d) ongoing ATGT: t_pre(Σ l_in of new requests) ≤ θ·min_j(T_dec·l_out_j − t_dec_j) over
  ongoing requests, i.e. the prefill fits in the time they have saved so far;
* (e) KV: the KV footprint over every future iteration, with each request growing by one
  token per step until its (predicted) end, stays ≤ the worker's KV capacity.

Among feasible workers the fullest by `capacity_norm` wins; when none fits the result
says so (`Placement.scale_out`): Alg. 1 opens a new worker there. Where none can be opened
(a fixed cluster, or one at its size limit) the request goes where it does the least harm
(`fallback_key`: no missed TTFT or full batch first, then the fewest ongoing requests whose
slack its prefill overruns, then the largest slack margin, then the emptiest). `capacity_norm` is
the L2 norm of (batch size, Σ(l_in + γ·l_out)), each divided by the worker's limit
(max_batch or the SLO batch bound, and l_d(1)) so that the two dimensions weigh alike
(the paper leaves the scaling open; raw tokens would drown the batch size).

Defaults: γ = 0.5 (paper), θ = 0.9 (the paper's knob in (0, 1)); SLOs from Aladdin
Table 2 for Llama2-70B: T_pre = 1600 ms, T_dec = 75 ms, unless the request carries its own.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from polyserve.core.perf import WorkerPerf
from polyserve.dispatcher.views import Decision, PolicyState, RequestView, RunningRequest, WorkerView
from polyserve.proto.messages import ATGT_SLO_MS, TTFT_SLO_MS  # Aladdin Table 2, Llama2-chat-70b

Repredict = Callable[[int, int, int], int]  # (input_tokens, predicted, generated) -> new total output


def double_generated(input_tokens: int, predicted: int, generated: int) -> int:
    """Default re-prediction for a request that outlived its prediction: twice what it has
    generated (Aladdin re-predicts with the conditional mean given the length so far; the
    simulator passes that, from the trace, as `AladdinConfig.repredict`)."""
    return max(generated + 1, 2 * generated)


@dataclass(frozen=True)
class AladdinConfig:
    """Knobs of Alg. 1/2 (see the module docstring)."""

    ttft_slo_ms: float = TTFT_SLO_MS
    atgt_slo_ms: float = ATGT_SLO_MS
    gamma: float = 0.5
    theta: float = 0.9
    repredict: Repredict = double_generated
    perf: WorkerPerf | None = None  # used for workers whose view carries no perf
    slack: str = "banked"  # constraint (d): "banked" (paper) | "lifetime" (see `ongoing_slack_ms`)


DEFAULT = AladdinConfig()


@dataclass(frozen=True, slots=True)
class Placement:
    """Result of Alg. 1: the chosen worker, or none and a scale-out signal."""

    worker_id: str | None
    scale_out: bool
    checked: int = 0  # workers whose constraints were evaluated
    reasons: dict = field(default_factory=dict)  # worker_id -> first failed constraint


def planned_output(r: RunningRequest, cfg: AladdinConfig = DEFAULT) -> int:
    """The output length Aladdin plans with: the prediction, or a re-prediction once the
    request has generated that many tokens; never more than the request's `max_tokens`
    (its hard cap, when known)."""
    if r.predicted_tokens > r.generated:
        out = r.predicted_tokens
    else:
        out = max(r.generated + 1, cfg.repredict(r.input_tokens, r.predicted_tokens, r.generated))
    return min(out, r.max_tokens) if r.max_tokens > 0 else out


def new_output(req: RequestView) -> int:
    """The output Aladdin plans for a request being placed: its prediction (at least 1),
    at most its `max_tokens` when known."""
    n = max(1, req.predicted_tokens)
    return min(n, req.max_tokens) if req.max_tokens > 0 else n


def as_new(req: RequestView) -> RunningRequest:
    """A request being placed, as a not-yet-started entry of a worker."""
    # positional (in RunningRequest's field order): the dispatcher makes one per placement
    # and keyword passing costs twice as much (0.8 -> 0.4 µs)
    return RunningRequest(req.request_id, req.input_tokens, new_output(req), 0, 0.0, False,
                          req.adapter, req.adapter_rank, req.max_tokens)


def _perf(w: WorkerView, cfg: AladdinConfig) -> WorkerPerf | None:
    return w.perf if w.perf is not None else cfg.perf


def _batch(w: WorkerView) -> int:
    return len(w.requests) if w.requests else max(w.outstanding, w.running + w.waiting)


def _weighted_ctx(w: WorkerView, cfg: AladdinConfig) -> float:
    """Σ(l_in + γ·l_out) over the worker's requests (its KV use when it lists none)."""
    if w.requests:
        g = cfg.gamma
        return float(sum(r.input_tokens + g * planned_output(r, cfg) for r in w.requests))
    return float(w.kv_used)


def capacity_norm(w: WorkerView, cfg: AladdinConfig = DEFAULT) -> float:
    """How full a worker is: L2 norm of (batch / batch limit, Σ(l_in + γ·l_out) / l_d(1))."""
    return norm_of(w, cfg, _perf(w, cfg), _batch(w), _weighted_ctx(w, cfg))


def norm_of(w: WorkerView, cfg: AladdinConfig, perf: WorkerPerf | None, b: int, ctx: float) -> float:
    """`capacity_norm` of a worker holding batch `b` and weighted context `ctx`."""
    b_lim = float(w.max_batch or 0)
    ctx_lim = 0.0
    if perf is not None:
        if not b_lim and perf.base.c2 > 0:
            b_lim = max(1.0, (cfg.atgt_slo_ms - perf.base.c3) / perf.base.c2)
        ctx_lim = perf.l_d(1, cfg.atgt_slo_ms)
    if not ctx_lim or not math.isfinite(ctx_lim) or ctx_lim <= 0:
        ctx_lim = float(w.kv_capacity or 1)
    return math.hypot(b / (b_lim or 1.0), ctx / ctx_lim)


def kv_peak(perf: WorkerPerf | None, entries: Iterable[tuple[float, float]]) -> float:
    """Peak KV over future iterations of requests given as (context now, steps left):
    each grows one token per step and frees its KV after its last step (constraint e).
    The peak is at the last step of some request: max_k Σ_{r_j ≥ r_k} kv(c_j + r_k)."""
    h, j = (perf.base.h, perf.base.j) if perf is not None else (1.0, 0.0)
    items = sorted(entries, key=lambda e: -e[1])
    peak = s_ctx = 0.0
    n = 0
    for ctx, left in items:
        s_ctx += ctx
        n += 1
        peak = max(peak, h * (s_ctx + n * left) + j * n)
    return peak


def request_slacks_ms(w: WorkerView, perf: WorkerPerf, new: RunningRequest, cfg: AladdinConfig = DEFAULT) -> list[float]:
    """The time each ongoing request of `w` can give up to a prefill (constraint d), one
    value per started request (see `ongoing_slack_ms`, their minimum)."""
    # A request in the prefill under way (started, no token yet) counts as one about to
    # have its first token: l_out = 1, t_dec = 0 — the new prefill would delay its first step.
    started = [r for r in w.requests if r.started]
    if not started:
        return []
    t_dec = cfg.atgt_slo_ms
    if cfg.slack != "lifetime":
        return [t_dec * max(1, r.generated) - r.decode_ms for r in started]
    b = len(w.requests) + 1
    ctx = (sum(r.input_tokens + r.generated for r in w.requests) + new.input_tokens) / b
    step = perf.decode_ms(ctx, b)
    out = []
    for r in started:
        total = planned_output(r, cfg)
        out.append(t_dec * (total - 1) - r.decode_ms - (total - max(1, r.generated)) * step)
    return out


def ongoing_slack_ms(w: WorkerView, perf: WorkerPerf, new: RunningRequest, cfg: AladdinConfig = DEFAULT) -> float:
    """The least time any ongoing request of `w` can give up to a prefill (constraint d);
    inf when none has started.

    ``banked`` (the paper): T_dec·l_out − t_dec, what it has saved so far against its ATGT
    budget. ``lifetime``: T_dec·(L − 1) − t_dec − (L − l_out)·t_step, what it will have
    saved by its planned end L if the rest of its steps take t_step (the modelled decode
    step of the batch with `new` in it) — less strict for a request that has just begun.
    """
    return min(request_slacks_ms(w, perf, new, cfg), default=math.inf)


def check(w: WorkerView, req: RequestView, cfg: AladdinConfig = DEFAULT) -> str:
    """"" when `w` may take `req` under constraints batch, (b)-(e); else the first failed one."""
    perf = _perf(w, cfg)
    new = as_new(req)
    b = _batch(w) + 1
    if w.max_batch and b > w.max_batch:
        return "batch"
    if perf is not None:
        if _weighted_ctx(w, cfg) + new.input_tokens + cfg.gamma * new.predicted_tokens \
                > cfg.theta * perf.l_d(b, cfg.atgt_slo_ms):
            return "atgt"
        # TTFT waits for every prompt not prefilled yet: queued, or in the prefill under way;
        # the ongoing requests' next step is delayed by the queued prompts and the new one
        queued_in = sum(r.input_tokens for r in w.requests if not r.started)
        running_in = sum(r.input_tokens for r in w.requests if r.started and r.generated == 0)
        t_ttft = perf.prefill_ms(queued_in + running_in + new.input_tokens)
        alone = perf.prefill_ms(new.input_tokens) > cfg.ttft_slo_ms
        if t_ttft > cfg.ttft_slo_ms and not (alone and queued_in + running_in == 0):
            return "ttft"
        if perf.prefill_ms(queued_in + new.input_tokens) > cfg.theta * ongoing_slack_ms(w, perf, new, cfg):
            return "slack"
    if w.kv_capacity > 0:
        if w.requests:
            entries = [(r.input_tokens + r.generated, max(1, planned_output(r, cfg) - r.generated))
                       for r in w.requests]
            entries.append((new.input_tokens, new.predicted_tokens))
            peak = kv_peak(perf, entries)
        else:  # heartbeat only: what is used now plus this request's whole footprint
            peak = w.kv_used + (perf.kv(new.input_tokens + new.predicted_tokens) if perf
                                else new.input_tokens + new.predicted_tokens)
        if peak > w.kv_capacity:
            return "kv"
    return ""


def place(workers: Sequence[WorkerView], req: RequestView, cfg: AladdinConfig = DEFAULT) -> Placement:
    """Alg. 1: the fullest worker (by capacity_norm) that passes every constraint, or
    `Placement(None, scale_out=True)` when none does."""
    ranked = sorted(workers, key=lambda w: (-capacity_norm(w, cfg), w.worker_id))
    reasons: dict[str, str] = {}
    for i, w in enumerate(ranked):
        why = check(w, req, cfg)
        if not why:
            return Placement(w.worker_id, False, i + 1, reasons)
        reasons[w.worker_id] = why
    return Placement(None, True, len(ranked), reasons)


def config_for(req: RequestView, base: AladdinConfig = DEFAULT) -> AladdinConfig:
    """`base` with the request's own SLOs, where it carries them (> 0); the same object
    for the same SLOs over `DEFAULT` (the live dispatcher sets them on every request)."""
    ttft = req.ttft_slo_ms if req.ttft_slo_ms > 0 else base.ttft_slo_ms
    atgt = req.atgt_slo_ms if req.atgt_slo_ms > 0 else base.atgt_slo_ms
    if ttft == base.ttft_slo_ms and atgt == base.atgt_slo_ms:
        return base
    if base is DEFAULT:
        return _slo_config(ttft, atgt)
    return replace(base, ttft_slo_ms=ttft, atgt_slo_ms=atgt)


@lru_cache(maxsize=64)
def _slo_config(ttft_slo_ms: float, atgt_slo_ms: float) -> AladdinConfig:
    return replace(DEFAULT, ttft_slo_ms=ttft_slo_ms, atgt_slo_ms=atgt_slo_ms)


def fallback_key(w: WorkerView, req: RequestView, cfg: AladdinConfig = DEFAULT) -> tuple:
    """How much harm `req` does on `w` when no worker passes Alg. 1 and none can be opened
    (a fixed cluster, or one at its size limit); the least key takes it:

    (over a hard limit, victims, −margin, capacity_norm, worker_id), where "over a hard
    limit" is a full batch or a TTFT (c) the request would miss waiting behind the prompts
    not yet prefilled there; "victims" the ongoing requests whose slack (constraint d,
    θ·slack_j) its prefill, with the prompts queued before it, would overrun; "margin"
    θ·min_j slack_j − that prefill (inf with no ongoing request). Alg. 1 itself has no
    such case (it opens a worker); the emptiest worker by capacity_norm alone ignores the
    prompt backlog and fresh requests' slack, and costs SLO misses when the cluster is
    fixed (see README, Aladdin experiments)."""
    perf = _perf(w, cfg)
    b = _batch(w) + 1
    hard = bool(w.max_batch and b > w.max_batch)
    victims, margin = 0, math.inf
    if perf is not None:
        queued = sum(r.input_tokens for r in w.requests if not r.started)
        prefilling = sum(r.input_tokens for r in w.requests if r.started and r.generated == 0)
        backlog = queued + prefilling
        if perf.prefill_ms(backlog + req.input_tokens) > cfg.ttft_slo_ms and backlog:
            hard = True
        t_pre = perf.prefill_ms(queued + req.input_tokens)
        slacks = request_slacks_ms(w, perf, as_new(req), cfg)
        if slacks:
            victims = sum(1 for x in slacks if cfg.theta * x < t_pre)
            margin = cfg.theta * min(slacks) - t_pre
    return hard, victims, -margin, capacity_norm(w, cfg), w.worker_id


def fallback(workers: Iterable[WorkerView], req: RequestView, cfg: AladdinConfig = DEFAULT) -> str:
    """The worker that takes `req` when none passes Alg. 1: the least `fallback_key`."""
    return min(fallback_key(w, req, cfg) for w in workers)[-1]


def aladdin_best_fit(workers: Sequence[WorkerView], request: RequestView, state: PolicyState,
                     rng) -> Decision:
    """`POLICIES["aladdin"]`: Alg. 1 over the live workers. When none fits (Alg. 1 would open
    a new worker: see `place` for that signal) the worker where the request does the least
    harm (`fallback_key`) takes it, with `scale_out=True`."""
    if not workers:
        raise ValueError("a dispatch policy needs at least one candidate worker")
    cfg = config_for(request)
    p = place(workers, request, cfg)
    if p.worker_id is not None:
        return Decision(p.worker_id, state)
    return Decision(fallback(workers, request, cfg), state, scale_out=True)


# ------------------------------------------------------------------ Alg. 2: re-balancing
@dataclass(frozen=True, slots=True)
class Move:
    """Move a not-yet-started request from one worker to another."""

    request_id: str
    src: str
    dst: str


def worker_error(w: WorkerView, cfg: AladdinConfig = DEFAULT) -> tuple[float, float]:
    """(l^e, b^e) of Alg. 2: the early finishes the view carries (`len_error`, `batch_error`,
    negative) plus, per ongoing request past its prediction, its re-predicted remaining
    length and one batch slot."""
    l_e, b_e = w.len_error, w.batch_error
    for r in w.requests:
        if r.started and r.predicted_tokens and r.generated >= r.predicted_tokens:
            l_e += planned_output(r, cfg) - r.generated
            b_e += 1
    return l_e, b_e


def _distance(perf: WorkerPerf | None, l_e: float, b_e: float) -> float:
    """Signed distance of (l^e, b^e) from the line k2·l + c2·b = 0 (Eq. 4's direction)."""
    a, b = (perf.base.k2, perf.base.c2) if perf is not None else (0.0, 1.0)
    norm = math.hypot(a, b) or 1.0
    return (a * l_e + b * b_e) / norm


def rebalance(workers: Sequence[WorkerView], cfg: AladdinConfig = DEFAULT, max_moves: int = 64) -> list[Move]:
    """Alg. 2: move not-yet-started requests from under-estimated (overloaded) workers to
    over-estimated ones while that lowers Σ|distance| of the workers' error points and the
    destination still passes Alg. 1's constraints. Greedy, best move first."""
    views = {w.worker_id: w for w in workers}
    err = {wid: list(worker_error(w, cfg)) for wid, w in views.items()}
    moves: list[Move] = []
    for _ in range(max_moves):
        dist = {wid: _distance(_perf(views[wid], cfg), *e) for wid, e in err.items()}
        best: tuple[float, str, str, RunningRequest] | None = None
        for src in sorted((wid for wid, d in dist.items() if d > 0), key=lambda k: -dist[k]):
            for r in views[src].requests:
                if r.started:
                    continue
                ln = planned_output(r, cfg)
                for dst in (wid for wid, d in dist.items() if d < 0):
                    d_src = _distance(_perf(views[src], cfg), err[src][0] - ln, err[src][1] - 1)
                    d_dst = _distance(_perf(views[dst], cfg), err[dst][0] + ln, err[dst][1] + 1)
                    gain = abs(dist[src]) + abs(dist[dst]) - abs(d_src) - abs(d_dst)
                    if gain > 1e-12 and (best is None or gain > best[0]):
                        rv = RequestView(request_id=r.request_id, input_tokens=r.input_tokens,
                                         predicted_tokens=r.predicted_tokens, adapter=r.adapter,
                                         adapter_rank=r.rank, max_tokens=r.max_tokens)
                        if not check(views[dst], rv, cfg):
                            best = (gain, src, dst, r)
        if best is None:
            break
        _, src, dst, r = best
        ln = planned_output(r, cfg)
        views[src] = replace(views[src], requests=tuple(x for x in views[src].requests if x is not r))
        views[dst] = replace(views[dst], requests=views[dst].requests + (r,))
        err[src][0] -= ln
        err[src][1] -= 1
        err[dst][0] += ln
        err[dst][1] += 1
        moves.append(Move(r.request_id, src, dst))
    return moves


class ErrorLedger:
    """Early finishes per worker (Alg. 2's over-estimates): a request that ends with fewer
    tokens than predicted counts (real − predicted, −1) in (l^e, b^e) until the time it
    was predicted to end (now + missing tokens × `step_ms`)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[tuple[float, float]]] = {}  # worker -> [(until, dl)]

    def finished(self, worker_id: str, predicted: int, real: int, now: float, step_ms: float) -> None:
        """Record a request that ended after `real` tokens (no-op unless it ended early)."""
        if predicted > real:
            until = now + (predicted - real) * step_ms / 1000.0
            self._entries.setdefault(worker_id, []).append((until, float(real - predicted)))

    def errors(self, worker_id: str, now: float) -> tuple[float, float]:
        """(l^e, b^e) of the early finishes still inside their predicted lifetime."""
        live = [e for e in self._entries.get(worker_id, ()) if e[0] > now]
        if live:
            self._entries[worker_id] = live
        else:
            self._entries.pop(worker_id, None)
        return sum(dl for _, dl in live), -float(len(live))

    def forget(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)
