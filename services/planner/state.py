"""What the planner remembers between polls and events, in one place, with no I/O.

`PlannerState` holds the per-deployment and per-worker tables the event handlers
fill (`handlers.PlannerHandlers`) and the reconcile reads (`service.PlannerService`):
sample windows, request lengths for Arlo, each deployment's autoscaler and its state
(`autoscalers.Autoscaler.step` returns the next one), the time of the last scaling
action, heartbeats (time and load) and when an agent first listed a worker. Time is
passed in, so it is tested without a bus.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from polyserve.planner.autoscalers import Autoscaler, WorkerLoad
from polyserve.planner.policy import Sample, Window
from polyserve.proto import AgentInfo, Heartbeat, RuntimePlan, ScaleDecision


@dataclass
class PlannerState:
    """The planner's memory (module docstring). Tables keyed by deployment are pruned by `forget`."""

    max_samples: int = 10_000
    windows: dict[str, Window] = field(default_factory=dict)
    lengths: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # (ts, input tokens), Arlo
    scalers: dict[str, tuple[Autoscaler, Any]] = field(default_factory=dict)  # deployment -> (scaler, its state)
    last_change: dict[str, float] = field(default_factory=dict)  # deployment -> time of the last scaling action
    decisions: dict[str, ScaleDecision] = field(default_factory=dict)
    last_signal: dict[str, float] = field(default_factory=dict)  # deployment -> when a signal was last acted on
    signals: dict[str, list[int]] = field(default_factory=dict)  # deployment -> [received, acted on]
    runtime_plans: dict[str, RuntimePlan] = field(default_factory=dict)
    other_deployments: set[str] = field(default_factory=set)  # not `encoder`: their lengths are not kept
    heartbeats: dict[str, float] = field(default_factory=dict)  # worker_id -> time of its last heartbeat
    loads: dict[str, float] = field(default_factory=dict)  # worker_id -> running + waiting at that heartbeat
    first_seen: dict[str, float] = field(default_factory=dict)  # worker_id -> when an AgentInfo first listed it
    live_workers: list[Heartbeat] = field(default_factory=list)  # from Redis (Kubernetes mode)

    # ------------------------------------------------------------------ events
    def add_completed(self, deployment: str, sample: Sample, input_tokens: int) -> None:
        """One completed request: into its window and, unless the deployment is known not
        to be `encoder`, its input length for Arlo's per-bin demand."""
        window = self.windows.get(deployment)
        if window is None:
            window = self.windows[deployment] = Window(self.max_samples)
        window.add(sample)
        if deployment in self.other_deployments:
            return
        lengths = self.lengths.get(deployment)
        if lengths is None:
            lengths = self.lengths[deployment] = deque(maxlen=10 * self.max_samples)
        lengths.append((sample.ts, max(0, input_tokens)))

    def heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.heartbeats[hb.worker_id] = now
        self.loads[hb.worker_id] = float(hb.running + hb.waiting)

    def worker_down(self, worker_id: str) -> None:
        self.heartbeats.pop(worker_id, None)
        self.loads.pop(worker_id, None)

    # ------------------------------------------------------------------ bookkeeping
    def forget(self, known: set[str], other: set[str]) -> None:
        """Keep only deployments in `known` (bounded memory: deleted deployments, events for
        unknown ones); `other` are the known non-`encoder` ones, whose lengths go."""
        self.other_deployments = set(other)
        for dep_id in other & self.lengths.keys():
            del self.lengths[dep_id]
        for table in (self.windows, self.scalers, self.last_change, self.decisions, self.lengths,
                      self.last_signal, self.signals, self.runtime_plans):
            for dep_id in [d for d in table if d not in known]:
                del table[dep_id]

    def track_workers(self, agents: Iterable[AgentInfo], now: float, stale_s: float) -> None:
        """Note when each listed worker was first seen; drop heartbeats older than `stale_s`
        of workers no agent lists."""
        listed = {w for a in agents for w in a.workers}
        for wid in listed:
            self.first_seen.setdefault(wid, now)
        for wid in [w for w in self.first_seen if w not in listed]:
            del self.first_seen[wid]
        for wid in [w for w, t in self.heartbeats.items() if t < now - stale_s and w not in listed]:
            self.worker_down(wid)

    def pending(self, worker_ids: Iterable[str], now: float, grace_s: float) -> int:
        """Workers started less than `grace_s` ago that have not heartbeated yet."""
        return sum(1 for w in worker_ids if w not in self.heartbeats and now - self.first_seen.get(w, now) < grace_s)

    def serving(self, dep_id: str) -> int:
        """Workers of `dep_id` with a live heartbeat in Redis (Kubernetes mode: the pods' workers)."""
        return sum(1 for hb in self.live_workers if hb.deployment == dep_id)

    def worker_loads(self, worker_ids: Iterable[str]) -> list[WorkerLoad]:
        """The outstanding work of the listed workers that have heartbeated."""
        return [WorkerLoad(w, self.loads[w]) for w in worker_ids if w in self.heartbeats and w in self.loads]

    def samples(self, dep_id: str, now: float, window_s: float, reset_on_scale: bool) -> list[Sample]:
        """The samples of the last `window_s` (and, with `reset_on_scale`, since the last
        scaling action); older ones are pruned."""
        window = self.windows.get(dep_id)
        if window is None:
            return []
        window.prune(now - window_s)
        t0 = now - window_s
        if reset_on_scale and dep_id in self.last_change:
            t0 = max(t0, self.last_change[dep_id])
        return window.since(t0)

    def sample_count(self, dep_id: str) -> int:
        """Samples held for `dep_id` (all of them, not only the current window)."""
        window = self.windows.get(dep_id)
        return len(window) if window is not None else 0

    def scaler_for(self, dep_id: str, scaler: Autoscaler) -> Any:
        """The state to step `scaler` from: the kept one while the deployment's scaler keeps its
        name (settings such as a threshold may change), else the scaler's initial state."""
        kept = self.scalers.get(dep_id)
        if kept is not None and kept[0].name == scaler.name:
            return kept[1]
        return scaler.initial()

    def keep_scaler(self, dep_id: str, scaler: Autoscaler, state: Any) -> None:
        self.scalers[dep_id] = (scaler, state)
