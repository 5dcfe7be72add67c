"""Least-squares fits of the engine performance models, and the profile file they go into.

Models (times in ms, KV in tokens):

* Aladdin §3 prefill (Eq. 2):  t = k1·Σl_in + c1
  and, as a diagnostic for engines that prefill one request at a time (the hf
  engine does), t = k1·Σl_in + e·n_prompts + c1 (`prefill_per_request`).
* Aladdin §3 decode (Eq. 3):   t = (k2·l_avg + c2)·b + c3
* Aladdin §3 KV (Eq. 1):       kv = h·(l_in + l_out) + j per sequence; over a batch
                               Σkv = h·Σ(l_in + l_out) + j·b. In bytes: h_bytes =
                               2·layers·kv_heads·head_dim·dtype_bytes (from the config).
* CaraServe §5 BGMV:           t = a·(b·max rank) + c
* CaraServe §5 MBGMV:          t = a·Σrank + c
  fitted on the whole decode step, as in the paper, and on the LoRA share alone
  (`*_share`): t − t_base = α·x + β, where t_base is the same batch without adapters
  measured in the same pass. The share is what the dispatcher adds to Aladdin's decode
  step (`dispatcher.perf_models`: profile keys `lora_bgmv_alpha/beta`,
  `lora_mbgmv_alpha/beta`). On a CPU the base cost grows with b, so the whole-step
  forms mostly see the batch size; the share forms separate the two.

Every fit carries R² and the maximum relative error over its rows.

The profile JSON is a superset of the sim engine's format (`worker.engines.sim.load_profile`
reads `k1 c1 k2 c2 c3 h j kv_capacity_tokens median_output_tokens output_log_sigma name`),
so the sim can replay any measured profile; `read_profile` gives the dispatcher and
planner the Aladdin `PerfModel`, the LoRA models and the fit quality.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from polyserve.core import profiles
from polyserve.core.perf import PerfModel
from polyserve.core.profile_fit import AZURE_CONV_LOG_SIGMA, AZURE_CONV_MEDIAN, Fit, lstsq

SCHEMA = "polyserve.profile/1"
PROFILES_DIR = profiles.profiles_dir()

FORMS = {
    "prefill": ("t_ms = k1*sum_l_in + c1", ("k1", "c1")),
    "prefill_per_request": ("t_ms = k1*sum_l_in + e*n_prompts + c1", ("k1", "e", "c1")),
    "decode": ("t_ms = (k2*l_avg + c2)*b + c3", ("k2", "c2", "c3")),
    "kv": ("kv_tokens = h*sum(l_in + l_out) + j*b", ("h", "j")),
    "lora_bgmv": ("t_ms = a*(b*max_rank) + c", ("a", "c")),
    "lora_mbgmv": ("t_ms = a*sum_rank + c", ("a", "c")),
    "lora_bgmv_share": ("t_ms - t_base_ms = a*(b*max_rank) + c (max_rel_err on t_ms)", ("a", "c")),
    "lora_mbgmv_share": ("t_ms - t_base_ms = a*sum_rank + c (max_rel_err on t_ms)", ("a", "c")),
}


def _fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> Fit | None:
    """lstsq, or None when there are fewer rows than coefficients."""
    x = np.asarray(rows, dtype=float)
    if len(y) == 0 or len(y) < x.shape[1]:
        return None
    return lstsq(x, np.asarray(y, dtype=float))


def fit_prefill(points: Sequence[dict]) -> Fit | None:
    """Aladdin Eq. 2 over points with `l_in_total` and `ms`."""
    return _fit([[p["l_in_total"], 1.0] for p in points], [p["ms"] for p in points])


def fit_prefill_per_request(points: Sequence[dict]) -> Fit | None:
    """Eq. 2 plus a per-prompt term, for engines that prefill each request on its own (the hf engine)."""
    return _fit([[p["l_in_total"], p["n_prompts"], 1.0] for p in points], [p["ms"] for p in points])


def fit_decode(points: Sequence[dict]) -> Fit | None:
    """Aladdin Eq. 3 over points with `b`, `l_avg` and `ms`."""
    return _fit([[p["l_avg"] * p["b"], p["b"], 1.0] for p in points], [p["ms"] for p in points])


def fit_kv(points: Sequence[dict]) -> Fit | None:
    """Aladdin Eq. 1 summed over a batch: kv_used = h·tokens + j·seqs."""
    return _fit([[p["tokens"], p["seqs"]] for p in points], [p["kv_used"] for p in points])


def fit_lora(points: Sequence[dict], kernel: str, share: bool = False) -> Fit | None:
    """CaraServe §5: BGMV on b·max_rank or MBGMV on Σrank; base-only rows skipped.

    `share`: fit the step time minus `base_ms` (the same batch without adapters) instead; its
    max relative error is then taken against the whole step (a share near 0 has no useful relative error)."""
    pts = [p for p in points if p["max_rank"] > 0 and (not share or p.get("base_ms") is not None)]
    key = {"bgmv": lambda p: p["b"] * p["max_rank"], "mbgmv": lambda p: p["sum_rank"]}[kernel]
    rows = [[key(p), 1.0] for p in pts]
    got = _fit(rows, [p["ms"] - (p["base_ms"] if share else 0.0) for p in pts])
    if got is None or not share:
        return got
    pred = np.asarray(rows) @ np.asarray(got.coef) + np.array([p["base_ms"] for p in pts])
    total = np.array([p["ms"] for p in pts])
    return replace(got, max_rel_err=float(np.max(np.abs(pred - total) / total)))


def with_base(points: Sequence[dict]) -> list[dict]:
    """LoRA points with `base_ms`: the "base" mix (no adapter) of the same batch size, same pass."""
    base = {p["b"]: p["ms"] for p in points if p["max_rank"] == 0}
    return [{**p, "base_ms": base.get(p["b"])} for p in points]


def fit_all(meas: dict) -> dict[str, Fit | None]:
    """Every model fitted from a Measurements dict (see grid.Measurements.as_dict)."""
    lora = with_base(meas.get("lora", []))
    pre = meas.get("prefill", [])
    return {"prefill": fit_prefill(pre), "prefill_per_request": fit_prefill_per_request(pre),
            "decode": fit_decode(meas.get("decode", [])), "kv": fit_kv(meas.get("kv", [])),
            "lora_bgmv": fit_lora(lora, "bgmv"), "lora_mbgmv": fit_lora(lora, "mbgmv"),
            "lora_bgmv_share": fit_lora(lora, "bgmv", True), "lora_mbgmv_share": fit_lora(lora, "mbgmv", True)}


def fit_entry(name: str, fit: Fit) -> dict:
    """A fit as it is stored in a profile's `fit` section."""
    form, names = FORMS[name]
    return {"form": form, "coef": dict(zip(names, fit.coef)), "r2": round(fit.r2, 6),
            "max_rel_err": round(fit.max_rel_err, 6), "rows": fit.rows}


