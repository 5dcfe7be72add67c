"""Workloads, runtime allocation and a discrete-event simulator for the embeddings experiment
(`polyserve bench embeddings`).

* Lengths: `twitter_like` (Arlo §2.1: median 21, P98 72 tokens, at most ~125,
  rescaled to span up to 512 as in Arlo §5) or the Azure LLM code trace's input
  lengths capped at 512.
* Arrivals: Poisson (stable) or a two-state Markov-modulated Poisson process
  (bursty, Arlo §5 "Twitter-Bursty"): the high state has 3x the rate of the low
  one and, to make the instantaneous length mix drift as in Fig. 1b, shorter inputs.
* `allocate`: instances per runtime for G workers, by Arlo's §3.3 ILP exactly as the
  planner solves it (`polyserve.planner.arlo_ilp.solve`, fed as the planner's
  Runtime Scheduler feeds it: the profile's static runtimes, Q_i = the requests per
  SLO period whose ideal runtime is i); the longest runtime always gets one (Eq. 7).
* `simulate`: the same dispatch policies (`polyserve.dispatcher.policy_arlo`,
  `least_outstanding`) over instances whose batch latency is the measured profile
  (static: the full shape; dynamic: the batch's rows and longest input). Its
  figures are simulated and labelled so.
"""
from __future__ import annotations

import csv
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from polyserve.dispatcher.policy import POLICIES, PolicyState, RequestView, WorkerView
from polyserve.dispatcher.policy_arlo import ARLO_POLICIES
from polyserve.planner import arlo_ilp
from polyserve.proto import EncoderProfile
from polyserve.shared.paths import datasets_dir
from polyserve.worker.engines.encoder import replay_ms

TWITTER_MU = math.log(21.0)
TWITTER_SIGMA = (math.log(72.0) - math.log(21.0)) / 2.0537  # P98 of a standard normal
TWITTER_MAX = 125
AZURE_CODE = datasets_dir() / "traces" / "azure_llm_2023_code.csv"


def twitter_like(rng: random.Random, max_length: int = 512, scale: float = 1.0) -> int:
    """One input length: lognormal with median 21 and P98 72 tokens, cut at 125, then
    stretched so 125 maps to `max_length`; `scale` < 1 shortens (a burst of short posts)."""
    x = min(TWITTER_MAX, max(1.0, rng.lognormvariate(TWITTER_MU, TWITTER_SIGMA) * scale))
    return max(3, min(max_length, math.ceil(x * max_length / TWITTER_MAX)))


def azure_code_lengths(path: Path = AZURE_CODE, cap: int = 512) -> list[int]:
    """Input lengths of the Azure LLM 2023 code trace, capped at `cap`."""
    with open(path, newline="") as f:
        return [max(3, min(cap, int(row["ContextTokens"]))) for row in csv.DictReader(f)]


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds from the start
    tokens: int


def arrivals(rate: float, duration: float, rng: random.Random, *, bursty: bool = False,
             lengths: list[int] | None = None, max_length: int = 512, high_factor: float = 3.0,
             sojourn_s: float = 2.0, burst_scale: float = 0.5) -> list[Arrival]:
    """Open-loop arrivals at mean `rate`/s for `duration` s; lengths from `lengths` (sampled)
    or `twitter_like`. Bursty: MMPP with states of mean `sojourn_s`, rates rate·2/(1+h) and
    rate·2h/(1+h) (mean = rate), lengths in the high state × `burst_scale`."""
    out: list[Arrival] = []
    t, high = 0.0, False
    switch = rng.expovariate(1.0 / sojourn_s) if bursty else math.inf
    lo = 2 * rate / (1 + high_factor)
    while True:
        r = (lo * high_factor if high else lo) if bursty else rate
        t += rng.expovariate(r)
        while t >= switch:  # the state changed before this arrival: redraw from the switch
            high = not high
            t = switch + rng.expovariate(lo * high_factor if high else lo)
            switch += rng.expovariate(1.0 / sojourn_s)
        if t >= duration:
            return out
        if lengths:
            n = rng.choice(lengths)
            n = max(3, math.ceil(n * burst_scale)) if (bursty and high) else n
        else:
            n = twitter_like(rng, max_length, burst_scale if (bursty and high) else 1.0)
        out.append(Arrival(t, n))


# ---------------------------------------------------------------------- allocation
def allocate(workers: int, profile: EncoderProfile, lengths: Sequence[int], rate: float) -> dict[int, int]:
    """max_length -> instances (those with at least one) for `workers` instances: the planner's
    §3.3 MILP over `profile`'s static runtimes, with Q_i per SLO period from `lengths`
    arriving at `rate`/s (see the module docstring)."""
    if not lengths or rate <= 0:
        raise ValueError("allocate needs request lengths and a rate > 0")
    specs = sorted((r for r in profile.runtimes if r.shape == "static" and r.max_length > 0),
                   key=lambda r: r.max_length)
    if not specs:
        raise ValueError("the encoder profile lists no static runtime")
    profiles = [arlo_ilp.from_runtime_spec(r) for r in specs]
    demand = arlo_ilp.demand_per_slo(lengths, len(lengths) / rate, profile.slo_ms / 1e3,
                                     [p.max_len for p in profiles])
    counts = arlo_ilp.solve(workers, demand, profiles).counts
    return {p.max_len: int(k) for p, k in zip(profiles, counts) if k > 0}


