"""Cache affinity end to end (gateway/routing.py): three sim workers, the gateway over HTTP and the
official `openai` client. Requests with one `prompt_cache_key` all reach one worker (whose prefix
cache would hold their common prompt), on completions, chat and the Responses API alike; requests
without a key are spread by the deployment's policy; many keys use every worker."""
from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest

from polyserve.proto import Deployment, Dispatched
from tests.helpers import running, wait_for
from tests.integration.conftest import MODEL, placements, sim_fleet

pytestmark = pytest.mark.integration
WORKERS = ("w-a", "w-b", "w-c")


async def test_one_key_one_worker_and_no_key_spread(make_settings, state, bus, subjects):
    where = await placements(bus, subjects, WORKERS)  # request id -> the worker it was sent to
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="least_outstanding"))
    # a bound no key reaches: spilling is the unit test's (test_gateway_routing.py), where loads are
    # exact; here the workers' heartbeats lag the gateway's own counts, and a busy CI machine can
    # make one of the 30 concurrent keyed requests look over 1.25 x the mean (seen once)
    gw, services = sim_fleet(make_settings, WORKERS, affinity_load_factor=10.0)
    async with running(*services):
        await wait_for(lambda: len(gw.gs.fresh_heartbeats(MODEL)) == 3, what="three workers' heartbeats")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        key = {"prompt_cache_key": "support-bot-v1"}
        keyed = await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=8, extra_body=key) for i in range(4)),
            *(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                             max_tokens=8, extra_body=key) for i in range(2)))
        resp = await client.responses.create(model=MODEL, input="r", max_output_tokens=8, extra_body=key)
        plain = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"x{i}", max_tokens=8)
                                       for i in range(6)))
        many = await asyncio.gather(*(client.completions.create(model=MODEL, prompt="y", max_tokens=4,
                                                                extra_body={"prompt_cache_key": f"k{i}"})
                                      for i in range(24)))
        await client.close()
        counted = gw.gs.metrics.render().decode()
        assert f'polyserve_affinity_placements_total{{deployment="{MODEL}",outcome="home"}} 31.0' in counted
        ids = [c.id for c in keyed + plain + many] + [resp.id]
        await wait_for(lambda: all(i in where for i in ids), what="every placement")
    homes = {where[c.id] for c in keyed}
    assert len(homes) == 1, [where[c.id] for c in keyed]  # one key: one worker
    assert sorted(Counter(where[c.id] for c in plain).values()) == [2, 2, 2]  # no key: least_outstanding
    assert set(Counter(where[c.id] for c in many)) == set(WORKERS)  # many keys: every worker
    assert where[resp.id] in homes  # the Responses API's request went home too


@pytest.mark.parametrize("policy", ["least_outstanding", "caraserve"])
async def test_the_dispatcher_keeps_a_key_on_its_worker_too(make_settings, state, bus, subjects, policy):
    """Where the dispatcher places (here `local_dispatch` off; also aladdin / caraserve, a LoRA
    request, or a gateway that does not hear the fleet as usual, as on a busy CI machine) the gateway
    sends the key's worker as `DispatchRequest.prefer` and the dispatcher follows it: six concurrent
    requests with one key meet on one worker (least outstanding alone spreads them), counted `home`
    and shown as `<policy>+affinity`."""
    where = await placements(bus, subjects, WORKERS)
    policies: dict[str, str] = {}

    async def on_dispatched(ev: Dispatched) -> None:
        policies[ev.request_id] = ev.policy

    await bus.listen(subjects.event("dispatched"), Dispatched, on_dispatched)
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy=policy))
    gw, services = sim_fleet(make_settings, WORKERS, local_dispatch=False)
    async with running(*services):
        await wait_for(lambda: len(gw.gs.fresh_heartbeats(MODEL)) == 3, what="three workers' heartbeats")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        keyed = await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=f"p{i}", max_tokens=8, extra_body={"prompt_cache_key": "support-bot-v1"})
            for i in range(6)))
        await client.close()
        counted = gw.gs.metrics.render().decode()
        ids = [c.id for c in keyed]
        await wait_for(lambda: all(i in where and i in policies for i in ids), what="every placement and event")
    assert len({where[i] for i in ids}) == 1, [where[i] for i in ids]
    assert {policies[i] for i in ids} == {f"{policy}+affinity"}
    assert f'polyserve_affinity_placements_total{{deployment="{MODEL}",outcome="home"}} 6.0' in counted