def scale_times(meas: dict, factor: float) -> dict:
    """A copy of the measurements with every time multiplied by `factor` (undoing a sim time_scale)."""
    out = json.loads(json.dumps(meas))
    for section in ("prefill", "decode", "lora"):
        for p in out.get(section, []):
            p["ms"] *= factor
            p["ms_all"] = [v * factor for v in p.get("ms_all", [])]
    return out


def build_profile(meas: dict, *, name: str, source: dict, kv_capacity_tokens: int, kv_bytes_per_token: int,
                  median_output_tokens: int = AZURE_CONV_MEDIAN, output_log_sigma: float = AZURE_CONV_LOG_SIGMA,
                  output_length_source: str = "Azure LLM 2023 conversation trace: median 129, log-sigma 0.86",
                  note: str = "") -> dict:
    """The profile dict: sim-readable Aladdin coefficients on top, every fit with its quality, the raw points."""
    fits = fit_all(meas)
    if fits["prefill"] is None or fits["decode"] is None:
        raise ValueError("the grid gave too few prefill/decode points to fit Aladdin's models")
    k1, c1 = fits["prefill"].coef
    k2, c2, c3 = fits["decode"].coef
    kv = fits["kv"]
    h, j = (kv.coef if kv is not None else (1.0, 0.0))
    lora, dispatcher_keys = {}, {}
    for key in ("lora_bgmv", "lora_mbgmv", "lora_bgmv_share", "lora_mbgmv_share"):
        if fits[key] is not None:
            lora[key.removeprefix("lora_")] = {"form": FORMS[key][0], **dict(zip(FORMS[key][1], fits[key].coef))}
            if key.endswith("_share"):  # what dispatcher.perf_models adds to Aladdin's decode step
                kernel = key.split("_")[1]
                dispatcher_keys[f"lora_{kernel}_alpha"], dispatcher_keys[f"lora_{kernel}_beta"] = fits[key].coef
    base_runs = [p for p in meas.get("lora", []) if p["max_rank"] == 0]
    if base_runs:  # base-only batches once adapters are loaded, against the decode model of the plain model
        lora["base_with_adapters_loaded"] = [
            {"b": p["b"], "l_avg": p["l_avg"], "ms": round(p["ms"], 4),
             "decode_model_ms": round((k2 * p["l_avg"] + c2) * p["b"] + c3, 4)} for p in base_runs]
    return {
        "schema": SCHEMA,
        "name": name,
        "measured": True,
        "simulated": False,
        "note": note or "measured wall-clock times of a real engine; the sim engine may replay it (then labelled "
                        "simulated)",
        "k1": k1, "c1": c1, "k2": k2, "c2": c2, "c3": c3, "h": round(h, 9) + 0.0, "j": round(j, 9) + 0.0,
        "units": {"k1": "ms per prompt token in the prefill batch", "c1": "ms",
                  "k2": "ms per context token per sequence", "c2": "ms per sequence", "c3": "ms",
                  "h": "KV tokens per token", "j": "KV tokens per sequence",
                  "lora.a": "ms per unit of b*max_rank (bgmv) or of sum of ranks (mbgmv)", "lora.c": "ms",
                  "lora_*_alpha": "= lora.*_share.a", "lora_*_beta": "= lora.*_share.c"},
        "kv_capacity_tokens": int(kv_capacity_tokens),
        "kv_bytes_per_token": int(kv_bytes_per_token),
        "kv_capacity_bytes": int(kv_capacity_tokens) * int(kv_bytes_per_token),
        "kv_source": ("h, j fitted to the engine's reported KV reservation (load().kv_used, tokens); bytes per "
                      "token = 2 x layers x kv_heads x head_dim x dtype bytes from the model config"),
        "median_output_tokens": int(median_output_tokens), "output_log_sigma": round(float(output_log_sigma), 4),
        "output_length_source": output_length_source,
        "lora": lora,
        **dispatcher_keys,
        "fit": {k: fit_entry(k, f) for k, f in fits.items() if f is not None},
        "source": source,
        "points": meas,
    }