# ---------------------------------------------------------------------- simulation
@dataclass
class SimInstance:
    view: WorkerView
    shape: str
    max_length: int
    batch_size: int
    queue: list
    busy_until: float = 0.0
    running: int = 0
    done_batch: list = field(default_factory=list)


def _policy(name: str):
    return ARLO_POLICIES.get(name) or POLICIES[name]


def simulate(profile: EncoderProfile, fleet: list[tuple[str, int, int]], policy: str, trace: list[Arrival],
             overhead_ms: float = 0.8, seed: int = 0) -> list[float]:
    """Latencies (ms, simulated) of `trace` on `fleet` = [(shape, max_length, capacity)] instances
    (batch size 1) placed by `policy`; `overhead_ms` per request as in Arlo §5.2.1."""
    rng = random.Random(seed)
    choose = _policy(policy)
    inst: list[SimInstance] = []
    for i, (shape, n, cap) in enumerate(fleet):
        view = WorkerView(worker_id=f"w{i:04d}", max_input_len=n, kv_capacity=cap * n, outstanding=0)
        inst.append(SimInstance(view=view, shape=shape, max_length=n, batch_size=1, queue=[]))
    index = {x.view.worker_id: k for k, x in enumerate(inst)}
    views = [x.view for x in inst]
    events: list[tuple[float, int, int]] = []  # (time, seq, instance) completions
    seq, lat, state = 0, [], PolicyState()

    def start(k: int, now: float) -> None:
        nonlocal seq
        x = inst[k]
        if x.running or not x.queue:
            return
        batch = [x.queue.pop(0) for _ in range(min(x.batch_size, len(x.queue)))]
        ms = replay_ms(profile, x.shape, len(batch), x.batch_size, x.max_length, max(a.tokens for a in batch))
        x.running = len(batch)
        x.busy_until = now + ms / 1e3
        x.done_batch = batch
        seq += 1
        heapq.heappush(events, (x.busy_until, seq, k))

    def finish(t: float, k: int) -> None:
        x = inst[k]
        for a in x.done_batch:
            lat.append((t - a.t) * 1e3 + overhead_ms)
        x.running = 0
        x.view = replace(x.view, outstanding=x.view.outstanding - len(x.done_batch))
        views[k] = x.view
        start(k, t)

    for a in trace:
        while events and events[0][0] <= a.t:
            t, _, k = heapq.heappop(events)
            finish(t, k)
        # every instance of ST/DT takes every length; the Arlo policies pick fitting levels themselves
        d = choose(views, RequestView(request_id="", input_tokens=a.tokens), state, rng)
        state = d.state
        k = index[d.worker_id]
        x = inst[k]
        x.queue.append(a)
        x.view = replace(x.view, outstanding=x.view.outstanding + 1)
        views[k] = x.view
        start(k, a.t)
    while events:
        t, _, k = heapq.heappop(events)
        finish(t, k)
    return lat


def fleets(profile: EncoderProfile, workers: int, lengths: list[int], rate: float) -> dict[str, list]:
    """The three schemes of Arlo Table 1 with `workers` instances: ST, DT, polymorphing
    (instances per runtime by `allocate`)."""
    rts = {r.max_length: r for r in profile.runtimes}
    top = max(rts)
    dyn = profile.dynamic
    alloc = allocate(workers, profile, lengths, rate)
    poly = [("static", n, rts[n].capacity) for n in sorted(alloc) for _ in range(alloc[n])]
    return {"ST": [("static", top, rts[top].capacity)] * workers,
            "DT": [("dynamic", top, dyn.capacity if dyn else rts[top].capacity)] * workers,
            "polymorphing": poly}


def poly_capacity(profile: EncoderProfile, lengths: list[int], workers: int) -> float:
    """Requests/s `workers` instances sustain when every request runs at its ideal runtime
    (the mean batch-1 latency of the ideal runtimes over `lengths`)."""
    rts = sorted(profile.runtimes, key=lambda r: r.max_length)
    ms = [next((r for r in rts if r.max_length >= n), rts[-1]).latency_ms[0] for n in lengths]
    return workers * 1000.0 / (sum(ms) / len(ms))


def summary(lat: list[float]) -> dict[str, float]:
    """Mean, median, P98 and max latency (ms) and the count."""
    if not lat:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p98": math.nan, "max": math.nan}
    s = sorted(lat)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"n": len(s), "mean": sum(s) / len(s), "p50": pick(0.5), "p98": pick(0.98), "max": s[-1]}
