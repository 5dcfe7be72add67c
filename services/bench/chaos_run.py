"""One chaos scenario, start to finish: a fresh cluster (`polyserve up`, sim engine, several
workers), bounded streaming load, one fault, recovery probes, then the row of figures
(`polyserve bench chaos` prints it; tests/chaos assert on it). See chaos.py for the list."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from polyserve.bench import chaos_faults as faults
from polyserve.bench.chaos_load import ClosedLoop, Probes, StreamResult, client, stream_once
from polyserve.cli import launcher

RECOVERY_TARGET_S = 10.0
OK_TARGET = 0.99


@dataclass
class Scenario:
    name: str
    title: str
    fault: Callable[["Ctx"], Awaitable[dict]] | None = None  # None: `kind` says what happens
    kind: str = "signal"  # signal | slow | overload
    env: dict[str, str] = field(default_factory=dict)
    needs: str = ""  # a launcher.ClusterSpec field this scenario needs (work in progress elsewhere)
    spec: dict = field(default_factory=dict)  # more launcher.ClusterSpec fields (e.g. gateways=2)

    def unavailable(self) -> str:
        if self.needs and not faults.cluster_flag(self.needs):
            return f"not available: `polyserve up` has no {self.needs} option yet"
        return ""

    def spec_fields(self) -> dict:
        if not self.needs:
            return dict(self.spec)
        f = next(f for f in dataclasses.fields(launcher.ClusterSpec) if f.name == self.needs)
        return {**self.spec, self.needs: True if isinstance(f.default, bool) else 3}


@dataclass
class Ctx:
    state: launcher.ClusterState
    observer: faults.Observer
    cfg: faults.ChaosConfig
    paused: list[int] = field(default_factory=list)


async def run_scenario(sc: Scenario, cfg: faults.ChaosConfig, say=print) -> dict:
    """The scenario's row (a dict; `available` False with the reason when it cannot run)."""
    reason = sc.unavailable()
    if reason:
        return {"scenario": sc.name, "title": sc.title, "available": False, "reason": reason}
    env = dict(sc.env)
    if sc.kind == "overload":  # the admission limit is the cluster's capacity; the clients stay under it
        env["POLYSERVE_GATEWAY_MAX_INFLIGHT"] = str(cfg.overload_inflight)
        cfg = dataclasses.replace(cfg, concurrency=min(cfg.concurrency, cfg.overload_inflight))
    spec = faults.spec_for(cfg, env, **sc.spec_fields())
    say(f"  {sc.name}: starting polyserve ({cfg.workers} sim workers) ...")
    try:
        state = await asyncio.to_thread(faults.start, spec, cfg.workers)
    except Exception as exc:  # noqa: BLE001 - a row that says so; the other scenarios still run
        return {"scenario": sc.name, "title": sc.title, "available": False,
                "reason": f"polyserve did not start: {exc}"[:300], "misses": ["did not start"]}
    ctx = Ctx(state, faults.Observer(state), cfg)
    try:
        await ctx.observer.start()
        return await _drive(sc, ctx, say)
    finally:
        faults.resume_paused(ctx)
        await ctx.observer.close()
        await asyncio.to_thread(faults.stop, spec)


