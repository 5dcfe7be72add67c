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
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from polyserve.cli import launcher
from polyserve.shared import infra


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


async def drive(base: str, model: str, stream: bool, n: int, concurrency: int, tokens: int) -> dict:
    """Closed-loop load: `concurrency` clients send `n` requests in total."""
    body = {"model": model, "prompt": "measure the control plane overhead please", "max_tokens": tokens,
            "stream": stream, "min_tokens": tokens}
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:
        for _ in range(min(20, n)):  # warm-up
            await _one(client, base + "/v1/completions", body)
        remaining = n

        async def worker():
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                lat.append(await _one(client, base + "/v1/completions", body))

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t
    arr = np.array(lat)
    return {"rps": len(lat) / elapsed, "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)), "mean_ms": float(arr.mean()), "n": len(lat)}


async def stage_breakdown(nats_url: str, prefix: str, base: str, model: str, n: int) -> dict:
    """Per-stage latencies from the request events of `n` sequential requests."""
    import nats

    nc = await nats.connect(nats_url)
    stages: dict[str, list[float]] = {"predict_ms": [], "dispatch_ms": [], "ttft_ms": [], "e2e_ms": []}

    async def on_msg(msg) -> None:
        ev = json.loads(msg.data)
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


def main(args: argparse.Namespace) -> int:
    """`polyserve bench overhead`."""
    run_dir = Path(tempfile.mkdtemp(prefix="ps-bench-"))
    bare_port = infra.free_port()
    bare = subprocess.Popen([sys.executable, "-m", "polyserve.bench.bare", "--port", str(bare_port),
                             "--tokens", str(args.tokens)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spec = launcher.ClusterSpec(run_dir=run_dir, engine="sim", model="bench-sim", port=infra.free_port(),
                                nats_port=0, redis_port=0, prefix="polyserve", min_replicas=1, max_replicas=1,
                                extra_env={"POLYSERVE_WORKER_TIME_SCALE": "0", "POLYSERVE_LOG_LEVEL": "WARNING",
                                           # the control plane alone: the historical-mean predictor, unless
                                           # --with-model also measures the BERT proxy model on this CPU
                                           "POLYSERVE_PREDICTOR_PROXY_ARTIFACT": "shipped" if args.with_model else ""})
    print("starting polyserve (sim engine, zero compute time) and a bare FastAPI endpoint ...", flush=True)
    try:
        state = launcher.up(spec, progress=lambda m: None)
        _wait_http(f"http://127.0.0.1:{bare_port}/healthz")
        results = {}
        for stream in (False, True):
            for conc in args.concurrency:
                mode = "stream" if stream else "json"
                print(f"  {mode} concurrency {conc}: bare ...", flush=True)
                b = asyncio.run(drive(f"http://127.0.0.1:{bare_port}", "bare", stream, args.requests, conc,
                                      args.tokens))
                print(f"  {mode} concurrency {conc}: polyserve ...", flush=True)
                p = asyncio.run(drive(state.gateway_url, "bench-sim", stream, args.requests, conc, args.tokens))
                results[f"{mode}-c{conc}"] = {"bare": b, "polyserve": p}
        stages = asyncio.run(stage_breakdown(state.nats_url, state.prefix, state.gateway_url, "bench-sim", 100))
    finally:
        launcher.down(run_dir, progress=lambda m: None)
        bare.terminate()
        bare.wait(10)
    predictor = "BERT proxy model" if args.with_model else "historical mean"
    print(f"\ncontrol-plane overhead ({args.requests} requests per cell, {args.tokens} output tokens, "
          f"sim worker with zero compute time, predictor: {predictor})")
    print(f"{'case':<12}{'bare rps':>10}{'ps rps':>10}{'rps ratio':>10}{'bare p50':>10}{'ps p50':>10}"
          f"{'added p50':>11}{'bare p99':>10}{'ps p99':>10}")
    for case, r in results.items():
        b, p = r["bare"], r["polyserve"]
        print(f"{case:<12}{b['rps']:>10.1f}{p['rps']:>10.1f}{p['rps'] / b['rps']:>10.3f}{b['p50_ms']:>10.2f}"
              f"{p['p50_ms']:>10.2f}{p['p50_ms'] - b['p50_ms']:>11.2f}{b['p99_ms']:>10.2f}{p['p99_ms']:>10.2f}")
    print(f"\nper-stage medians over 100 sequential requests (ms, from request events): {stages}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "stages": stages}, indent=2))
        print(f"wrote {args.json}")
    return 0


def add_arguments(o) -> None:
    o.add_argument("--requests", type=int, default=500)
    o.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    o.add_argument("--tokens", type=int, default=16)
    o.add_argument("--json", help="also write the figures to this file")
    o.add_argument("--with-model", action="store_true",
                   help="predict with the BERT proxy model (default: the historical mean, i.e. the control plane alone)")
