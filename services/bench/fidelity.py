"""`polyserve bench fidelity`: the same trace slice through a live cluster and the simulator.

Starts polyserve itself (nats-server, redis-server, the services, `--workers` workers of
`--engine` sim or hf, in a temporary run dir), replays a trace slice open-loop through the
gateway (`bench.replay`), runs the very same requests — their send times and the token
counts the engine reported — through `polyserve.simulator.simulate_requests` with that
engine's profile and the live workers' settings (worker count, max_batch, KV reserved at
admission, a 256-request waiting queue, least_outstanding placement), and prints the
simulator's error against the live system for mean and P98 TTFT, end-to-end latency and
ATGT, with JSON and a CDF plot.

The live path includes the control plane (gateway → predictor → dispatcher → worker,
tokens back over NATS, HTTP streaming); the simulator models the engine only. Shown: the
error of the simulator with the profile as shipped, and of the simulator with the idle
overheads measured before the replay by sequential probe requests (`calibrate`: the live
engine's per-step surplus or slowdown, and the control plane's TTFT cost). The request
events (predicted, dispatched, first_token) split the live TTFT into its hops.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from polyserve.bench import replay as br
from polyserve.cli import launcher
from polyserve.core import profiles
from polyserve.core.profiles import profile_path
from polyserve.shared import batching, infra

PROFILES = profiles.profiles_dir()
ENGINE_PROFILES = {"sim": profile_path(profiles.DEFAULT_SIM), "hf": profile_path(profiles.HF_CPU)}
ENGINE_MODELS = {"sim": "fidelity-sim", "hf": "tiny-llama-random"}
ENGINE_CAPS = {"sim": (4000, 4000), "hf": (3000, 1000)}  # (input, output) tokens the engine accepts
METRICS = (("ttft_ms", "mean"), ("ttft_ms", "p98"), ("e2e_ms", "mean"), ("e2e_ms", "p98"), ("atgt_ms", "mean"),
           ("atgt_ms", "p98"))


def _stats(x: np.ndarray) -> dict:
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p98": float(np.percentile(x, 98))} \
        if x.size else {"mean": None, "p50": None, "p98": None}


def compare(reqs: list[br.LiveRequest], sim: list, cal: list, overhead_ms: float) -> dict:
    """Errors (simulated − live) ÷ live, in %, over the requests served in all three runs: the
    simulator with the profile as shipped (`sim`), and with the idle overheads measured by the
    probes (`cal`: per-step overhead added to the profile's decode constant c3, control-plane
    TTFT overhead added to TTFT and end-to-end)."""
    both = [(r, s, c) for r, s, c in zip(reqs, sim, cal)
            if not r.error and not s.rejected and not c.rejected and math.isfinite(s.e2e_ms)]
    out: dict = {"paired_requests": len(both), "overhead_ms": overhead_ms}
    for key, stat in METRICS:
        name = key.removesuffix("_ms")
        cols = [np.array([getattr(x[k], key) for x in both]) for k in range(3)]
        lv, sv, cv = (_stats(c)[stat] for c in cols) if both else (None,) * 3
        out[f"{name}_{stat}"] = {"live_ms": lv, "simulated_ms": sv, "calibrated_ms": cv,
                                 "error_pct": (sv - lv) / lv * 100 if lv else None,
                                 "calibrated_error_pct": (cv - lv) / lv * 100 if lv else None}
    if both:  # per request: how far each simulated latency is from its live twin
        e = np.array([abs(s.e2e_ms - r.e2e_ms) / r.e2e_ms for r, s, _ in both if r.e2e_ms > 0])
        out["per_request_e2e_abs_error_pct"] = {"median": float(np.median(e) * 100),
                                                "p90": float(np.percentile(e, 90) * 100)}
    return out


async def probe(url: str, model: str, tok, n: int = 8, out_tokens: int = 32) -> list[br.LiveRequest]:
    """`n` sequential small requests on the idle cluster (the first two, which warm connections
    and caches, are dropped)."""
    prompts = br.make_prompts([64] * n, "synthetic", tok, seed=99)
    tr = br.Trace("probe", np.zeros(1), np.array([64]), np.array([out_tokens]))
    live = []
    for p in prompts:
        (r,) = await br.replay(url, model, tr, [p], progress=False, timeout_s=60, lead_s=0.0)
        if r.error:
            raise br.ReplayError(f"probe request failed: {r.error}")
        live.append(r)
    return live[2:]


async def probe_batch(url: str, model: str, tok, b: int = 16, out_tokens: int = 32) -> list[br.LiveRequest]:
    """`b` small requests sent together: a decode batch of `b` on the idle cluster."""
    tr = br.Trace("probe-batch", np.zeros(b), np.full(b, 64), np.full(b, out_tokens))
    live = await br.replay(url, model, tr, br.make_prompts(tr.input_len, "synthetic", tok, seed=98),
                           progress=False, timeout_s=60, lead_s=0.0)
    bad = [r.error for r in live if r.error]
    if bad:
        raise br.ReplayError(f"batch probe failed: {bad[0]}")
    return live


def calibrate(live: list[br.LiveRequest], raw: dict, mode: str,
              batch: list[br.LiveRequest] | None = None) -> tuple[dict, dict]:
    """The profile adjusted to the idle probes, each compared with the same request alone in the
    simulator, and the control plane's TTFT overhead (HTTP, predictor, dispatcher, NATS):

    * ``additive`` (sim engine: it sleeps the modelled time, so the live surplus is Python and
      NATS work per iteration — a fixed part and a part per sequence, as each sequence's token is
      published): the median ATGT surplus alone (b = 1) and in the `batch` probe (b sent together)
      give c3's and c2's additions;
    * ``scale`` (hf engine: real compute, slower by a factor when the machine is busier than when
      it was profiled): every coefficient is multiplied by the median live ÷ simulated ATGT.
    Then the TTFT overhead = median(live TTFT − simulated TTFT with the adjusted profile)."""
    from polyserve.simulator import simulate_requests

    def alone(profile):
        return [simulate_requests([(0.0, r.prompt_tokens, r.completion_tokens)], profile)[0] for r in live]

    base = alone(raw)
    info = {"probes": len(live), "mode": mode, "live_ttft_ms_median": statistics.median(r.ttft_ms for r in live),
            "live_atgt_ms_median": statistics.median(r.atgt_ms for r in live),
            "simulated_atgt_ms": statistics.median(s.atgt_ms for s in base)}
    if mode == "scale":
        f = statistics.median(r.atgt_ms / s.atgt_ms for r, s in zip(live, base) if s.atgt_ms > 0)
        info["scale"] = f
        cal = {**raw, **{k: raw[k] * f for k in ("k1", "c1", "k2", "c2", "c3") if k in raw}}
    else:
        step = max(0.0, statistics.median(r.atgt_ms - s.atgt_ms for r, s in zip(live, base)))
        per_seq = 0.0
        if batch and len(batch) > 1:
            sim_b = simulate_requests([(r.sent_s, r.prompt_tokens, r.completion_tokens) for r in batch], raw)
            step_b = statistics.median(r.atgt_ms - s.atgt_ms for r, s in zip(batch, sim_b))
            per_seq = max(0.0, (step_b - step) / (len(batch) - 1))
            info["batch_step_overhead_ms"], info["batch"] = step_b, len(batch)
        info["step_overhead_ms"], info["per_seq_overhead_ms"] = step, per_seq
        cal = {**raw, "c3": raw["c3"] + max(0.0, step - per_seq), "c2": raw["c2"] + per_seq}
    info["overhead_ms"] = statistics.median(r.ttft_ms - s.ttft_ms for r, s in zip(live, alone(cal)))
    return cal, info


class EventLog:
    """Per-request stage timings from the cluster's request events (`<prefix>.v1.events.request.>`):
    predictor and dispatcher latency and the gateway's TTFT (its `first_token` event)."""

    def __init__(self, nats_url: str, prefix: str):
        self.nats_url, self.prefix = nats_url, prefix
        self.by_id: dict[str, dict] = {}
        self.kinds: dict[str, int] = {}
        self.failed_reasons: dict[str, int] = {}
        self.nc = None

    async def start(self) -> None:
        import nats

        self.nc = await nats.connect(self.nats_url)
        fields = {"predicted": ("latency_ms", "predict_ms"), "dispatched": ("latency_ms", "dispatch_ms"),
                  "first_token": ("ttft_ms", "gateway_ttft_ms")}

        async def on(msg) -> None:
            for ev in batching.event_dicts(msg.data):  # one event or several (shared/batching.py)
                kind = ev.get("event", "")
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
                if kind == "failed":
                    reason = f"{ev.get('status')} {ev.get('reason')}"
                    self.failed_reasons[reason] = self.failed_reasons.get(reason, 0) + 1
                if kind in fields:
                    src, dst = fields[kind]
                    self.by_id.setdefault(ev.get("request_id", ""), {})[dst] = ev[src]

        await self.nc.subscribe(f"{self.prefix}.v1.events.request.>", cb=on)
        await self.nc.flush()

    async def stop(self) -> None:
        if self.nc is not None:
            await asyncio.sleep(0.5)  # the last events
            await self.nc.drain()


