"""`polyserve bench overhead`: the control plane's own cost.

Runs, side by side in one invocation, (a) a bare FastAPI endpoint returning the
same body and (b) the full path gateway -> predictor -> dispatcher -> worker
(sim engine with zero compute time) -> gateway, each in its own processes, and
drives both with the same closed-loop HTTP client. Prints requests/s and
latency p50/p99 for non-streamed and streamed requests, their ratios, and where
the control plane's time goes (per-stage latencies from the request events).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from polyserve.cli import launcher
from polyserve.proto import Keys
from polyserve.shared import batching, infra, machine
from polyserve.shared.state import connect_sync


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> float:
    t = time.perf_counter()
    if body.get("stream"):
        async with client.stream("POST", url, json=body) as resp:
            resp.raise_for_status()
            async for _ in resp.aiter_lines():
                pass
    else:
        resp = await client.post(url, json=body)
        resp.raise_for_status()
    return (time.perf_counter() - t) * 1e3


async def _drive_raw(base: str, model: str, stream: bool, n: int, concurrency: int, tokens: int,
                     go: float = 0.0) -> tuple[list[float], float, float]:
    """(latencies ms, start, end) of `n` closed-loop requests over `concurrency` connections,
    timed from `go` (a `time.perf_counter` instant, shared by the processes of `drive_procs`;
    0 = once warmed up). See `drive`."""
    body = {"model": model, "prompt": "measure the control plane overhead please", "max_tokens": tokens,
            "stream": stream, "min_tokens": tokens}
    url = base + "/v1/completions"
    lat: list[float] = []
    clients = [httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(_one(c, url, body) for c in clients))  # open every connection
        for _ in range(min(20, n)):  # warm-up
            await _one(clients[0], url, body)
        remaining = n

        async def worker(client: httpx.AsyncClient):
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                lat.append(await _one(client, url, body))

        if go > time.perf_counter():
            await asyncio.sleep(go - time.perf_counter())
        t = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        end = time.perf_counter()
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return lat, max(t, go), end


def _summary(lat: list[float], elapsed: float) -> dict:
    arr = np.array(lat)
    return {"rps": len(lat) / elapsed, "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)), "mean_ms": float(arr.mean()), "n": len(lat)}


async def drive(base: str, model: str, stream: bool, n: int, concurrency: int, tokens: int) -> dict:
    """Closed-loop load: `concurrency` clients send `n` requests in total.

    Each client has its own one-connection httpx pool: one pool of `concurrency` connections
    costs O(connections) per request in httpx (`_assign_requests_to_connections` checks every
    connection's expiry, with a getpeername each); at 64 that was 8 ms of client CPU per request,
    the load generator taking the 2-core machine from both sides (docs/benchmarks/overhead.md)."""
    lat, t0, t1 = await _drive_raw(base, model, stream, n, concurrency, tokens)
    return _summary(lat, t1 - t0)


def _client(job: tuple) -> tuple[list[float], float, float, float]:
    """One load generator process's share of `drive_procs` (run in a child): its latencies, start,
    end and the CPU seconds it used."""
    c0 = time.process_time()
    lat, t0, t1 = asyncio.run(_drive_raw(*job))
    return lat, t0, t1, time.process_time() - c0


def drive_procs(pool, k: int, base: str, model: str, stream: bool, n: int, concurrency: int,
                tokens: int) -> tuple[dict, float]:
    """`drive` from `k` processes of `pool` (`--clients`: one Python process drives ~1,000
    requests/s at most, so on a machine with more cores it would be the limit, not the endpoint),
    `n` and `concurrency` split evenly, all timed from one instant; (`drive`'s figures over every
    process, their CPU ms)."""
    k = min(k, concurrency)  # at least one connection per process
    if k <= 1:
        me = _cpu_s(os.getpid())
        out = asyncio.run(drive(base, model, stream, n, concurrency, tokens))
        return out, (_cpu_s(os.getpid()) - me) * 1e3
    go = time.perf_counter() + 2.0  # after every process has opened its connections and warmed up
    jobs = [(base, model, stream, n // k + (i < n % k), concurrency // k + (i < concurrency % k),
             tokens, go) for i in range(k)]
    parts = list(pool.map(_client, jobs))
    lat = [x for p in parts for x in p[0]]
    return _summary(lat, max(p[2] for p in parts) - min(p[1] for p in parts)), sum(p[3] for p in parts) * 1e3


async def stage_breakdown(nats_url: str, prefix: str, base: str, model: str, n: int) -> dict:
    """Per-stage latencies from the request events of `n` sequential requests."""
    import nats

    nc = await nats.connect(nats_url)
    stages: dict[str, list[float]] = {"predict_ms": [], "dispatch_ms": [], "ttft_ms": [], "e2e_ms": []}

    async def on_msg(msg) -> None:
        for ev in batching.event_dicts(msg.data):  # one event or several (shared/batching.py)
            kind = ev.get("event")
            if kind == "predicted":
                stages["predict_ms"].append(ev["latency_ms"])
            elif kind == "dispatched":
                stages["dispatch_ms"].append(ev["latency_ms"])
            elif kind == "first_token":
                stages["ttft_ms"].append(ev["ttft_ms"])
            elif kind == "completed":
                stages["e2e_ms"].append(ev["e2e_ms"])

    await nc.subscribe(f"{prefix}.v1.events.request.>", cb=on_msg)
    await nc.flush()
    await drive(base, model, False, n, 1, 16)
    await asyncio.sleep(0.3)
    await nc.drain()
    return {k: round(statistics.median(v), 3) for k, v in stages.items() if v}


def _ready(_: int) -> int:
    """A `--clients` process, started: it has imported this module (and httpx) by now."""
    return os.getpid()


def _wait_workers(state: launcher.ClusterState, n: int, timeout: float = 60.0) -> None:
    """Until `n` workers are in the registry (`launcher.up` waits for the first)."""
    r, keys = connect_sync(state.redis_url), Keys(state.prefix)
    deadline = time.monotonic() + timeout
    while (have := launcher.live_counts(r, keys)[1]) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{have} of {n} workers ready within {timeout:.0f} s; logs in {state.run_dir}/logs")
        time.sleep(0.2)


def _wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up within {timeout}s")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) `pid` has used; 0 once it is gone (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _processes(state: launcher.ClusterState) -> dict[str, int]:
    """pid of every process of the run by role (gateways summed as "gateway"; workers are
    the gpu-agent's children); the load generator's CPU comes from `drive_procs`."""
    procs = {name: pid for name, pid in state.pids.items() if name != "supervisor"}
    agent = state.pids.get("gpu-agent")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent:
                procs[f"worker-{stat.parent.name}"] = int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return procs


def _role(name: str) -> str:
    return "gateway" if name.startswith("gateway") else "worker" if name.startswith("worker-") else name


def _spec(args: argparse.Namespace, gateways: int) -> launcher.ClusterSpec:
    return launcher.ClusterSpec(
        run_dir=Path(tempfile.mkdtemp(prefix="ps-bench-")), engine="sim", model="bench-sim",
        port=infra.free_port(), nats_port=0, redis_port=0, prefix="polyserve",
        gateways=gateways, min_replicas=args.workers, max_replicas=args.workers,
        extra_env={"POLYSERVE_WORKER_TIME_SCALE": "0", "POLYSERVE_LOG_LEVEL": "WARNING",
                   # the control plane alone: the historical-mean predictor, unless
                   # --with-model also measures the BERT proxy model on this CPU
                   "POLYSERVE_PREDICTOR_PROXY_ARTIFACT": "shipped" if args.with_model else ""})


def _cpu_ms(procs: dict[str, int], before: dict[str, float], into: dict[str, float]) -> None:
    """Add the CPU ms each role used since `before` to `into`."""
    for name, pid in procs.items():
        role = _role(name)
        into[role] = into.get(role, 0.0) + (_cpu_s(pid) - before[name]) * 1e3


def _per_request(total_ms: dict[str, float], n: int) -> dict[str, float]:
    return {k: round(v / max(1, n), 3) for k, v in sorted(total_ms.items(), key=lambda kv: -kv[1])}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median requests/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["rps"])[(len(runs) - 1) // 2]


def _run(args: argparse.Namespace, gateways: int, bare_url: str | None, bare_pid: int = 0, pool=None) -> dict:
    """Every case against polyserve with `gateways` gateway processes (and against the bare
    endpoint, case by case, when `bare_url` is given), with the CPU each role used, and the
    CPU the bare endpoint and the load generator used for it (`bare_pid`). With `--repeats R`
    each case runs R bare / polyserve pairs back to back: the table shows each side's median
    run and the ratio of every pair (a single run's bare side alone moves by several percent on
    a shared 2-core machine); the CPU per request is over all R runs of a side."""
    spec = _spec(args, gateways)
    out: dict = {"results": {}, "cpu_ms_per_request": {}}
    repeats = max(1, args.repeats)
    try:
        state = launcher.up(spec, progress=lambda m: None)
        _wait_workers(state, args.workers)
        procs = _processes(state)
        out["workers"] = sum(1 for name in procs if name.startswith("worker-"))
        bare_procs = {"bare": bare_pid}
        k = args.clients
        for stream in (False, True):
            for conc in args.concurrency:
                case = f"{'stream' if stream else 'json'}-c{conc}"
                bare_runs: list[dict] = []
                ps_runs: list[dict] = []
                bare_ms: dict[str, float] = {}
                ps_ms: dict[str, float] = {}
                ps_s = 0.0
                for r in range(repeats):
                    of = f" ({r + 1}/{repeats})" if repeats > 1 else ""
                    if bare_url is not None:
                        print(f"  {case}: bare{of} ...", flush=True)
                        before = {n: _cpu_s(p) for n, p in bare_procs.items()}
                        res, lg_ms = drive_procs(pool, k, bare_url, "bare", stream, args.requests, conc, args.tokens)
                        bare_runs.append(res)
                        _cpu_ms(bare_procs, before, bare_ms)
                        bare_ms["load generator"] = bare_ms.get("load generator", 0.0) + lg_ms
                    print(f"  {case}: polyserve, {gateways} gateway process(es){of} ...", flush=True)
                    before = {n: _cpu_s(p) for n, p in procs.items()}
                    res, lg_ms = drive_procs(pool, k, state.gateway_url, "bench-sim", stream, args.requests, conc,
                                             args.tokens)
                    ps_runs.append(res)
                    ps_s += res["n"] / res["rps"]  # the timed part (not the connections, warm-up, start)
                    _cpu_ms(procs, before, ps_ms)
                    ps_ms["load generator"] = ps_ms.get("load generator", 0.0) + lg_ms
                cell: dict = {"polyserve": _median_run(ps_runs)}
                if bare_runs:
                    cell["bare"] = _median_run(bare_runs)
                    out.setdefault("bare_cpu_ms_per_request", {})[case] = _per_request(
                        bare_ms, sum(b["n"] for b in bare_runs))
                    if repeats > 1:
                        cell["pairs"] = [{"bare_rps": b["rps"], "polyserve_rps": p["rps"], "ratio": p["rps"] / b["rps"]}
                                         for b, p in zip(bare_runs, ps_runs)]
                n_ps = sum(p["n"] for p in ps_runs)
                cpu = _per_request(ps_ms, n_ps)
                cpu["cores busy"] = round(sum(ps_ms.values()) / 1e3 / ps_s, 2)
                out["results"][case], out["cpu_ms_per_request"][case] = cell, cpu
        if bare_url is not None:
            out["stages"] = asyncio.run(stage_breakdown(state.nats_url, state.prefix, state.gateway_url,
                                                         "bench-sim", 100))
    finally:
        launcher.down(spec.run_dir, progress=lambda m: None)
    return out


def _print_overhead(args: argparse.Namespace, first: dict) -> None:
    predictor = "BERT proxy model" if args.with_model else "historical mean"
    print(f"\ncontrol-plane overhead ({args.requests} requests per cell, {args.tokens} output tokens, "
          f"sim worker with zero compute time, predictor: {predictor}, {args.gateways[0]} gateway process(es))")
    print(f"{'case':<12}{'bare rps':>10}{'ps rps':>10}{'rps ratio':>10}{'bare p50':>10}{'ps p50':>10}"
          f"{'added p50':>11}{'bare p99':>10}{'ps p99':>10}")
    for case, r in first["results"].items():
        b, p = r["bare"], r["polyserve"]
        print(f"{case:<12}{b['rps']:>10.1f}{p['rps']:>10.1f}{p['rps'] / b['rps']:>10.3f}{b['p50_ms']:>10.2f}"
              f"{p['p50_ms']:>10.2f}{p['p50_ms'] - b['p50_ms']:>11.2f}{b['p99_ms']:>10.2f}{p['p99_ms']:>10.2f}")
    pairs = {case: r["pairs"] for case, r in first["results"].items() if r.get("pairs")}
    if pairs:
        print(f"\n{len(next(iter(pairs.values())))} bare / polyserve pairs per case, run back to back (the table: "
              f"each side's median run); rps ratio of each pair, and their median:")
        for case, ps in pairs.items():
            ratios = [x["ratio"] for x in ps]
            print(f"{case:<12}" + " ".join(f"{x:.3f}" for x in ratios) + f"   median {statistics.median(ratios):.3f}")
    print(f"\nper-stage medians over 100 sequential requests (ms, from request events): {first['stages']}")
    _print_cpu(first)


ROLES = ("gateway", "worker", "nats-server", "predictor", "dispatcher")


def _print_cpu(first: dict) -> None:
    """CPU ms per request, both sides (load generator included), and their ratio: the requests/s
    ratio a machine would give where CPU is the only limit and the benchmark has it alone. Unlike
    requests/s it barely moves with what else runs on a shared machine (docs/benchmarks/overhead.md)."""
    bare_cpu = first.get("bare_cpu_ms_per_request", {})
    print("\nCPU ms per request (user + system, all processes; 'client' = the load generator)")
    print(f"{'case':<12}{'bare all':>10}{'ps all':>10}{'cpu ratio':>10}{'client':>8}"
          + "".join(f"{r[:10]:>11}" for r in ROLES) + f"{'rest':>8}")
    for case, cpu in first["cpu_ms_per_request"].items():
        if case not in bare_cpu:
            continue
        b = sum(bare_cpu[case].values())
        ps = {k: v for k, v in cpu.items() if k != "cores busy"}
        total = sum(ps.values())
        rest = total - ps.get("load generator", 0) - sum(ps.get(r, 0) for r in ROLES)
        print(f"{case:<12}{b:>10.2f}{total:>10.2f}{b / total:>10.3f}{ps.get('load generator', 0):>8.2f}"
              + "".join(f"{ps.get(r, 0):>11.2f}" for r in ROLES) + f"{rest:>8.2f}")


def _print_scale_out(runs: dict[int, dict]) -> None:
    """polyserve requests/s by gateway processes, and the CPU per request of each role (where
    the next bottleneck is: the role with the most ms, or the machine when its cores are busy)."""
    print(f"\nscale-out: polyserve requests/s by gateway processes (this machine: {os.cpu_count()} CPUs)")
    cases = list(next(iter(runs.values()))["results"])
    print(f"{'gateways':<10}" + "".join(f"{c:>12}" for c in cases))
    for n, run in runs.items():
        print(f"{n:<10}" + "".join(f"{run['results'][c]['polyserve']['rps']:>12.1f}" for c in cases))
    for n, run in runs.items():
        for case in cases[-1:] + [c for c in cases if c.endswith("-c8")][:1]:
            cpu = run["cpu_ms_per_request"][case]
            print(f"  {n} gateway(s), {case}: CPU ms/request " + ", ".join(f"{k} {v}" for k, v in cpu.items()))


def main(args: argparse.Namespace) -> int:
    """`polyserve bench overhead`: the overhead table with the first --gateways count, then
    (with several) the scale-out table."""
    if args.clients < 1 or args.workers < 1 or min(args.gateways) < 1 or min(args.concurrency) < 1:
        raise SystemExit("need --clients, --workers, --gateways and --concurrency of at least 1")
    bare_port = infra.free_port()
    bare = subprocess.Popen([sys.executable, "-m", "polyserve.bench.bare", "--port", str(bare_port),
                             "--tokens", str(args.tokens)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    facts = machine.describe()
    print(f"machine: {machine.line(facts)}")
    print(f"starting polyserve (sim engine, zero compute time, {args.workers} worker(s)) and a bare FastAPI "
          f"endpoint; {args.clients} load generator process(es) ...", flush=True)
    runs: dict[int, dict] = {}
    pool = None
    if args.clients > 1:  # started once, before any timing (a spawned process imports for ~1 s)
        pool = concurrent.futures.ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    try:
        if pool is not None:
            list(pool.map(_ready, range(args.clients)))
        _wait_http(f"http://127.0.0.1:{bare_port}/healthz")
        for i, n in enumerate(args.gateways):
            runs[n] = _run(args, n, f"http://127.0.0.1:{bare_port}" if i == 0 else None, bare.pid, pool)
    finally:
        bare.terminate()
        bare.wait(10)
        if pool is not None:
            pool.shutdown()
    _print_overhead(args, runs[args.gateways[0]])
    if len(runs) > 1:
        _print_scale_out(runs)
    if args.json:
        first = runs[args.gateways[0]]
        Path(args.json).write_text(json.dumps({"results": first["results"], "stages": first["stages"],
                                               "cpu_ms_per_request": first["cpu_ms_per_request"],
                                               "bare_cpu_ms_per_request": first.get("bare_cpu_ms_per_request", {}),
                                               "machine": facts, "load": os.getloadavg(), "by_gateways": runs}, indent=2))
        print(f"wrote {args.json}")
    return 0


def add_arguments(o) -> None:
    o.add_argument("--requests", type=int, default=500)
    o.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    o.add_argument("--tokens", type=int, default=16)
    o.add_argument("--json", help="also write the figures to this file")
    o.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="bare / polyserve pairs per case, back to back: each side's median run in the table, "
                        "every pair's ratio and their median below it (single runs move by several percent)")
    o.add_argument("--with-model", action="store_true",
                   help="predict with the BERT proxy model (default: the historical mean, i.e. the control plane alone)")
    o.add_argument("--clients", type=int, default=1, metavar="K",
                   help="load generator processes, the concurrency split among them (one Python process "
                        "drives ~1,000 requests/s at most: on a machine with many cores, e.g. for --gateways 4)")
    o.add_argument("--workers", type=int, default=1, metavar="W",
                   help="sim workers (zero compute time) behind the gateways")
    o.add_argument("--gateways", type=int, nargs="+", default=[1], metavar="N",
                   help="gateway processes (polyserve up --gateways N) to measure, e.g. 1 2 4: the overhead "
                        "table with the first, then requests/s and CPU per role for each")
