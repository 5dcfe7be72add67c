"""Load shedding at the door (services/gateway/shed.py, issue 13): while the gateway is at
max_inflight, a model request is refused 429 + Retry-After before anything reads or checks its
body, and counted as an overload refusal; other endpoints still answer. The burst figures are
the chaos tier's (tests/chaos, `overload`)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration


async def test_a_full_gateway_refuses_before_reading_the_body(plane):
    async with plane(max_inflight=1, worker_kw={"time_scale": 1.0}) as p:
        slow = asyncio.create_task(p.client.completions.create(model=MODEL, prompt="slow", max_tokens=50,
                                                               extra_body={"min_tokens": 50}))
        await wait_for(lambda: p.gateway.inflight == 1, what="first request in flight")
        before = p.gateway.gs.metrics.rejected.labels("overload")._value.get()
        async with httpx.AsyncClient(base_url=p.url) as h:
            # not JSON at all: had the body been read, this would be a 400
            r = await h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "too many requests in flight (1)" in r.json()["error"]["message"]
            assert (await h.get("/v1/models")).status_code == 200  # only the model requests are shed
            assert (await h.get("/readyz")).status_code == 200
        assert p.gateway.gs.metrics.rejected.labels("overload")._value.get() == before + 1
        assert (await slow).choices[0].finish_reason == "length"
        async with httpx.AsyncClient(base_url=p.url) as h:  # a free slot: the body is read again
            r = await h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400
