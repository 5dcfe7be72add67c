"""The chaos tier: the scenarios of `polyserve bench chaos` (services/bench/chaos*.py), run by
the same harness code on a smaller load, so the tier stays within a few minutes on a 2-core
machine. Each test starts its own `polyserve up` (sim engine, 2 workers, the supervisor),
drives streaming requests over HTTP, injects one fault by signal and asserts on the row."""
from __future__ import annotations

import asyncio
import dataclasses

from polyserve.bench import chaos, chaos_faults
from polyserve.bench.chaos_run import run_scenario

# 150 streams of 64 tokens, 50 at a time, on 2 workers: about 5 s of load around the fault
CONFIG = chaos_faults.ChaosConfig(workers=2, requests=150, concurrency=50, tokens=64, time_scale=0.5,
                                  hang_s=30.0, overload_inflight=32, overload_s=3.0, slow_readers=2,
                                  slow_tokens=12_000, slow_stall_s=6.0)


def scenario_row(name: str, **overrides) -> dict:
    """Run one scenario of the suite; its row (chaos_run.summarize)."""
    cfg = dataclasses.replace(CONFIG, **overrides)
    (sc,) = chaos.by_name([name], cfg)
    row = asyncio.run(run_scenario(sc, cfg, say=lambda m: None))
    assert row.get("available", False), row.get("reason")
    return row


def assert_promised(row: dict) -> None:
    """What holds under every fault: no stream ends normally short, none hangs, every accepted
    request has exactly one terminal event in the event stream (JetStream; the live core NATS
    copy misses what came while the observer reconnected); whatever did not succeed failed
    explicitly."""
    ctx = f"{row['scenario']}: {row['samples']}"
    assert row["short"] == 0, f"silently short streams: {ctx}"
    assert row["hung"] == 0, f"hung streams: {ctx}"
    assert row["events_from"].startswith("JetStream stream"), \
        f"terminal events not from the stream: {row['events_from']}"
    assert row["no_terminal"] == [], (
        f"{len(row['no_terminal'])} of {row['accepted']} accepted without a terminal event in the "
        f"{row['events_from']}; last event heard live of each (kind, s): {row['no_terminal_last_seen']}; "
        f"fault at {row['fault_at_s']} s, observer disconnected/reconnected at {row['observer_away_s']}")
    assert row["duplicate_terminal"] == [], f"two terminal events: {row['duplicate_terminal'][:5]}"
    assert row["ok"] + row["errors"] == row["sent"]


def assert_targets(row: dict) -> None:
    """Issue 13's targets: the promises, recovery within 10 s, >= 99% of the requests not on a
    killed worker succeed (chaos_run.misses lists what a row misses)."""
    assert_promised(row)
    assert row["misses"] == [], f"{row['scenario']} misses {row['misses']}; probes: {row['probe_failures']}"

