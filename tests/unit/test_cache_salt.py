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
