"""`polyserve simulate` (also `python -m polyserve.simulator.cli`): trace-driven cluster
simulation. Runs every combination of --policy × --order × --kernel × --rate-scale on
each --trace, writes results.json, results.txt and PNG plots to --out. SIMULATED.

Examples::

    # policies at three loads, fixed 4 workers of the default profile
    python -m polyserve.simulator.cli --policy aladdin,least_outstanding,power_of_two \\
        --rate-scale 0.5,1,2 --workers 4 --out sim-out/policies
    # the fewest workers that keep 99% of requests within both SLOs
    python -m polyserve.simulator.cli --policy least_outstanding,power_of_two,aladdin \\
        --rate-scale 1,2,4 --search-gpus --target 0.99 --out sim-out/gpus
    # µ-Serve queue orders on one worker
    python -m polyserve.simulator.cli --order fcfs,ssjf,sjf_oracle --workers 2 --out sim-out/sjf
    # CaraServe: LoRA adapters of ranks 8-64 with Azure Functions popularity
    python -m polyserve.simulator.cli --adapters 1000 --kernel bgmv,mbgmv \\
        --policy caraserve,least_loaded,first_fit,random --workers 4 --out sim-out/lora
    # the planner's autoscalers (one run each), 60 s cold starts, up to 16 workers
    python -m polyserve.simulator.cli --autoscaler pertoken,request,target_tracking,muserve \\
        --cold-start-s 60 --max-workers 16 --rate-scale 0.5,1,1.5 --out sim-out/autoscale
    # a synthetic load step (1 -> 3 req/s at 300 s, lengths from the conv trace): first scale-out after it
    python -m polyserve.simulator.cli --trace synthetic:step:1:3:300:1200 --autoscaler pertoken,request \
        --threshold-factor 0.6,1 --cold-start-s 60 --out sim-out/step
    # MIAD vs the maximum clock on 4 workers, at three loads and two SLO scales
    python -m polyserve.simulator.cli --workers 4 --clock max,miad --rate-scale 0.5,1,1.5 \\
        --slo-scale 1,2 --out sim-out/miad
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from polyserve.core import profiles
from polyserve.core.perf import KERNELS, load_perf
from polyserve.core.profiles import profile_path
from polyserve.core.queue_order import ORDER_KEYS, OVERTAKE_BOUND, TAIL_GUARD
from polyserve.simulator import report
from polyserve.simulator.cluster import SIM_POLICIES, SimConfig, simulate
from polyserve.simulator.engine import WorkerConfig
from polyserve.simulator.limits import context_limit, profiled_prompt_tokens
from polyserve.simulator.power import gpu_from_profile, gpu_spec
from polyserve.simulator.predictor import ESTIMATES, MODES, LengthPredictor, resolve_confusion
from polyserve.simulator.trace import SYNTHETIC_HELP, assign_adapters, datasets_dir, load_trace, make_adapters, window

DEFAULT_PROFILE = profile_path(profiles.DEFAULT_SIM)


def _csv(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="polyserve simulate", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    traces = datasets_dir() / "traces"
    _add_workload_args(ap, traces)
    _add_mode_args(ap)
    _add_autoscaler_args(ap)
    _add_clock_args(ap)
    _add_cluster_args(ap)
    _add_worker_args(ap, traces)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="simulate-out", help="output folder")
    ap.add_argument("--no-plots", action="store_true")
    return ap


def _add_workload_args(ap: argparse.ArgumentParser, traces: Path) -> None:
    """Traces, the profile and the grid's axes (policy x order x kernel x rate)."""
    ap.add_argument("--trace", action="append", default=None,
                    help="CSV trace (Azure LLM columns TIMESTAMP, ContextTokens, GeneratedTokens, or BurstGPT-style "
                         "Timestamp, Request tokens, Response tokens; see simulator/trace.py), a Mooncake .jsonl, "
                         f"servegen:/muserve: specs or {SYNTHETIC_HELP}, repeatable "
                         f"(default {traces / 'azure_llm_2023_conv.csv'})")
    ap.add_argument("--synthetic-lengths", default=str(traces / "azure_llm_2023_conv.csv"),
                    help="Azure CSV whose (input, output) length pairs synthetic traces draw from")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="engine profile JSON (core/profiles)")
    ap.add_argument("--policy", default="least_outstanding", help=f"comma list of: {', '.join(SIM_POLICIES)}")
    ap.add_argument("--order", default="fcfs", help=f"queue orders, comma list of: {', '.join(ORDER_KEYS)}")
    ap.add_argument("--kernel", default="bgmv", help=f"LoRA kernels, comma list of: {', '.join(KERNELS)}")
    ap.add_argument("--rate-scale", default="1", help="comma list of rate multipliers (2 = twice the trace's rate)")
    ap.add_argument("--slice", default="", help="START:END seconds of the original trace (before rescaling)")
    ap.add_argument("--duration", type=float, default=None, help="simulate the first S seconds (after rescaling)")