async def _drive(sc: Scenario, ctx: Ctx, say) -> dict:
    cfg, url = ctx.cfg, ctx.state.gateway_url
    load = ClosedLoop(url, faults.MODEL, cfg.requests, cfg.concurrency, cfg.tokens, cfg.hang_s)
    t_load = time.monotonic()
    load_task = asyncio.create_task(load.run())
    # the fault hits once that share of the requests was placed on workers (streams running)
    while len(ctx.observer.workers) < cfg.requests * cfg.fault_after and not load_task.done():
        await asyncio.sleep(0.02)
    in_flight = load.in_flight()
    fault_at = ctx.observer.elapsed()
    say(f"  {sc.name}: {load.started} sent, {in_flight} in flight; injecting the fault")
    side: list[StreamResult] = []
    released = asyncio.Event()
    probes = Probes(url, faults.MODEL, since=time.monotonic())
    probing = slow = None
    try:
        if sc.kind == "overload":
            info = await _overload(ctx, load, t_load, side)
            probes.since = time.monotonic()  # recovery is counted from the end of the burst
            probing = asyncio.create_task(probes.run(released))
        else:
            probing = asyncio.create_task(probes.run(released))
            slow = asyncio.create_task(_slow_readers(ctx)) if sc.kind == "slow" else None
            info = await sc.fault(ctx) if sc.fault else {"slow_readers": cfg.slow_readers}
            if slow is not None:
                side += await slow
        results = await load_task
        released.set()
        await probing
    finally:  # a fault that raised: no client outlives the scenario
        for task in (load_task, probing, slow):
            if task is not None and not task.done():
                task.cancel()
    await asyncio.sleep(1.5)  # the last terminal events on their way
    # the terminal events from the stream that keeps them, until it has those of every accepted request
    # (bounded: faults.READ_WAIT_S); the live copy misses what came while the observer reconnected
    await ctx.observer.finish(ctx.observer.admitted | {r.rid for r in results + side if r.rid})
    row = summarize(sc, results + side, ctx, probes, info)
    row["fault_at_s"] = fault_at
    row["restarts"] = faults.current(ctx.state).restarts
    row["in_flight_at_fault"] = in_flight
    row["load_s"] = round(time.monotonic() - t_load, 1)
    return row


async def _slow_readers(ctx: Ctx) -> list[StreamResult]:
    """Clients that ask for a long stream, read nothing for a while (a 4 KiB socket buffer),
    then read it all: every token, or an explicit error, never a silent cut."""
    cfg = ctx.cfg
    async with client(cfg.slow_readers, cfg.hang_s + cfg.slow_stall_s + 60, small_buffers=True) as c:
        return list(await asyncio.gather(*(
            stream_once(c, ctx.state.gateway_url, faults.MODEL, cfg.slow_tokens, cfg.hang_s + cfg.slow_stall_s + 60,
                        tag="slow", stall_s=cfg.slow_stall_s) for _ in range(cfg.slow_readers))))


async def _overload(ctx: Ctx, load: ClosedLoop, t_load: float, side: list[StreamResult]) -> dict:
    """A burst at `overload_factor` x the rate the cluster served so far (open loop, 429s not
    retried) for `overload_s`, sent by chaos_burst.py in a process of its own."""
    cfg = ctx.cfg
    served = max(1.0, sum(1 for r in load.results if r.kind == "ok") / max(0.5, time.monotonic() - t_load))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "polyserve.bench.chaos_burst", ctx.state.gateway_url, faults.MODEL,
        str(cfg.overload_factor * served), str(cfg.overload_s), str(cfg.tokens), str(cfg.hang_s),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the burst client exited with {proc.returncode}")
    got = json.loads(out)
    fields = {f.name for f in dataclasses.fields(StreamResult)}
    side += [StreamResult(**{k: v for k, v in r.items() if k in fields}, tag="burst") for r in got["results"]]
    return {"served_per_s": round(served, 1), "offered_per_s": round(got["offered_per_s"], 1),
            "factor": round(got["offered_per_s"] / served, 1), "burst": len(got["results"])}


def causes(results: list[StreamResult]) -> dict[str, int]:
    """What the errors said, ids and figures blanked out, most frequent first."""
    found = Counter(re.sub(r"w-[0-9a-f]+|cmpl-[0-9a-f-]+|\d+(\.\d+)?", "#", r.detail)[:90]
                    for r in results if r.kind != "ok")
    return dict(found.most_common(8))


def _count(results: list[StreamResult], kind: str) -> int:
    return sum(1 for r in results if r.kind == kind)


