"""Admission, one path for every endpoint that serves a model (completions, chat and
embeddings), after the endpoint validated its body:

1. `admit()`: refuse while draining (503) or over the in-flight limit (429, both with
   Retry-After), resolve the request's `model` to a deployment (and a LoRA adapter);
   404 when it names none, 503 when the cluster state cannot be read.
2. `Admission.begin()` / `end()`: the request's in-flight slot (limit checked and slot
   taken in one synchronous step) and its server span.
3. `check_input()`: 400 naming the limit for a prompt longer than any live worker takes.
4. `predict()`: the predictor's output-length hint, clamped to the request's max_tokens
   (completions; an embedding produces no tokens); a hint, answered locally past its budget.
   `predict_later()`: the same for a request that does not wait for it, asked in a batch.
5. `place()`: the gateway's own placement for the load-only policies (routing.py), else the
   dispatcher's, with its `dispatched` event; a second try, then a local least-outstanding
   placement when no dispatcher answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from polyserve.core import length_hint
from polyserve.core.names import MODEL_POLICIES, PREFERRED
from polyserve.proto import (
    AdapterSpec,
    Deployment,
    Dispatched,
    DispatchRequest,
    Heartbeat,
    Placement,
    Predicted,
    Prediction,
    PredictRequest,
)
from polyserve.shared.bus import BusError

from . import policy, prefixes, tenancy
from .context import GatewayState
from .errors import GatewayError, status_of
from .policy import InvalidRequest
from .routing import LOCAL_POLICIES, candidates, ranked_for

logger = logging.getLogger(__name__)

# Dispatch policies that read the request's prediction (`predicted_tokens` / `length_class`):
# aladdin and caraserve (their performance models), first_fit (room for input + predicted
# output) and least_loaded (tokens of the tracked requests). For every other policy the gateway
# asks the predictor and the dispatcher at once (handlers.RequestRun._predict_and_place).
USES_PREDICTION = MODEL_POLICIES | {"first_fit", "least_loaded"}


@dataclass
class Admission:
    """An admitted request: its deployment, the adapter it names, and (between `begin`
    and `end`) its in-flight slot and server span."""

    gs: GatewayState
    deployment: Deployment
    adapter: AdapterSpec | None = None
    span: Span | None = None

    def begin(self, name: str, headers: Mapping[str, str]) -> Span:
        """Take the in-flight slot and start the server span (parent: the client's trace headers).

        The limit is checked and the slot taken here, in one synchronous step (no await between
        them), so concurrent requests cannot all pass a check made before an await: 429 when full."""
        gs = self.gs
        if gs.inflight >= gs.settings.max_inflight:
            raise overloaded(gs)
        gs.inflight += 1
        gs.metrics.inflight.inc()
        # only the headers the propagators read: most requests carry none, and copying every header
        # into a dict for them cost more than the rest of the span (issue 15)
        fields = propagate.get_global_textmap().fields
        carrier = {k: v for k, v in headers.items() if k in fields}
        self.span = gs.tracer.start_span(name, kind=SpanKind.SERVER,
                                         context=propagate.extract(carrier) if carrier else None)
        return self.span

    def failed(self, exc: GatewayError) -> None:
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, exc.message))

    def end(self) -> None:
        """Give the slot back and end the span (once)."""
        if self.span is None:
            return
        self.gs.inflight -= 1
        self.gs.metrics.inflight.dec()
        self.span.end()
        self.span = None


def overloaded(gs: GatewayState) -> GatewayError:
    gs.metrics.rejected.labels("overload").inc()
    return GatewayError(429, f"too many requests in flight ({gs.settings.max_inflight}); retry shortly",
                        retry_after=1)


async def admit(gs: GatewayState, model: str, adapter: str | None = None) -> Admission:
    """Admit a request for `model` (and the explicitly named LoRA `adapter`); raises
    GatewayError or InvalidRequest saying why not. The in-flight slot is taken by `begin()`."""
    if gs.draining:
        gs.metrics.rejected.labels("draining").inc()
        raise GatewayError(503, "the gateway is shutting down; retry on another instance", retry_after=1)
    if gs.inflight >= gs.settings.max_inflight:  # early and cheap; begin() checks again atomically
        raise overloaded(gs)
    policy.check_text(model, "model")
    policy.check_text(adapter or "", "adapter")
    try:
        deployment, spec = await gs.find_deployment(model)
    except Exception as exc:
        raise GatewayError(503, f"cluster state unavailable: {exc}", retry_after=1) from exc
    if deployment is None:
        raise InvalidRequest(f"The model '{model}' does not exist; GET /v1/models lists the served models",
                             "model", 404, "model_not_found")
    if adapter:
        spec = gs.adapters.get(adapter)
        if spec is None or spec.deployment != deployment.id:
            known = sorted(a.name for a in gs.adapters.values() if a.deployment == deployment.id)
            raise InvalidRequest(f"unknown adapter '{adapter}' for '{deployment.id}'; registered: "
                                 f"{known or 'none'} (POST /v1/adapters)", "adapter", 404, "adapter_not_found")
    await fair_turn(gs, deployment)
    return Admission(gs, deployment, spec)


def fair_slots(gs: GatewayState, dep_id: str) -> int:
    """How many requests of `dep_id` this gateway lets run before the fair queue holds the next:
    the setting `fair_slots`, else the batch slots (`max_batch`) of the live workers, plus
    `fair_headroom` of them while only one tenant is active (the control plane takes a while to
    hand a waiting request to a worker, and the batch runs short meanwhile; under contention the
    headroom would queue other tenants' requests FCFS in the worker, so there is none). When no
    heartbeat is fresh (a worker restarting, a slow event loop) the last known count holds: 0
    would release every waiting request at once into the workers' FCFS queues. 0 = never known."""
    if gs.settings.fair_slots:
        return gs.settings.fair_slots
    q = gs.fairness.queue(dep_id)
    batch = sum(max(0, hb.max_batch) for hb in gs.fresh_heartbeats(dep_id))
    if batch > 0:
        q.slots = batch
    if q.slots and not q.contended():  # one tenant: headroom, a request ready the moment a sequence ends
        return q.slots + math.ceil(q.slots * gs.settings.fair_headroom)
    return q.slots


async def fair_turn(gs: GatewayState, deployment: Deployment) -> None:
    """Wait for the request's turn in the deployment's VTC queue (fairness.py) when it has a client
    key and the deployment's slots are taken; the access middleware gives the slot back at the end."""
    t = tenancy.current()
    if t is None or t.record is None or t.grant is not None or not gs.settings.fair_share:
        return
    slots = fair_slots(gs, deployment.id)
    if slots <= 0:
        return
    q = gs.fairness.queue(deployment.id)
    if q.queued >= gs.settings.max_inflight:
        gs.metrics.rejected.labels("fair_queue_full").inc()
        raise GatewayError(429, f"{q.queued} requests wait for '{deployment.id}' on this gateway (the limit is "
                                f"max_inflight {gs.settings.max_inflight}); retry shortly", retry_after=1)
    t.deployment = deployment.id
    q.reserve_fraction = gs.settings.fair_reserve
    t.grant = await q.acquire(t.record.tenant, t.record.priority, t.est_in, t.est_out, slots)
    if t.grant.waited_s:
        gs.metrics.fair_wait.labels(deployment.id).observe(t.grant.waited_s)


def fair_priority(priority: int) -> int:
    """The `priority` a worker gets for the request being served: one ahead of the client's when
    the fair queue started it for a tenant with nothing running while another tenant ran, so a
    worker with a priority-aware `scheduling` starts it before the other tenant's queued requests
    (e.g. `fair_headroom` ones); FCFS workers ignore it (docs/security.md, fair sharing)."""
    t = tenancy.current()
    return priority - 1 if t is not None and t.grant is not None and t.grant.ahead else priority


def truncated_input(gs: GatewayState, deployment: Deployment, input_tokens: int, keep: int) -> int:
    """The prompt's token estimate after the workers cut it (`SamplingParams.truncate_prompt_tokens`:
    k keeps the last k, -1 the last max_input_len of the deployment's workers)."""
    if keep == -1:
        keep = gs.max_input_len(deployment.id)
    return min(input_tokens, keep) if keep > 0 else input_tokens


def check_input(gs: GatewayState, deployment: Deployment, input_tokens: int) -> None:
    """400 naming the limit when the prompt is longer than any live worker of the deployment
    takes (`max_input_len` from their heartbeats): retrying cannot help, so no 503."""
    limit = gs.max_input_len(deployment.id)
    if limit and input_tokens > limit:
        raise InvalidRequest(f"the prompt is about {input_tokens} tokens; '{deployment.id}' accepts at most "
                             f"{limit} input tokens (max_input_len): shorten it", "prompt",
                             code="context_length_exceeded")


def local_prediction(gs: GatewayState, req: PredictRequest) -> Prediction:
    """The gateway's own estimate (core.length_hint: the predictor's history rule over the
    requests this gateway saw complete, else the prior); source "local-history" / "local-prior"."""
    tokens, klass, source = gs.lengths.estimate(req.model, req.input_tokens, req.max_tokens)
    return Prediction(request_id=req.request_id, model=req.model, length_class=klass, tokens_estimate=tokens,
                      source=f"local-{source}", num_classes=len(length_hint.CLASS_BOUNDS) + 1)


async def predict(gs: GatewayState, req: PredictRequest, base: dict) -> Prediction:
    """The predictor's output-length hint for `req` (never above `req.max_tokens` when set);
    publishes `predicted`. A hint: when the predictor does not answer within
    `predict_timeout_s` (or fails), the gateway answers it from its own history of completed
    requests, else the prior (source "local-history" / "local-prior"); never an error."""
    t = time.monotonic()
    try:
        p = await gs.bus.request(gs.subjects.predict, req, Prediction, timeout=gs.settings.predict_timeout_s,
                                 span_name="predict")
    except BusError as exc:
        logger.debug("predictor: %s; a local estimate", exc.description)
        p = None
    return _took(gs, req, base, p, t)


def _took(gs: GatewayState, req: PredictRequest, base: dict, p: Prediction | None, t: float) -> Prediction:
    """`p`, else (the predictor gave none in time) the local estimate; publishes `predicted`
    with the time since `t`."""
    if p is None:
        p = local_prediction(gs, req)
        gs.metrics.fallbacks.labels("predict").inc()
    gs.emit("predicted", Predicted(**base, length_class=p.length_class, tokens_estimate=p.tokens_estimate,
                                   source=p.source, latency_ms=(time.monotonic() - t) * 1e3))
    return p


def predict_later(gs: GatewayState, req: PredictRequest, base: dict) -> asyncio.Future:
    """As `predict`, for a request that does not wait for its prediction (it already runs on a
    free batch slot): a future of it, asked with others in one message after up to
    `predict_batch_ms` (predict_batch.py), or at once when that is 0. `predicted` (published as
    the future completes, before its other callbacks run) says how long it took in all. No task
    per request: the batch's answer completes the future through a callback (issue 15)."""
    if gs.settings.predict_batch_ms <= 0:
        return asyncio.ensure_future(predict(gs, req, base))
    t = time.monotonic()
    out = asyncio.get_running_loop().create_future()

    def answered(asked: asyncio.Future) -> None:
        p = None if asked.cancelled() or asked.exception() is not None else asked.result()
        if not out.done():
            out.set_result(_took(gs, req, base, p, t))

    gs.predictions.ask(req).add_done_callback(answered)
    return out


def place_here(gs: GatewayState, req: DispatchRequest, policy: str,
               prefix: tuple[int, ...] = ()) -> tuple[Placement, bool] | None:
    """The gateway's own placement of `req` (routing.py), and whether the chosen worker has a
    free batch slot (the request starts there at once); None when the dispatcher must decide:
    `local_dispatch` off, a policy that reads more than worker load, a LoRA adapter, no
    fresh heartbeat of a worker that can take the request, or a fleet not heard as usual
    (`GatewayState.fleet_steady`: during and just after a NATS stall). `prefix`: hashes of the
    prompt's starts where prefix-aware placement applies (prefixes.blocks)."""
    if not gs.settings.local_dispatch or policy not in LOCAL_POLICIES or req.adapter:
        return None
    fits = candidates(gs.fresh_heartbeats(req.deployment), req.input_tokens, req.exclude)
    if not fits or not gs.fleet_steady(fits[0].ttl_s):
        return None
    if req.affinity:  # prompt_cache_key: the key's worker unless it is overloaded (routing.py)
        ranked = ranked_for(req.affinity, fits)
        hb, policy = gs.router.first_within(ranked, gs.settings.affinity_load_factor), policy + "+affinity"
        gs.metrics.affinity.labels(req.deployment, "home" if hb is ranked[0] else "spilled").inc()
    elif prefix:  # the worker that has the longest start of the prompt, unless it is overloaded
        hb, policy = _by_prefix(gs, req, policy, fits, prefix)
    else:
        hb = gs.router.choose(policy, req.deployment, fits)
    free = hb.waiting == 0 and gs.router.load(hb) < max(1, hb.max_batch)
    gs.router.assign(req.request_id, hb.worker_id)
    return _placement(gs, req, hb, policy), free


def _by_prefix(gs: GatewayState, req: DispatchRequest, policy: str, fits: list[Heartbeat],
               prefix: tuple[int, ...]) -> tuple[Heartbeat, str]:
    hb, outcome = prefixes.choose(gs.router, gs.prefixes, prefix, policy, req.deployment, fits,
                                  gs.settings.affinity_load_factor)
    gs.metrics.prefix.labels(req.deployment, outcome).inc()
    return hb, policy + "+prefix" if outcome == "hit" else policy


async def place(gs: GatewayState, req: DispatchRequest, base: dict, after: asyncio.Future | None = None,
                policy: str = "", here: Placement | None = None, prefix: tuple[int, ...] = ()) -> Placement:
    """Where `req` runs: the gateway's own choice for a load-only `policy` (`place_here`), else
    the dispatcher's placement; publishes `dispatched`. A dispatcher that does not
    answer in time is asked once more (the queue group may pick another replica); when none
    answers (timeouts, or no dispatcher listening) the gateway places the request itself on the
    least-outstanding live worker from the heartbeats it follows (policy "local-fallback").
    With `after` (the prediction asked at the same time), `dispatched` waits for it, so the
    events of a request keep their order: admitted, predicted, dispatched. `here`: the
    gateway's own choice made already (`place_here`; a policy's state moves once per choice)."""
    t = time.monotonic()
    if here is None:
        mine = place_here(gs, req, policy, prefix)
        here = mine[0] if mine else None
    hint = None
    if here is None and (req.affinity or prefix):  # the dispatcher decides: with a hint (`dispatch_hint`)
        hint = dispatch_hint(gs, req, prefix)
        req = msgspec.structs.replace(req, prefer=hint[0])
    placement = here if here is not None else await _ask_dispatcher(gs, req)
    if hint is not None:
        placement = _count_hint(gs, req, placement, hint)
    latency_ms = (time.monotonic() - t) * 1e3
    if after is not None:
        await asyncio.shield(after)  # the caller may cancel this wait, never the prediction under it
    await announce(gs, base, placement, latency_ms)
    return placement


def dispatch_hint(gs: GatewayState, req: DispatchRequest, prefix: tuple[int, ...]) -> tuple[list[str], str, bool]:
    """(`DispatchRequest.prefer`, the key's home worker or "", whether some worker holds a start of the
    prompt): what the gateway would have placed `req` by, where the dispatcher places it
    (dispatcher/prefer.py; its policy then checks its SLO): a `prompt_cache_key`'s first worker
    within the affinity bound (`LocalRouter.first_within`), else the workers holding the longest
    start of the prompt that take one more request within it (`prefixes.choose`'s rule)."""
    fits = candidates(gs.fresh_heartbeats(req.deployment), req.input_tokens, req.exclude)
    if not fits:
        return [], "", False
    factor = gs.settings.affinity_load_factor
    if req.affinity:
        ranked = ranked_for(req.affinity, fits)
        return [gs.router.first_within(ranked, factor).worker_id], ranked[0].worker_id, False
    within, held = prefixes.hint(gs.router, gs.prefixes, prefix, fits, factor)
    return within, "", held


def _count_hint(gs: GatewayState, req: DispatchRequest, placement: Placement,
                hint: tuple[list[str], str, bool]) -> Placement:
    """Count the affinity or prefix outcome of a placement the dispatcher made with `dispatch_hint`'s
    hint; the placement with its policy named as the gateway names its own (`<policy>+affinity`,
    `<policy>+prefix`) where the dispatcher followed the hint (it answers `<policy>+prefer`)."""
    _, home, held = hint
    followed = placement.policy.endswith(PREFERRED)
    if req.affinity:
        if home:
            gs.metrics.affinity.labels(req.deployment, "home" if placement.worker_id == home else "spilled").inc()
    else:
        gs.metrics.prefix.labels(req.deployment, "hit" if followed else "spilled" if held else "miss").inc()
    if not followed:
        return placement
    named = placement.policy[:-len(PREFERRED)] + ("+affinity" if req.affinity else "+prefix")
    return msgspec.structs.replace(placement, policy=named)


async def announce(gs: GatewayState, base: dict, placement: Placement, latency_ms: float) -> None:
    """The `dispatched` event (the dispatchers count placements made elsewhere from it)."""
    await gs.event("dispatched", Dispatched(**base, worker_id=placement.worker_id, policy=placement.policy,
                                            latency_ms=latency_ms))


async def _ask_dispatcher(gs: GatewayState, req: DispatchRequest) -> Placement:
    placement = None
    for attempt in range(2):
        try:
            placement = await gs.bus.request(gs.subjects.dispatch, req, Placement,
                                             timeout=gs.settings.dispatch_timeout_s, span_name="dispatch")
            break
        except BusError as exc:
            unanswered = exc.code == 504 or (exc.code == 503 and exc.description.startswith("no service is"))
            if not unanswered:
                raise status_of(exc, "dispatcher") from exc
            logger.warning("dispatcher did not answer %s (%s)%s", req.request_id, exc.description,
                           "; asking again" if attempt == 0 and exc.code == 504 else "; placing locally")
            if exc.code != 504:
                break
    if placement is None:
        placement = await local_placement(gs, req)
        gs.metrics.fallbacks.labels("dispatch").inc()
    return placement


async def local_placement(gs: GatewayState, req: DispatchRequest) -> Placement:
    """Least outstanding (this gateway's requests on it plus the others' at its last heartbeat,
    routing.LocalRouter) among the live workers of the deployment that take the request;
    the Redis registry answers when no heartbeat was heard yet. 503 when there is none."""
    live = gs.fresh_heartbeats(req.deployment)
    if not live:
        with contextlib.suppress(GatewayError):
            live = await gs.live_workers(req.deployment)
    fits = candidates(live, req.input_tokens, req.exclude)
    if not fits:
        raise GatewayError(503, f"no dispatcher answered and no live worker of '{req.deployment}' can take the "
                                "request; retry shortly", retry_after=1)

    def load(hb: Heartbeat) -> tuple[int, int]:
        has_adapter = bool(req.adapter) and any(a.name == req.adapter for a in hb.adapters)
        return gs.router.load(hb), 0 if has_adapter else 1

    hb = min(fits, key=load)
    gs.router.assign(req.request_id, hb.worker_id)
    return _placement(gs, req, hb, "local-fallback")


def _placement(gs: GatewayState, req: DispatchRequest, hb: Heartbeat, policy: str) -> Placement:
    return Placement(request_id=req.request_id, worker_id=hb.worker_id,
                     generate_subject=hb.generate_subject or gs.subjects.generate(hb.worker_id),
                     cancel_subject=hb.cancel_subject or gs.subjects.cancel(hb.worker_id),
                     policy=policy, priority=req.priority)
