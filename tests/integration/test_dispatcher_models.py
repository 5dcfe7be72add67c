"""The live dispatcher with the model-driven policies (Aladdin, CaraServe): per-request
bookkeeping from placements and request events, online fits from `completed` events,
the scale-out signal, and Alg. 2 moves carried out through the workers and the gateway.
Real nats-server and redis-server; the moved request goes through real sim workers and
the real gateway with the official `openai` client."""
from __future__ import annotations

import asyncio

import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.proto import (
    AnyEvent,
    Completed,
    Deployment,
    Dispatched,
    FirstToken,
    Placement,
    ScaleSignal,
    Withdraw,
    WithdrawReply,
)
from polyserve.worker.config import WorkerSettings
from polyserve.worker.service import WorkerService
from tests.helpers import running, wait_for
from tests.integration.conftest import MODEL
from tests.integration.test_dispatcher import dispatch, start_workers, with_index

pytestmark = pytest.mark.integration


@pytest.fixture(params=[True, False], ids=["index", "scan"])
def make_settings(make_settings, request):
    """Every test twice: with the dispatcher's worker index (the default) and with the scan."""
    return with_index(make_settings, request.param)

PROFILE = "sim-llama2-70b-h100-tp4"


async def test_aladdin_books_requests_fits_models_and_signals_scale_out(make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m", policy="aladdin"))
    signals: list[ScaleSignal] = []

    async def on_signal(ev: ScaleSignal):
        signals.append(ev)

    await bus.listen(subjects.scale_signal("d"), ScaleSignal, on_signal)
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", rebalance_s=0))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", "w2", profile=PROFILE, max_batch=2, kv_capacity=100_000)
        models = svc.view.models
        got = [(await dispatch(bus, subjects, rid=f"r{i}", predicted_tokens=50)).worker_id for i in range(4)]
        # best fit: the fullest feasible worker; each takes two (max_batch 2)
        assert got == ["w1", "w1", "w2", "w2"]
        assert (models.requests.tracked("w1"), models.requests.tracked("w2")) == (2, 2)
        assert not signals
        # nobody fits a fifth: placed anyway (least full) and the planner is asked for a worker
        await dispatch(bus, subjects, rid="r4", predicted_tokens=50)
        await wait_for(lambda: signals, what="ScaleSignal from the dispatcher")
        assert signals[0].source == "aladdin" and signals[0].request_id == "r4"
        await dispatch(bus, subjects, rid="r5", predicted_tokens=50)
        await asyncio.sleep(0.1)  # the subject: no second signal arrives within the rate-limit interval
        assert len(signals) == 1  # rate-limited per deployment

        # events feed the book and the fits
        perf0 = models.perf(svc.view.registry.live("d")[0])
        assert perf0 is not None and perf0.label.startswith(PROFILE)
        await bus.publish(subjects.event("first_token"), FirstToken(request_id="r0", worker_id="w1", ttft_ms=5))
        await wait_for(lambda: any(r.started for r in models.requests.requests("w1", models.clock(), None)),
                       what="r0 started in the book")
        held = models.requests.tracked("w1")
        await bus.publish(subjects.event("completed"), Completed(
            request_id="r0", worker_id="w1", input_tokens=10, output_tokens=40, e2e_ms=900, ttft_ms=300,
            queue_ms=20, atgt_ms=30.0, predicted_tokens=50))
        await wait_for(lambda: models.requests.tracked("w1") == held - 1, what="r0 finished in the book")
        err = models.errors()["w1"]
        assert err["prefill"]["n"] >= 1 and err["decode"]["n"] >= 1
        assert err["prefill"]["mean_rel_err"] is not None
        rep = models.report()["w1"]  # what `polyserve status` shows (stored in Redis every 5 s)
        assert rep["start"] == PROFILE and rep["coef"]["k1"] > 0 and rep["errors"] == err
        # r0 ended 10 tokens before its prediction: Alg. 2's over-estimate ledger has it
        assert models.requests.ledger.errors("w1", models.clock())[0] == -10.0