def _add_mode_args(ap: argparse.ArgumentParser) -> None:
    """How the worker count is decided (exclusive): fixed, Aladdin's signal, a search, the planner's scalers."""
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--autoscale", action="store_true",
                      help="Aladdin's scale-out signal opens workers, idle ones are released (down to --workers)")
    mode.add_argument("--search-gpus", action="store_true",
                      help="per run, the fewest fixed workers with SLO attainment (both) >= --target")
    mode.add_argument("--autoscaler", default="",
                      help="planner autoscalers, comma list of pertoken, request, target_tracking, muserve (one "
                           "run each); --workers is the minimum and the start")


def _add_autoscaler_args(ap: argparse.ArgumentParser) -> None:
    sc = ap.add_argument_group("autoscalers (--autoscaler; defaults: simulator.autoscale)")
    sc.add_argument("--initial-workers", type=int, default=0,
                    help="workers at the start (0 = --workers, which stays the minimum)")
    sc.add_argument("--planner-period-s", type=float, default=15.0, help="seconds between decisions")
    sc.add_argument("--scaler-window-s", type=float, default=30.0, help="completed requests of this window")
    sc.add_argument("--stabilization-s", type=float, default=30.0, help="HPA scale-down stabilisation (planner)")
    sc.add_argument("--max-step", type=int, default=0, help="HPA: most workers per decision (0 = no limit)")
    sc.add_argument("--threshold-factor", default="0.6",
                    help="HPA thresholds = this x the mean SLO budget in the scaler's metric (auto thresholds); "
                         "a comma list runs each HPA scaler once per factor")
    sc.add_argument("--pertoken-threshold-ms", type=float, default=0.0, help="0 = auto")
    sc.add_argument("--request-threshold-ms", type=float, default=0.0, help="0 = auto")
    sc.add_argument("--tracking-slo-ms", type=float, default=0.0, help="0 = auto (mean per-token SLO budget)")
    sc.add_argument("--tracking-metric", choices=("pertoken", "request"), default="pertoken")
    sc.add_argument("--tracking-up-at", type=float, default=0.95, help="Arlo: add a worker at P98 >= this x SLO")
    sc.add_argument("--tracking-down-below", type=float, default=0.5, help="Arlo: remove below this x SLO ...")
    sc.add_argument("--tracking-hold-s", type=float, default=60.0, help="... held this long")
    sc.add_argument("--muserve-idle-release-s", type=float, default=60.0,
                    help="µ-Serve defines no scale-in: release one worker after all were idle this long (0 = never)")
    sc.add_argument("--live-pertoken", default="off",
                    help="per-token HPA also sees requests in flight (per-token latency so far; the thesis "
                         "streams it per token): off | on | off,on (one run each)")
    sc.add_argument("--no-reset-window", action="store_true",
                    help="keep samples from before a scaling action (the planner drops them)")
    sc.add_argument("--rise-factor", type=float, default=1.25,
                    help="load rise: first planner period with rate >= this x the first minute's")


