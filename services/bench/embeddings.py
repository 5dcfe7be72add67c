"""`polyserve bench embeddings`: Arlo's comparison through the live system (and the simulator).

Each run starts, in this process, a dispatcher, a gateway and G encoder workers
(each hosting ONE runtime) on a real nats-server and redis-server, replays an
open-loop arrival trace of `/v1/embeddings` requests (one input each, Twitter-like
lengths by default) over HTTP, and records client-side latency.

Parts (all by default; pick with `--parts`):

* ``live``: real compute on this CPU (one torch thread per worker, G = `--workers`,
  default 2 = the cores here): ST (every worker a static 512 runtime, JSQ), DT (every
  worker the dynamic runtime, JSQ) and polymorphing + Arlo MLQ (runtimes from the
  profile, instances per runtime by the planner's §3.3 ILP, `simulator.encoder.allocate`)
  at increasing rates (fractions of ST's capacity).
* ``replay``: the same schemes (at 0.5x and 1.5x ST's capacity) and the MLQ / ILB /
  IG comparison under a bursty pattern (at 0.85x polymorphing's capacity), through
  the same live control plane, with workers that replay the measured profile's
  latency instead of computing (labelled SIMULATED): G = `--replay-workers`
  instances on a 2-core host, as if each were its own accelerator, each
  `--replay-scale` times slower than the profile so that one Python process carries
  the gateway, dispatcher, workers and client at the resulting rates.
* ``sim``: the discrete-event simulator with the same policies at large scale
  (`--sim-workers`, default 100), SIMULATED.

Prints mean / P50 / P98 latency per run, writes `results.json` and `latency_cdf.png`
under `--out`.

    python -m polyserve.bench.embeddings --profile services/core/profiles/encoder-minilm-l6-cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import msgspec

from polyserve.core import profiles
from polyserve.core.profiles import profile_path
from polyserve.proto import Deployment, EncoderProfile, ScalerPolicy
from polyserve.simulator import encoder as bsim

logger = logging.getLogger(__name__)
DEFAULT_PROFILE = profile_path(profiles.ENCODER_CPU)
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------- one live run
async def live_run(infra_urls: tuple[str, str], profile_path: str, profile: EncoderProfile,
                   fleet: list[tuple[str, int, int]], policy: str, trace: list[bsim.Arrival], *,
                   replay: bool, backend: str, time_scale: float = 1.0) -> list[float]:
    """Start dispatcher + gateway + one worker per fleet entry, replay `trace`, stop; latencies (ms)."""
    from polyserve.dispatcher.config import DispatcherSettings
    from polyserve.dispatcher.service import DispatcherService
    from polyserve.gateway.config import GatewaySettings
    from polyserve.gateway.service import GatewayService
    from polyserve.proto import Keys
    from polyserve.shared import settings as settings_mod
    from polyserve.shared.state import State, connect
    from polyserve.worker.config import WorkerSettings
    from polyserve.worker.engines.encoder import EncoderConfig, EncoderEngine
    from polyserve.worker.service import WorkerService

    nats_url, redis_url = infra_urls
    prefix = "be" + uuid.uuid4().hex[:8]

    def cfg(cls, svc, **kw):
        base = dict(nats_url=nats_url, redis_url=redis_url, prefix=prefix, drain_timeout_s=10.0,
                    service_ttl_s=5.0, log_level="WARNING")
        base.update(kw)
        return settings_mod.load(cls, svc, environ={}, **base)

    state = State(connect(redis_url), Keys(prefix))
    dep = "embed"
    await state.put_deployment(Deployment(id=dep, model=MODEL, engine="encoder", policy=policy,
                                          scaler=ScalerPolicy(min_replicas=len(fleet), max_replicas=len(fleet))))
    await state.close()
    workers = []
    for i, (shape, max_len, cap) in enumerate(fleet):
        engine = EncoderEngine(EncoderConfig(
            model=MODEL, max_length=max_len, batch_size=1, shape=shape,
            backend=(backend if shape == "static" else "eager"), slo_ms=profile.slo_ms, capacity=cap,
            threads=1, profile=profile_path if replay else "", max_waiting=100_000,
            time_scale=time_scale if replay else 1.0))
        ws = cfg(WorkerSettings, "worker", worker_id=f"w{i}-{shape[0]}{max_len}", deployment=dep, model=MODEL,
                 heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0)
        workers.append(WorkerService(ws, engine=engine))
    dispatcher = DispatcherService(cfg(DispatcherSettings, "dispatcher"))
    gateway = GatewayService(cfg(GatewaySettings, "gateway", port=0, max_inflight=100_000,
                                 first_token_timeout_s=120.0))
    services = [dispatcher, *workers, gateway]
    tasks = []
    try:
        for s in services:
            tasks.append(asyncio.create_task(s.run()))
            await asyncio.wait_for(s.ready.wait(), timeout=120)
        await asyncio.sleep(1.2)  # a heartbeat from every worker reaches the dispatcher
        return await drive(gateway.url, dep, trace)
    finally:
        for s in reversed(services):
            s.request_stop()
        await asyncio.wait(tasks, timeout=30)


async def drive(url: str, dep: str, trace: list[bsim.Arrival], warmup: int = 4) -> list[float]:
    """Open loop: send each arrival at its time (not waiting for earlier answers)."""
    lat: list[float] = []
    failed = 0
    texts: dict[int, str] = {}

    def text(n: int) -> str:  # "word" is one token: n-2 of them plus [CLS] and [SEP]
        return texts.setdefault(n, " ".join(["word"] * max(1, n - 2)))

    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200)) as http:
        for n in (16, 64, 128, 256)[:warmup]:
            await http.post("/v1/embeddings", json={"model": dep, "input": text(n), "encoding_format": "base64"})

        async def one(a: bsim.Arrival) -> None:
            nonlocal failed
            t = time.perf_counter()
            r = await http.post("/v1/embeddings", json={"model": dep, "input": text(a.tokens),
                                                        "encoding_format": "base64"})
            if r.status_code == 200:
                lat.append((time.perf_counter() - t) * 1e3)
            else:
                failed += 1
                if failed <= 3:
                    logger.warning("request failed: %s %s", r.status_code, r.text[:200])

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pending = []
        for a in trace:
            delay = t0 + a.t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            pending.append(asyncio.create_task(one(a)))
        await asyncio.gather(*pending)
    if failed:
        _say(f"    ({failed} requests failed)")
    return lat


# ---------------------------------------------------------------------- experiment
def _row(label: str, lat: list[float], sim: bool) -> dict:
    s = bsim.summary(lat)
    _say(f"  {label:<44} n={s['n']:5d}  mean {s['mean']:8.1f} ms  p50 {s['p50']:8.1f}  p98 {s['p98']:8.1f}"
         + ("   [SIMULATED]" if sim else ""))
    return {"label": label, "simulated": sim, **s}


def _cdf(lat: list[float], points: int = 2000) -> list[float]:
    """The sorted latencies, thinned to at most `points` evenly spaced quantiles."""
    s = sorted(lat)
    if len(s) <= points:
        return s
    return [s[round(i * (len(s) - 1) / (points - 1))] for i in range(points)]


def _lengths(args, rng: random.Random) -> list[int]:
    if args.lengths == "azure-code":
        return bsim.azure_code_lengths()
    return [bsim.twitter_like(rng) for _ in range(20_000)]


async def run_all(args) -> dict:
    from polyserve.shared import infra

    profile = msgspec.json.decode(Path(args.profile).read_bytes(), type=EncoderProfile)
    rng = random.Random(args.seed)
    sample = [min(n, max(r.max_length for r in profile.runtimes)) for n in _lengths(args, rng)]
    dist = sample  # arrivals draw from this sample (capped at the longest runtime)
    rts = {r.max_length: r for r in profile.runtimes}
    top = max(rts)
    results: dict = {"profile": args.profile, "lengths": args.lengths, "runs": [], "cdf": {}}
    _say(f"lengths: {args.lengths}, median {sorted(sample)[len(sample) // 2]}, "
         f"P98 {sorted(sample)[int(0.98 * len(sample))]} tokens; runtimes {sorted(rts)}; "
         f"ST latency at {top}: {rts[top].latency_ms[0]:.1f} ms")
    run_dir = Path(tempfile.mkdtemp(prefix="pbe-", dir="/tmp"))
    nats, nats_url, _ = infra.start_nats(run_dir / "nats")
    redis, redis_url = infra.start_redis(run_dir / "redis", unix_socket=str(run_dir / "r.sock"))
    urls = (nats_url, redis_url)
    try:
        for part, workers, replay in (("live", args.workers, False), ("replay", args.replay_workers, True)):
            if part not in args.parts:
                continue
            scale = args.replay_scale if replay else 1.0
            st_cap = workers * 1000.0 / rts[top].latency_ms[0] / scale
            tag = f"SIMULATED replay, each instance {scale:g}x slower than the profile, " if replay else ""
            _say(f"\n== {part}: {workers} workers ({tag}ST capacity ~{st_cap:.1f} req/s by the profile)")
            for frac in (args.loads if replay else args.live_loads):
                rate = frac * st_cap
                trace = bsim.arrivals(rate, args.duration, random.Random(args.seed), lengths=dist)
                fl = bsim.fleets(profile, workers, sample, rate * scale)
                _say(f" rate {rate:.1f} req/s ({frac:.0%} of ST capacity), {len(trace)} requests; polymorphing "
                     f"runtimes {[n for _, n, _ in fl['polymorphing']]}")
                for scheme, policy in (("ST", "least_outstanding"), ("DT", "least_outstanding"),
                                       ("polymorphing", "arlo_mlq")):
                    lat = await live_run(urls, args.profile, profile, fl[scheme], policy, trace, replay=replay,
                                         backend=args.backend, time_scale=scale)
                    label = f"{part} {scheme}{'+MLQ' if policy == 'arlo_mlq' else ''} @{rate:.1f}/s"
                    results["runs"].append(_row(label, lat, replay))
                    results["cdf"][label] = _cdf(lat)
            if replay and "bursty" in args.parts:
                rate = args.bursty_load * bsim.poly_capacity(profile, sample, workers) / scale
                trace = bsim.arrivals(rate, args.duration, random.Random(args.seed + 1), bursty=True, lengths=dist)
                fl = bsim.fleets(profile, workers, sample, rate * scale)["polymorphing"]
                _say(f" bursty (MMPP, short bursts) {rate:.1f} req/s mean ({args.bursty_load:.0%} of polymorphing's "
                     f"capacity), {len(trace)} requests, runtimes "
                     f"{[n for _, n, _ in fl]}")
                for policy in ("arlo_mlq", "arlo_ilb", "arlo_ig"):
                    lat = await live_run(urls, args.profile, profile, fl, policy, trace, replay=True,
                                         backend=args.backend, time_scale=scale)
                    label = f"bursty {policy} @{rate:.1f}/s"
                    results["runs"].append(_row(label, lat, True))
                    results["cdf"][label] = _cdf(lat)
    finally:
        for proc in (redis, nats):
            proc.terminate()
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    if "sim" in args.parts:
        sim_part(args, profile, sample, dist, results)
    return results


def sim_part(args, profile: EncoderProfile, sample: list[int], dist, results: dict) -> None:
    rts = {r.max_length: r for r in profile.runtimes}
    g = args.sim_workers
    st_cap = g * 1000.0 / rts[max(rts)].latency_ms[0]
    _say(f"\n== sim: {g} instances, discrete-event simulator with the measured profile [SIMULATED]")
    for frac in args.loads:
        rate = frac * st_cap
        trace = bsim.arrivals(rate, args.sim_duration, random.Random(args.seed), lengths=dist)
        fl = bsim.fleets(profile, g, sample, rate)
        for scheme, policy in (("ST", "least_outstanding"), ("DT", "least_outstanding"),
                               ("polymorphing", "arlo_mlq")):
            lat = bsim.simulate(profile, fl[scheme], policy, trace)
            label = f"sim {scheme}{'+MLQ' if policy == 'arlo_mlq' else ''} {g}w @{rate:.0f}/s"
            results["runs"].append(_row(label, lat, True))
            results["cdf"][label] = _cdf(lat)
    rate = args.bursty_load * bsim.poly_capacity(profile, sample, g)
    trace = bsim.arrivals(rate, args.sim_duration, random.Random(args.seed + 1), bursty=True, lengths=dist)
    fl = bsim.fleets(profile, g, sample, rate)["polymorphing"]
    for policy in ("arlo_mlq", "arlo_ilb", "arlo_ig"):
        lat = bsim.simulate(profile, fl, policy, trace)
        label = f"sim bursty {policy} {g}w @{rate:.0f}/s"
        results["runs"].append(_row(label, lat, True))
        results["cdf"][label] = _cdf(lat)


def plot(results: dict, path: Path) -> None:
    """Latency CDFs, one panel per group of comparable runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups: dict[str, list[str]] = {}
    for label in results["cdf"]:
        key = label.split(" ")[0] + (" " + label.rsplit("@", 1)[-1] if "@" in label else "")
        if label.startswith("sim bursty"):
            key = "sim bursty"
        groups.setdefault(key, []).append(label)
    n = len(groups)
    if not n:
        return
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (key, labels) in zip(axes.flat, groups.items()):
        for label in labels:
            xs = results["cdf"][label]
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label.split(" @")[0])
        sim = any(r["simulated"] for r in results["runs"] if r["label"] in labels)
        ax.set_title(key + (" (SIMULATED)" if sim else " (measured)"), fontsize=9)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="polyserve bench embeddings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="EncoderProfile JSON (polyserve profile --encoder)")
    ap.add_argument("--parts", default="live,replay,bursty", help="comma list of live, replay, bursty, sim")
    ap.add_argument("--lengths", default="twitter", choices=("twitter", "azure-code"))
    ap.add_argument("--workers", type=int, default=2, help="live part: real-compute workers")
    ap.add_argument("--replay-workers", type=int, default=8)
    ap.add_argument("--replay-scale", type=float, default=3.0,
                    help="replayed instances run this many times slower than the profile (rates and the SLO "
                         "scale with it), so one Python process can carry the control plane's load")
    ap.add_argument("--sim-workers", type=int, default=100)
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.5],
                    help="replay and sim parts: rates as fractions of ST's capacity by the profile")
    ap.add_argument("--live-loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.3, 0.6],
                    help="live part: rates as fractions of ST's capacity by the profile (lower: the profile is "
                         "CPU time on a core of its own, and this host's cores are shared)")
    ap.add_argument("--bursty-load", type=float, default=0.85,
                    help="bursty runs: mean rate as a fraction of polymorphing's capacity (ideal runtimes)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per live run")
    ap.add_argument("--sim-duration", type=float, default=60.0, help="seconds of simulated arrivals")
    ap.add_argument("--backend", default="jit", choices=("jit", "compile", "eager"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="/tmp/polyserve-bench-embeddings")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("polyserve", "httpx", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = asyncio.run(run_all(args))
    results["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "latency_cdf.png")
    _say(f"\nwrote {out / 'results.json'} and {out / 'latency_cdf.png'} in {results['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
