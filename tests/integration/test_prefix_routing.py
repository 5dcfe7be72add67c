"""Prefix-aware placement end to end (gateway/prefixes.py): three sim workers behind a gateway
with `prefix_affinity` on, the official `openai` client over HTTP. A multi-turn chat (each turn's
prompt starts with the one before) stays on one worker while the policy, round robin, spreads
unrelated prompts; a second conversation gets its own worker; a short prompt is never moved; with
the default (`auto`) a sim deployment, whose workers keep no prefix cache, is not affected."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import openai
import pytest

from polyserve.proto import Deployment, Dispatched
from polyserve.proto.messages import ATGT_SLO_MS
from tests.helpers import running, wait_for
from tests.integration.conftest import MODEL, placements, sim_fleet

pytestmark = pytest.mark.integration
WORKERS = ("w-a", "w-b", "w-c")


def _system(topic: str) -> str:
    return f"You are the {topic} assistant of a mid-sized company. Answer briefly and cite the policy. " * 6


async def _conversation(client: openai.AsyncOpenAI, topic: str, turns: int) -> list[str]:
    """`turns` chat requests, each the whole conversation so far plus one question: their ids."""
    messages = [{"role": "system", "content": _system(topic)}]
    ids = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} about {topic}?"})
        r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        ids.append(r.id)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    return ids


async def _run(make_settings, state, bus, subjects, **gateway) -> tuple[dict[str, list[str]], str]:
    """Two conversations, six unrelated long prompts at once and three short ones: (the workers
    each group's requests were sent to, the gateway's metrics)."""
    where = await placements(bus, subjects, WORKERS)  # request id -> the worker it was sent to
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="round_robin"))
    gw, services = sim_fleet(make_settings, WORKERS, **gateway)
    async with running(*services):
        await wait_for(lambda: len(gw.gs.fresh_heartbeats(MODEL)) == 3, what="three workers' heartbeats")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        billing = await _conversation(client, "billing", 5)
        travel = await _conversation(client, "travel", 3)
        plain = await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=f"{i}: an unrelated prompt, long enough to be hashed. " * 8, max_tokens=4)
            for i in range(6)))
        short = [await client.completions.create(model=MODEL, prompt="hi", max_tokens=4) for _ in range(3)]
        await client.close()
        counted = gw.gs.metrics.render().decode()
        ids = billing + travel + [c.id for c in plain + short]
        await wait_for(lambda: all(i in where for i in ids), what="every placement")
    groups = {"billing": billing, "travel": travel, "plain": [c.id for c in plain], "short": [c.id for c in short]}
    return {name: [where[i] for i in ids] for name, ids in groups.items()}, counted


async def test_a_conversation_stays_on_one_worker(make_settings, state, bus, subjects):
    on, counted = await _run(make_settings, state, bus, subjects, prefix_affinity="on")
    assert len(set(on["billing"])) == 1 and len(set(on["travel"])) == 1, on
    assert sorted(Counter(on["plain"]).values()) == [2, 2, 2]  # unrelated: round robin
    assert len(set(on["short"])) == 3  # a short prompt is the policy's: round robin
    # every turn after a conversation's first found its start (4 + 2); firsts and plain ones missed
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="hit"}} 6.0' in counted
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="miss"}} 8.0' in counted


async def test_auto_leaves_a_deployment_without_prefix_cache_alone(make_settings, state, bus, subjects):
    auto, counted = await _run(make_settings, state, bus, subjects)
    assert len(set(auto["billing"])) == 3  # round robin over the five turns
    assert "polyserve_prefix_placements_total{" not in counted


async def test_gateways_share_the_starts_they_placed(make_settings, state, bus, subjects):
    """Two gateway processes' worth (replicas behind one address): a conversation whose turns
    alternate between them stays on one worker, as each hears where the other placed a prompt
    (`PrefixPlaced` on `<p>.v1.gateway.prefixes`). Gateway B's round robin is moved on first, so
    without the sharing its turns would go elsewhere."""
    from polyserve.gateway.config import GatewaySettings
    from polyserve.gateway.service import GatewayService

    where = await placements(bus, subjects, WORKERS)
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="round_robin"))
    gw_a, services = sim_fleet(make_settings, WORKERS, prefix_affinity="on")
    gw_b = GatewayService(make_settings(GatewaySettings, "gateway", port=0, prefix_affinity="on"))
    async with running(*services, gw_b):
        await wait_for(lambda: all(len(g.gs.fresh_heartbeats(MODEL)) == 3 for g in (gw_a, gw_b)),
                       what="three workers' heartbeats at both gateways")
        a, b = (openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=20)
                for g in (gw_a, gw_b))
        await b.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # B's round robin: past w-a
        messages, ids = [{"role": "system", "content": _system("billing")}], []
        for i in range(6):
            gw, client, other = (gw_a, a, gw_b) if i % 2 == 0 else (gw_b, b, gw_a)
            messages.append({"role": "user", "content": f"question {i} about my invoice?"})
            known = other.gs.prefixes.recorded
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
            ids.append(r.id)
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            # the next turn comes from a person, seconds later; the other gateway hears within ms
            await wait_for(lambda: other.gs.prefixes.recorded > known, what="the other gateway told of the placement")
        await a.close()
        await b.close()
        await wait_for(lambda: all(i in where for i in ids), what="every placement")
        counted = gw_b.gs.metrics.render().decode()
    assert len({where[i] for i in ids}) == 1, [where[i] for i in ids]
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="hit"}} 3.0' in counted  # B's 3 turns


async def test_a_conversation_whose_worker_went_down_moves_once(make_settings, state, bus, subjects):
    """Fault: the worker holding a conversation's start stops (its WorkerDown event). The gateway
    forgets what it held (its cache is gone with it), the next turn goes where the policy puts it,
    and the turns after that stay there."""
    from polyserve.worker.service import WorkerService

    where = await placements(bus, subjects, WORKERS)
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="round_robin"))
    gw, services = sim_fleet(make_settings, WORKERS, prefix_affinity="on")
    workers = {s.settings.worker_id: s for s in services if isinstance(s, WorkerService)}
    async with running(*services):
        await wait_for(lambda: len(gw.gs.fresh_heartbeats(MODEL)) == 3, what="three workers' heartbeats")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        messages, ids = [{"role": "system", "content": _system("travel")}], []

        async def turn(i: int) -> str:
            messages.append({"role": "user", "content": f"question {i} about my trip?"})
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            ids.append(r.id)
            await wait_for(lambda: r.id in where, what="the placement seen")
            return where[r.id]

        home = [await turn(0), await turn(1)]
        assert home[0] == home[1]
        workers[home[0]].request_stop()  # publishes WorkerDown as it goes
        await wait_for(lambda: not gw.gs.prefixes.holds(home[0]),
                       what="the gateway forgetting the stopped worker's prompt starts")
        after = [await turn(i) for i in range(2, 5)]
        await client.close()
    assert home[0] not in after and len(set(after)) == 1, (home, after)


@pytest.mark.parametrize("atgt_slo_ms", [ATGT_SLO_MS, 0.001], ids=["within-the-slo", "no-worker-meets-the-slo"])
async def test_under_caraserve_the_dispatcher_follows_the_hint(make_settings, state, bus, subjects, atgt_slo_ms):
    """Under a policy the dispatcher runs (caraserve), the gateway sends the workers holding the
    prompt's start as `DispatchRequest.prefer`. Two long answers in the same conversation load its
    worker; caraserve alone would now put any request on an idle worker (as it does an unrelated
    prompt sent at the same moment), but the conversation's next turn stays home, answered as
    `caraserve+prefix`, within the load bound. With an ATGT SLO no worker can meet (0.001 ms per
    token: every placement flagged for scale-out, the fault of an overloaded fleet) the hint stands
    as well (prefer.follows: the cache hit costs nothing the policy could have saved; the dispatcher
    refused it before)."""
    where = await placements(bus, subjects, WORKERS)
    await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="sim", policy="caraserve",
                                          atgt_slo_ms=atgt_slo_ms))
    # the sim at its profile's own pace: the dispatcher's online fits (from `completed` events) then
    # stay at the profile, and the workers differ in load only
    gw, services = sim_fleet(make_settings, WORKERS, time_scale=1.0, prefix_affinity="on")
    policies: dict[str, str] = {}  # request id -> the policy its `dispatched` event names

    async def on_dispatched(ev: Dispatched) -> None:
        policies[ev.request_id] = ev.policy

    await bus.listen(subjects.event("dispatched"), Dispatched, on_dispatched)
    async with running(*services):
        await wait_for(lambda: len(gw.gs.fresh_heartbeats(MODEL)) == 3, what="three workers' heartbeats")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        messages = [{"role": "system", "content": _system("billing")},
                    {"role": "user", "content": "question 0 about my invoice?"}]
        first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        await wait_for(lambda: first.id in where, what="the first turn's placement")
        home = where[first.id]
        messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})

        async def long_answer(i: int) -> str:  # ~1.8 s at the sim's pace: in flight for what follows
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages + [{"role": "user", "content": f"a long question {i}?"}],
                max_tokens=60, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                rid = chunk.id
            return rid

        long = [asyncio.ensure_future(long_answer(i)) for i in range(2)]
        await wait_for(lambda: len(where) >= 3, what="the two long answers placed")
        messages.append({"role": "user", "content": "question 1 about my invoice?"})
        turn, unrelated = await asyncio.gather(
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6),
            client.completions.create(model=MODEL, prompt="an unrelated prompt, long enough to hash. " * 9,
                                      max_tokens=6))
        long_ids = await asyncio.gather(*long)
        await client.close()
        await wait_for(lambda: all(i in where and i in policies for i in (turn.id, unrelated.id, *long_ids)),
                       what="every placement and its dispatched event")
        counted = gw.gs.metrics.render().decode()
    assert [where[i] for i in long_ids] == [home, home]
    assert where[turn.id] == home and where[unrelated.id] != home
    assert [policies[i] for i in (*long_ids, turn.id, unrelated.id)] == ["caraserve+prefix"] * 3 + ["caraserve"]
    # the two long answers and the turn found the start (hits); the first turn and the unrelated prompt did not
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="hit"}} 3.0' in counted
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="miss"}} 2.0' in counted


async def test_a_prompts_starts_are_its_lora_adapters_own(plane, tmp_path):
    """An engine's prefix cache is per adapter (vLLM keys a cached block by its request's LoRA), so
    the gateway keeps a prompt's starts per adapter: the same long prompt under the base model, then
    adapter a1 twice, then a2 finds a cached start only for a1's second request (the dispatcher
    places LoRA requests, with the gateway's hint). Counted in the gateway's own metrics."""
    def adapter(name: str):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        (path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
        return {"name": name, "path": str(path), "deployment": MODEL}

    prompt = "You are the billing assistant of a mid-sized company; answer from the policy. " * 8
    async with plane(adapter_roots=str(tmp_path), prefix_affinity="on") as p, \
            httpx.AsyncClient(base_url=p.url) as h:
        for name in ("a1", "a2"):
            assert (await h.post("/v1/adapters", json=adapter(name))).status_code == 201
        for extra in ({}, {"adapter": "a1"}, {"adapter": "a1"}, {"adapter": "a2"}):
            await p.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body=extra)
        counted = (await h.get("/metrics")).text
    # the base model's own start was placed by the gateway; a1's first and a2's found none of theirs
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="hit"}} 1.0' in counted
    assert f'polyserve_prefix_placements_total{{deployment="{MODEL}",outcome="miss"}} 3.0' in counted
