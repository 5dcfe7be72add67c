"""`polyserve bench dispatch`: decision latency of every dispatch policy, pure scan vs index.

Builds one deployment's worker view the way the dispatcher holds it — 1,200 workers by
default, heartbeat-like `WorkerView`s with the perf models of a profile
(`services/core/profiles/sim-llama2-70b-h100-tp4.json`), LoRA adapters of ranks 8–64
(resident sets with full slots, Zipf popularity), request sizes from the Azure LLM 2023
conversation trace; for the Arlo policies 1,200 encoder instances over 12 static-length
runtimes with Twitter-like input lengths — then, per policy:

1. **burst**: `--outstanding` requests (2,400) placed back to back on the idle cluster,
   each decision followed by the index update it causes (`WorkerIndex.placed`); total ms
   (Arlo, §5, reports 0.737 ms for a 2,400-request burst over 1,200 instances in C++);
2. **steady state** from there: per step one worker heartbeat (`upsert`), one completion
   (`finished`) and one decision + `placed`, so 2,400 requests stay outstanding;
   `time.perf_counter_ns` around each decision + its update; p50 / p99 µs.

The pure policy (the O(n) scan of `policy*.py`, given the dispatcher's list of views) and
the indexed one (`polyserve.dispatcher.index`) run in lockstep on the same request stream,
rng and cluster state for the first `--pure-decisions` steps, and their decisions are
compared (they must be identical); the index then runs alone to `--decisions`.

    polyserve bench dispatch [--workers 1200 --runtimes 12 --outstanding 2400 \\
                              --decisions 5000 --policy all] [--json]

``--baseline-index FILE`` also runs each policy with another copy of `dispatcher/index.py`
(e.g. an older commit's; with the `index_structs.py` and `index_models.py` beside it, if
there are), in the same process on the same cluster, for before/after rows.

With ``--live`` it times the live dispatcher's own code path instead: `DispatchHandlers`
in process (heartbeats, `dispatch`, `completed` events; no NATS round trip, the deployment
pre-cached) with `index` off (the scan over views built from the heartbeats, as before the
index was wired in) and on, `--live-decisions` steady-state dispatches each.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import random
import sys
import time
from bisect import bisect_left
from dataclasses import replace
from pathlib import Path

from polyserve.bench import dispatch_lockstep as lockstep
from polyserve.core import profiles
from polyserve.core.perf import BGMV, KERNELS, MBGMV, WorkerPerf, load_perf
from polyserve.core.profiles import profile_path
from polyserve.dispatcher import index as ix
from polyserve.dispatcher import native
from polyserve.dispatcher.policy import PolicyState, RequestView, WorkerView
from polyserve.shared import machine
from polyserve.shared.paths import datasets_dir

PROFILE = profile_path(profiles.DEFAULT_SIM)
TRACE = datasets_dir() / "traces" / "azure_llm_2023_conv.csv"
ARLO_BASE = 512  # the longest runtime (BERT-like encoders)
ARLO_PAPER_BURST_MS = 0.737  # Arlo: 2,400 requests over 1,200 instances, C++
ALL = list(ix.FAST_POLICIES)


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def pct(xs: list[float], q: float) -> float:
    """q-th percentile (nearest rank) of `xs`."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


# ------------------------------------------------------------------ workloads
def trace_sizes(path: Path, rng: random.Random, profile: dict) -> tuple[list[tuple[int, int]], str]:
    """(input, output) pairs from the Azure trace, or lognormal from the profile without it."""
    if path.is_file():
        with open(path, newline="") as f:
            rows = [(int(r["ContextTokens"]), max(1, int(r["GeneratedTokens"]))) for r in csv.DictReader(f)]
        return rows, f"{path.name} ({len(rows)} requests)"
    med, sig = float(profile.get("median_output_tokens", 129)), float(profile.get("output_log_sigma", 0.86))
    rows = [(max(1, int(rng.lognormvariate(math.log(600), 1.0))), max(1, int(rng.lognormvariate(math.log(med), sig))))
            for _ in range(20_000)]
    return rows, f"lognormal (trace {path} not found)"


