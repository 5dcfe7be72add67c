"""Live bookkeeping for the model-driven policies (Aladdin best-fit, CaraServe rank-aware).

The pure policies reason over `WorkerView.requests` (what each worker holds, with lengths)
and `WorkerView.perf` (its performance models). In the live dispatcher those come from:

* `RequestBook`: every placement, then `first_token` / `completed` / `failed` events;
  tokens generated so far are estimated from the time since the first token and the
  worker's modelled decode step (never more than the request's `max_tokens`);
* a `PerfFitter` per worker, started from the engine profile its heartbeat names
  (`Heartbeat.profile`: a shipped profile name or a path, `core.profiles.profile_path`)
  and refitted online from every `completed` event (prefill from TTFT − queue; decode
  step from ATGT with the batch and context the book saw on that worker). `errors()`
  reports each fit's current out-of-sample error.

`ModelBook` also decides when an Aladdin/CaraServe "no feasible worker" becomes a
`ScaleSignal` (at most one per deployment per `signal_interval_s`) and carries out Alg. 2
moves.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from polyserve.core import profiles
from polyserve.core.perf import PerfFitter, WorkerPerf, load_perf
from polyserve.dispatcher.policy_aladdin import ErrorLedger, as_new
from polyserve.dispatcher.views import RequestView, RunningRequest
from polyserve.proto import ATGT_SLO_MS, Completed, Failed, FirstToken, Heartbeat

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    worker_id: str
    req: RunningRequest
    first_token: float | None = None  # seconds


class RequestBook:
    """What Aladdin and CaraServe need of each placed request, for the live dispatcher:
    fed by placements and `first_token` / `completed` / `failed` events; `requests()` gives a
    worker's `WorkerView.requests`, estimating tokens generated so far as decode time so far
    divided by the worker's current modelled decode step. Bounded by `max_tracked`."""

    def __init__(self, max_tracked: int = 100_000):
        self.max_tracked = max_tracked
        self._by_id: dict[str, _Entry] = {}
        self._by_worker: dict[str, dict[str, _Entry]] = {}
        self.ledger = ErrorLedger()

    def place(self, worker_id: str, req: RequestView) -> RunningRequest:
        """Track `req` on the worker; its entry (`as_new(req)`) is returned."""
        self.finish(req.request_id, None, 0.0)
        if len(self._by_id) >= self.max_tracked:
            self.finish(next(iter(self._by_id)), None, 0.0)
        e = _Entry(worker_id, as_new(req))
        self._by_id[req.request_id] = e
        self._by_worker.setdefault(worker_id, {})[req.request_id] = e
        return e.req

    def move(self, request_id: str, worker_id: str) -> bool:
        """A not-yet-started request now waits on `worker_id` (an Alg. 2 move)."""
        e = self._by_id.get(request_id)
        if e is None:
            return False
        self._by_worker.get(e.worker_id, {}).pop(request_id, None)
        e.worker_id = worker_id
        self._by_worker.setdefault(worker_id, {})[request_id] = e
        return True

    def tracked(self, worker_id: str) -> int:
        """Requests the book holds for a worker."""
        return len(self._by_worker.get(worker_id, ()))

    def first_token(self, request_id: str, now: float) -> None:
        e = self._by_id.get(request_id)
        if e is not None and e.first_token is None:
            e.first_token = now
            e.req = replace(e.req, started=True, generated=1)

    def finish(self, request_id: str, output_tokens: int | None, now: float, step_ms: float = ATGT_SLO_MS) -> None:
        """A request ended (`output_tokens` None when it failed); early finishes go to the ledger."""
        e = self._by_id.pop(request_id, None)
        if e is None:
            return
        self._by_worker.get(e.worker_id, {}).pop(request_id, None)
        if output_tokens is not None and e.req.predicted_tokens:
            self.ledger.finished(e.worker_id, e.req.predicted_tokens, output_tokens, now, step_ms)

    def forget_worker(self, worker_id: str) -> None:
        for rid in list(self._by_worker.pop(worker_id, {})):
            self._by_id.pop(rid, None)
        self.ledger.forget(worker_id)

    def requests(self, worker_id: str, now: float, perf: WorkerPerf | None) -> tuple[RunningRequest, ...]:
        """The worker's `WorkerView.requests` at `now` (generated tokens estimated)."""
        entries = list(self._by_worker.get(worker_id, {}).values())
        started = [e for e in entries if e.first_token is not None]
        step = ATGT_SLO_MS
        if perf is not None and started:
            ctx = sum(e.req.input_tokens for e in started) / len(started)
            step = max(1e-3, perf.decode_ms(ctx, len(started)))
        out = []
        for e in entries:
            if e.first_token is None:
                out.append(e.req)
                continue
            dec = max(0.0, (now - e.first_token) * 1000.0)
            generated = 1 + int(dec / step)
            if e.req.max_tokens > 0:  # it cannot have generated more than its cap
                generated = min(generated, max(1, e.req.max_tokens))
            out.append(replace(e.req, decode_ms=dec, generated=generated))
        return tuple(out)