def summarize(sc: Scenario, results: list[StreamResult], ctx: Ctx, probes: Probes, info: dict) -> dict:
    """The row: counts by outcome, terminal-event bookkeeping, recovery, and the targets missed."""
    obs = ctx.observer
    accepted = obs.admitted | {r.rid for r in results if r.rid}
    row = {"scenario": sc.name, "title": sc.title, "available": True, "fault": info, "sent": len(results),
           "ok": _count(results, "ok"), "errors": _count(results, "error"), "short": _count(results, "short"),
           "hung": _count(results, "hung"), "rejected_429": sum(1 for r in results if r.status == 429),
           "accepted": len(accepted), "no_terminal": sorted(accepted - obs.terminal.keys()),
           "duplicate_terminal": sorted(rid for rid, t in obs.terminal.items() if len(t) > 1),
           "events_from": obs.source, "observer_away_s": obs.away,
           "recovery_s": probes.recovery_s(), "probes": len(probes.log),
           "probes_disrupted": probes.disrupted(), "probe_failures": probes.failures[:8],
           "samples": {k: [r.detail for r in results if r.kind == k][:3] for k in ("error", "short", "hung")},
           "error_causes": causes(results)}
    killed = info.get("worker", "")
    on = [r for r in results if killed and killed in obs.workers.get(r.rid, [])]
    off = [r for r in results if r not in on and r.status != 429]  # 429 under overload: admission refused
    row["on_killed_worker"] = len(on)
    row["ok_rate_on_killed"] = round(_count(on, "ok") / len(on), 4) if on else None
    row["ok_rate_others"] = round(_count(off, "ok") / len(off), 4) if off else None
    if sc.kind == "overload":
        row["overload"] = _overload_figures(results, ctx.cfg.budget_s)
    if sc.kind == "slow":
        slow = [r for r in results if r.tag == "slow"]
        row["slow_readers"] = {k: _count(slow, k) for k in ("ok", "error", "short", "hung")}
        row["slow_readers"]["samples"] = [r.detail for r in slow if r.kind != "ok"][:3]
    # for a failure's message: the last event the live subscription heard of each (kind, s since start)
    row["no_terminal_last_seen"] = {rid: obs.last_seen.get(rid) for rid in row["no_terminal"][:10]}
    row["misses"] = misses(row)
    return row


def _overload_figures(results: list[StreamResult], budget_s: float) -> dict:
    admitted = [r for r in results if r.status == 200]
    rejected = [r for r in results if r.status == 429]
    lat = sorted(r.seconds for r in admitted if r.kind == "ok")
    refused = sorted(r.seconds for r in rejected)
    return {"admitted": len(admitted), "admitted_ok": _count(admitted, "ok"),
            "admitted_over_budget": sum(1 for r in admitted if r.seconds > budget_s or r.kind != "ok"),
            "budget_s": budget_s, "rejected_429": len(rejected),
            "429_without_retry_after": sum(1 for r in rejected if not r.retry_after),
            "other_errors": sum(1 for r in results if r.status not in (200, 429)),
            "admitted_p50_s": round(lat[len(lat) // 2], 2) if lat else None,
            "admitted_p99_s": _p99(lat), "429_p50_s": round(refused[len(refused) // 2], 3) if refused else None,
            "429_p99_s": _p99(refused, 3)}


def _p99(values: list[float], digits: int = 2) -> float | None:
    return round(values[max(0, int(len(values) * 0.99) - 1)], digits) if values else None


def misses(row: dict) -> list[str]:
    """The issue's targets this row misses (empty: all met)."""
    out = []
    skipped = (row.get("fault") or {}).get("skipped")
    if skipped:
        out.append(f"fault not injected: {skipped}")
    for key in ("short", "hung"):
        if row[key]:
            out.append(f"{row[key]} {key}")
    if row["no_terminal"]:
        out.append(f"{len(row['no_terminal'])} without a terminal event")
    rec = row["recovery_s"]
    if rec is None or rec > RECOVERY_TARGET_S:
        out.append(f"recovery {'never' if rec is None else f'{rec}s'} > {RECOVERY_TARGET_S:.0f}s")
    rate = row["ok_rate_others"]
    if rate is not None and rate < OK_TARGET:
        out.append(f"ok {rate:.1%} < 99%")
    ov = row.get("overload")
    if ov:
        if ov["admitted_over_budget"]:
            out.append(f"{ov['admitted_over_budget']} admitted past {ov['budget_s']:.0f}s or failed")
        if ov["429_without_retry_after"]:
            out.append(f"{ov['429_without_retry_after']} 429 without Retry-After")
        if ov["other_errors"]:
            out.append(f"{ov['other_errors']} errors other than 429")
    return out

