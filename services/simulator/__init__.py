"""Trace-driven discrete-event simulation of a polyserve cluster (`polyserve simulate`).

It imports the dispatcher's placement policies and the worker's queue orders — it
does not copy them — and times each worker's iterations with a profile's performance
models. Everything it reports is SIMULATED.

`simulate_requests` is the entry point for comparing the simulator with the live
system: the same (arrival, input, output) requests through the simulator with a given
profile, per-request latencies back.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from polyserve.core.perf import WorkerPerf, load_perf, perf_from_dict


@dataclass(frozen=True)
class RequestLatency:
    """One simulated request (ms; `rejected` says why it was not served, "" when it was)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    ttft_ms: float
    atgt_ms: float
    e2e_ms: float
    queue_ms: float
    worker: str
    rejected: str = ""


def simulate_requests(requests: Sequence[tuple[float, int, int]], profile: str | Path | Mapping | WorkerPerf,
                      *, workers: int = 1, policy: str = "least_outstanding", order: str = "fcfs",
                      max_batch: int = 64, kv_mode: str = "reserve", kv_capacity: int | None = None,
                      max_waiting: int = 0, max_prefill_tokens: int = 0,
                      predicted_tokens: Sequence[int] | None = None, seed: int = 0) -> list[RequestLatency]:
    """Simulate `requests` — (arrival seconds, input tokens, output tokens) — on `workers`
    identical workers timed by `profile` (a profile JSON path, dict or WorkerPerf) and
    return their latencies in the order given.

    Defaults mirror the `sim` engine: max_batch 64, KV reserved for input + output at
    admission (``kv_mode="reserve"``; "grow" is vLLM's paged KV), capacity from the
    profile, unbounded queue (the sim engine answers 429 beyond 256: pass max_waiting=256).
    `predicted_tokens` (per request) feed the policies and the KV reservation, as the live
    dispatcher's predictions would; by default the true lengths.
    """
    import numpy as np

    from polyserve.simulator.cluster import SimConfig, simulate
    from polyserve.simulator.engine import WorkerConfig
    from polyserve.simulator.predictor import GivenPredictions, LengthPredictor
    from polyserve.simulator.trace import Trace

    raw: Mapping = {}
    if isinstance(profile, WorkerPerf):
        perf = profile
    elif isinstance(profile, Mapping):
        perf, raw = perf_from_dict(profile), profile
    else:
        perf, raw = load_perf(profile)
    cap = kv_capacity if kv_capacity is not None else int(raw.get("kv_capacity_tokens", 0))
    order_idx = sorted(range(len(requests)), key=lambda k: requests[k][0])
    arr = np.array([float(requests[k][0]) for k in order_idx])
    trace = Trace("requests", arr - (arr[0] if arr.size else 0.0),
                  np.array([int(requests[k][1]) for k in order_idx], dtype=np.int64),
                  np.maximum(1, np.array([int(requests[k][2]) for k in order_idx], dtype=np.int64)))
    pred = LengthPredictor("oracle", trace.output_len) if predicted_tokens is None else \
        GivenPredictions(np.array([int(predicted_tokens[k]) for k in order_idx], dtype=np.int64))
    cfg = SimConfig(policy=policy, order=order, workers=workers, seed=seed,
                    worker=WorkerConfig(max_batch=max_batch, kv_capacity=cap, kv_mode=kv_mode,
                                        max_waiting=max_waiting, max_prefill_tokens=max_prefill_tokens,
                                        tp=int(raw.get("tensor_parallel", 1))))
    res = simulate(trace, perf, cfg, predictor=pred)
    base = float(arr[0]) if arr.size else 0.0
    out: list[RequestLatency | None] = [None] * len(requests)
    for r in res.requests:
        k = order_idx[r.idx]
        served = not r.rejected and r.finish >= 0
        nan = float("nan")
        out[k] = RequestLatency(
            arrival_s=r.arrival + base, input_tokens=r.input_len, output_tokens=r.output_len,
            ttft_ms=(r.first_token - r.arrival) * 1000.0 if served else nan,
            atgt_ms=((r.finish - r.first_token) * 1000.0 / (r.output_len - 1) if r.output_len > 1 else 0.0)
            if served else nan,
            e2e_ms=(r.finish - r.arrival) * 1000.0 if served else nan,
            queue_ms=(r.admitted - r.arrival) * 1000.0 if served else nan, worker=r.worker, rejected=r.rejected)
    return out  # type: ignore[return-value]


__all__ = ["RequestLatency", "simulate_requests"]
