"""Prefix-cache salts (core/cache_salt.py): the salt is a function of (tenant, client salt) that no
client can steer into another tenant's; the worker setting decides where the tenant enters; the
vllm engine hands vLLM a TokensPrompt with it (a CONTRACT test against the fake of vLLM's API,
whose TokensPrompt keys come from the 0.33.0 sources)."""
from __future__ import annotations

import pytest

from polyserve.core import cache_salt as cs
from polyserve.proto import SamplingParams
from polyserve.worker.engine import EngineRequest, Finished
from polyserve.worker.engines.vllm_engine import VllmEngine
from tests.fakes import fake_vllm
from tests.unit.test_vllm_contract import settings

pytestmark = pytest.mark.unit


def test_no_two_tenants_share_a_salt_and_no_client_can_pick_another_tenants():
    acme, evil = cs.salt("acme", ""), cs.salt("evil", "")
    assert acme and evil and acme != evil and cs.salt("acme", "") == acme  # stable: one tenant shares
    assert cs.salt("", "") == ""  # no key, no salt: unsalted, as vLLM
    # a client that sends another tenant's salt (or the hash of it) still gets its own tenant's
    assert cs.salt("evil", acme) not in (acme, cs.salt("acme", acme))
    assert cs.salt("", acme) != acme and cs.salt("", "x") != cs.salt("acme", "x")
    # the encoding is unambiguous: no (tenant, salt) pair collides with another by concatenation
    assert cs.salt("ab", "c") != cs.salt("a", "bc") and cs.salt("a\"", "") != cs.salt("a", "\"")


def test_where_the_tenant_enters():
    t, s = "acme", "mine"
    assert cs.engine_salt(t, "", "auto", "vllm") == cs.salt(t, "")  # vllm: every keyed request
    assert cs.engine_salt(t, "", "auto", "openai-http") == ""  # the upstream may not take the field
    assert cs.engine_salt(t, s, "auto", "openai-http") == cs.salt(t, s)
    assert cs.engine_salt(t, "", "on", "openai-http") == cs.salt(t, "")
    assert cs.engine_salt(t, "", "off", "vllm") == "" and cs.engine_salt(t, s, "off", "vllm") == cs.salt("", s)
    with pytest.raises(ValueError, match="cache_salt_tenants"):
        cs.mode("always")


def test_the_worker_setting_is_checked():
    from polyserve.shared.settings import SettingsError
    from polyserve.worker.config import load
    assert load([], {}, cache_salt_tenants="on").cache_salt_tenants == "on"
    with pytest.raises(SettingsError, match="cache_salt_tenants"):
        load([], {}, cache_salt_tenants="yes")


async def _prompt_of(engine: VllmEngine, fake, rid: str, tenant: str, salt: str) -> dict:
    req = EngineRequest(rid, "hi there", SamplingParams(max_tokens=3, cache_salt=salt), tenant=tenant)
    events = [ev async for ev in engine.generate(req)]
    assert isinstance(events[-1], Finished), events[-1]
    return next(c["prompt"] for c in fake.engine.calls if c["request_id"].startswith(rid))


@pytest.mark.parametrize("mode", ["auto", "off"])
async def test_the_vllm_engine_salts_vllms_tokens_prompt(monkeypatch, mode):
    fake = fake_vllm.install(monkeypatch, "v1")
    engine = VllmEngine(settings(cache_salt_tenants=mode))
    await engine.start()
    try:
        ids = [ord(c) for c in "hi there"]
        assert await _prompt_of(engine, fake, "a", "", "") == {"prompt_token_ids": ids}
        keyed = await _prompt_of(engine, fake, "b", "acme", "")
        own = await _prompt_of(engine, fake, "c", "acme", "mine")
        if mode == "auto":
            assert keyed == {"prompt_token_ids": ids, "cache_salt": cs.salt("acme", "")}
            assert own["cache_salt"] == cs.salt("acme", "mine")
        else:
            assert keyed == {"prompt_token_ids": ids} and own["cache_salt"] == cs.salt("", "mine")
    finally:
        await engine.stop()


async def _cached(engine: VllmEngine, rid: str, prompt: str, tenant: str = "") -> int:
    events = [ev async for ev in engine.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=2),
                                                               tenant=tenant))]
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1].stats.cached_tokens


async def test_the_vllm_engine_reports_vllms_prefix_cache_hits_per_tenant(monkeypatch):
    """RequestOutput.num_cached_tokens (vLLM's automatic prefix caching: whole 16-token blocks of a
    prompt computed before, short of its last token) becomes the request's cached_tokens, which the
    gateway returns as usage.prompt_tokens_details.cached_tokens; salted per tenant, another
    tenant's identical prompt finds nothing."""
    fake_vllm.install(monkeypatch, "v1")
    engine = VllmEngine(settings())
    await engine.start()
    try:
        doc = "the quarterly report says revenue grew by four percent in the north region. "  # 76 chars
        assert await _cached(engine, "a", doc + "summarise it", "acme") == 0  # nothing computed before
        assert await _cached(engine, "b", doc + "translate it", "acme") == 64  # 4 whole blocks of the 76 alike
        assert await _cached(engine, "c", doc + "summarise it", "acme") == 80  # all 88 but the last block
        assert await _cached(engine, "d", doc + "summarise it", "globex") == 0  # another tenant's salt
        assert await _cached(engine, "e", doc + "summarise it") == 0  # no key: unsalted, its own cache
    finally:
        await engine.stop()