def decompose(reqs: list[br.LiveRequest], sim: list, events: dict[str, dict]) -> dict:
    """Where the live TTFT goes, per request (mean, P50, P98), next to the simulated engine's:
    at the client; at the gateway (its first_token event); the difference (HTTP, SSE, the
    client's event loop); the predictor and dispatcher hops; and the rest of the gateway's TTFT
    (the worker's queue + prefill, the generate hand-off and the first chunk over NATS), which
    is what the simulator models."""
    rows = [(r, s, events.get(r.request_id, {})) for r, s in zip(reqs, sim)
            if not r.error and not s.rejected and "gateway_ttft_ms" in events.get(r.request_id, {})]
    out: dict = {"requests": len(rows)}
    if not rows:
        return out
    nan = float("nan")
    terms = {
        "ttft_client": [r.ttft_ms for r, _, _ in rows],
        "ttft_gateway": [e["gateway_ttft_ms"] for _, _, e in rows],
        "http_sse_client": [r.ttft_ms - e["gateway_ttft_ms"] for r, _, e in rows],
        "predict": [e.get("predict_ms", nan) for _, _, e in rows],
        "dispatch": [e.get("dispatch_ms", nan) for _, _, e in rows],
        "worker_and_nats": [e["gateway_ttft_ms"] - e.get("predict_ms", 0.0) - e.get("dispatch_ms", 0.0)
                            for _, _, e in rows],
        "ttft_simulated": [s.ttft_ms for _, s, _ in rows],
    }
    for name, xs in terms.items():
        x = np.array(xs, dtype=float)
        out[name] = _stats(x[np.isfinite(x)])
    for stat in ("mean", "p98"):  # the engine's part: simulated vs the rest of the gateway's TTFT
        w, s = out["worker_and_nats"][stat], out["ttft_simulated"][stat]
        out[f"engine_ttft_{stat}_error_pct"] = (s - w) / w * 100 if w else None
    return out


