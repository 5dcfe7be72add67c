"""The gateway places least_outstanding requests itself (services/gateway/routing.py): real
nats-server, redis-server, predictor, dispatcher, two sim workers and the gateway over HTTP."""
from __future__ import annotations

import asyncio

import openai
import pytest

from polyserve.proto import AnyEvent, Deployment, DispatchRequest, GenerateRequest, PredictBatch
from polyserve.shared.bus import decode
from tests.helpers import assert_lifecycle, running, wait_for
from tests.integration.conftest import MODEL, sim_fleet

pytestmark = pytest.mark.integration


async def test_least_outstanding_is_placed_in_the_gateway_and_spread(make_settings, state, bus, subjects):
    asked: list[DispatchRequest] = []
    generated: dict[str, list[GenerateRequest]] = {"w-a": [], "w-b": []}
    events: list = []

    async def on_dispatch(req: DispatchRequest):
        asked.append(req)

    async def on_event(ev):
        events.append(ev)

    await bus.listen(subjects.dispatch, DispatchRequest, on_dispatch)  # a copy of every dispatch request
    for wid, got in generated.items():
        async def on_generate(req: GenerateRequest, got=got):
            got.append(req)
        await bus.listen(subjects.generate(wid), GenerateRequest, on_generate)
    await bus.listen(f"{subjects.prefix}.v1.events.>", AnyEvent, on_event)
    headers: list = []
    batches: list[PredictBatch] = []

    async def on_raw(msg):
        headers.append(msg.headers)

    async def on_batch(msg):
        headers.append(msg.headers)
        batches.append(decode(msg.data, PredictBatch))

    await bus.nc.subscribe(subjects.predict, cb=on_raw)
    await bus.nc.subscribe(subjects.predict_batch, cb=on_batch)
    await bus.nc.subscribe(subjects.generate("w-a"), cb=on_raw)
    await bus.nc.flush()

    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="least_outstanding"))
    gw, services = sim_fleet(make_settings, list(generated))
    async with running(*services):
        await wait_for(lambda: len(gw.gs.fresh_heartbeats(MODEL)) == 2, what="both workers' heartbeats")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        # six at once: each worker gets three, whatever order their heartbeats came in
        done = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=12)
                                      for i in range(6)))
        assert all(c.choices[0].text for c in done)
        await wait_for(lambda: sum(len(g) for g in generated.values()) == 6, what="six generate requests")
        assert sorted(len(g) for g in generated.values()) == [3, 3]
        assert gw.gs.router.own == {}  # every request ended: none counts against a worker
        await client.close()
        ids = {c.id for c in done}
        await wait_for(lambda: sum(1 for e in events if type(e).__struct_config__.tag == "completed"
                                   and e.request_id in ids) == 6, what="six completed events")
    assert asked == []  # no dispatcher round trip
    # each started on a free slot: their predictions, which nothing waited for, went in batches
    # (predict_batch.py), fewer messages than requests, every request's in one of them
    assert sorted(r.request_id for b in batches for r in b.items) == sorted(ids)
    assert len(batches) < 6, [len(b.items) for b in batches]
    # nothing exports spans here (sampling off): no trace headers on the requests' messages
    assert len(headers) >= 3 + len(batches) and not any(headers), headers[:3]
    for rid in ids:
        mine = [e for e in events if getattr(e, "request_id", None) == rid]
        assert_lifecycle([type(e).__struct_config__.tag for e in mine])
        by = {type(e).__struct_config__.tag: e for e in mine}
        assert by["dispatched"].policy == "least_outstanding"
        # the predictor's answer is recorded even when the request did not wait for it
        assert by["completed"].predicted_tokens == by["predicted"].tokens_estimate > 0
