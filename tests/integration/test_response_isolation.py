"""Stored responses are isolated per tenant (issue 14): over real HTTP with the official openai
client (Responses API) and two client keys of different tenants, a tenant that knows another
tenant's response id can neither read, continue nor delete it (the same 404 as an unknown id,
so existence is not revealed); another key of the same tenant can; the admin key reads all."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.test_keys import ADMIN, client_for, make_key

pytestmark = pytest.mark.integration


async def _not_found(call) -> dict:
    with pytest.raises(openai.NotFoundError) as err:
        await call
    return err.value.body


async def test_a_tenant_cannot_read_continue_or_delete_another_tenants_response(plane, state, prefix):
    async with plane(client_keys="on", admin_api_key=ADMIN) as p:
        acme = client_for(p.url, (await make_key(p.url, tenant="acme"))["key"])
        acme2 = client_for(p.url, (await make_key(p.url, tenant="acme", name="second"))["key"])
        evil = client_for(p.url, (await make_key(p.url, tenant="evil"))["key"])
        admin = client_for(p.url, ADMIN)

        made = await acme.responses.create(model="sim-test", input="my secret plan", max_output_tokens=4)
        assert made.status in ("completed", "incomplete") and made.id.startswith("resp_")
        assert (await acme.responses.retrieve(made.id)).id == made.id

        # another tenant: the same 404 (message and code) as for an id that does not exist
        unknown = await _not_found(evil.responses.retrieve("resp_" + "0" * 32))
        theirs = await _not_found(evil.responses.retrieve(made.id))
        assert theirs["message"] == unknown["message"].replace("resp_" + "0" * 32, made.id)
        assert theirs.get("code") == unknown.get("code")
        cont = await _not_found(evil.responses.create(model="sim-test", input="and then?",
                                                      previous_response_id=made.id, max_output_tokens=2))
        assert cont["param"] == "previous_response_id" and made.id in cont["message"]
        await _not_found(evil.responses.delete(made.id))
        assert await state.r.exists(f"{prefix}:response:{made.id}")  # the refused delete removed nothing

        # the same tenant (another key) continues it; the admin key reads every tenant's
        follow = await acme2.responses.create(model="sim-test", input="and then?", previous_response_id=made.id,
                                              max_output_tokens=2)
        assert follow.previous_response_id == made.id
        assert (await admin.responses.retrieve(made.id)).id == made.id
        assert (await admin.responses.retrieve(follow.id)).previous_response_id == made.id

        # a response the admin key made is the admin's: no tenant reads it, not even one named "admin"
        own = await admin.responses.create(model="sim-test", input="ops note", max_output_tokens=2)
        named_admin = client_for(p.url, (await make_key(p.url, tenant="admin"))["key"])
        await _not_found(named_admin.responses.retrieve(own.id))
        await _not_found(acme.responses.retrieve(own.id))

        # a streamed response is stored with its owner too
        stream = await acme.responses.create(model="sim-test", input="streamed secret", max_output_tokens=3,
                                             stream=True)
        done = [e async for e in stream if e.type in ("response.completed", "response.incomplete")]
        streamed = done[0].response.id
        assert (await acme2.responses.retrieve(streamed)).id == streamed
        await _not_found(evil.responses.retrieve(streamed))

        # the owner deletes its own; then it is gone for everyone
        await acme.responses.delete(made.id)
        await _not_found(admin.responses.retrieve(made.id))
        async with httpx.AsyncClient(base_url=p.url) as http:  # the refusals were counted
            text = (await http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).text
        assert 'polyserve_rejected_total{reason="response_not_owned"}' in text


async def test_without_keys_an_anonymous_response_is_not_readable_with_a_key(plane):
    """On loopback keys are optional: a response made without a key is not readable by a keyed
    tenant, and a keyed tenant's response is not readable without a key."""
    async with plane(admin_api_key=ADMIN) as p:
        anon = p.client
        made = await anon.responses.create(model="sim-test", input="hello", max_output_tokens=2)
        assert (await anon.responses.retrieve(made.id)).id == made.id
        keyed = client_for(p.url, (await make_key(p.url, tenant="acme"))["key"])
        await _not_found(keyed.responses.retrieve(made.id))
        theirs = await keyed.responses.create(model="sim-test", input="mine", max_output_tokens=2)
        await _not_found(anon.responses.retrieve(theirs.id))
        assert (await keyed.responses.retrieve(theirs.id)).id == theirs.id
