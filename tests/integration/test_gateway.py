"""The OpenAI-compatible gateway over real HTTP with the official `openai` client,
in front of real predictor, dispatcher and sim worker services on real NATS/Redis."""
from __future__ import annotations

import asyncio
import contextlib

import httpx
import openai
import pytest

from polyserve.proto import ATGT_SLO_MS, TTFT_SLO_MS, AnyEvent, DispatchRequest, PredictRequest
from tests.helpers import assert_lifecycle, wait_for
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration


def kind(ev) -> str:
    """The tag of an event struct (its `event` field on the wire)."""
    return type(ev).__struct_config__.tag


async def collect_events(bus, subjects, into: list):
    async def on(ev):
        into.append(ev)

    await bus.listen(f"{subjects.prefix}.v1.events.>", AnyEvent, on)
    await bus.nc.flush()


async def test_completions_and_chat_stream_and_not(plane, bus, subjects):
    events: list = []
    await collect_events(bus, subjects, events)
    async with plane() as p:
        models = await p.client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        c = await p.client.completions.create(model=MODEL, prompt="hello there", max_tokens=5,
                                              extra_body={"min_tokens": 5})
        assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
        assert c.model_extra.get("simulated") is True

        two = await p.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2, seed=7,
                                                temperature=0.7, top_p=0.9)
        assert len(two.choices) == 2 and {ch.index for ch in two.choices} == {0, 1}
        again = await p.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2, seed=7,
                                                  temperature=0.7, top_p=0.9)
        assert [ch.text for ch in again.choices] == [ch.text for ch in two.choices]

        stream = await p.client.completions.create(model=MODEL, prompt="stream me", max_tokens=6, stream=True,
                                                   extra_body={"min_tokens": 6})
        pieces = [ch async for ch in stream]
        assert sum(1 for ch in pieces if ch.choices and ch.choices[0].text) == 6
        assert pieces[-1].choices[0].finish_reason == "length"

        chat = await p.client.chat.completions.create(model=MODEL, max_tokens=3,
                                                      messages=[{"role": "user", "content": "hello"}])
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        cstream = await p.client.chat.completions.create(model=MODEL, max_tokens=3, stream=True,
                                                         stream_options={"include_usage": True},
                                                         messages=[{"role": "user", "content": "hi"}])
        chunks = [ch async for ch in cstream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

        # a stop string ends the text before it
        first = (await p.client.completions.create(model=MODEL, prompt="x", max_tokens=8, seed=1,
                                                   extra_body={"min_tokens": 8})).choices[0].text
        word = first.split()[2]
        stopped = await p.client.completions.create(model=MODEL, prompt="x", max_tokens=8, seed=1, stop=[word],
                                                    extra_body={"min_tokens": 2})
        assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].text
        assert first.startswith(stopped.choices[0].text)

    rid = c.id
    await wait_for(lambda: any(getattr(e, "request_id", None) == rid and kind(e) == "completed" for e in events),
                   what="completed event")
    kinds = [kind(e) for e in events if getattr(e, "request_id", None) == rid]
    assert_lifecycle(kinds)
    assert set(kinds) == {"admitted", "predicted", "dispatched", "first_token", "completed"}
    done = next(e for e in events if getattr(e, "request_id", None) == rid and kind(e) == "completed")
    assert done.output_tokens == 5 and done.e2e_ms > 0 and done.simulated
    assert any(kind(e) == "heartbeat" for e in events)
    # streamed requests end with `completed` too (never a 499 `failed` at the done chunk)
    sid = pieces[0].id
    await wait_for(lambda: any(getattr(e, "request_id", None) == sid and kind(e) == "completed" for e in events),
                   what="completed event of the streamed request")
    assert not [e for e in events if kind(e) == "failed"]


