"""A GPU's latency and power against its SM clock: the model behind the simulated GPU,
the MIAD controller's weights and the simulator. Every figure it produces is modelled,
not measured; callers label it so.

Latency (µ-Serve §2.2, Fig. 2: latency falls steeply at low clocks and flattens toward
a horizontal asymptote at high ones). A unit of work that takes `compute_ms` of
clock-bound (compute) time and `memory_ms` of memory-bound time at the maximum
clock f_max takes, at clock f (x = f/f_max):
    T(x) = compute_ms / x + memory_ms · max(1, knee / x)
The compute part scales with 1/f. The memory-bound part is flat until the clock
falls so low that the arithmetic it overlaps with becomes the bottleneck (the
roofline "knee", as a fraction of f_max); below it, it scales like compute.
`elasticity(x)` = −d ln T / d ln f is the share of the latency that moves with the
clock at x; it is the MIAD weight of Alg. 3 (line 15): one STEP down costs about
elasticity · T · STEP / f. µ-Serve's sensitivity score (ΔLatency/ΔFrequency when
halving the default clock, normalised) is `sensitivity_score` = T(0.5)/T(1) − 1.

Calibration from `../shared/datasets/profiles/splitwise_llama2_70b_bloom_176b_a100_h100.csv`
(`calibrate_splitwise` recomputes every figure):
* power-capped H100 ("h100-80gb-pcap") vs uncapped ("h100-80gb"), same model, TP,
  prompt, batch and output size (76 pairs): prompt_time ×1.30 in every pair,
  token_time ×1.00 in every pair. Splitwise-sim's SKU configs give the capped
  DGX-H100 7,140 W against 10,200 W: a cap at 70% of TDP. Prefill is compute
  bound (PREFILL_COMPUTE_SHARE = 1), so under that cap the clock ran at
  f_max/1.30 = 0.77·f_max; decode lost nothing there, so its memory-bound part's
  knee lies below 0.77 (DECODE_KNEE = 0.3 is our assumption from a roofline
  estimate — H100 batch-32 decode does ~b/295 of its memory time in arithmetic —
  not a measurement).
* A100 rows with power: peak_power (normalised to TDP) has median 1.0 over
  prefill-heavy runs (PEAK = 1.0); the median average_power of decode-dominated
  runs (token_size >= prompt_size/4) is 0.74 (TP 2), 0.60 (TP 4) and 0.54 (TP 8)
  of TDP, i.e. utilisations 0.71, 0.55 and 0.49 in the power model below.

Power (µ-Serve Fig. 2 right: close to linear in the clock): with utilisation u in
[0, 1] (the share of time the SMs are busy) and x = f/f_max,
    P(u, x) = TDP · (IDLE + (PEAK − IDLE) · u · x^GAMMA)
IDLE = 0.10 of TDP is an assumption (the CSV has no idle rows). GAMMA follows from
the cap above: at full utilisation P(1, 1/1.30) = 0.70·TDP gives
GAMMA = ln((0.70 − IDLE)/(PEAK − IDLE)) / ln(1/1.30) = 1.545. Cross-check against
µ-Serve §2.2's one quoted pair (V100, gpt2-large, 214 W at 1,300 MHz → 120 W at
800 MHz, TDP 300 W): u from 214 W is 0.68 and the model gives 117 W at 800 MHz.
"""
from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

IDLE = 0.10  # idle power / TDP (assumption)
PEAK = 1.0  # power at full utilisation and maximum clock / TDP (Splitwise A100 peak_power median)
CAP_FRACTION = 0.70  # Splitwise power cap: 7,140 W of 10,200 W per DGX-H100
CAP_SLOWDOWN = 1.30  # prompt_time capped / uncapped, every Splitwise pair
GAMMA = math.log((CAP_FRACTION - IDLE) / (PEAK - IDLE)) / math.log(1.0 / CAP_SLOWDOWN)
PREFILL_COMPUTE_SHARE = 1.0
DECODE_KNEE = 0.3  # assumption (roofline estimate), below the 0.77 the data covers


@dataclass(frozen=True)
class GpuClockSpec:
    """Clock range and TDP of a GPU model (public specifications)."""

    name: str
    tdp_w: float
    min_mhz: int
    max_mhz: int

    def frac(self, mhz: float) -> float:
        return min(1.0, max(self.min_mhz, mhz) / self.max_mhz)


A100_80GB = GpuClockSpec("A100-SXM4-80GB", 400.0, 210, 1410)
H100_80GB = GpuClockSpec("H100-SXM5-80GB", 700.0, 210, 1980)
V100_16GB = GpuClockSpec("V100-SXM2-16GB", 300.0, 135, 1530)