def _add_clock_args(ap: argparse.ArgumentParser) -> None:
    ck = ap.add_argument_group("clocks and energy (simulated, gpu_agent.gpu_model)")
    ck.add_argument("--clock", default="", help="comma list of max, miad (one run each); none = fixed max clock")
    ck.add_argument("--gpu", default="", help="h100 | a100 | v100 (default: the profile's hardware)")
    ck.add_argument("--clock-period-s", type=float, default=0.5, help="MIAD period (µ-Serve: 500 ms)")
    ck.add_argument("--miad-step-mhz", type=int, default=100)
    ck.add_argument("--miad-threshold", type=float, default=0.05)
    ck.add_argument("--miad-window-s", type=float, default=2.0, help="latency window MIAD looks at")
    ck.add_argument("--miad-quantile", type=float, default=99.0, help="TTFT quantile MIAD looks at")
    ck.add_argument("--miad-min-mhz", default="0",
                    help="comma list of MIAD clock floors in MHz (0 = the GPU's minimum) or 'auto': the lowest "
                         "clock that prefills the --miad-floor-quantile prompt length within the TTFT SLO")
    ck.add_argument("--miad-floor-quantile", type=float, default=99.9,
                    help="auto floor: percentile of the trace's prompt lengths (simulator.power.auto_floor_mhz)")
    ck.add_argument("--scale-out-after", type=int, default=4,
                    help="MIAD UP requests at max clock in a row before µ-Serve's scale-out signal")


def _add_cluster_args(ap: argparse.ArgumentParser) -> None:
    """SLOs, worker counts and Aladdin's parameters."""
    ap.add_argument("--slo-scale", default="1", help="comma list: multiply both SLOs (one run each)")
    ap.add_argument("--workers", type=int, default=1, help="fixed workers (minimum with --autoscale)")
    ap.add_argument("--max-workers", type=int, default=256)
    ap.add_argument("--target", type=float, default=0.99, help="SLO attainment target of --search-gpus")
    ap.add_argument("--idle-release-s", type=float, default=30.0)
    ap.add_argument("--cold-start-s", type=float, default=0.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1600.0, help="default: Aladdin Table 2, Llama2-70B")
    ap.add_argument("--atgt-slo-ms", type=float, default=75.0, help="default: Aladdin Table 2, Llama2-70B")
    ap.add_argument("--gamma", type=float, default=0.5)
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--slack", choices=("banked", "lifetime"), default="banked", help="Aladdin constraint (d)")


def _add_worker_args(ap: argparse.ArgumentParser, traces: Path) -> None:
    """The length predictor, LoRA adapters and each worker's engine."""
    ap.add_argument("--predictor", choices=MODES, default="confusion",
                    help="confusion: noisy predictor drawn from a confusion matrix; real: the predictions the trace "
                         "carries (muserve:CSV); oracle; history")
    ap.add_argument("--confusion", default=None,
                    help="JSON confusion matrix (rows: true class) or a predictor metadata JSON/folder with "
                         "'ood_confusion' (default: the shipped artifact's ood_confusion, else a named fallback)")
    ap.add_argument("--token-estimate", choices=ESTIMATES, default="class_mean",
                    help="tokens of a predicted class: its mean, or E[true length | predicted class]")
    ap.add_argument("--class-bounds", default="percentile", help="'percentile' (µ-Serve) or e.g. 32,128,256,512")
    ap.add_argument("--adapters", type=int, default=0, help="LoRA adapters (0 = none), one per Azure function")
    ap.add_argument("--functions", default=str(traces / "azure_functions_2019_sample1000_invocations.csv"))
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--max-adapters", type=int, default=0, help="adapter slots per worker (0 = no limit)")
    ap.add_argument("--adapter-load-ms-per-rank", type=float, default=0.125)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--kv-mode", choices=("grow", "reserve"), default="grow")
    ap.add_argument("--kv-capacity", type=int, default=0, help="KV tokens per worker (0 = the profile's)")
    ap.add_argument("--max-waiting", type=int, default=0, help="queue bound per worker (0 = none)")
    ap.add_argument("--max-prefill-tokens", type=int, default=0,
                    help="prompt tokens per prefill step (vLLM max_num_batched_tokens; 0 = none, as the sim engine)")
    ap.add_argument("--aging-s", type=float, default=0.0,
                    help="ssjf_class aging: seconds per length class (0 = default)")
    ap.add_argument("--ssjf-input-weight", type=float, default=-1.0,
                    help="ssjf: output-token equivalents per prompt token (< 0 = core.queue_order default)")
    ap.add_argument("--ssjf-window-factor", type=float, default=0.0,
                    help="ssjf starvation bound: only requests arriving within this x the recent mean JCT "
                         "overtake one (0 = default)")
    ap.add_argument("--ssjf-window-s", type=float, default=0.0,
                    help="ssjf: that window before any request completed (0 = default)")
    ap.add_argument("--overtake-bound", type=float, default=OVERTAKE_BOUND,
                    help="ssjf: a request overtaken by more than this share of the completions of the last P99 "
                         f"JCT goes first, FCFS among such (default {OVERTAKE_BOUND:g}, as in a live worker; 0 = off)")
    ap.add_argument("--tail-guard", type=float, default=TAIL_GUARD,
                    help="ssjf: a request waiting past this quantile of recent JCTs goes first, FCFS among such "
                         f"(default {TAIL_GUARD:g} = off, as in a live worker; 0.7 was the live rule before the "
                         "overtake bound)")
    ap.add_argument("--refine-preempt", action="store_true",
                    help="with --order ssjf / sjf_oracle only: preemptive shortest-(expected-)remaining-first at iteration "
                         "boundaries, paused requests keep their KV (docs/experiments/sjf.md)")
    ap.add_argument("--context-limit", type=int, default=-1,
                    help="context window in tokens (-1 = the profile's model's, 0 = none)")
    ap.add_argument("--over-context", choices=("reject", "truncate"), default="truncate",
                    help="a prompt at or over the context window: cut to fit (default: attainment stays "
                         "comparable with runs from before the limit) or rejected (an SLO miss); counted either way")
    ap.add_argument("--max-input-len", type=int, default=0, help="reject longer prompts (0 = no limit)")
    ap.add_argument("--fit-online", action="store_true", help="policies use models fitted online from the steps")