async def test_max_tokens_reaches_predictor_and_dispatcher(plane, bus, subjects):
    """The request's max_tokens (per sequence, so also with n > 1) travels in PredictRequest and
    DispatchRequest; the predictor clamps its estimate to it and the gateway passes that on."""
    seen: dict[str, list] = {"predict": [], "dispatch": [], "events": []}

    async def on_predict(req: PredictRequest):
        seen["predict"].append(req)

    async def on_dispatch(req: DispatchRequest):
        seen["dispatch"].append(req)

    await bus.listen(subjects.predict, PredictRequest, on_predict)  # copies; the services answer
    await bus.listen(subjects.dispatch, DispatchRequest, on_dispatch)
    await collect_events(bus, subjects, seen["events"])

    def of(kind_: str, rid: str):
        return next((x for x in seen[kind_] if getattr(x, "request_id", None) == rid), None)

    async with plane(local_dispatch=False) as p:  # the dispatcher asked for every request (routing.py)
        small = await p.client.completions.create(model=MODEL, prompt="cap me", max_tokens=7, n=2)
        chat = await p.client.chat.completions.create(model=MODEL, max_completion_tokens=3,
                                                      messages=[{"role": "user", "content": "hi"}])
        big = await p.client.completions.create(model=MODEL, prompt="no cap", max_tokens=500)
        for rid in (small.id, chat.id, big.id):
            await wait_for(lambda rid=rid: of("dispatch", rid) and of("predict", rid), what=f"requests of {rid}")
            # events leave up to a batch window after the answer (shared/batching.py)
            await wait_for(lambda rid=rid: any(getattr(e, "request_id", None) == rid and kind(e) == "predicted"
                                               for e in seen["events"]), what=f"predicted event of {rid}")
        # the predictor's prior is 129 tokens: clamped for the small caps, kept under 500
        # (this deployment's policy does not read the prediction: the gateway asks the dispatcher at the
        # same time as the predictor, so without it; admission.USES_PREDICTION; test_gateway_overhead.py)
        for rid, cap, predicted in ((small.id, 7, 7), (chat.id, 3, 3), (big.id, 500, 129)):
            assert of("predict", rid).max_tokens == cap
            d = of("dispatch", rid)
            assert (d.max_tokens, d.predicted_tokens) == (cap, 0)
            ev = next(e for e in seen["events"] if getattr(e, "request_id", None) == rid and kind(e) == "predicted")
            if cap == 500 and ev.source == "history":
                # the predictor may have learnt from the first two requests' `completed` events by
                # now (their order against this prediction is timing: failed once in CI): unclamped
                assert 0 < ev.tokens_estimate < cap, ev
            else:
                assert ev.tokens_estimate == predicted, ev


async def test_one_trace_spans_every_service(plane, span_exporter):
    # local_dispatch off: the dispatcher takes part in every request (with it on, the gateway
    # places least_outstanding requests itself and the dispatcher is not on the request's path)
    async with plane(local_dispatch=False) as p:
        c = await p.client.completions.create(model=MODEL, prompt="trace me", max_tokens=2)
    await wait_for(lambda: any(s.name == "worker generate" for s in span_exporter.get_finished_spans()),
                   what="worker span")
    spans = span_exporter.get_finished_spans()
    root = next(s for s in spans if s.attributes.get("polyserve.request_id") == c.id)
    in_trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    services = {s.resource.attributes["service.name"] for s in in_trace}
    assert {"polyserve-gateway", "polyserve-predictor", "polyserve-dispatcher", "polyserve-worker"} <= services