async def test_each_deployment_is_placed_against_its_own_slos(make_settings, bus, subjects, state):
    """Two aladdin deployments alike but for their ATGT SLO (read from Redis): the one at
    20 ms per token (below the profile's 28.8 ms decode step) asks for a worker, the one at
    the default 75 ms does not. The request's max_tokens caps the output the book plans with."""
    await state.put_deployment(Deployment(id="loose", model="m", policy="aladdin"))
    await state.put_deployment(Deployment(id="tight", model="m", policy="aladdin", atgt_slo_ms=20.0))
    signals: list[ScaleSignal] = []

    async def on_signal(ev: ScaleSignal):
        signals.append(ev)

    await bus.listen(subjects.scale_signal("*"), ScaleSignal, on_signal)
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", rebalance_s=0))
    async with running(svc):
        for dep in ("loose", "tight"):
            await start_workers(bus, subjects, svc, f"{dep}-w", dep=dep, profile=PROFILE, kv_capacity=100_000)
        await dispatch(bus, subjects, rid="a", dep="loose", predicted_tokens=5000, max_tokens=50)
        await dispatch(bus, subjects, rid="b", dep="tight", predicted_tokens=50)
        await wait_for(lambda: signals, what="ScaleSignal for the tight deployment")
        # one connection delivers in order: a signal for "loose" would have come first
        assert [(s.deployment, s.request_id) for s in signals] == [("tight", "b")]
        assert svc.view.models.requests._by_id["a"].req.predicted_tokens == 50


async def test_rebalance_moves_a_queued_request_from_under_to_over_estimated_worker(
        make_settings, bus, subjects, state):
    await state.put_deployment(Deployment(id="d", model="m", policy="aladdin"))
    asked: list[tuple[str, Withdraw]] = []
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", rebalance_s=0))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", "w2", profile=PROFILE, max_batch=8, kv_capacity=100_000)
        models = svc.view.models
        now = [1000.0]
        models.clock = lambda: now[0]
        assert (await dispatch(bus, subjects, rid="r0", predicted_tokens=5)).worker_id == "w1"
        assert (await dispatch(bus, subjects, rid="r1", predicted_tokens=5)).worker_id == "w1"
        assert (await dispatch(bus, subjects, rid="r9", predicted_tokens=500, exclude=["w1"])).worker_id == "w2"
        for rid, wid in (("r0", "w1"), ("r9", "w2")):
            await bus.publish(subjects.event("first_token"), FirstToken(request_id=rid, worker_id=wid, ttft_ms=1))
        await wait_for(lambda: sum(r.started for w in ("w1", "w2")
                                   for r in models.requests.requests(w, now[0], None)) == 2,
                       what="r0 and r9 started")
        # w2's request ends after 1 of its 500 predicted tokens (over-estimated worker) ...
        await bus.publish(subjects.event("completed"), Completed(
            request_id="r9", worker_id="w2", input_tokens=10, output_tokens=1, e2e_ms=5, ttft_ms=1,
            predicted_tokens=500))
        await wait_for(lambda: models.requests.tracked("w2") == 0, what="r9 finished")
        now[0] += 30.0  # ... while w1's r0 has run far past its 5 predicted tokens (under-estimated)

        async def ask(subject: str, msg: Withdraw) -> WithdrawReply:
            asked.append((subject, msg))
            return WithdrawReply(request_id=msg.request_id, worker_id="w1", withdrawn=True)

        assert await svc.handlers.rebalance(ask) == 1
        subject, msg = asked[0]
        assert subject == subjects.withdraw("w1") and msg.request_id == "r1"  # the queued one, not r0
        assert msg.placement.worker_id == "w2" and msg.placement.generate_subject == subjects.generate("w2")
        assert (models.requests.tracked("w1"), models.requests.tracked("w2")) == (1, 1)
        assert (svc.view.outstanding.count("w1"), svc.view.outstanding.count("w2")) == (1, 1)

        async def refuse(subject: str, msg: Withdraw) -> WithdrawReply:  # already started there
            return WithdrawReply(request_id=msg.request_id, worker_id="w1", withdrawn=False, reason="started")

        assert await svc.handlers.rebalance(refuse) == 0