def power_w(spec: GpuClockSpec, util: float, mhz: float, idle: float = IDLE, peak: float = PEAK,
            gamma: float = GAMMA) -> float:
    """Modelled board power (module docstring)."""
    u = min(1.0, max(0.0, util))
    return spec.tdp_w * (idle + (peak - idle) * u * spec.frac(mhz) ** gamma)


def util_from_power(norm_power: float, idle: float = IDLE, peak: float = PEAK) -> float:
    """The utilisation that draws `norm_power` (fraction of TDP) at the maximum clock."""
    return min(1.0, max(0.0, (norm_power - idle) / (peak - idle)))


def clock_under_cap(cap_fraction: float, util: float = 1.0, idle: float = IDLE, peak: float = PEAK,
                    gamma: float = GAMMA) -> float:
    """x = f/f_max a power cap (fraction of TDP) allows at utilisation `util` (1.0 if uncapped)."""
    busy = (peak - idle) * min(1.0, max(0.0, util))
    if busy <= 0 or idle + busy <= cap_fraction:
        return 1.0
    return max(0.0, (cap_fraction - idle) / busy) ** (1.0 / gamma)


def fit_gamma(p_hi_w: float, p_lo_w: float, x_lo: float, idle_w: float) -> float:
    """GAMMA from two powers at the same load: p_hi at x = 1 and p_lo at x = x_lo."""
    return math.log((p_lo_w - idle_w) / (p_hi_w - idle_w)) / math.log(x_lo)


@dataclass(frozen=True)
class WorkLatency:
    """Latency of a unit of work against the clock (module docstring)."""

    compute_ms: float
    memory_ms: float = 0.0
    knee: float = DECODE_KNEE

    def at(self, x: float) -> float:
        x = max(1e-6, x)
        return self.compute_ms / x + self.memory_ms * max(1.0, self.knee / x)

    def elasticity(self, x: float) -> float:
        """−d ln T / d ln f at x: the share of the latency that scales with 1/f."""
        x = max(1e-6, x)
        scaling = self.compute_ms / x + (self.memory_ms * self.knee / x if x < self.knee else 0.0)
        total = self.at(x)
        return scaling / total if total > 0 else 0.0

    def sensitivity_score(self) -> float:
        """µ-Serve §3.1's score: normalised latency increase when halving the default clock."""
        base = self.at(1.0)
        return self.at(0.5) / base - 1.0 if base > 0 else 0.0


def llm_request(prefill_ms: float, decode_ms: float, knee: float = DECODE_KNEE) -> WorkLatency:
    """An LLM request's latency: prefill compute bound, decode memory bound (calibration above)."""
    return WorkLatency(compute_ms=PREFILL_COMPUTE_SHARE * prefill_ms,
                       memory_ms=(1 - PREFILL_COMPUTE_SHARE) * prefill_ms + decode_ms, knee=knee)


def calibrate_splitwise(path: str | Path) -> dict:
    """Recompute the figures of the module docstring from the Splitwise CSV."""
    groups: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    a100_peak, a100_avg_decode = [], defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (r["model"], r["tensor_parallel"], r["prompt_size"], r["batch_size"], r["token_size"])
            groups[key][r["hardware"]].append(r)
            if r["hardware"] == "a100-80gb" and float(r["average_power"]) > 0:
                a100_peak.append(float(r["peak_power"]))
                if int(r["token_size"]) >= int(r["prompt_size"]) // 4:  # decode-dominated runs
                    a100_avg_decode[int(r["tensor_parallel"])].append(float(r["average_power"]))
    prompt_ratio, token_ratio = [], []
    for by_hw in groups.values():
        if "h100-80gb" in by_hw and "h100-80gb-pcap" in by_hw:
            mean = lambda rows, k: statistics.fmean(float(x[k]) for x in rows)
            prompt_ratio.append(mean(by_hw["h100-80gb-pcap"], "prompt_time") / mean(by_hw["h100-80gb"], "prompt_time"))
            token_ratio.append(mean(by_hw["h100-80gb-pcap"], "token_time") / mean(by_hw["h100-80gb"], "token_time"))
    if not prompt_ratio:
        raise ValueError(f"{path}: no capped/uncapped H100 pairs")
    slowdown = statistics.median(prompt_ratio)
    return {
        "pairs": len(prompt_ratio),
        "prompt_slowdown_median": slowdown,
        "prompt_slowdown_range": (min(prompt_ratio), max(prompt_ratio)),
        "token_slowdown_median": statistics.median(token_ratio),
        "token_slowdown_range": (min(token_ratio), max(token_ratio)),
        "capped_clock_fraction": 1.0 / slowdown,
        "gamma": math.log((CAP_FRACTION - IDLE) / (PEAK - IDLE)) / math.log(1.0 / slowdown),
        "a100_peak_power_median": statistics.median(a100_peak) if a100_peak else None,
        "a100_decode_avg_power_median_by_tp": {tp: statistics.median(v) for tp, v in sorted(a100_avg_decode.items())},
    }