def _search(trace, perf, cfg: SimConfig, target: float, max_workers: int, **kw):
    """Fewest fixed workers with slo_both >= target: (result, metrics, workers) of that run."""
    cache: dict[int, tuple] = {}

    allowed = int((1.0 - target) * len(trace))  # more misses than this and the run cannot pass

    def run(n: int):
        if n not in cache:
            res = simulate(trace, perf, replace(cfg, workers=n, max_workers=max(n, cfg.max_workers),
                                                abort_misses=max(1, allowed)), **kw)
            cache[n] = (res, report.metrics(res))
        return cache[n]

    lo, hi = 0, max(1, cfg.workers)
    while run(hi)[1]["slo_both"] < target:
        lo, hi = hi, hi * 2
        if hi > max_workers:
            hi = max_workers
            if run(hi)[1]["slo_both"] < target:
                res, m = run(hi)
                m["target_reached"] = False
                return res, m, hi
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid)[1]["slo_both"] >= target:
            hi = mid
        else:
            lo = mid
    res, m = run(hi)
    m["target_reached"] = True
    return res, m, hi


def main(argv: list[str] | None = None) -> int:
    """Run the grid of simulations; 0 on success, 2 on bad input."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"polyserve simulate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


@dataclass
class _Grid:
    """The runs `polyserve simulate` makes: per trace x rate scale, every policy x order x
    kernel x variant; a variant is (label suffix, SLO scale, SimConfig changes), one per
    SLO scale x autoscaler (x HPA threshold factor x live per-token) x clock (x MIAD floor)."""

    traces: list[str]
    policies: list[str]
    orders: list[str]
    kernels: list[str]
    scales: list[float]
    start: float
    end: float | None
    confusion: object
    bounds: tuple[int, ...] | None
    factors: list[float]
    variants: list[tuple[str, float, dict]] = field(default_factory=list)


@dataclass
class _Outputs:
    rows: list[dict] = field(default_factory=list)
    cdfs: dict = field(default_factory=dict)  # (trace, scale) -> label -> latencies
    runs_meta: list[dict] = field(default_factory=list)
    series: dict = field(default_factory=dict)  # (trace, scale, slo) -> arrivals and runs over time


def _main(args) -> int:
    t_start = time.perf_counter()
    perf, raw = load_perf(args.profile)
    tp = int(raw.get("tensor_parallel", 1))
    grid = _grid(args)
    base = _base_config(args, raw, tp, grid.factors[0])
    for _, _, ch in grid.variants:
        replace(base, **ch).validate()
    out = _Outputs()
    for tpath in grid.traces:
        full = load_trace(tpath, args.synthetic_lengths, seed=args.seed)
        for scale in grid.scales:
            _run_scale(args, grid, base, perf, tpath, full, scale, out)
    _write(args, raw, base, tp, out, t_start)
    return 0


def _grid(args) -> _Grid:
    """The grid's axes from the comma lists (ValueError naming the flag at fault)."""
    traces = args.trace or [str(datasets_dir() / "traces" / "azure_llm_2023_conv.csv")]
    kernels = _csv(args.kernel)
    for k in kernels:
        if k not in KERNELS:
            raise ValueError(f"kernel {k!r} is unknown; choose from {', '.join(KERNELS)}")
    scales = _csv(args.rate_scale, float)
    start, end = 0.0, None
    if args.slice:
        a, _, b = args.slice.partition(":")
        start, end = float(a or 0), (float(b) if b else None)
    confusion, args.confusion_name = resolve_confusion(args.confusion)
    bounds = None if args.class_bounds == "percentile" else tuple(_csv(args.class_bounds, int))
    scalers = _csv(args.autoscaler) or [""]
    clocks = _csv(args.clock) or [""]
    floors = [x if x == "auto" else int(x) for x in _csv(args.miad_min_mhz, str.lower)] or [0]
    lives = [{"off": False, "on": True}.get(x) for x in _csv(args.live_pertoken, str.lower)] or [False]
    if None in lives:
        raise ValueError("--live-pertoken takes off, on or off,on")
    factors = _csv(args.threshold_factor, float) or [0.6]
    if any(f <= 0 for f in factors):
        raise ValueError("--threshold-factor values must be > 0")
    slo_scales = _csv(args.slo_scale, float)
    if any(x <= 0 for x in slo_scales):
        raise ValueError("--slo-scale values must be > 0")
    grid = _Grid(traces, _csv(args.policy), _csv(args.order), kernels, scales, start, end, confusion, bounds,
                 factors)
    grid.variants = _variants(args, slo_scales, scalers, factors, lives, clocks, floors)
    return grid


