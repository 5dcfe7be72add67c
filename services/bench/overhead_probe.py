"""Three probes behind the tables of docs/benchmarks/overhead.md (issue 15), on the cluster
`polyserve bench overhead` starts (sim worker, zero compute, historical-mean predictor):

* `split`: where one request's milliseconds go at concurrency 1: the client's clock around
  each request against the timestamps of its request events (`admitted`, `dispatched`,
  `first_token`, `completed`; one machine, one clock), p50 of each segment.
* `spy OUT`: `py-spy record` of the gateway process (or `--role`'s) while a closed-loop client
  drives json (or `--stream`) requests (`--concurrency`, default 8); raw collapsed stacks in OUT.

* `summary OUT...`: a `spy` file's samples by component (the deepest frame that names one:
  a library by its path, polyserve by its file), one column per file. py-spy counts a thread
  that is runnable but preempted as busy: a socket write that wakes nats-server on a 2-core
  machine shows as time in `writelines` although `perf` finds the kernel at ~9% of the
  gateway's CPU (docs/benchmarks/overhead.md, sixth session).

* `msgs`: NATS messages per request by connection (service): what each published and was
  delivered, from nats-server's `/connz` counters before and after `--requests` sequential json
  requests (a busy loop of nothing else: heartbeats and telemetry add ~0.01 per request).

    python -m polyserve.bench.overhead_probe split [--requests 200]
    python -m polyserve.bench.overhead_probe spy gateway.txt [--seconds 12] [--role worker] [--stream]
    python -m polyserve.bench.overhead_probe summary before.txt after.txt
    python -m polyserve.bench.overhead_probe msgs [--requests 300]
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from polyserve.bench import overhead
from polyserve.cli import launcher
from polyserve.shared import batching

SEGMENTS = (("client send -> admitted", None, "admitted"), ("admitted -> dispatched", "admitted", "dispatched"),
            ("dispatched -> first_token", "dispatched", "first_token"),
            ("first_token -> completed", "first_token", "completed"), ("completed -> client has the body",
                                                                         "completed", None))


async def split(state: launcher.ClusterState, n: int, warmup: int = 20) -> dict[str, float]:
    """p50 ms of each segment of `n` sequential json requests (after `warmup` more)."""
    import nats

    nc = await nats.connect(state.nats_url)
    ts: dict[str, dict[str, float]] = {}

    async def on_msg(msg) -> None:
        for ev in batching.event_dicts(msg.data):  # one event or several (shared/batching.py)
            if "request_id" in ev:
                ts.setdefault(ev["request_id"], {})[ev.get("event", "")] = ev.get("ts", 0.0)

    await nc.subscribe(f"{state.prefix}.v1.events.request.>", cb=on_msg)
    await nc.flush()
    rows = []
    async with httpx.AsyncClient(base_url=state.gateway_url, timeout=30) as client:
        for i in range(n + warmup):
            t0 = time.time()
            r = await client.post("/v1/completions", json={"model": "bench-sim", "prompt": "hello there",
                                                           "max_tokens": 16})
            t1 = time.time()
            if i >= warmup and r.status_code == 200:
                rows.append((r.json()["id"], t0, t1))
    await asyncio.sleep(1.0)  # the last events
    await nc.close()
    out: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    out["total"] = []
    for rid, t0, t1 in rows:
        ev = ts.get(rid, {})
        if not all(k in ev for k in ("admitted", "dispatched", "first_token", "completed")):
            continue
        for name, a, b in SEGMENTS:
            out[name].append((t1 if b is None else ev[b]) - (t0 if a is None else ev[a]))
        out["total"].append(t1 - t0)
    return {name: round(statistics.median(v) * 1e3, 3) for name, v in out.items() if v}


def _connz(state: launcher.ClusterState) -> dict[str, tuple[int, int]]:
    """(messages published, messages delivered) per connection name, summed over its connections."""
    url = f"http://127.0.0.1:{state.nats_monitor_port}/connz?limit=4096"
    out: dict[str, tuple[int, int]] = {}
    for c in httpx.get(url, timeout=5).json().get("connections", []):
        name = c.get("name") or str(c.get("cid"))
        pub, got = out.get(name, (0, 0))
        out[name] = (pub + c.get("in_msgs", 0), got + c.get("out_msgs", 0))
    return out


async def messages(state: launcher.ClusterState, n: int, warmup: int = 20) -> dict[str, tuple[float, float]]:
    """Per service: NATS messages it published and was delivered, per request, over `n` sequential
    json requests (after `warmup` more)."""
    body = {"model": "bench-sim", "prompt": "hello there", "max_tokens": 16}
    async with httpx.AsyncClient(base_url=state.gateway_url, timeout=30) as client:
        for _ in range(warmup):
            await client.post("/v1/completions", json=body)
        await asyncio.sleep(1.0)  # the warm-up's events and predictions
        before = _connz(state)
        for _ in range(n):
            (await client.post("/v1/completions", json=body)).raise_for_status()
        await asyncio.sleep(0.5)  # this run's last events, acks and predictions
        after = _connz(state)
    return {name: ((pub - before.get(name, (0, 0))[0]) / n, (got - before.get(name, (0, 0))[1]) / n)
            for name, (pub, got) in sorted(after.items())}


def spy(state: launcher.ClusterState, path: str, seconds: float, concurrency: int, role: str = "gateway",
        stream: bool = False) -> None:
    """py-spy of the first process of `role` while json (or streamed) requests run at `concurrency`."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    target = next(pid for name, pid in overhead._processes(state).items() if name.startswith(role))
    asyncio.run(overhead.drive(state.gateway_url, "bench-sim", stream, 200, concurrency, 16))  # warm up
    proc = subprocess.Popen([exe, "record", "-p", str(target), "-d", str(int(seconds)), "-r", "250", "-f", "raw",
                             "--nonblocking", "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = time.monotonic()
    while time.monotonic() - t < seconds - 1:
        asyncio.run(overhead.drive(state.gateway_url, "bench-sim", stream, 300, concurrency, 16))
    proc.wait()


# (component, path fragments of its frames); the first component a frame matches names it
COMPONENTS = (
    ("NATS client: socket writes", ("asyncio/streams.py", "uvloop/")),  # only under nats-py's flusher
    ("nats-py (read loop, parse, publish)", ("nats/",)),
    ("FastAPI / Starlette / pydantic", ("fastapi/", "starlette/", "pydantic")),
    ("HTTP server (uvicorn, httptools)", ("uvicorn/", "httptools")),
    ("completions: validation, bodies", ("gateway/completions.py", "gateway/policy.py", "gateway/compat.py",
                                         "gateway/schemas.py", "gateway/tools.py", "gateway/logprobs.py")),
    ("RequestRun: relay, order, credits", ("gateway/handlers.py", "gateway/delivery.py")),
    ("admission + placement", ("gateway/admission.py", "gateway/routing.py", "gateway/predict_batch.py",
                               "core/length_hint.py")),
    ("gateway middlewares (own code)", ("gateway/access.py", "gateway/shed.py", "gateway/limits.py",
                                        "gateway/app.py", "gateway/fastpath.py", "gateway/tenancy.py")),
    ("events + metrics", ("gateway/observe.py", "gateway/metrics.py", "gateway/context.py")),
    ("bus / durable events (shared/)", ("shared/bus.py", "shared/durable.py")),
    ("prometheus", ("prometheus_client/",)),
    ("tracing (OpenTelemetry)", ("opentelemetry/",)),
    ("worker", ("services/worker/", "worker/")),
)
OTHER = "event loop (uvloop, asyncio) and other"


def component(stack: list[str]) -> str:
    """The component of one sample: its deepest frame that names one (`COMPONENTS`); a write
    counts as the NATS client's only when nats-py's flusher made it."""
    for frame in reversed(stack):
        for name, parts in COMPONENTS:
            if any(p in frame for p in parts):
                if name.startswith("NATS client") and not any("_flusher" in f for f in stack):
                    continue
                return name
    return OTHER


def summary(paths: list[str]) -> dict[str, dict[str, float]]:
    """{file: {component: share of its samples}} for `py-spy record -f raw` files (`spy`)."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        counts: dict[str, int] = {}
        for line in Path(path).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            name = component(stack.split(";"))
            counts[name] = counts.get(name, 0) + int(n)
        total = sum(counts.values()) or 1
        out[path] = {k: v / total for k, v in counts.items()} | {"samples": float(total)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m polyserve.bench.overhead_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("split", help="where a request's milliseconds go at concurrency 1")
    s.add_argument("--requests", type=int, default=200)
    m = sub.add_parser("msgs", help="NATS messages per request, by service")
    m.add_argument("--requests", type=int, default=300)
    p = sub.add_parser("spy", help="py-spy of a service (the gateway by default) under json load")
    p.add_argument("out")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--role", default="gateway", help="gateway, worker, dispatcher, predictor, planner, gpu-agent")
    p.add_argument("--stream", action="store_true", help="streamed requests instead of json")
    sm = sub.add_parser("summary", help="a spy file's samples by component, one column per file")
    sm.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    if args.what == "summary":  # reads files only: no cluster
        table = summary(args.files)
        names = [n for n, _ in COMPONENTS] + [OTHER]
        names.sort(key=lambda n: -max(t.get(n, 0.0) for t in table.values()))
        print(f"{'component':40s}" + "".join(f"{Path(f).name[:14]:>15s}" for f in args.files))
        for n in names:
            if any(t.get(n) for t in table.values()):
                print(f"{n:40s}" + "".join(f"{100 * t.get(n, 0.0):14.1f}%" for t in table.values()))
        print(f"{'samples':40s}" + "".join(f"{int(t['samples']):15d}" for t in table.values()))
        return 0
    spec = overhead._spec(argparse.Namespace(with_model=False, workers=1), 1)
    print(f"starting polyserve (sim engine, zero compute time) in {spec.run_dir} ...", flush=True)
    state = launcher.up(spec, progress=lambda m: None)
    try:
        if args.what == "split":
            for name, ms in asyncio.run(split(state, args.requests)).items():
                print(f"{name:34s} p50 {ms:7.3f} ms")
        elif args.what == "msgs":
            rows = asyncio.run(messages(state, args.requests))
            print(f"{'connection':24s} published  delivered  (NATS messages per request)")
            for name, (pub, got) in rows.items():
                print(f"{name:24s} {pub:9.2f}  {got:9.2f}")
            print(f"{'all':24s} {sum(p for p, _ in rows.values()):9.2f}  {sum(g for _, g in rows.values()):9.2f}")
        else:
            spy(state, args.out, args.seconds, args.concurrency, args.role, args.stream)
            print(f"wrote {args.out}")
    finally:
        launcher.down(spec.run_dir, progress=lambda m: None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
