"""Performance models the placement policies reason with, and their online fit.

Models (times in ms, KV in tokens when h = 1, j = 0):

* Aladdin §3 (`PerfModel`, `prefill_ms`, `decode_ms`, `kv_demand` below; Eq. 1-3 of
  `../shared/papers/aladdin-joint-placement-scaling.txt`):
  prefill ``t = k1·Σl_in + c1``; decode step ``t = (k2·l_avg + c2)·b + c3``;
  KV per sequence ``kv = h·(l_in + l_out) + j``.
* CaraServe §5, the LoRA share of a decode step, linear in
  ``b·max_rank`` for the padding BGMV kernel (Punica) or in ``Σ rank`` for the
  padding-free MBGMV kernel (S-LoRA): ``t_lora = α·x + β``.

Default LoRA coefficients (`LORA_DEFAULTS`) come from the two-instance example of
CaraServe §2.3 / Fig. 5 (24 requests of rank 32 vs 16 of rank 64 on Llama2-7B):
BGMV 34.8 ms at b·max_rank = 768 and 35.8 ms at 1024 → α = 1/256 ms, and the
base step ≈ 31.8 ms; MBGMV 35.3 ms at Σrank = 768 and 35.9 ms at 1024 → α =
0.6/256 ms and an extra 1.7 ms over BGMV's base (MBGMV's overhead on homogeneous
ranks). They are added to the base model's decode step as ``α·x (+ β)``. They are
taken from the paper's text, not measured here; a profile may override them with
``lora_bgmv_alpha`` etc.

`PerfFitter` refits every model online by least squares, starting from a profile:
the profile's own predictions at typical operating points weigh as `prior_weight`
observations, and exponential forgetting lets the fit follow a worker that drifts.
Each observation is first predicted with the current fit and the relative error
recorded, so `errors()` reports out-of-sample error.
"""
from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class PerfModel:
    """Coefficients of Aladdin's models; times in ms, KV in tokens when h=1, j=0."""

    k1: float
    c1: float
    k2: float
    c2: float
    c3: float
    h: float = 1.0
    j: float = 0.0


def prefill_ms(model: PerfModel, total_input_tokens: int) -> float:
    """Time of one prefill batch whose prompts hold `total_input_tokens` tokens (Eq. 2)."""
    if total_input_tokens <= 0:
        return 0.0
    return max(0.0, model.k1 * total_input_tokens + model.c1)


def decode_ms(model: PerfModel, l_avg: float, batch: int) -> float:
    """Time of one decode step of `batch` sequences of mean context length `l_avg` (Eq. 3)."""
    if batch <= 0:
        return 0.0
    return max(0.0, (model.k2 * l_avg + model.c2) * batch + model.c3)


def kv_demand(model: PerfModel, l_in: int, l_out: int, n: int = 1) -> int:
    """Peak KV demand of a request with `n` independent sequences (Eq. 1), rounded up."""
    return n * math.ceil(model.h * (l_in + l_out) + model.j)


BGMV, MBGMV = "bgmv", "mbgmv"
KERNELS = (BGMV, MBGMV)
LORA_DEFAULTS = {BGMV: (1.0 / 256.0, 0.0), MBGMV: (0.6 / 256.0, 1.7)}
"""kernel -> (α ms per unit of x, β ms): CaraServe §2.3 example (see module docstring)."""


@dataclass(frozen=True, slots=True)
class WorkerPerf:
    """A worker's models: Aladdin's base model plus the LoRA cost of each kernel."""

    base: PerfModel
    lora: Mapping[str, tuple[float, float]] = field(default_factory=lambda: dict(LORA_DEFAULTS))
    label: str = ""

    def prefill_ms(self, total_input_tokens: int) -> float:
        """One prefill batch of `total_input_tokens` (Eq. 2)."""
        return prefill_ms(self.base, total_input_tokens)

    def decode_ms(self, l_avg: float, batch: int) -> float:
        """One decode step of `batch` sequences of mean context `l_avg` (Eq. 3), without LoRA."""
        return decode_ms(self.base, l_avg, batch)

    def kv(self, tokens: float) -> float:
        """KV footprint of one sequence holding `tokens` tokens (Eq. 1)."""
        return self.base.h * tokens + self.base.j

    def lora_ms(self, kernel: str, batch: int, max_rank: int, sum_rank: int) -> float:
        """LoRA share of a decode step: BGMV on batch·max_rank, MBGMV on Σrank; 0 without LoRA."""
        if batch <= 0 or max_rank <= 0:
            return 0.0
        alpha, beta = self.lora.get(kernel, LORA_DEFAULTS[BGMV])
        x = batch * max_rank if kernel != MBGMV else sum_rank
        return max(0.0, alpha * x + beta)

    def l_d(self, batch: int, atgt_slo_ms: float) -> float:
        """Eq. 4: the most total context a batch of `batch` may hold and still decode within
        `atgt_slo_ms` per step: (T_dec − c3 − c2·b) / k2 (inf when k2 <= 0)."""
        m = self.base
        room = atgt_slo_ms - m.c3 - m.c2 * batch
        if m.k2 <= 0:
            return math.inf if room >= 0 else -1.0
        return room / m.k2


