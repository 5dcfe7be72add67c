"""`python -m polyserve.bench.durable_events`: what keeping `completed`/`failed` events in
JetStream costs the publisher (the gateway), against plain core NATS (shared/durable.py).

Starts its own nats-server (JetStream), publishes N terminal events through `Bus.publish_soon`
as the gateway does (in bursts of 50), waits until JetStream has acknowledged every one, and
prints the CPU time per event of this process, alternating core and durable runs.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from polyserve.proto import Completed, Subjects
from polyserve.shared import bus as bus_mod
from polyserve.shared import infra, machine
from polyserve.shared.telemetry import make_tracer


async def _run(url: str, n: int, durable: bool, tag: str) -> tuple[float, float]:
    tracer, _ = make_tracer("bench")
    subjects = Subjects(f"bench{tag}")
    pub = await bus_mod.Bus.connect(url, tracer, "gateway")
    real = bus_mod.durable.prefix_of
    if not durable:  # every subject core NATS, as before shared/durable.py
        bus_mod.durable.prefix_of = lambda subject: None
    try:
        events = [Completed(request_id=f"r{i}", worker_id="w", input_tokens=1, output_tokens=2, e2e_ms=1.0,
                            ttft_ms=1.0) for i in range(n)]
        pub.publish_soon(subjects.event("completed"), events[0])  # stream created, connection warm
        await pub.flush_soon()
        await asyncio.sleep(0.5)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for i, ev in enumerate(events):
            pub.publish_soon(subjects.event("completed"), ev)
            if i % 50 == 49:
                await asyncio.sleep(0.003)
        await pub.flush_soon()
        await pub.nc.flush()
        while pub.outbox.pending:
            await asyncio.sleep(0.01)
        return (time.process_time() - cpu0) / n * 1e6, time.perf_counter() - wall0
    finally:
        bus_mod.durable.prefix_of = real
        await pub.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="polyserve bench durable_events", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="ps-bench-dur-"))
    proc, url, _ = infra.start_nats(run_dir / "nats")
    print(f"machine: {machine.line()}")
    try:
        for r in range(args.rounds):
            for durable in (False, True):
                cpu_us, wall = asyncio.run(_run(url, args.events, durable, f"{r}{int(durable)}"))
                print(f"{'durable (JetStream)' if durable else 'core NATS':20s} {args.events} completed events: "
                      f"{cpu_us:6.1f} us CPU per event in the publisher, {wall:.2f} s wall")
    finally:
        infra.stop_pid(proc.pid)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