def _variants(args, slo_scales: list[float], scalers: list[str], factors: list[float], lives: list[bool],
              clocks: list[str], floors: list) -> list[tuple[str, float, dict]]:
    """(label suffix, SLO scale, SimConfig changes) per SLO scale x autoscaler (x HPA threshold
    factor x live per-token) x clock (x MIAD floor)."""
    variants = []
    for slo in slo_scales:
        for a in scalers:
            hpa = bool(a) and a.strip().lower() in ("pertoken", "request")
            for fac, lv in itertools.product(factors if hpa else factors[:1],
                                             lives if a.strip().lower() == "pertoken" else [False]):
                for c in clocks:
                    for fl in (floors if c == "miad" else [0]):
                        suffix = (f"/{a}" if a else "") + (f"@{fac:g}" if hpa and len(factors) > 1 else "") + \
                            ("+live" if lv else "") + \
                            (f"/{c}" if c else "") + \
                            (f">={fl}MHz" if c == "miad" and (fl or len(floors) > 1) else "") + \
                            (f"/slo x{slo:g}" if len(slo_scales) > 1 else "")
                        variants.append((suffix, slo, {"autoscaler": a, "clock": c, "miad_min_mhz": fl,
                                                       "threshold_factor": fac, "live_pertoken": lv,
                                                       "ttft_slo_ms": args.ttft_slo_ms * slo,
                                                       "atgt_slo_ms": args.atgt_slo_ms * slo}))
    return variants