async def test_withdrawn_request_moves_to_another_worker_and_completes(plane, make_settings, bus, subjects,
                                                                         span_exporter):
    """The worker gives back a queued request; the gateway re-sends it to the new worker."""
    events: list = []

    async def on(ev):
        events.append(ev)

    await bus.listen(f"{subjects.prefix}.v1.events.request.>", AnyEvent, on)
    # one slow sequence at a time on w-test, so a second request waits in its queue
    async with plane(worker_kw={"max_batch": 1, "time_scale": 0.3}) as p:
        first = asyncio.create_task(p.client.completions.create(
            model=MODEL, prompt="a long one", max_tokens=40, extra_body={"min_tokens": 40}))
        await wait_for(lambda: p.worker.engine.load().running == 1, what="first request running")
        # its first_token event may come up to a batch window later (shared/batching.py)
        await wait_for(lambda: any(isinstance(e, FirstToken) for e in events), what="the first request's first_token")
        second = asyncio.create_task(p.client.completions.create(
            model=MODEL, prompt="the queued one", max_tokens=3, extra_body={"min_tokens": 3}))
        await wait_for(lambda: p.worker.engine.load().waiting == 1, what="second request queued")
        queued = next(r for r in p.worker.engine.open_requests()
                      if r not in {e.request_id for e in events if isinstance(e, FirstToken)})
        other = WorkerService(make_settings(WorkerSettings, "worker", worker_id="w-other", deployment=MODEL,
                                            model=MODEL, engine="sim", time_scale=0.01),
                              span_exporter=span_exporter)
        async with running(other):
            target = Placement(request_id=queued, worker_id="w-other", policy="aladdin",
                               generate_subject=subjects.generate("w-other"),
                               cancel_subject=subjects.cancel("w-other"))
            running_id = next(r for r in p.worker.engine.open_requests() if r != queued)
            no = await bus.request(subjects.withdraw("w-test"), Withdraw(request_id=running_id, placement=target),
                                   WithdrawReply, timeout=2)
            assert not no.withdrawn and "started" in no.reason
            yes = await bus.request(subjects.withdraw("w-test"), Withdraw(request_id=queued, placement=target),
                                    WithdrawReply, timeout=2)
            assert yes.withdrawn and yes.worker_id == "w-test"
            out = await asyncio.wait_for(second, 20)
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
            done = await wait_for(lambda: next((e for e in events if isinstance(e, Completed)
                                                and e.request_id == queued), None), what="completed event")
            assert done.worker_id == "w-other"
            assert any(isinstance(e, Dispatched) and e.request_id == queued and e.policy.endswith(":moved")
                       for e in events)
            assert p.worker.handlers.withdrawn == 1
        await asyncio.wait_for(first, 30)


async def test_first_token_is_followed_from_the_first_model_placement_on(make_settings, bus, subjects, state):
    """`first_token` only moves a model-book entry (aladdin/caraserve) of the replica's own
    placements: a dispatcher serving load-only policies does not listen to it (one delivery and
    index refresh per request fewer, issue 15); its first aladdin placement subscribes, before
    the reply, and that request's `first_token` then reaches the book."""
    def following() -> bool:
        return any(s.subject == subjects.event("first_token") for s in svc.bus._subs)

    await state.put_deployment(Deployment(id="d", model="m", policy="least_outstanding"))
    await state.put_deployment(Deployment(id="a", model="m", policy="aladdin"))
    svc = DispatcherService(make_settings(DispatcherSettings, "dispatcher", rebalance_s=0))
    async with running(svc):
        await start_workers(bus, subjects, svc, "w1", profile=PROFILE, max_batch=4, kv_capacity=100_000)
        await start_workers(bus, subjects, svc, "w2", dep="a", profile=PROFILE, max_batch=4, kv_capacity=100_000)
        await dispatch(bus, subjects, rid="plain", predicted_tokens=50)
        assert not following()
        placed = await dispatch(bus, subjects, rid="modelled", dep="a", predicted_tokens=50)
        assert following() and placed.worker_id == "w2"
        await bus.publish(subjects.event("first_token"), FirstToken(request_id="modelled", worker_id=placed.worker_id,
                                                                     ttft_ms=5))
        await wait_for(lambda: any(r.started for r in svc.view.models.requests.requests(
            placed.worker_id, svc.view.models.clock(), None)), what="the first token in the book")