def perf_from_dict(raw: Mapping, label: str = "") -> WorkerPerf:
    """WorkerPerf from a profile dict (the JSON that `polyserve.core.profile_fit` writes)."""
    base = PerfModel(k1=float(raw["k1"]), c1=float(raw["c1"]), k2=float(raw["k2"]), c2=float(raw["c2"]),
                        c3=float(raw["c3"]), h=float(raw.get("h", 1.0)), j=float(raw.get("j", 0.0)))
    lora = dict(LORA_DEFAULTS)
    for k in KERNELS:
        if f"lora_{k}_alpha" in raw:
            lora[k] = (float(raw[f"lora_{k}_alpha"]), float(raw.get(f"lora_{k}_beta", 0.0)))
    return WorkerPerf(base=base, lora=lora, label=label or str(raw.get("name", "")))


def load_perf(path: str | Path) -> tuple[WorkerPerf, dict]:
    """(WorkerPerf, the whole profile dict) from a profile JSON file."""
    raw = json.loads(Path(path).read_text())
    return perf_from_dict(raw, str(raw.get("name", Path(path).stem))), raw


# ------------------------------------------------------------------ online least squares
@dataclass
class OnlineLinearFit:
    """y ≈ θ·x by least squares with forgetting factor `decay` per observation (1.0 =
    remember everything), starting from a prior θ0: before any data the fit holds
    `prior_weight` pseudo-observations of θ0's own predictions at the `anchors` (typical x
    rows), so it starts at θ0 and data take over as they accumulate."""

    prior: Sequence[float]
    anchors: Sequence[Sequence[float]]
    prior_weight: float = 5.0
    decay: float = 0.999
    window: int = 200  # observations in the error report
    n: int = 0

    # Plain Python lists, not numpy: the models have 2-3 coefficients, and numpy's per-call
    # overhead made one observation ~40 µs (an outer product, a scaled 3x3 solve), on every
    # `completed` event of an aladdin/caraserve deployment in the dispatcher's one loop (issue 15).
    def __post_init__(self) -> None:
        d = len(self.prior)
        self._theta = [float(c) for c in self.prior]
        self._a = [[0.0] * d for _ in range(d)]
        self._b = [0.0] * d
        w = self.prior_weight / max(1, len(self.anchors))
        for x in self.anchors:
            xv = [float(v) for v in x]
            self._add(xv, self.predict(xv), w)
        self._errs: deque[float] = deque(maxlen=self.window)
        self._sq: deque[tuple[float, float]] = deque(maxlen=self.window)

    def predict(self, x: Sequence[float]) -> float:
        """The current fit at `x`."""
        out = 0.0
        for t, v in zip(self._theta, x):
            out += t * v
        return out

    def _add(self, x: list[float], y: float, weight: float) -> None:
        """The normal equations gain `weight` × (x xᵀ, x y)."""
        for i, xi in enumerate(x):
            row, wx = self._a[i], weight * xi
            for j, xj in enumerate(x):
                row[j] += wx * xj
            self._b[i] += wx * y

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0) -> float:
        """Add one observation; returns the relative error the fit made on it before updating."""
        xv = [float(v) for v in x]
        pred = self.predict(xv)
        rel = abs(pred - y) / max(abs(y), 1e-9)
        self._errs.append(rel)
        self._sq.append((pred, float(y)))
        k = self.decay
        self._a = [[v * k for v in row] for row in self._a]
        self._b = [v * k for v in self._b]
        self._add(xv, float(y), weight)
        self.n += 1
        self._solve()
        return rel

    def _solve(self) -> None:
        """θ from the normal equations: column scaling keeps them well conditioned (x spans 1 ..
        1e6), then a Cholesky solve (they are symmetric positive definite: the prior's anchors
        span every coefficient, and decay only shrinks them); not positive definite in floating
        point: keep the last coefficients, as numpy's solve did on a singular system."""
        a, b, d = self._a, self._b, len(self._b)
        s = [1.0 / math.sqrt(max(a[i][i], 1e-300)) for i in range(d)]
        low = [[0.0] * d for _ in range(d)]  # L of M = L Lᵀ, M = diag(s) A diag(s)
        z = [0.0] * d
        for i in range(d):
            ai, si, li = a[i], s[i], low[i]
            for j in range(i + 1):
                lj, v = low[j], ai[j] * si * s[j]
                for k in range(j):
                    v -= li[k] * lj[k]
                if i == j:
                    if v <= 0.0:
                        return
                    li[i] = math.sqrt(v)
                else:
                    li[j] = v / lj[j]
            v = b[i] * si  # forward: L y = diag(s) b
            for k in range(i):
                v -= li[k] * z[k]
            z[i] = v / li[i]
        for i in range(d - 1, -1, -1):  # back: Lᵀ z = y
            v = z[i]
            for k in range(i + 1, d):
                v -= low[k][i] * z[k]
            z[i] = v / low[i][i]
        self._theta = [s[i] * z[i] for i in range(d)]

    @property
    def coef(self) -> list[float]:
        return [float(c) for c in self._theta]

    def error(self) -> dict:
        """Out-of-sample error over the last `window` observations: mean and P90 |relative
        error| and R² (None before any observation)."""
        if not self._errs:
            return {"n": self.n, "mean_rel_err": None, "p90_rel_err": None, "r2": None}
        errs = np.asarray(self._errs)
        pred, y = np.asarray(self._sq).T
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else None
        return {"n": self.n, "mean_rel_err": float(errs.mean()), "p90_rel_err": float(np.percentile(errs, 90)),
                "r2": r2}