def _base_config(args, raw: dict, tp: int, threshold_factor: float) -> SimConfig:
    """The SimConfig every run starts from (the grid's axes replace some of its fields)."""
    kv_cap = args.kv_capacity or int(raw.get("kv_capacity_tokens", 0))
    ctx, args.context_source = context_limit(raw)
    if args.context_limit >= 0:
        ctx, args.context_source = args.context_limit, "--context-limit"
    args.profiled_prompt, args.profiled_source = profiled_prompt_tokens(raw)
    return SimConfig(context_limit=ctx, over_context=args.over_context, profiled_prefill_tokens=args.profiled_prompt,
                     ssjf_input_weight=args.ssjf_input_weight, ssjf_window_factor=args.ssjf_window_factor,
                     ssjf_window_s=args.ssjf_window_s,workers=args.workers, autoscale=args.autoscale, max_workers=args.max_workers,
                     idle_release_s=args.idle_release_s, cold_start_s=args.cold_start_s,
                     ttft_slo_ms=args.ttft_slo_ms, atgt_slo_ms=args.atgt_slo_ms, gamma=args.gamma,
                     theta=args.theta, slack=args.slack, max_input_len=args.max_input_len,
                     fit_online=args.fit_online, seed=args.seed, aging_s=args.aging_s,
                     worker=WorkerConfig(max_batch=args.max_batch, kv_capacity=kv_cap, kv_mode=args.kv_mode,
                                         max_adapters=args.max_adapters, max_waiting=args.max_waiting,
                                         max_prefill_tokens=args.max_prefill_tokens,
                                         adapter_load_ms_per_rank=args.adapter_load_ms_per_rank, tp=tp,
                                         refine_preempt=args.refine_preempt, tail_guard=args.tail_guard,
                                         overtake_bound=args.overtake_bound),
                     planner_period_s=args.planner_period_s, initial_workers=args.initial_workers,
                     scaler_window_s=args.scaler_window_s,
                     stabilization_s=args.stabilization_s, scaler_max_step=args.max_step,
                     threshold_factor=threshold_factor, pertoken_threshold_ms=args.pertoken_threshold_ms,
                     request_threshold_ms=args.request_threshold_ms, tracking_slo_ms=args.tracking_slo_ms,
                     tracking_metric=args.tracking_metric, tracking_up_at=args.tracking_up_at,
                     tracking_down_below=args.tracking_down_below, tracking_hold_s=args.tracking_hold_s,
                     muserve_idle_release_s=args.muserve_idle_release_s,
                     reset_window_on_scale=not args.no_reset_window, rise_factor=args.rise_factor,
                     gpu=args.gpu or gpu_from_profile(raw), clock_period_s=args.clock_period_s,
                     miad_step_mhz=args.miad_step_mhz, miad_threshold=args.miad_threshold,
                     miad_window_s=args.miad_window_s, miad_quantile=args.miad_quantile,
                     miad_floor_quantile=args.miad_floor_quantile,
                     scale_out_after=args.scale_out_after)


def _run_scale(args, grid: _Grid, base: SimConfig, perf, tpath: str, full, scale: float, out: _Outputs) -> None:
    """Every policy x order x kernel x variant on `full` at `scale` x its rate (one predictor for all)."""
    tr = window(full, start_s=grid.start, end_s=grid.end, rate_scale=scale, duration_s=args.duration)
    pred = make_predictor(args, grid, full, tr)
    kw = {"predictor": pred}
    if args.adapters:
        ads = make_adapters(args.functions, args.adapters, _csv(args.ranks, int), seed=args.seed)
        kw.update(adapters=ads, adapter_idx=assign_adapters(len(tr), ads, seed=args.seed))
    for pol, order, kernel, (suffix, slo, ch) in itertools.product(grid.policies, grid.orders, grid.kernels,
                                                                   grid.variants):
        cfg = replace(base, policy=pol, order=order, worker=replace(base.worker, kernel=kernel), **ch)
        stem = pol + (f"/{order}" if len(grid.orders) > 1 else "") + \
            (f"/{kernel}" if len(grid.kernels) > 1 or args.adapters else "")
        label = stem + suffix
        group = stem + (f"/{ch['autoscaler']}" if ch["autoscaler"] else "") + \
            (f"@{ch['threshold_factor']:g}" if len(grid.factors) > 1 and
             ch["autoscaler"].strip().lower() in ("pertoken", "request") else "") + \
            ("+live" if ch["live_pertoken"] else "")
        if args.search_gpus:
            res, m, n = _search(tr, perf, cfg, args.target, args.max_workers, **kw)
            m["workers"] = n
        else:
            res = simulate(tr, perf, cfg, **kw)
            m = report.metrics(res)
        m.update(label=label, load=round(tr.rate, 3), rate_scale=scale, trace=full.name, slo_scale=slo, group=group,
                 predictor=pred.name)
        out.rows.append(m)
        out.cdfs.setdefault((full.name, scale), {})[label] = report.latencies(res)
        if cfg.autoscaler or cfg.clock:
            out.series.setdefault((full.name, scale, slo), {"arrivals": tr.arrival, "runs": {}})
            out.series[(full.name, scale, slo)]["runs"][label] = (res.timeline, res.extra, res.horizon_s, cfg)
        print(report.table([m]).splitlines()[-1], f"  [{res.wall_s:.1f}s]", flush=True)
        out.runs_meta.append({"trace": tpath, "rate_scale": scale, "label": label, "config": res.config})