def arlo_runtimes(k: int) -> list[int]:
    """k static max_lengths spread over 16..512 (the shorter, the denser, as Arlo's ILP picks)."""
    if k < 1:
        raise SystemExit("--runtimes must be >= 1")
    return sorted({max(8, round(ARLO_BASE * ((i + 1) / k) ** 1.5 / 8) * 8) for i in range(k)} | {ARLO_BASE})[-k:]


class Workload:
    """Worker views and a request stream for one policy family."""

    def __init__(self, args: argparse.Namespace, encoder: bool):
        self.args = args
        self.encoder = encoder
        self.rng = random.Random(args.seed)
        self.perf, raw = load_perf(args.profile)
        self.kv_capacity = int(raw.get("kv_capacity_tokens", 500_000))
        self.sizes, self.sizes_source = trace_sizes(Path(args.trace), self.rng, raw)
        self.adapters = [f"lora-{i:03d}" for i in range(args.adapters)]
        self.ranks = {a: self.rng.choice([8, 16, 32, 64]) for a in self.adapters}
        weights = [1.0 / (i + 1) for i in range(len(self.adapters))]  # Zipf(1) popularity
        self.cum = [sum(weights[:i + 1]) for i in range(len(weights))]
        self.runtimes = arlo_runtimes(args.runtimes)
        self.n = 0
        if encoder:  # Twitter-like input lengths, as `polyserve bench embeddings` uses
            from polyserve.simulator.encoder import twitter_like

            self._twitter_like = twitter_like

    def views(self) -> list[WorkerView]:
        a, rng, out = self.args, self.rng, []
        ids = [f"w{i:05d}" for i in range(a.workers)]
        rng.shuffle(ids)  # heartbeats arrive in no particular order
        for i, wid in enumerate(ids):
            if self.encoder:
                n = self.runtimes[i % len(self.runtimes)]
                m = max(2, 2048 // n)  # M_i: requests within the SLO, reported as a token budget
                out.append(WorkerView(worker_id=wid, max_input_len=n, kv_capacity=m * n, gpu_id=f"gpu{i}"))
                continue
            held = tuple(rng.sample(self.adapters, min(a.max_adapters, len(self.adapters))))
            perf = self.perf
            if a.per_worker_perf or a.perf_spread > 0:  # its own fit, as the live dispatcher's online fits
                f = (lambda: rng.uniform(1 - a.perf_spread, 1 + a.perf_spread)) if a.perf_spread > 0 else \
                    (lambda: 1.0)
                b = perf.base
                perf = WorkerPerf(replace(b, k1=b.k1 * f(), c1=b.c1 * f(), k2=b.k2 * f(), c2=b.c2 * f(), c3=b.c3 * f()),
                                  {k: (al * f(), be) for k, (al, be) in perf.lora.items()}, label=f"{wid}+online")
            kernel = a.kernel if a.kernel in KERNELS else (BGMV, MBGMV)[i % 2]
            out.append(WorkerView(worker_id=wid, kv_capacity=self.kv_capacity, gpu_id=f"gpu{i}",
                                  adapters=held, adapter_ranks=tuple(self.ranks[x] for x in held),
                                  max_adapters=a.max_adapters, kernel=kernel, max_batch=64, perf=perf))
        return out

    def request(self) -> RequestView:
        self.n += 1
        rng = self.rng
        if self.encoder:
            return RequestView(request_id=f"q{self.n}", input_tokens=self._twitter_like(rng, ARLO_BASE))
        l_in, l_out = rng.choice(self.sizes)
        adapter = None
        if self.adapters and rng.random() < self.args.lora_share:
            x = rng.random() * self.cum[-1]
            adapter = self.adapters[min(len(self.adapters) - 1, bisect_left(self.cum, x))]
        predicted = max(1, round(l_out * rng.lognormvariate(0.0, 0.3)))  # a predictor's error
        return RequestView(request_id=f"q{self.n}", input_tokens=l_in, predicted_tokens=predicted,
                           adapter=adapter, adapter_rank=self.ranks[adapter] if adapter else 0)

    def heartbeat(self, w: WorkerView) -> WorkerView:
        """The worker's next heartbeat: its requests started and a few tokens further, its KV
        use and batch from them, adapters of its requests loaded (evicting others)."""
        if self.encoder:
            return replace(w, running=min(w.outstanding, max(1, w.kv_capacity // max(1, w.max_input_len))))
        rng, step = self.rng, self.perf.decode_ms(600.0, max(1, len(w.requests)))
        reqs = []
        for r in w.requests:
            gen = r.generated + rng.randint(1, 40) if r.started else 1
            reqs.append(replace(r, started=True, generated=gen, decode_ms=(gen - 1) * step))
        want = [r.adapter for r in reqs if r.adapter]
        held = list(dict.fromkeys(want + list(w.adapters)))[:w.max_adapters or None]
        return replace(w, requests=tuple(reqs), running=len(reqs), waiting=0,
                       kv_used=sum(r.input_tokens + r.generated for r in reqs), adapters=tuple(held),
                       adapter_ranks=tuple(self.ranks.get(x, 0) for x in held))


# ------------------------------------------------------------------ one policy
def run_policy(name: str, args: argparse.Namespace) -> dict:
    """Burst, then steady state, of policy `name` (module docstring); one result row."""
    encoder = name.startswith("arlo")
    wl = Workload(args, encoder)
    base = wl.views()
    track = not encoder
    fast, pure = ix.WorkerIndex(policies=(name,), track_requests=track), ix.WorkerIndex(track_requests=track)
    for v in base:
        fast.upsert(v)
        pure.upsert(v)
    seed = args.seed + 1
    state = PolicyState()
    run = lockstep.Lockstep(name, wl, base, track, fast, pure, random.Random(seed), random.Random(seed), state, state)
    gc.collect()
    burst = lockstep.burst(run, args, ix)
    steady = lockstep.steady(run, args, ix)
    fast_us, pure_us, fast_cpu, pure_cpu = steady["fast_us"], steady["pure_us"], steady["fast_cpu"], steady["pure_cpu"]
    hb_us, fin_us = steady["hb_us"], steady["fin_us"]
    res = {
        "policy": name, "workers": len(base), "outstanding": len(run.outstanding),
        "runtimes": len({v.max_input_len for v in base}) if encoder else None,
        "pure_p50_us": pct(pure_us, 50), "pure_p99_us": pct(pure_us, 99),
        "fast_p50_us": pct(fast_us, 50), "fast_p99_us": pct(fast_us, 99), "fast_max_us": max(fast_us),
        "pure_cpu_p50_us": pct(pure_cpu, 50), "pure_cpu_p99_us": pct(pure_cpu, 99),
        "fast_cpu_p50_us": pct(fast_cpu, 50), "fast_cpu_p99_us": pct(fast_cpu, 99),
        # the two parts of fast_cpu: the decision alone, then the index update it causes
        "decision_cpu_p50_us": pct(steady["decision_cpu"], 50), "decision_cpu_p99_us": pct(steady["decision_cpu"], 99),
        "update_cpu_p50_us": pct(steady["update_cpu"], 50), "update_cpu_p99_us": pct(steady["update_cpu"], 99),
        "speedup_p50": pct(pure_cpu, 50) / pct(fast_cpu, 50) if pure_cpu else None,  # CPU time
        "speedup_p99": pct(pure_cpu, 99) / pct(fast_cpu, 99) if pure_cpu else None,
        **burst,
        "heartbeat_upsert_p50_us": pct(hb_us, 50), "heartbeat_upsert_p99_us": pct(hb_us, 99),
        "finished_p50_us": pct(fin_us, 50), "finished_p99_us": pct(fin_us, 99),
        "decisions": len(fast_us), "compared": steady["compared"], "identical": steady["same"],
        "meets_50us_p99": pct(fast_us, 99) <= 50.0, "meets_50us_p99_cpu": pct(fast_cpu, 99) <= 50.0,
        "meets_20us_p99_cpu": pct(fast_cpu, 99) <= 20.0,  # issue 15's target
        "sizes": wl.sizes_source if not encoder else "twitter-like",
    }
    return res


# ------------------------------------------------------------------ the live dispatcher
async def _live_run(name: str, index: bool, args: argparse.Namespace) -> dict:
    import asyncio

    from polyserve.dispatcher.config import DispatcherSettings, tune_gc
    from polyserve.dispatcher.handlers import DispatchHandlers
    from polyserve.dispatcher.liveview import LiveView
    from polyserve.dispatcher.registry import DeploymentCache, Outstanding
    from polyserve.proto import AdapterInfo, Completed, Deployment, DispatchRequest, Heartbeat, Subjects
    from polyserve.shared.settings import load

    settings = load(DispatcherSettings, "dispatcher", [], environ={}, index=index, seed=args.seed)
    gc_before = tune_gc(settings)  # the garbage-collection thresholds the dispatcher process runs with
    cache = DeploymentCache(None, ttl_s=math.inf, timeout_s=1.0, retry_s=1.0)  # type: ignore[arg-type]
    cache._cache["d"] = (Deployment(id="d", model="m", policy=name), time.monotonic())
    view = LiveView(settings, random.Random(args.seed), outstanding=Outstanding(10**6, 1e9))
    h = DispatchHandlers(settings, view, cache, Subjects("bench"))
    encoder = name.startswith("arlo")
    wl = Workload(args, encoder)
    profile = Path(args.profile).stem if Path(args.profile).parent == PROFILE.parent else args.profile
    views = wl.views()  # (once: it draws from the workload's random stream)
    for v in views:
        await h.on_heartbeat(Heartbeat(
            worker_id=v.worker_id, deployment="d", model="m", engine="sim", ttl_s=1e6, gpu_id=v.gpu_id,
            kv_capacity=v.kv_capacity, max_input_len=v.max_input_len, max_batch=v.max_batch, kernel=v.kernel,
            adapters=[AdapterInfo(name=a, rank=r) for a, r in zip(v.adapters, v.adapter_ranks)],
            max_adapters=v.max_adapters, profile="" if encoder else profile))
    placed: list[tuple[str, str, int]] = []
    ids = [v.worker_id for v in views]
    hint_rng = random.Random(args.seed + 7)  # its own stream: the workload's requests stay those of --prefer 0
    # drawn before the timing (the gateway makes the hint, not the dispatcher)
    hints = [hint_rng.sample(ids, args.prefer) for _ in range(args.outstanding + args.live_decisions)]
    settle = getattr(view, "settle", lambda: None)  # (a dispatcher from before the fifth round has none)

    async def one() -> None:  # the reply's path: bookkeeping queued (`LiveView.record_later`)
        r = wl.request()
        p = await h.dispatch(DispatchRequest(
            request_id=r.request_id, deployment="d", model="m", input_tokens=r.input_tokens,
            predicted_tokens=r.predicted_tokens, adapter=r.adapter, adapter_rank=r.adapter_rank,
            prefer=hints.pop() if args.prefer else []))
        placed.append((p.worker_id, r.request_id, r.input_tokens))

    for _ in range(args.outstanding):
        await one()
        settle()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    cpu, fin, book = [], [], []
    tt = time.thread_time_ns
    for _ in range(args.live_decisions):
        k = wl.rng.randrange(len(placed))
        placed[k], placed[-1] = placed[-1], placed[k]
        wid, rid, n_in = placed.pop()
        c0 = tt()
        await h.on_finished(Completed(request_id=rid, worker_id=wid, input_tokens=n_in, output_tokens=100,
                                      e2e_ms=2000.0, ttft_ms=200.0, queue_ms=10.0, atgt_ms=30.0))
        c1 = tt()
        await one()
        c2 = tt()
        settle()  # the bookkeeping the handler left for after its reply (aladdin/caraserve)
        c3 = tt()
        fin.append((c1 - c0) / 1e3)
        cpu.append((c2 - c1) / 1e3)
        book.append((c3 - c2) / 1e3)
        await asyncio.sleep(0)  # let the loop run what the handler queued (now a no-op), as
        await asyncio.sleep(0)  # the service's loop does between messages (not timed)
    gc.set_threshold(*gc_before)
    gc.unfreeze()
    total = [a + b for a, b in zip(cpu, book)]
    return {"policy": name, "index": index, "dispatch_cpu_p50_us": pct(cpu, 50), "dispatch_cpu_p99_us": pct(cpu, 99),
            "after_reply_cpu_p50_us": pct(book, 50), "after_reply_cpu_p99_us": pct(book, 99),
            "with_bookkeeping_cpu_p50_us": pct(total, 50), "with_bookkeeping_cpu_p99_us": pct(total, 99),
            "completed_cpu_p50_us": pct(fin, 50), "completed_cpu_p99_us": pct(fin, 99),
            "indexed_decisions": view.indexed_decisions, "dispatches": view.placed, "prefer": args.prefer}


_NO_SCAN = {"dispatch_cpu_p50_us": math.nan, "dispatch_cpu_p99_us": math.nan, "completed_cpu_p50_us": math.nan,
            "with_bookkeeping_cpu_p99_us": math.nan}


def live_main(names: list[str], args: argparse.Namespace) -> int:
    import asyncio

    _say(f"bench dispatch --live: DispatchHandlers in process, {args.workers} workers, {args.outstanding} "
         f"outstanding, {args.live_decisions} dispatches per policy after a completed event each"
         f"{f', each naming {args.prefer} preferred workers' if args.prefer else ''}; CPU µs; "
         f"{machine.line()}; {native.describe()}")
    _say(f"{'policy':18} {'scan p50':>9} {'scan p99':>9} {'index p50':>9} {'index p99':>9} {'x p50':>6} "
         f"{'completed p50 (scan / index)':>29} {'after reply p50/p99':>20} {'with it p50/p99':>16}")
    results = []
    for name in names:
        scan = asyncio.run(_live_run(name, False, args)) if args.live_scan else _NO_SCAN
        fast = asyncio.run(_live_run(name, True, args))
        results += [scan, fast] if args.live_scan else [fast]
        _say(f"{name:18} {scan['dispatch_cpu_p50_us']:9.1f} {scan['dispatch_cpu_p99_us']:9.1f} "
             f"{fast['dispatch_cpu_p50_us']:9.1f} {fast['dispatch_cpu_p99_us']:9.1f} "
             f"{scan['dispatch_cpu_p50_us'] / fast['dispatch_cpu_p50_us']:6.0f} "
             f"{scan['completed_cpu_p50_us']:14.1f} / {fast['completed_cpu_p50_us']:<12.1f} "
             f"{fast['after_reply_cpu_p50_us']:9.1f}/{fast['after_reply_cpu_p99_us']:<8.1f} "
             f"{fast['with_bookkeeping_cpu_p50_us']:7.1f}/{fast['with_bookkeeping_cpu_p99_us']:.1f}")
    _say(f"scan = POLYSERVE_DISPATCHER_INDEX=false (views built from every live heartbeat per dispatch), "
         f"index = the default; p50/p99 = the dispatch handler up to its reply; after reply = the "
         f"placement's bookkeeping the handler leaves for after its reply (`LiveView.settle`); with it = "
         f"both; load {os.getloadavg()[0]:.2f} at the end")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": {"build": native.describe(), "machine": machine.describe()},
                                                "results": results}, indent=1))
    return 0


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="polyserve bench dispatch", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1200)
    ap.add_argument("--runtimes", type=int, default=12, help="Arlo static-length runtimes (encoder policies)")
    ap.add_argument("--outstanding", type=int, default=2400, help="requests in flight (and the burst size)")
    ap.add_argument("--decisions", type=int, default=5000, help="steady-state decisions timed per policy")
    ap.add_argument("--pure-decisions", type=int, default=1000,
                    help="of those, how many also run the pure scan in lockstep (it is slow)")
    ap.add_argument("--no-pure-burst", dest="pure_burst", action="store_false",
                    help="skip the pure scan's burst (minutes for aladdin at 1,200 workers)")
    ap.add_argument("--policy", default="all", help=f"comma-separated, or all: {', '.join(ALL)}")
    ap.add_argument("--profile", default=str(PROFILE), help="perf profile JSON of the LLM workers")
    ap.add_argument("--trace", default=str(TRACE), help="Azure LLM trace CSV for request sizes")
    ap.add_argument("--adapters", type=int, default=64, help="LoRA adapters in the deployment")
    ap.add_argument("--max-adapters", type=int, default=8, help="adapter slots per worker")
    ap.add_argument("--lora-share", type=float, default=0.9, help="share of requests naming an adapter")
    ap.add_argument("--kernel", default=BGMV, choices=[BGMV, MBGMV, "mixed"])
    ap.add_argument("--per-worker-perf", action="store_true",
                    help="each worker its own perf-model object (as with per-worker online fits), equal values")
    ap.add_argument("--perf-spread", type=float, default=0.0,
                    help="each worker its own fit, every coefficient x U(1-F, 1+F) (online fits that differ)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-index", metavar="FILE",
                    help="another version of dispatcher/index.py (e.g. from `git show REV:services/dispatcher/"
                         "index.py`): each policy is also run with it, as a row 'POLICY (baseline)'")
    ap.add_argument("--live", action="store_true",
                    help="time the live dispatcher's handlers (DispatchHandlers) with the index off and on")
    ap.add_argument("--live-decisions", type=int, default=1000, help="steady-state dispatches per policy with --live")
    ap.add_argument("--prefer", type=int, default=0, metavar="K",
                    help="with --live, every request names K random workers in DispatchRequest.prefer (the "
                         "gateway's cache-affinity / prefix hint: dispatcher/prefer.py)")
    ap.add_argument("--no-live-scan", dest="live_scan", action="store_false",
                    help="with --live, time the index only (the scan takes seconds per policy)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--out", help="also write the JSON results to this file")
    return ap