# ---------------------------------------------------------------------- reading profiles
@dataclass(frozen=True)
class LoraModel:
    """CaraServe §5 model of a decode step of LoRA requests: the whole step, or its LoRA share."""

    kernel: str  # "bgmv" | "mbgmv"
    a: float
    c: float
    share: bool = False  # True: the time beyond the same batch without adapters

    def ms(self, ranks: Sequence[int]) -> float:
        """Predicted time (ms) for a batch whose requests have these adapter ranks (0 = base model)."""
        if not ranks or max(ranks) <= 0:
            return 0.0
        x = len(ranks) * max(ranks) if self.kernel == "bgmv" else sum(ranks)
        return max(0.0, self.a * x + self.c)


@dataclass(frozen=True)
class Profile:
    """A profile file as the dispatcher, planner and simulator use it."""

    name: str
    perf: PerfModel
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    measured: bool
    lora: dict[str, LoraModel] = field(default_factory=dict)
    fit: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)
    path: str = ""


def read_profile(path: str | Path) -> Profile:
    """Read a profile JSON (measured by `polyserve profile run` or fitted from Splitwise)."""
    raw = json.loads(Path(path).read_text())
    perf = PerfModel(k1=raw["k1"], c1=raw["c1"], k2=raw["k2"], c2=raw["c2"], c3=raw["c3"],
                     h=raw.get("h", 1.0), j=raw.get("j", 0.0))
    lora = {}
    for key, m in (raw.get("lora") or {}).items():
        if not isinstance(m, dict) or "a" not in m:
            continue
        lora[key] = LoraModel(kernel=key.split("_")[0], a=float(m["a"]), c=float(m["c"]), share=key.endswith("_share"))
    return Profile(name=str(raw.get("name", Path(path).stem)), perf=perf,
                   kv_capacity_tokens=int(raw["kv_capacity_tokens"]),
                   kv_bytes_per_token=int(raw.get("kv_bytes_per_token", 0)),
                   measured=bool(raw.get("measured", False)), lora=lora, fit=raw.get("fit", {}),
                   source=raw.get("source", {}), path=str(path))


def is_engine_profile(path: str | Path) -> bool:
    """Whether a JSON file is an LLM engine profile (Aladdin coefficients), not e.g. an encoder profile."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and all(k in raw for k in ("k1", "c1", "k2", "c2", "c3", "kv_capacity_tokens"))


def list_profiles(directory: str | Path = PROFILES_DIR) -> list[Profile]:
    """Every LLM engine profile in `directory` (the shipped ones by default), by name; other JSON is skipped."""
    paths = [p for p in Path(directory).glob("*.json") if is_engine_profile(p)]
    return sorted((read_profile(p) for p in paths), key=lambda p: p.name)


def summary_lines(fit_section: dict) -> list[str]:
    """One line per fit: form, coefficients, R², max relative error, rows."""
    lines = []
    for key, q in fit_section.items():
        coef = " ".join(f"{n}={v:.6g}" for n, v in (q.get("coef") or {}).items())
        lines.append(f"{key:<19} R2={q['r2']:.4f}  max rel err={q['max_rel_err']:.3f}  rows={q['rows']:<3}  "
                     f"{q['form']}  {coef}".rstrip())
    return lines