def make_predictor(args, grid: _Grid, full, tr) -> LengthPredictor:
    """The run's length predictor, named exactly (its name goes into the report)."""
    if args.predictor == "real":
        if tr.predicted_class is None:
            raise ValueError(f"--predictor real: trace {full.name} carries no predictions (use muserve:CSV)")
        return LengthPredictor("real", full.output_len, bounds=tr.class_bounds, seed=args.seed,
                               estimate=args.token_estimate, given_classes=tr.predicted_class,
                               name=f"real: the trace's own predictions ({full.name}), classes "
                                    f"{'/'.join(map(str, tr.class_bounds))}, tokens {args.token_estimate}")
    pred = LengthPredictor(args.predictor, full.output_len, bounds=grid.bounds, confusion=grid.confusion,
                           seed=args.seed, estimate=args.token_estimate)
    if args.predictor == "confusion":
        pred.name = f"confusion: {args.confusion_name}; classes {'/'.join(map(str, pred.bounds))}; " \
                    f"tokens {args.token_estimate}"
    return pred


def _write(args, raw: dict, base: SimConfig, tp: int, out: _Outputs, t_start: float) -> None:
    """The tables (printed and in results.txt), results.json and the plots."""
    rows = out.rows
    title = (f"profile {raw.get('name', Path(args.profile).stem)}, SLO TTFT {args.ttft_slo_ms:g} ms / "
             f"ATGT {args.atgt_slo_ms:g} ms, predictor {args.predictor}"
             + (f", search: fewest workers with >= {args.target:g} attainment" if args.search_gpus else ""))
    names = list(dict.fromkeys(r["trace"] for r in rows))
    text = "\n\n".join(report.table([r for r in rows if r["trace"] == name], f"{name} — {title}") for name in names)
    text += "\n\n" + report.honesty_notes(rows, args, base)
    if out.series:
        text += "\n\n" + "\n\n".join(
            report.extra_table([r for r in rows if r["trace"] == name],
                               f"{name} — SLO violations, autoscaling, modelled energy ({base.gpu}, "
                               f"TDP {gpu_spec(base.gpu).tdp_w:g} W x {tp} GPUs per worker)")
            for name in names)
    if {"max", "miad"} <= {r.get("clock") for r in rows}:
        text += "\n\n" + "\n\n".join(
            report.miad_table([r for r in rows if r["trace"] == name], args.target,
                              f"{name} — MIAD vs the maximum clock at equal SLO attainment (>= {args.target:g}), "
                              f"modelled power")
            for name in names)
    payload = {"command": "polyserve simulate " + " ".join(args.argv), "profile": args.profile,
               "title": title, "predictor_model": sorted({r.get("predictor", "") for r in rows}),
               "context_limit": {"tokens": base.context_limit, "source": args.context_source,
                                 "over_context": base.over_context},
               "profiled_prompt_tokens": {"tokens": args.profiled_prompt, "source": args.profiled_source}, "rows": rows, "runs": out.runs_meta,
               "wall_s": time.perf_counter() - t_start}
    pj, pt = report.write(args.out, payload, text)
    print("\n" + text)
    if not args.no_plots:
        from polyserve.simulator import plots

        slo = {"ttft": args.ttft_slo_ms, "atgt": args.atgt_slo_ms}
        for p in plots.grid_figures(rows, out.cdfs, Path(args.out), slo, args.target) + \
                plots.series_figures(out.series, Path(args.out)):
            print(f"plot: {p}")
    print(f"results: {pj} {pt}  ({time.perf_counter() - t_start:.1f}s)")


if __name__ == "__main__":
    raise SystemExit(main())