async def test_bad_input_gets_clear_4xx_and_disturbs_nothing(plane):
    async with plane() as p:
        async with httpx.AsyncClient(base_url=p.url) as h:
            r = await h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
            r = await h.post("/v1/completions", json={"model": MODEL})
            assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
            r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
            await p.client.completions.create(model=MODEL, prompt="x", max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="limit of 4096"):
            await p.client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await p.client.completions.create(model="nope", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await p.client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
        ok = await p.client.completions.create(model=MODEL, prompt="still fine", max_tokens=2)
        assert ok.choices[0].text


async def test_no_worker_is_503_and_silent_services_are_not_a_hang(plane, bus, subjects):
    async with plane(with_worker=False) as p:
        with pytest.raises(openai.APIStatusError) as err:
            await p.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "no worker" in err.value.message
    # The prediction is a hint (issue 13): no predictor, or one that never answers, costs no
    # request; the gateway estimates locally (tests/integration/test_gateway_faults.py).
    async with plane(with_predictor=False, predict_timeout_s=0.5) as p:
        assert (await p.client.completions.create(model=MODEL, prompt="x", max_tokens=2)).choices[0].text

        async def black_hole(msg):  # a predictor that never answers
            pass

        sub = await bus.nc.subscribe(subjects.predict, cb=black_hole)
        await bus.nc.flush()
        loop = asyncio.get_running_loop()
        t = loop.time()
        assert (await p.client.completions.create(model=MODEL, prompt="x", max_tokens=2)).choices[0].text
        assert loop.time() - t < 5
        await sub.unsubscribe()


async def test_admin_api_deployments_and_key(plane):
    async with plane(admin_api_key="s3cret") as p:
        async with httpx.AsyncClient(base_url=p.url) as h:
            body = {"id": "chat-a", "model": "m-a", "engine": "sim", "policy": "round_robin",
                    "scaler": {"type": "pertoken", "min_replicas": 1, "max_replicas": 3, "window_s": 20,
                               "threshold_ms": 40}}
            assert (await h.post("/v1/deployments", json=body)).status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            r = await h.post("/v1/deployments", json=body, headers=auth)
            assert r.status_code == 201 and r.json()["scaler"]["max_replicas"] == 3
            assert (await h.post("/v1/deployments", json=body, headers=auth)).status_code == 409
            bad = dict(body, id="b", policy="magic")
            r = await h.post("/v1/deployments", json=bad, headers=auth)
            assert r.status_code == 400 and "magic" in r.json()["error"]["message"]
            r = await h.post("/v1/deployments", json=dict(body, id="c", scaler={"min_replicas": 5,
                                                                               "max_replicas": 2}), headers=auth)
            assert r.status_code == 400
            r = await h.post("/v1/deployments", json=dict(body, id="d", reasoning_parser="granite"), headers=auth)
            assert r.status_code == 400 and "reasoning_parser" in r.text
            r = await h.post("/v1/deployments", json=dict(body, id="e", reasoning_parser="deepseek_r1"), headers=auth)
            assert r.status_code == 201 and r.json()["reasoning_parser"] == "deepseek_r1"
            ids = [d["id"] for d in (await h.get("/v1/deployments", headers=auth)).json()["data"]]
            assert "chat-a" in ids and MODEL in ids
            assert (await h.get("/v1/deployments/chat-a", headers=auth)).json()["model"] == "m-a"
            assert (await h.delete("/v1/deployments/chat-a", headers=auth)).status_code == 200
            assert (await h.get("/v1/deployments/chat-a", headers=auth)).status_code == 404
            assert (await h.delete("/v1/deployments/chat-a", headers=auth)).status_code == 404
            assert (await h.get("/healthz")).status_code == 200
            assert (await h.get("/readyz")).status_code == 200
            metrics = (await h.get("/metrics")).text
            assert "polyserve_requests_total" in metrics


async def test_admin_api_deployment_slos(plane, state):
    """A deployment carries its TTFT and ATGT SLOs: given (> 0) or the proto defaults
    (Aladdin Table 2), stored in Redis and shown by GET."""
    async with plane() as p:
        async with httpx.AsyncClient(base_url=p.url) as h:
            r = await h.post("/v1/deployments", json={"id": "slo-a", "model": "m-a", "ttft_slo_ms": 800,
                                                      "atgt_slo_ms": 40.5})
            assert r.status_code == 201 and (r.json()["ttft_slo_ms"], r.json()["atgt_slo_ms"]) == (800, 40.5)
            got = (await h.get("/v1/deployments/slo-a")).json()
            assert (got["ttft_slo_ms"], got["atgt_slo_ms"]) == (800, 40.5)
            stored = await state.get_deployment("slo-a")
            assert (stored.ttft_slo_ms, stored.atgt_slo_ms) == (800, 40.5)

            r = await h.post("/v1/deployments", json={"id": "slo-b", "model": "m-b"})
            assert r.status_code == 201
            listed = {d["id"]: d for d in (await h.get("/v1/deployments")).json()["data"]}
            assert (listed["slo-b"]["ttft_slo_ms"], listed["slo-b"]["atgt_slo_ms"]) == (TTFT_SLO_MS, ATGT_SLO_MS)

            for field, value in (("ttft_slo_ms", 0), ("atgt_slo_ms", -5), ("ttft_slo_ms", "soon")):
                r = await h.post("/v1/deployments", json={"id": "slo-c", "model": "m-c", field: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert (await h.get("/v1/deployments/slo-c")).status_code == 404


async def test_client_disconnect_cancels_at_the_worker(plane, bus, subjects):
    events: list = []
    await collect_events(bus, subjects, events)
    async with plane(worker_kw={"time_scale": 1.0}) as p:
        async with httpx.AsyncClient(base_url=p.url, timeout=10) as h:
            async with h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "long", "stream": True,
                                                                 "max_tokens": 2000, "min_tokens": 2000}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break
        await wait_for(lambda: any(kind(e) == "failed" and e.status == 499 for e in events), what="499 event")
        await wait_for(lambda: p.worker.engine.load().running == 0, what="worker slot freed")


async def test_client_disconnect_of_a_non_streamed_request_cancels_at_the_worker(plane, bus, subjects):
    """A client that goes away while its non-streamed answer is generated: the request fails with
    499 and its worker slot is freed (the gateway checks every 0.5 s, disconnect.watched)."""
    events: list = []
    await collect_events(bus, subjects, events)
    async with plane(worker_kw={"time_scale": 1.0}) as p:
        async with httpx.AsyncClient(base_url=p.url, timeout=30) as h:
            call = asyncio.create_task(h.post("/v1/completions", json={
                "model": MODEL, "prompt": "long", "max_tokens": 2000, "min_tokens": 2000}))
            await wait_for(lambda: p.worker.engine.load().running == 1, what="request running")
            call.cancel()  # httpx closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await call
        await wait_for(lambda: any(kind(e) == "failed" and e.status == 499 for e in events), what="499 event")
        await wait_for(lambda: p.worker.engine.load().running == 0, what="worker slot freed")


async def test_client_disconnect_of_a_batch_of_prompts_cancels_every_prompt(plane, bus, subjects):
    """A batch (a list of prompts) whose client goes away: each prompt fails 499 and its slot is freed."""
    events: list = []
    await collect_events(bus, subjects, events)
    async with plane(worker_kw={"time_scale": 1.0}) as p:
        async with httpx.AsyncClient(base_url=p.url, timeout=30) as h:
            call = asyncio.create_task(h.post("/v1/completions", json={
                "model": MODEL, "prompt": ["long one", "long two"], "max_tokens": 2000, "min_tokens": 2000}))
            await wait_for(lambda: p.worker.engine.load().running == 2, what="both prompts running")
            call.cancel()  # httpx closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await call
        await wait_for(lambda: sum(kind(e) == "failed" and e.status == 499 for e in events) == 2,
                       what="a 499 event per prompt")
        await wait_for(lambda: p.worker.engine.load().running == 0, what="worker slots freed")


async def test_overload_answers_429_with_retry_after(plane):
    async with plane(max_inflight=1, worker_kw={"time_scale": 1.0}) as p:
        slow = asyncio.create_task(p.client.completions.create(model=MODEL, prompt="slow", max_tokens=50,
                                                               extra_body={"min_tokens": 50}))
        await wait_for(lambda: p.gateway.inflight == 1, what="first request in flight")
        async with httpx.AsyncClient(base_url=p.url) as h:
            r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert (await slow).choices[0].finish_reason == "length"


async def test_redis_briefly_down_gateway_serves_cached_reads(plane, infra_servers, make_settings, tmp_path):
    import os
    import signal

    async with plane(deployment_cache_s=0.1) as p:
        await p.client.completions.create(model=MODEL, prompt="warm", max_tokens=2)
        os.kill(infra_servers.redis_pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.2)  # let the cache go stale so the gateway tries Redis and falls back
            c = await p.client.completions.create(model=MODEL, prompt="redis is away", max_tokens=2)
            assert c.choices[0].text
            models = await p.client.models.list()
            assert [m.id for m in models.data] == [MODEL]
        finally:
            os.kill(infra_servers.redis_pid, signal.SIGCONT)


async def test_health_ping_version_answer_as_readyz(plane):
    from polyserve.gateway.app import polyserve_version

    async with plane() as p:
        async with httpx.AsyncClient(base_url=p.url) as h:
            ready = await h.get("/readyz")
            for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
                r = await h.request(method, path)
                assert (r.status_code, r.json()) == (200, ready.json()), (method, path)
            assert (await h.get("/version")).json() == {"version": polyserve_version()}
            p.gateway.gs.draining = True  # cannot serve: 503, as /readyz
            try:
                assert [(await h.get(u)).status_code for u in ("/readyz", "/health", "/ping")] == [503] * 3
            finally:
                p.gateway.gs.draining = False


async def test_batched_prompts_are_requests_of_their_own(plane, bus, subjects):
    """A list of prompts: each through the predictor and dispatcher with its own id and events;
    choice j of prompt i has index i * n + j; usage summed; streamed and not."""
    events: list = []
    await collect_events(bus, subjects, events)
    async with plane() as p:
        one = await p.client.completions.create(model=MODEL, prompt="alpha beta", max_tokens=4, n=2, seed=3,
                                                extra_body={"min_tokens": 4})
        two = await p.client.completions.create(model=MODEL, prompt="gamma", max_tokens=4, n=2, seed=3,
                                                extra_body={"min_tokens": 4})
        both = await p.client.completions.create(model=MODEL, prompt=["alpha beta", "gamma"], max_tokens=4, n=2,
                                                 seed=3, extra_body={"min_tokens": 4})
        assert [c.index for c in both.choices] == [0, 1, 2, 3]
        assert [c.text for c in both.choices] == [c.text for c in one.choices + two.choices]
        assert both.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
        assert both.usage.completion_tokens == 16
        stream = await p.client.completions.create(model=MODEL, prompt=["alpha beta", "gamma"], max_tokens=4, n=2,
                                                   seed=3, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"min_tokens": 4})
        texts: dict[int, str] = {}
        chunks = [c async for c in stream]
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert [texts[i] for i in range(4)] == [c.text for c in both.choices]
        assert chunks[-1].usage.total_tokens == both.usage.total_tokens
        with pytest.raises(openai.BadRequestError, match="limit is 64"):
            await p.client.completions.create(model=MODEL, prompt=["x"] * 65, max_tokens=1)
    for i in (0, 1):
        rid = f"{both.id}-{i}"
        await wait_for(lambda rid=rid: any(getattr(e, "request_id", None) == rid and kind(e) == "completed"
                                           for e in events), what=f"completed event of {rid}")
        kinds = [kind(e) for e in events if getattr(e, "request_id", None) == rid]
        assert_lifecycle(kinds)
        assert set(kinds) == {"admitted", "predicted", "dispatched", "first_token", "completed"}