def _check(args: argparse.Namespace) -> list[str]:
    names = ALL if args.policy == "all" else [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in names if p not in ix.FAST_POLICIES]
    if bad:
        raise SystemExit(f"unknown policy {', '.join(bad)}; choose from: all, {', '.join(ALL)}")
    for k in ("workers", "outstanding", "decisions"):
        if getattr(args, k) < 1:
            raise SystemExit(f"--{k} must be >= 1")
    if args.pure_decisions < 0 or args.adapters < 0 or args.max_adapters < 0:
        raise SystemExit("--pure-decisions, --adapters and --max-adapters must be >= 0")
    if not 0 <= args.prefer <= min(16, args.workers):
        raise SystemExit(f"--prefer must be between 0 and {min(16, args.workers)} (the dispatcher reads 16 at most)")
    if not Path(args.profile).is_file():
        raise SystemExit(f"profile {args.profile} not found; pass --profile PATH to a perf profile JSON")
    args.pure_decisions = min(args.pure_decisions, args.decisions)
    return names


def load_baseline_index(path: Path):
    """Another copy of `dispatcher/index.py` as a module, with the `index_structs.py` and
    `index_models.py` beside it when there are (a copy of the whole folder), else today's."""
    import importlib.util

    if not path.is_file():
        raise SystemExit(f"--baseline-index {path} not found; pass a copy of dispatcher/index.py")
    saved = {}
    try:
        for part in ("index_structs", "index_models", "index_cara", "index"):
            file = path if part == "index" else path.with_name(f"{part}.py")
            if not file.is_file():
                continue
            spec = importlib.util.spec_from_file_location(f"polyserve_baseline_{part}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            # the next baseline module's `from polyserve.dispatcher.<part> import ...` gets this copy
            name = f"polyserve.dispatcher.{part}"
            saved.setdefault(name, sys.modules.get(name))
            sys.modules[name] = module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = _check(args)
    if args.live:
        if args.live_decisions < 1:
            raise SystemExit("--live-decisions must be >= 1")
        return live_main(names, args)
    meta = {"machine": machine.describe(),  # CPU, flags, CPUs, Python, load
            "loadavg_start": os.getloadavg(), "args": {k: v for k, v in vars(args).items()},
            "build": native.describe()}
    if not args.json:
        _say(f"bench dispatch: {args.workers} workers, {args.outstanding} outstanding, {args.decisions} decisions "
             f"per policy ({args.pure_decisions} also by the pure scan); {machine.line(meta['machine'])}; "
             f"{meta['build']}")
        _say(f"{'':18} {'CPU µs per decision (+ its update)':^50} {'wall µs':>10} {f'{args.outstanding}-burst, ms':^23}")
        _say(f"{'policy':18} {'scan p50':>9} {'scan p99':>9} {'index p50':>9} {'index p99':>9} {'x p50':>5} "
             f"{'x p99':>5} {'index p99':>10} {'scan':>8} {'index':>6} {'(wall)':>7} {'hb p99':>7} {'same':>10} "
             f"{'dec p50/p99':>12} {'upd p50/p99':>12}")
    global ix
    runs = [("", ix)]
    if args.baseline_index:
        base_ix = load_baseline_index(Path(args.baseline_index))
        runs.insert(0, (" (baseline)", base_ix))
    results = []
    for name, (suffix, module) in ((n, run) for n in names for run in runs):
        current, ix = ix, module
        try:
            r = run_policy(name, args)
        finally:
            ix = current
        r["index_module"] = "baseline" if suffix else "current"
        r["label"] = name + suffix
        results.append(r)
        name = name + suffix
        if not args.json:
            _say(f"{name:18} {_fmt(r['pure_cpu_p50_us']):>9} {_fmt(r['pure_cpu_p99_us']):>9} "
                 f"{_fmt(r['fast_cpu_p50_us']):>9} {_fmt(r['fast_cpu_p99_us']):>9} {_fmt(r['speedup_p50'], '.0f'):>5} "
                 f"{_fmt(r['speedup_p99'], '.0f'):>5} {_fmt(r['fast_p99_us']):>10} {_fmt(r['burst_pure_cpu_ms'], '.0f'):>8} "
                 f"{_fmt(r['burst_fast_cpu_ms']):>6} {_fmt(r['burst_fast_ms']):>7} "
                 f"{_fmt(r['heartbeat_upsert_p99_us']):>7} {r['identical']:>5}/{r['compared']:<4} "
                 f"{_fmt(r['decision_cpu_p50_us']):>5}/{_fmt(r['decision_cpu_p99_us']):<6} "
                 f"{_fmt(r['update_cpu_p50_us']):>5}/{_fmt(r['update_cpu_p99_us']):<6}")
    meta["loadavg_end"] = os.getloadavg()
    diverged = [r["label"] for r in results if r["identical"] != r["compared"] or not r["burst_same_placements"]]
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.json:
        _say(json.dumps({"meta": meta, "results": results}, indent=1))
    else:
        slow = [r["label"] for r in results if not r["meets_50us_p99"]]
        slow_cpu = [r["label"] for r in results if not r["meets_50us_p99_cpu"]]
        over_20 = [r["label"] for r in results if not r["meets_20us_p99_cpu"]]
        _say(f"\nindex = polyserve.dispatcher.index, a decision + the update it causes; scan = the policy "
             f"function over the dispatcher's list of views (O(n)), + the same update; CPU = thread_time_ns "
             f"(leaves out time the thread was preempted: this machine may be shared), wall = perf_counter_ns; "
             f"x = scan / index (CPU); hb = a heartbeat upsert into the index; same = identical decisions / "
             f"compared; dec / upd = the index's decision alone / the update it causes (CPU). "
             f"Arlo reports {ARLO_PAPER_BURST_MS} ms for a 2,400-request burst over 1,200 instances "
             f"in C++.")
        _say(f"index p99 <= 50 µs (CPU): {'all policies' if not slow_cpu else 'not ' + ', '.join(slow_cpu)}; "
             f"(wall): {'all policies' if not slow else 'not ' + ', '.join(slow)}; "
             f"load {meta['loadavg_end'][0]:.2f} at the end")
        _say(f"index p99 <= 20 µs (CPU): {'all policies' if not over_20 else 'not ' + ', '.join(over_20)}")
        dec_20 = [r["label"] for r in results if not r["decision_cpu_p99_us"] <= 20.0]
        burst_20 = [r["label"] for r in results if not r["burst_fast_cpu_ms"] <= 20.0]
        _say(f"decision alone p99 <= 20 µs (CPU): {'all policies' if not dec_20 else 'not ' + ', '.join(dec_20)}; "
             f"{args.outstanding}-burst <= 20 ms (CPU): {'all policies' if not burst_20 else 'not ' + ', '.join(burst_20)}")
        if diverged:
            _say(f"DECISIONS DIFFER between pure and indexed: {', '.join(diverged)}")
    return 1 if diverged else 0


if __name__ == "__main__":
    sys.exit(main())
