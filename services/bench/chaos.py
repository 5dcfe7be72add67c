"""`polyserve bench chaos`: faults injected by signal into a real polyserve, under load.

Per scenario a fresh `polyserve up` (sim engine, several workers, the supervisor), a few
hundred streaming requests of 64 tokens over HTTP, and one fault once a share of them has
started: a worker SIGKILLed, nats-server stopped for 5 s or killed, redis-server killed,
the predictor, dispatcher or planner killed, the gateway sent SIGTERM, slow readers, a burst
at 40x what the cluster serves, one node of a 3-node NATS cluster killed. Each row says what
the clients saw (ok, explicit errors, silently short streams, hung), how many accepted
requests ended without a terminal event on the bus, and how long until new requests
succeeded again (chaos_run.py, chaos_load.py, chaos_faults.py; docs/reliability.md).

Targets (issue 13): 0 short, 0 hung, 0 without a terminal event, recovery <= 10 s, >= 99%
of the requests not on a killed worker succeed. A row lists the targets it misses.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from pathlib import Path

from polyserve.bench import chaos_faults as faults
from polyserve.bench.chaos_run import Scenario, run_scenario
from polyserve.shared import machine


def scenarios(cfg: faults.ChaosConfig | None = None) -> list[Scenario]:
    cfg = cfg or faults.ChaosConfig()
    return [
        Scenario("worker-kill", "SIGKILL the busiest worker", faults.kill_worker),
        Scenario("nats-pause", "nats-server SIGSTOP 5 s, then SIGCONT", faults.pause_nats),
        Scenario("nats-restart", "nats-server SIGKILL; the supervisor restarts it", faults.kill_nats),
        Scenario("redis-restart", "redis-server SIGKILL; the supervisor restarts it", faults.killer("redis-server")),
        Scenario("predictor-kill", "predictor SIGKILL; the supervisor restarts it", faults.killer("predictor")),
        # local_dispatch off: every request goes through the dispatcher (else the default policy is
        # placed by the gateway and the fault would not be on any request's path)
        Scenario("dispatcher-kill", "dispatcher SIGKILL; the supervisor restarts it (every request through it)",
                 faults.killer("dispatcher"), env={"POLYSERVE_GATEWAY_LOCAL_DISPATCH": "false"}),
        Scenario("planner-kill", "planner SIGKILL; the supervisor restarts it", faults.killer("planner")),
        Scenario("gateway-term", "gateway SIGTERM under load (drain); the supervisor restarts it",
                 faults.killer("gateway", signal.SIGTERM)),
        Scenario("gateway-term-of-2", "one of 2 gateway processes on the port SIGTERMed under load",
                 faults.killer("gateway", signal.SIGTERM), spec={"gateways": 2}),
        Scenario("slow-reader", f"{cfg.slow_readers} clients stall {cfg.slow_stall_s:.0f} s on a "
                                f"{cfg.slow_tokens:,}-token stream (4 KiB socket buffer; sim at 1/50 time)",
                 kind="slow", env={"POLYSERVE_WORKER_TIME_SCALE": "0.02"}),
        Scenario("overload", f"{cfg.overload_factor:.0f}x the served rate for {cfg.overload_s:.0f} s "
                             f"(max_inflight {cfg.overload_inflight}; 429s not retried)", kind="overload"),
        Scenario("nats-node-kill", "SIGKILL one nats-server of a 3-node cluster", faults.kill_nats_node,
                 needs="nats_cluster"),
        Scenario("redis-failover", "redis-server primary SIGKILL with a replica and Sentinel (--redis-replica)",
                 faults.killer("redis-server"), needs="redis_replica"),
    ]


def by_name(names: list[str], cfg: faults.ChaosConfig | None = None) -> list[Scenario]:
    known = {s.name: s for s in scenarios(cfg)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def _fmt_rate(rate) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def render(rows: list[dict], console=None) -> None:
    """The rich table of the rows."""
    from rich.console import Console
    from rich.table import Table

    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    table = Table(title="polyserve chaos suite", show_lines=False)
    for col in ("scenario", "sent", "ok", "errors", "of which 429", "short", "hung", "no terminal",
                "recover s", "ok% others", "ok% on killed", "misses"):
        table.add_column(col, justify="left" if col in ("scenario", "misses") else "right",
                         overflow="fold")
    for r in rows:
        if not r["available"]:
            table.add_row(r["scenario"], *["-"] * 10, r["reason"])
            continue
        rec = r["recovery_s"]
        table.add_row(r["scenario"], str(r["sent"]), str(r["ok"]), str(r["errors"]), str(r["rejected_429"]),
                      str(r["short"]), str(r["hung"]), str(len(r["no_terminal"])),
                      "never" if rec is None else f"{rec:.1f}", _fmt_rate(r["ok_rate_others"]),
                      _fmt_rate(r["ok_rate_on_killed"]), "; ".join(r["misses"]) or "none")
    console.print(table)
    for r in rows:
        extra = {k: r[k] for k in ("overload", "slow_readers") if r.get(k)}
        if r.get("available") and (extra or any(r["samples"].values())):
            console.print(f"[bold]{r['scenario']}[/]: fault {r['fault']}; events from {r['events_from']}")
            for k, v in extra.items():
                console.print(f"  {k}: {v}")
            for k, v in r["samples"].items():
                if v:
                    console.print(f"  {k} e.g.: {v[0]}")


async def run_all(chosen: list[Scenario], cfg: faults.ChaosConfig, say=print) -> list[dict]:
    rows = []
    for i, sc in enumerate(chosen, 1):
        say(f"[{i}/{len(chosen)}] {sc.name}: {sc.title}")
        row = await run_scenario(sc, cfg, say)
        if row["available"]:
            say(f"  {sc.name}: {row['ok']}/{row['sent']} ok, {row['errors']} errors, {row['short']} short, "
                f"{row['hung']} hung, {len(row['no_terminal'])} without a terminal event, recovery "
                f"{row['recovery_s']} s; misses: {'; '.join(row['misses']) or 'none'}")
        else:
            say(f"  {sc.name}: {row['reason']}")
        rows.append(row)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = faults.ChaosConfig()
    p.add_argument("--scenarios", nargs="+", metavar="NAME", help="run only these (default: all): "
                   + ", ".join(s.name for s in scenarios()))
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--requests", type=int, default=d.requests, help="streaming requests per scenario")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per stream (min_tokens = max_tokens)")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="sim engine compute time x this (0.5: a 64-token stream takes about 1.5 s)")
    p.add_argument("--hang-s", type=float, default=d.hang_s, help="a stream with no end by then counts as hung")
    p.add_argument("--overload-factor", type=float, default=d.overload_factor)
    p.add_argument("--overload-inflight", type=int, default=d.overload_inflight)
    p.add_argument("--json", metavar="FILE", help="also write the rows (and machine, load, settings) here")


def config_of(args: argparse.Namespace) -> faults.ChaosConfig:
    return faults.ChaosConfig(workers=args.workers, requests=args.requests, concurrency=args.concurrency,
                              tokens=args.tokens, time_scale=args.time_scale, hang_s=args.hang_s,
                              overload_factor=args.overload_factor, overload_inflight=args.overload_inflight)


def main(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    if args.list:
        for s in scenarios(cfg):
            print(f"  {s.name:<16} {s.title}" + (f"  [{s.unavailable()}]" if s.unavailable() else ""))
        return 0
    chosen = by_name(args.scenarios, cfg) if args.scenarios else scenarios(cfg)
    before = machine.describe()
    print(f"chaos suite: {len(chosen)} scenario(s), {cfg.requests} streams of {cfg.tokens} tokens each at "
          f"concurrency {cfg.concurrency}, {cfg.workers} sim workers (time scale {cfg.time_scale}); "
          f"{machine.line(before)}", flush=True)
    rows = asyncio.run(run_all(chosen, cfg, say=lambda m: print(m, flush=True)))
    render(rows)
    after = machine.describe()
    print(f"load average before {before['load_average']}, after {after['load_average']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": before, "load_after": after["load_average"],
                                               "config": dataclasses.asdict(cfg), "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(not r.get("misses") for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="polyserve bench chaos")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
