"""Per-tenant prefix-cache salts end to end (core/cache_salt.py; docs/security.md), with the official
`openai` client, client keys of two tenants, and an openai-http worker in front of a stand-in that
speaks vLLM's wire and keeps every request body: what reaches the engine server is the salt.
With `cache_salt_tenants=on` (a vLLM upstream) every keyed request is salted by its tenant: two
keys of one tenant share a salt, another tenant never gets it, not even by sending it as its own
`cache_salt`. With the default (`auto`) an openai-http upstream sees a salt only where the client
sent one (a server without the field would refuse it). An empty salt is a 400 naming the field."""
from __future__ import annotations

import openai
import pytest

from polyserve.core.cache_salt import salt
from polyserve.proto import Deployment
from tests.integration.test_keys import ADMIN, client_for, make_key
from tests.integration.test_openai_http_chat import StandIn, _worker

pytestmark = pytest.mark.integration
MSG = [{"role": "user", "content": "the same long system prompt every tenant sends"}]


async def _salts(up: StandIn, n: int) -> list[str | None]:
    return [body.get("cache_salt") for _, body in up.posts[-n:]]


async def test_tenants_never_share_a_salt_and_cannot_pick_anothers(plane, state):
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(completion_out=[" a", " b"], finish="stop") as up:
        async with plane(client_keys="on", admin_api_key=ADMIN,
                         worker_kw={**_worker(up), "cache_salt_tenants": "on"}) as p:
            acme = client_for(p.url, (await make_key(p.url, tenant="acme"))["key"])
            acme2 = client_for(p.url, (await make_key(p.url, tenant="acme", name="second"))["key"])
            evil = client_for(p.url, (await make_key(p.url, tenant="evil"))["key"])
            for c in (acme, acme2, evil):
                await c.completions.create(model="up", prompt="shared prefix", max_tokens=2)
            a, a2, e = await _salts(up, 3)
            assert a == a2 == salt("acme", "") and e == salt("evil", "") and e != a
            await evil.completions.create(model="up", prompt="shared prefix", max_tokens=2, extra_body={"cache_salt": a})
            await acme.chat.completions.create(model="up", messages=MSG, max_tokens=2, extra_body={"cache_salt": "x"})
            forged, own = await _salts(up, 2)
            assert forged == salt("evil", a) and forged != a and own == salt("acme", "x")
            with pytest.raises(openai.BadRequestError) as err:
                await acme.completions.create(model="up", prompt="hi", max_tokens=2, extra_body={"cache_salt": ""})
            assert err.value.body["param"] == "cache_salt", err.value.body
            assert len(up.posts) == 5  # the refused request never left the gateway


async def test_by_default_an_upstream_sees_only_a_clients_own_salt(plane, state):
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(completion_out=[" a"], finish="stop") as up:
        async with plane(client_keys="on", admin_api_key=ADMIN, worker_kw=_worker(up)) as p:
            acme = client_for(p.url, (await make_key(p.url, tenant="acme"))["key"])
            await acme.completions.create(model="up", prompt="hi", max_tokens=2)
            await acme.completions.create(model="up", prompt="hi", max_tokens=2, extra_body={"cache_salt": "s"})
            assert await _salts(up, 2) == [None, salt("acme", "s")]


async def test_the_engines_cached_prompt_tokens_reach_the_client_and_the_metrics(plane, state):
    """What the engine's prefix cache served (here an upstream's `usage.prompt_tokens_details`, as vLLM
    reports it) comes back as OpenAI's `usage.prompt_tokens_details.cached_tokens` on completions and
    chat, streamed and not, as the Responses API's `input_tokens_details.cached_tokens`, and counts in
    `polyserve_prompt_tokens_total{source}`; an upstream that does not report it: no details."""
    import httpx

    from tests.helpers import wait_for

    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(completion_out=[" a", " b"], finish="stop", cached=8) as up:
        async with plane(worker_kw=_worker(up)) as p:
            c = await p.client.completions.create(model="up", prompt="a shared prefix", max_tokens=2)
            assert (c.usage.prompt_tokens, c.usage.prompt_tokens_details.cached_tokens) == (9, 8)
            stream = await p.client.chat.completions.create(model="up", messages=MSG, max_tokens=2, stream=True,
                                                            stream_options={"include_usage": True})
            last = [chunk async for chunk in stream][-1]
            assert (last.usage.prompt_tokens, last.usage.prompt_tokens_details.cached_tokens) == (11, 8)
            r = await p.client.responses.create(model="up", input="hi", max_output_tokens=2)
            assert r.usage.input_tokens_details.cached_tokens == 8
            up.cached = None  # a server that leaves the details out (transformers serve, vLLM by default)
            plain = await p.client.chat.completions.create(model="up", messages=MSG, max_tokens=2)
            assert plain.usage.prompt_tokens == 11 and plain.usage.prompt_tokens_details is None

            async with httpx.AsyncClient(base_url=p.url) as http:
                async def counted(line: str) -> bool:
                    return line in (await http.get("/metrics")).text

                await wait_for(lambda: counted('polyserve_prompt_tokens_total{deployment="up",source="cached"} 24.0'),
                               what="the cached prompt tokens counted")
                # computed: 9 - 8 (completion), 11 - 8 (chat), 11 - 8 (Responses, a chat upstream), 11 (no details)
                await wait_for(lambda: counted('polyserve_prompt_tokens_total{deployment="up",source="computed"} 18.0'),
                               what="the computed prompt tokens counted")