class PerfFitter:
    """Online fits of the prefill, decode, KV and LoRA (BGMV, MBGMV) models of one worker
    (or one worker type), starting from `start` (a profile)."""

    def __init__(self, start: WorkerPerf, *, prior_weight: float = 5.0, decay: float = 0.999):
        m = start.base
        kw = {"prior_weight": prior_weight, "decay": decay}
        self.start = start
        # Anchors: typical operating points (prompt batches, batch x context, contexts, LoRA loads).
        self.prefill = OnlineLinearFit([m.k1, m.c1], [[t, 1.0] for t in (64, 512, 2048, 8192)], **kw)
        self.decode = OnlineLinearFit([m.k2, m.c2, m.c3], [[ctx * b, b, 1.0] for b in (1, 8, 32)
                                                           for ctx in (256, 1024, 2048)], **kw)
        self.kv = OnlineLinearFit([m.h, m.j], [[t, 1.0] for t in (16, 256, 4096)], **kw)
        self.lora = {k: OnlineLinearFit([a, b], [[x, 1.0] for x in (64, 512, 2048, 8192)], **kw)
                     for k, (a, b) in start.lora.items()}

    # -- observations ------------------------------------------------------------
    def observe_prefill(self, total_input_tokens: int, ms: float) -> float:
        """One prefill iteration of Σl_in tokens that took `ms`."""
        return self.prefill.observe([total_input_tokens, 1.0], ms)

    def observe_decode(self, l_avg: float, batch: int, ms: float, *, kernel: str = BGMV,
                       max_rank: int = 0, sum_rank: int = 0) -> float:
        """One decode step; its LoRA share (current LoRA fit) is taken off first."""
        base_ms = ms - self.current().lora_ms(kernel, batch, max_rank, sum_rank)
        return self.decode.observe([l_avg * batch, batch, 1.0], base_ms)

    def observe_kv(self, tokens: int, kv_used: float) -> float:
        """KV use (tokens or blocks × block size) measured for `tokens` tokens of context."""
        return self.kv.observe([tokens, 1.0], kv_used)

    def observe_lora(self, kernel: str, batch: int, max_rank: int, sum_rank: int, extra_ms: float) -> float:
        """A decode step's time beyond the base model's (with minus without adapters)."""
        x = batch * max_rank if kernel != MBGMV else sum_rank
        return self.lora[kernel].observe([x, 1.0], extra_ms)

    def observe_completed(self, *, input_tokens: int, output_tokens: int, ttft_ms: float, queue_ms: float,
                          atgt_ms: float, mean_batch: float | None = None,
                          mean_context: float | None = None) -> None:
        """A `completed` event: ttft − queue is the prefill of (at least) its own prompt,
        weighted ½ because batch-mates may share that prefill; ATGT is the mean decode step
        over its life, used when the caller tracked the worker's mean batch and context."""
        if ttft_ms > queue_ms >= 0 and input_tokens > 0:
            self.prefill.observe([input_tokens, 1.0], ttft_ms - queue_ms, weight=0.5)
        if output_tokens > 1 and atgt_ms > 0 and mean_batch and mean_context:
            self.decode.observe([mean_context * mean_batch, mean_batch, 1.0], atgt_ms, weight=0.5)

    # -- results -------------------------------------------------------------------
    def current(self) -> WorkerPerf:
        """The models with the coefficients fitted so far."""
        k1, c1 = self.prefill.coef
        k2, c2, c3 = self.decode.coef
        h, j = self.kv.coef
        base = replace(self.start.base, k1=k1, c1=c1, k2=k2, c2=c2, c3=c3, h=h, j=j)
        lora = {k: tuple(f.coef) for k, f in self.lora.items()}
        return WorkerPerf(base=base, lora=lora, label=f"{self.start.label}+online")

    def errors(self) -> dict[str, dict]:
        """Current out-of-sample error of each model (see `OnlineLinearFit.error`)."""
        out = {"prefill": self.prefill.error(), "decode": self.decode.error(), "kv": self.kv.error()}
        out.update({f"lora_{k}": f.error() for k, f in self.lora.items()})
        return out
