"""Fair sharing (VTC, services/gateway/fairness.py) over real HTTP: two tenants with client keys
on one sim worker whose batch is the bottleneck. With a heavy tenant flooding, the light tenant's
share of the tokens and its latency stay fair with VTC, and are not without it (same load, same
plane, `fair_share` off: the worker's FCFS queue). The queue itself: class order, VTC order, lift,
cancellation."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from polyserve.bench.fairness import TenantLoad, _one, measure

pytestmark = pytest.mark.integration

ADMIN = "admin-s3cret"
WORKER = {"max_batch": 4, "time_scale": 0.3, "max_waiting": 1024}


async def keys(url: str) -> tuple[str, str]:
    out = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        for tenant in ("heavy", "light"):
            r = await http.post("/v1/keys", json={"tenant": tenant})
            out.append(r.json()["key"])
    return out[0], out[1]


async def run(plane, fair: bool, light_concurrency: int, stream: bool, seconds: float = 4.0) -> dict:
    async with plane(client_keys="on", admin_api_key=ADMIN, fair_share=fair, worker_kw=WORKER) as p:
        kh, kl = await keys(p.url)
        loads = [TenantLoad("heavy", kh, concurrency=16, max_tokens=16),
                 TenantLoad("light", kl, concurrency=light_concurrency, max_tokens=16, stream=stream)]
        return await measure(p.url, loads, seconds, model="sim-test")


async def test_backlogged_tenants_share_tokens_evenly_with_vtc(plane):
    """Both tenants keep requests queued, the heavy one 4× as many: FCFS serves them in proportion
    to what they queue, VTC the same tokens each."""
    fcfs = await run(plane, fair=False, light_concurrency=4, stream=False)
    vtc = await run(plane, fair=True, light_concurrency=4, stream=False)
    assert fcfs["light"]["share"] < 0.3, fcfs  # 4 : 16 queued
    assert 0.4 <= vtc["light"]["share"] <= 0.6, vtc


async def test_a_light_tenant_is_not_starved_by_a_flood(plane):
    """One streamed request at a time from the light tenant while the heavy one keeps 16 in flight
    (4 batch slots): without VTC each light request waits behind the heavy queue; with VTC it
    starts at the next free slot."""
    fcfs = await run(plane, fair=False, light_concurrency=1, stream=True)
    vtc = await run(plane, fair=True, light_concurrency=1, stream=True)
    assert vtc["light"]["requests"] >= 2 and vtc["heavy"]["requests"] >= 4, vtc
    assert vtc["light"]["ttft_p50_ms"] < 0.5 * fcfs["light"]["ttft_p50_ms"], (fcfs["light"], vtc["light"])
    # The tail after the light tenant's first request: that one arrives when the flood holds every
    # batch slot, which no queue order can change (on a loaded CI machine it alone waited 0.9 s, and
    # with 12 requests it was the p99: CI at 7b92952). Quiet EPYC runs: VTC 22-24 ms, FCFS 680-810 ms.
    assert vtc["light"]["ttft_p99_after_first_ms"] < fcfs["light"]["ttft_p99_after_first_ms"], \
        (fcfs["light"], vtc["light"])
    assert vtc["light"]["requests"] > fcfs["light"]["requests"], (fcfs["light"], vtc["light"])


async def _light_ttft_behind_queued_heavy(plane, scheduling: str) -> float:
    """The heavy tenant has 5 requests on a worker with one batch slot (`fair_slots` 5: 1 running,
    4 queued in the worker, as `fair_headroom` leaves them); then the light tenant's first request:
    seconds to its first token."""
    worker = {"max_batch": 1, "time_scale": 0.3, "max_waiting": 64, "scheduling": scheduling}
    async with plane(client_keys="on", admin_api_key=ADMIN, fair_slots=5, worker_kw=worker) as p:
        kh, kl = await keys(p.url)
        heavy = TenantLoad("heavy", kh, concurrency=1, max_tokens=24)
        light = TenantLoad("light", kl, concurrency=1, max_tokens=4, stream=True)
        async with httpx.AsyncClient(base_url=p.url, timeout=60, headers={"Authorization": f"Bearer {kh}"}) as hh, \
                httpx.AsyncClient(base_url=p.url, timeout=60, headers={"Authorization": f"Bearer {kl}"}) as hl:
            flood = [asyncio.ensure_future(_one(hh, heavy, "sim-test")) for _ in range(5)]
            await asyncio.sleep(0.3)  # all 5 at the worker
            got = await _one(hl, light, "sim-test")
            assert all(await asyncio.gather(*flood))
    assert got is not None
    return got[2]


async def test_a_tenant_with_nothing_running_goes_ahead_in_a_priority_worker(plane):
    """The fair queue sends the request of a tenant with nothing running one `priority` ahead
    (admission.fair_priority): a worker with `scheduling=priority` starts it before the other
    tenant's queued requests (after the running one); an FCFS worker after all of them."""
    fcfs = await _light_ttft_behind_queued_heavy(plane, "fcfs")
    prio = await _light_ttft_behind_queued_heavy(plane, "priority")
    print(f"light TTFT behind 4 queued heavy requests: fcfs {fcfs * 1e3:.0f} ms, priority {prio * 1e3:.0f} ms")
    assert prio < 0.5 * fcfs, (prio, fcfs)