def decomposition_table(d: dict) -> str:
    if d.get("requests", 0) == 0:
        return "(no request events matched)"
    names = [("ttft_client", "TTFT at the client (live)"), ("ttft_gateway", "  at the gateway (live)"),
             ("http_sse_client", "  HTTP + SSE + client = client - gateway"), ("predict", "  predictor hop"),
             ("dispatch", "  dispatcher hop"), ("worker_and_nats", "  worker queue+prefill + NATS = the rest"),
             ("ttft_simulated", "TTFT simulated (engine)")]
    lines = [f"{'TTFT term (ms)':<44}{'mean':>9}{'p50':>9}{'p98':>9}"]
    for key, label in names:
        st = d[key]
        lines.append(f"{label:<44}" + "".join(f"{v:>9.1f}" if v is not None else f"{'-':>9}"
                                              for v in (st["mean"], st["p50"], st["p98"])))
    lines.append("engine part, simulated vs live (worker queue+prefill + NATS): " + ", ".join(
        f"{stat} {d[f'engine_ttft_{stat}_error_pct']:+.1f}%" for stat in ("mean", "p98")
        if d.get(f"engine_ttft_{stat}_error_pct") is not None))
    return "\n".join(lines)


def _wait_workers(state: launcher.ClusterState, n: int, timeout: float = 120.0) -> None:
    import redis

    from polyserve.proto import Keys

    r = redis.Redis.from_url(state.redis_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.zcount(Keys(state.prefix).workers, time.time(), "+inf") >= n:
            return
        time.sleep(0.2)
    raise launcher.LaunchError(f"fewer than {n} workers ready within {timeout:.0f}s; logs in {state.run_dir}/logs")


async def experiment(args, state: launcher.ClusterState, profile: Path) -> dict:
    trace = br.load_trace(args.trace, args.slice, args.rate_scale, args.duration, args.max_requests)
    capped = int((trace.input_len > args.max_input_tokens).sum() + (trace.output_len > args.max_output_tokens).sum())
    trace = br.Trace(trace.name, trace.arrival, np.minimum(trace.input_len, args.max_input_tokens),
                     np.minimum(trace.output_len, args.max_output_tokens))
    info = await br.deployment_info(state.gateway_url, state.model)
    tok = br.resolve_tokenizer("auto", args.engine, str(info.get("root", "")))
    print("probing the idle control plane's TTFT overhead ...", flush=True)
    raw = json.loads(profile.read_text())
    mode = args.calibrate or ("scale" if args.engine == "hf" else "additive")
    seq = await probe(state.gateway_url, state.model, tok)
    batch = await probe_batch(state.gateway_url, state.model, tok) if mode == "additive" else None
    calibrated, probe_info = calibrate(seq, raw, mode, batch)
    prompts = br.make_prompts(trace.input_len, args.prompts, tok, seed=args.seed)
    load0 = os.getloadavg()
    print(f"replaying {len(trace)} requests over {trace.duration_s:.0f}s ({trace.rate:.2f} req/s; "
          f"{capped} lengths capped at {args.max_input_tokens}/{args.max_output_tokens}); load {load0[0]:.2f}",
          flush=True)
    events = EventLog(state.nats_url, state.prefix)
    await events.start()
    try:
        reqs = await br.replay(state.gateway_url, state.model, trace, prompts, progress=args.progress,
                               timeout_s=args.timeout)
    finally:
        await events.stop()
    load1 = os.getloadavg()
    live, live_lat = br.live_row(reqs, args.ttft_slo_ms, args.atgt_slo_ms, workers=args.workers)
    sim, sim_lat, sim_reqs = br.sim_row(reqs, profile, workers=args.workers, max_batch=args.max_batch,
                                        ttft_slo_ms=args.ttft_slo_ms, atgt_slo_ms=args.atgt_slo_ms)
    cal, cal_lat, cal_reqs = br.sim_row(reqs, calibrated, workers=args.workers, max_batch=args.max_batch,
                                  ttft_slo_ms=args.ttft_slo_ms, atgt_slo_ms=args.atgt_slo_ms,
                                  label="simulator+idle overheads", shift_ms=probe_info["overhead_ms"])
    for row in (live, sim, cal):
        row["load"] = args.rate_scale
    return {"engine": args.engine, "profile": str(profile), "workers": args.workers, "max_batch": args.max_batch,
            "trace": {"path": args.trace, "slice": args.slice, "rate_scale": args.rate_scale,
                      "duration_s": args.duration, "requests": len(trace), "rate": trace.rate, "capped": capped},
            "tokenizer": tok.name, "probe": probe_info, "loadavg_before": load0, "loadavg_after": load1,
            "rows": [live, sim, cal], "fidelity": compare(reqs, sim_reqs, cal_reqs, probe_info["overhead_ms"]),
            "decomposition": decompose(reqs, sim_reqs, events.by_id), "events_seen": events.kinds,
            "failed_event_reasons": events.failed_reasons,
            "latencies": {"live (measured)": live_lat, "simulator (SIMULATED)": sim_lat,
                          "simulator + idle overheads (SIMULATED)": cal_lat}, "requests": reqs}


def fidelity_table(f: dict) -> str:
    def fmt(x, spec="{:.1f}"):
        return "-" if x is None else spec.format(x)

    lines = [f"{'metric':<11}{'live ms':>10}{'sim ms':>10}{'error %':>9}{'sim+ovh ms':>12}{'error %':>9}"]
    # sim+ovh: the simulator with the idle overheads the probes measured (see probe_overhead)
    for key, stat in METRICS:
        name = f"{key.removesuffix('_ms')}_{stat}"
        d = f[name]
        lines.append(f"{name:<11}{fmt(d['live_ms']):>10}{fmt(d['simulated_ms']):>10}{fmt(d['error_pct'], '{:+.1f}'):>9}"
                     f"{fmt(d['calibrated_ms']):>12}{fmt(d['calibrated_error_pct'], '{:+.1f}'):>9}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`polyserve bench fidelity`."""
    profile = Path(args.profile) if args.profile else ENGINE_PROFILES[args.engine]
    args.max_input_tokens = args.max_input_tokens or ENGINE_CAPS[args.engine][0]
    args.max_output_tokens = args.max_output_tokens or ENGINE_CAPS[args.engine][1]
    try:
        br.validate_args(argparse.Namespace(url="http://-", ttft_slo_ms=args.ttft_slo_ms,
                                            atgt_slo_ms=args.atgt_slo_ms, timeout=args.timeout))
        if args.workers < 1 or args.max_batch < 1:
            raise br.ReplayError("--workers and --max-batch must be >= 1")
        if not profile.is_file():
            raise br.ReplayError(f"--profile {profile}: no such file (see {PROFILES})")
        br.load_trace(args.trace, args.slice, args.rate_scale, args.duration, args.max_requests)
    except br.ReplayError as exc:
        print(f"error: {exc}")
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="ps-fidelity-"))
    env = {"POLYSERVE_LOG_LEVEL": "WARNING", "POLYSERVE_PREDICTOR_PROXY_ARTIFACT": "",
           "POLYSERVE_WORKER_MAX_BATCH": str(args.max_batch), "POLYSERVE_WORKER_MAX_WAITING": "256",
           "POLYSERVE_WORKER_PROFILE": str(profile) if args.engine == "sim" else "",
           "POLYSERVE_WORKER_MAX_INPUT_LEN": str(max(args.max_input_tokens + 64, 4096)),
           # the simulator reserves KV against the profile's capacity: the live worker the same
           "POLYSERVE_WORKER_KV_CAPACITY_TOKENS": str(json.loads(profile.read_text()).get("kv_capacity_tokens", 0))}
    spec = launcher.ClusterSpec(run_dir=run_dir, engine=args.engine, model=ENGINE_MODELS[args.engine],
                                port=infra.free_port(), nats_port=0, redis_port=0, min_replicas=args.workers,
                                max_replicas=args.workers, extra_env=env)
    print(f"starting polyserve ({args.workers} x {args.engine} worker, max_batch {args.max_batch}, profile "
          f"{profile.name}) in {run_dir} ...", flush=True)
    try:
        state = launcher.up(spec, progress=lambda m: None)
        _wait_workers(state, args.workers)
        res = asyncio.run(experiment(args, state, profile))
    except (br.ReplayError, launcher.LaunchError) as exc:
        print(f"error: {exc}")
        return 1
    finally:
        launcher.down(run_dir, progress=lambda m: None)
    title = (f"{args.engine} engine, {res['trace']['requests']} requests of {Path(args.trace).name} "
             f"[{args.slice or 'all'}] x{args.rate_scale:g}, {args.workers} worker(s)")
    text = "\n".join([br.table(res["rows"], title), "",
                      f"fidelity (simulated vs live, {res['fidelity']['paired_requests']}"
                      f" requests served in all runs; sim+ovh adds the idle overheads the probes measured: "
                      f"{res['probe']['overhead_ms']:.1f} ms control-plane TTFT, "
                      + (f"profile x{res['probe']['scale']:.2f} (hf compute slower than profiled)):"
                         if "scale" in res["probe"] else
                         f"{res['probe']['step_overhead_ms'] - res['probe']['per_seq_overhead_ms']:.2f} ms per "
                         f"decode step + {res['probe']['per_seq_overhead_ms']:.2f} ms per sequence in it):"),
                      fidelity_table(res["fidelity"]), "",
                      "where the time goes (per request, from the request events; simulated = profile as shipped):",
                      decomposition_table(res["decomposition"]),
                      f"load average before/after: {res['loadavg_before'][0]:.2f} / {res['loadavg_after'][0]:.2f}"])
    print(text)
    live = res["rows"][0]
    if live["errors"]:
        print(f"live errors: {live['errors']} e.g. {live['error_examples'][:2]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {k: v for k, v in res.items() if k not in ("latencies", "requests")}
    payload["note"] = "row 'live' is measured; the simulator's row and figures are SIMULATED"
    payload["requests"] = br.requests_json(res["requests"])
    br.write_json(out / "fidelity.json", payload)
    (out / "fidelity.txt").write_text(text + "\n")
    paths = [out / "fidelity.json", out / "fidelity.txt"]
    if not args.no_plots:
        paths.append(br.plot_cdfs(res["latencies"], out / "fidelity_cdf.png", title))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--engine", choices=("sim", "hf"), default="sim")
    p.add_argument("--profile", default="", help="engine profile JSON (default: the engine's shipped profile)")
    p.add_argument("--trace", default=str(br.datasets_dir() / "traces" / "azure_llm_2023_conv.csv"))
    p.add_argument("--slice", default="0:1200", help="START:END seconds of the original trace")
    p.add_argument("--rate-scale", type=float, default=0.5, help="rate multiplier (what this machine sustains)")
    p.add_argument("--duration", type=float, default=120.0, help="replay the first S seconds (after rescaling)")
    p.add_argument("--max-requests", type=int, default=0)
    p.add_argument("--max-input-tokens", type=int, default=0,
                   help="cap prompt lengths (0 = the engine's limit: sim 4000, hf 3000 of the random model's 4096 "
                        "positions)")
    p.add_argument("--max-output-tokens", type=int, default=0, help="cap output lengths (0 = sim 4000, hf 1000)")
    p.add_argument("--calibrate", choices=("additive", "scale"), default="",
                   help="how the sim+ovh row adjusts the profile to the idle probes (default: additive for sim, "
                        "scale for hf)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--prompts", choices=("sharegpt", "synthetic"), default="sharegpt")
    p.add_argument("--ttft-slo-ms", type=float, default=1600.0)
    p.add_argument("--atgt-slo-ms", type=float, default=75.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fidelity-out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", dest="progress", action="store_false")
