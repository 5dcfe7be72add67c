"""Client API keys (issue 14) over real HTTP with the official openai client: keys made with the
admin API, `Authorization: Bearer` on every OpenAI endpoint when keys are on (401 with an OpenAI
error body), 403 for a model the key may not use, revocation on every gateway within
key_cache_s, only a hash in Redis, usage counted per key, and /metrics, /docs, /openapi.json
admin-only by default when keys are on."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.service import GatewayService
from polyserve.proto import GenerateRequest
from tests.helpers import running

pytestmark = pytest.mark.integration

ADMIN = "admin-s3cret"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


async def make_key(url: str, **body) -> dict:
    async with httpx.AsyncClient(base_url=url, headers=ADMIN_H) as http:
        r = await http.post("/v1/keys", json={"tenant": "acme", **body})
    assert r.status_code == 201, r.text
    return r.json()


def client_for(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


async def test_keys_on_every_openai_endpoint_needs_a_valid_key(plane):
    async with plane(client_keys="on", admin_api_key=ADMIN) as p:
        # p.client sends "Bearer unused": not a key
        with pytest.raises(openai.AuthenticationError) as err:
            await p.client.completions.create(model="sim-test", prompt="hi", max_tokens=2)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        assert "POST /v1/keys" in err.value.body["message"]
        async with httpx.AsyncClient(base_url=p.url) as http:
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
                                 ("POST", "/v1/responses"), ("GET", "/v1/models"), ("POST", "/tokenize"),
                                 ("POST", "/detokenize"), ("GET", "/v1/responses/resp_x"), ("GET", "/v1/nothing")):
                r = await http.request(method, path, json={"model": "sim-test"})
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["type"] and r.json()["error"]["code"] == "invalid_api_key"
            assert (await http.get("/healthz")).status_code == 200  # probes stay open
            assert (await http.get("/readyz")).status_code == 200
        forged = "psk_0123456789ab_" + "0" * 48
        with pytest.raises(openai.AuthenticationError):
            await client_for(p.url, forged).models.list()

        made = await make_key(p.url, name="ci", rpm=1000)
        assert made["key"].startswith("psk_") and made["tenant"] == "acme" and "hash" not in made
        c = client_for(p.url, made["key"])
        out = await c.chat.completions.create(model="sim-test", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3)
        assert out.choices[0].message.content
        assert [m.id for m in (await c.models.list()).data] == ["sim-test"]
        # a key differing in its secret only is refused (constant-time hash compare)
        wrong = made["key"][:-4] + ("0000" if not made["key"].endswith("0000") else "1111")
        with pytest.raises(openai.AuthenticationError):
            await client_for(p.url, wrong).models.list()
        # the admin key is also a client key (operators, CI)
        assert (await client_for(p.url, ADMIN).completions.create(model="sim-test", prompt="x", max_tokens=1)).choices


async def test_only_the_hash_is_stored_and_the_secret_is_shown_once(plane, state, prefix):
    async with plane(client_keys="on", admin_api_key=ADMIN) as p:
        made = await make_key(p.url, models=["sim-test"], rpm=5, tpm=1000, priority="high")
        raw = (await state.r.get(f"{prefix}:apikey:{made['id']}")).decode()
        secret = made["key"].rsplit("_", 1)[1]
        assert secret not in raw and made["key"] not in raw and '"hash"' in raw
        async with httpx.AsyncClient(base_url=p.url, headers=ADMIN_H) as http:
            listed = (await http.get("/v1/keys")).json()["data"]
            assert [k["id"] for k in listed] == [made["id"]]
            assert "key" not in listed[0] and "hash" not in listed[0]
            assert listed[0]["priority"] == "high" and listed[0]["rpm"] == 5 and listed[0]["tpm"] == 1000
            # the admin API itself needs the admin key; bad bodies are 400s naming the field
            assert (await http.get("/v1/keys", headers={"Authorization": "Bearer " + made["key"]})).status_code == 401
            bad = await http.post("/v1/keys", json={"tenant": "a b"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tenant"
            bad = await http.post("/v1/keys", json={"tenant": "t", "rpm": -1})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
            bad = await http.post("/v1/keys", json={"tenant": "t", "priority": "urgent"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
            assert (await http.delete("/v1/keys/nope")).status_code == 404


async def test_a_model_the_key_may_not_use_is_403(plane):
    async with plane(client_keys="on", admin_api_key=ADMIN) as p:
        other = await make_key(p.url, tenant="other", models=["some-other-model"])
        c = client_for(p.url, other["key"])
        with pytest.raises(openai.PermissionDeniedError) as err:
            await c.completions.create(model="sim-test", prompt="hi", max_tokens=2)
        assert err.value.status_code == 403 and err.value.body["param"] == "model"
        assert err.value.body["code"] == "model_not_allowed" and "some-other-model" in err.value.body["message"]
        assert (await c.models.list()).data == []  # it sees only what it may use
        mine = await make_key(p.url, tenant="mine", models=["sim-test"])
        ok = await client_for(p.url, mine["key"]).completions.create(model="sim-test", prompt="hi", max_tokens=2)
        assert ok.choices


async def test_revocation_reaches_every_gateway_within_key_cache_s(plane, make_settings, span_exporter):
    async with plane(client_keys="on", admin_api_key=ADMIN, key_cache_s=0.5) as p:
        second = GatewayService(make_settings(GatewaySettings, "gateway", port=0, client_keys="on",
                                              admin_api_key=ADMIN, key_cache_s=0.5), span_exporter=span_exporter)
        async with running(second):
            made = await make_key(p.url)
            c1, c2 = client_for(p.url, made["key"]), client_for(second.url, made["key"])
            assert (await c1.models.list()).data and (await c2.models.list()).data  # both cache it now
            async with httpx.AsyncClient(base_url=p.url, headers=ADMIN_H) as http:
                assert (await http.delete(f"/v1/keys/{made['id']}")).json()["deleted"] is True
            with pytest.raises(openai.AuthenticationError):  # the revoking gateway: at once
                await c1.models.list()
            await asyncio.sleep(0.6)  # the other: within key_cache_s
            with pytest.raises(openai.AuthenticationError):
                await c2.models.list()


async def test_usage_is_counted_per_key_in_redis_and_per_tenant_in_metrics(plane, bus, subjects):
    tenants: list[str] = []  # what the worker is told: the key's tenant (ssjf_refine's client tables)

    async def on_generate(req: GenerateRequest) -> None:
        tenants.append(req.tenant)

    await bus.listen(subjects.generate("w-test"), GenerateRequest, on_generate)
    async with plane(client_keys="on", admin_api_key=ADMIN) as p:
        made = await make_key(p.url, tenant="counted")
        c = client_for(p.url, made["key"])
        total = 0
        for _ in range(3):
            out = await c.completions.create(model="sim-test", prompt="count my tokens please", max_tokens=4)
            total += out.usage.total_tokens
        stream = await c.chat.completions.create(model="sim-test", messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage:
                total += chunk.usage.total_tokens
        async with httpx.AsyncClient(base_url=p.url, headers=ADMIN_H) as http:
            async def usage() -> dict:
                return (await http.get(f"/v1/keys/{made['id']}")).json()["usage"]
            for _ in range(50):  # settled in the background once each request ended
                if (await usage()).get("requests") == 4:
                    break
                await asyncio.sleep(0.05)
            u = await usage()
            assert u["requests"] == 4 and u["total_tokens"] == total > 0
            text = (await http.get("/metrics")).text
        prompt = [ln for ln in text.splitlines() if ln.startswith('polyserve_tenant_tokens_total{kind="prompt",'
                                                                  'tenant="counted"}')]
        completion = [ln for ln in text.splitlines()
                      if ln.startswith('polyserve_tenant_tokens_total{kind="completion",tenant="counted"}')]
        assert prompt and completion
        assert float(prompt[0].split()[-1]) + float(completion[0].split()[-1]) == total
        assert tenants == ["counted"] * 4


async def test_metrics_and_docs_are_admin_only_when_keys_are_on(plane):
    async with plane(client_keys="on", admin_api_key=ADMIN) as p:
        made = await make_key(p.url)
        async with httpx.AsyncClient(base_url=p.url) as http:
            for path in ("/metrics", "/docs", "/openapi.json", "/redoc"):
                assert (await http.get(path)).status_code == 401, path
                assert (await http.get(path, headers={"Authorization": "Bearer " + made["key"]})).status_code == 401
                assert (await http.get(path, headers=ADMIN_H)).status_code == 200, path
    async with plane(client_keys="on", admin_api_key=ADMIN, metrics_access="open", docs_access="keys") as p:
        made = await make_key(p.url)
        async with httpx.AsyncClient(base_url=p.url) as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/openapi.json")).status_code == 401
            r = await http.get("/openapi.json", headers={"Authorization": "Bearer " + made["key"]})
            assert r.status_code == 200 and "/v1/keys" in r.json()["paths"]
    async with plane(admin_api_key=ADMIN, docs_access="off") as p:  # loopback, keys auto: off
        async with httpx.AsyncClient(base_url=p.url) as http:
            assert (await http.get("/metrics")).status_code == 200  # open, as before keys
            assert (await http.get("/openapi.json", headers=ADMIN_H)).status_code == 404


async def test_on_loopback_keys_are_optional_and_a_given_key_still_counts(plane):
    """keys auto on 127.0.0.1: the README's example (any api_key) works; a `psk_` key is checked
    and its limits apply."""
    async with plane(admin_api_key=ADMIN) as p:
        out = await p.client.completions.create(model="sim-test", prompt="hi", max_tokens=2)
        assert out.choices
        made = await make_key(p.url, rpm=1)
        c = client_for(p.url, made["key"])
        raw = await c.completions.with_raw_response.create(model="sim-test", prompt="hi", max_tokens=2)
        assert raw.headers["x-ratelimit-limit-requests"] == "1"
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError):
            await c.completions.create(model="sim-test", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            await client_for(p.url, "psk_0123456789ab_" + "0" * 48).models.list()


async def test_an_unreadable_key_store_answers_503_never_lets_in(plane):
    """Redis unreachable for key lookups (the gateway's key store pointed at a socket nothing
    listens on): a key not in the cache gets a 503 to retry, not a pass; the admin key, which
    needs no lookup, still works."""
    import redis.asyncio as aioredis

    from polyserve.gateway.keys import KeyStore

    async with plane(client_keys="on", admin_api_key=ADMIN, key_cache_s=0) as p:
        made = await make_key(p.url)
        gs = p.gateway.gs
        good = gs.keystore
        gs._keystore = KeyStore(aioredis.Redis(unix_socket_path="/nonexistent/redis.sock", socket_timeout=0.5),
                                gs.settings.prefix, 0)
        try:
            with pytest.raises(openai.InternalServerError) as err:
                await client_for(p.url, made["key"]).models.list()
            assert err.value.status_code == 503 and "API keys cannot be checked" in err.value.body["message"]
            assert (await client_for(p.url, ADMIN).models.list()).data
        finally:
            gs._keystore = good
        assert (await client_for(p.url, made["key"]).models.list()).data