class ModelBook:
    """Requests and fitted models of every worker this dispatcher places on."""

    def __init__(self, max_tracked: int = 100_000, *, signal_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.requests = RequestBook(max_tracked)
        self.clock = clock
        self.signal_interval_s = signal_interval_s
        self._fits: dict[str, PerfFitter] = {}
        self._perf: dict[str, WorkerPerf] = {}  # current() of each fit, until its next observation
        self._profiles: dict[str, WorkerPerf | None] = {}
        self._last_signal: dict[str, float] = {}
        self.moves = 0
        self.signals = 0

    # ---------------------------------------------------------------- models
    def _profile(self, ref: str) -> WorkerPerf | None:
        if ref not in self._profiles:
            perf = None
            if ref:
                try:
                    path = profiles.profile_path(ref)
                except FileNotFoundError:
                    logger.warning("dispatcher: profile %r named by a worker is not found", ref)
                else:
                    try:
                        perf = load_perf(path)[0]
                    except (OSError, ValueError, KeyError) as exc:
                        logger.warning("dispatcher: cannot read profile %s (%s); fitting without it", path, exc)
            self._profiles[ref] = perf
        return self._profiles[ref]

    def perf(self, hb: Heartbeat) -> WorkerPerf | None:
        """The worker's current models (None when its heartbeat names no usable profile)."""
        wid = hb.worker_id
        cur = self._perf.get(wid)
        if cur is not None:
            return cur
        fit = self._fits.get(wid)
        if fit is None:
            start = self._profile(hb.profile)
            if start is None:
                return None
            fit = self._fits[wid] = PerfFitter(start)
        cur = self._perf[wid] = fit.current()
        return cur

    def errors(self) -> dict[str, dict]:
        """Per worker, each model's out-of-sample error (see `PerfFitter.errors`)."""
        return {wid: fit.errors() for wid, fit in self._fits.items()}

    def report(self) -> dict[str, dict]:
        """Per worker: the profile it started from, the current coefficients and the errors."""
        out = {}
        for wid, fit in self._fits.items():
            cur = fit.current()
            b = cur.base
            out[wid] = {"worker_id": wid, "start": fit.start.label,
                        "coef": {"k1": b.k1, "c1": b.c1, "k2": b.k2, "c2": b.c2, "c3": b.c3, "h": b.h, "j": b.j,
                                 **{f"lora_{k}": list(v) for k, v in cur.lora.items()}},
                        "errors": fit.errors()}
        return out

    # ---------------------------------------------------------------- views
    def extras(self, hb: Heartbeat, now: float | None = None) -> dict:
        """The model fields of a `WorkerView` for this worker."""
        now = self.clock() if now is None else now
        perf = self.perf(hb)
        l_e, b_e = self.requests.ledger.errors(hb.worker_id, now)
        ranks = tuple(a.rank for a in hb.adapters)
        return {"requests": self.requests.requests(hb.worker_id, now, perf), "perf": perf,
                "len_error": l_e, "batch_error": b_e, "adapter_ranks": ranks, "max_batch": hb.max_batch,
                "kernel": hb.kernel or "bgmv", "max_adapters": hb.max_adapters}

    # ---------------------------------------------------------------- events
    def placed(self, worker_id: str, req: RequestView) -> RunningRequest:
        return self.requests.place(worker_id, req)

    def moved(self, request_id: str, worker_id: str) -> bool:
        return self.requests.move(request_id, worker_id)

    def first_token(self, ev: FirstToken) -> None:
        self.requests.first_token(ev.request_id, self.clock())

    def finished(self, ev: Completed | Failed) -> None:
        """Fit the worker's models from a completed request, then forget the request."""
        now = self.clock()
        wid = ev.worker_id
        step = ATGT_SLO_MS
        if isinstance(ev, Completed):
            fit = self._fits.get(wid)
            held = self.requests.requests(wid, now, self._perf.get(wid))
            started = [r for r in held if r.started]
            if fit is not None:
                mates = [r for r in started if r.request_id != ev.request_id]
                batch = len(mates) + 1
                ctx = (sum(r.input_tokens + r.generated for r in mates)
                       + ev.input_tokens + ev.output_tokens / 2.0) / batch
                fit.observe_completed(input_tokens=ev.input_tokens, output_tokens=ev.output_tokens,
                                      ttft_ms=ev.ttft_ms, queue_ms=ev.queue_ms, atgt_ms=ev.atgt_ms,
                                      mean_batch=batch, mean_context=ctx)
                self._perf.pop(wid, None)
            if ev.atgt_ms > 0:
                step = ev.atgt_ms
            self.requests.finish(ev.request_id, ev.output_tokens, now, step)
        else:
            self.requests.finish(ev.request_id, None, now)

    def forget_worker(self, worker_id: str) -> None:
        self.requests.forget_worker(worker_id)
        self._fits.pop(worker_id, None)
        self._perf.pop(worker_id, None)

    # ---------------------------------------------------------------- scale signal
    def should_signal(self, deployment: str) -> bool:
        """At most one scale-out signal per deployment per `signal_interval_s`."""
        now = self.clock()
        last = self._last_signal.get(deployment)
        if last is not None and now - last < self.signal_interval_s:
            return False
        self._last_signal[deployment] = now
        self.signals += 1
        return True
