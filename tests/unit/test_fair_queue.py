"""The VTC queue (services/gateway/fairness.py) on its own: the order it starts waiting requests
in (priority class, then the smallest virtual token counter, FIFO within a tenant), the lift of a
tenant that becomes backlogged, the express start of an idle tenant, correction with actual usage,
cancellation."""
from __future__ import annotations

import asyncio

import pytest

from polyserve.gateway.fairness import W_IN, W_OUT, FairQueue, Grant


class Recorder:
    """Waiting requests on a FairQueue with one slot; `drain()` releases the running one each time
    and records which tenant started next."""

    def __init__(self, q: FairQueue):
        self.q, self.order, self.grants = q, [], []

    async def _wait(self, tenant: str, klass: str) -> None:
        g = await self.q.acquire(tenant, klass, 0, 10, slots=1)
        self.order.append(tenant)
        self.grants.append(g)

    async def queue(self, tenant: str, n: int = 1, klass: str = "normal") -> None:
        for _ in range(n):
            asyncio.ensure_future(self._wait(tenant, klass))
            await asyncio.sleep(0)

    async def drain(self, running: list[Grant]) -> None:
        while running or self.q.queued:
            g = running.pop(0) if running else next(x for x in self.grants if not x.released)
            self.q.release(g, slots=1)
            await asyncio.sleep(0)


async def test_waiting_requests_start_by_smallest_counter_not_arrival():
    q = FairQueue()
    rec = Recorder(q)
    heavy = await q.acquire("heavy", "normal", 0, 10, slots=1)  # holds the one slot
    await rec.queue("heavy", 6)
    light = await q.acquire("light", "normal", 0, 10, slots=1)  # idle tenant: starts at once, over the slot
    assert q.busy == 2 and q.counters["light"] == q.counters["heavy"] + W_OUT * 10  # lifted, then charged
    await rec.queue("light", 2)  # light is running now: these wait
    assert q.queued == 8
    await rec.drain([heavy, light])
    assert len(rec.order) == 8
    assert max(i for i, t in enumerate(rec.order) if t == "light") < 5, rec.order  # FIFO: positions 6 and 7


async def test_priority_classes_come_first_and_lift_banks_no_credit():
    q = FairQueue()
    rec = Recorder(q)
    q.counters["idle"] = 0.0  # long idle: must not get the whole past as credit
    busy = await q.acquire("busy", "normal", 0, 1000, slots=1)
    vip = await q.acquire("vip", "high", 0, 10, slots=1)  # express (was idle); the one extra start
    await rec.queue("busy", 2)
    await rec.queue("vip", 1, "high")
    await rec.queue("idle", 1, "low")  # no second express start: it waits
    assert q.counters["idle"] == q.counters["busy"] == W_OUT * 1000  # lifted to the smallest waiting counter
    await rec.drain([busy, vip])
    assert rec.order == ["vip", "busy", "busy", "idle"]  # high first, low last, whatever the counters


async def test_actual_usage_corrects_the_counter_and_cancelled_waiters_leave():
    q = FairQueue()
    g = await q.acquire("a", "normal", 10, 100, slots=1)
    assert q.counters["a"] == W_IN * 10 + W_OUT * 100
    await q.acquire("b", "normal", 1, 1, slots=1)  # express: b was idle
    waiter = asyncio.ensure_future(q.acquire("b", "normal", 1, 1, slots=1))
    await asyncio.sleep(0)
    assert q.queued == 1
    waiter.cancel()
    await asyncio.sleep(0)
    assert q.queued == 0
    q.release(g, actual_in=10, actual_out=3, slots=1)  # stopped early: charged what it used
    assert q.counters["a"] == W_IN * 10 + W_OUT * 3 and q.busy == 1


async def test_a_started_grant_given_back_twice_counts_once():
    q = FairQueue()
    g = await q.acquire("a", "normal", 1, 1, slots=2)
    q.release(g, slots=2)
    q.release(g, slots=2)
    assert q.busy == 0 and q.running == {}
    with pytest.raises(asyncio.TimeoutError):  # nothing leaks a slot: 2 run, the third waits
        await q.acquire("a", "normal", 1, 1, slots=2)
        await q.acquire("a", "normal", 1, 1, slots=2)
        await asyncio.wait_for(q.acquire("a", "normal", 1, 1, slots=2), 0.05)


async def test_the_reserve_keeps_a_slot_for_a_tenant_under_its_share():
    """With two tenants active, the last 1/8 of the slots (at least one) go only to a tenant holding
    fewer than its equal share: the heavy tenant runs at most 7 of 8, so the light tenant's next
    request starts in a free batch slot instead of waiting for a heavy sequence to end."""
    q, slots = FairQueue(), 8
    q.release(await q.acquire("light", "normal", 0, 8, slots=slots), slots=slots)  # light was active just now
    heavy = [await q.acquire("heavy", "normal", 0, 32, slots=slots) for _ in range(7)]
    waiting = asyncio.ensure_future(q.acquire("heavy", "normal", 0, 32, slots=slots))
    await asyncio.sleep(0)
    assert q.busy == 7 and q.queued == 1  # the 8th slot is reserved
    light = await q.acquire("light", "normal", 0, 8, slots=slots)  # starts in the reserved slot
    assert q.busy == 8
    q.release(light, slots=slots)
    await asyncio.sleep(0)
    assert q.busy == 7 and not waiting.done()  # the heavy tenant does not take the reserve back
    q.release(heavy.pop(), slots=slots)
    await asyncio.sleep(0)
    assert waiting.done() and q.busy == 7
    # both backlogged: a tenant under its share (8 / 2) fills the reserve, so no slot idles
    light = [await q.acquire("light", "normal", 0, 8, slots=slots)]
    light.append(asyncio.ensure_future(q.acquire("light", "normal", 0, 8, slots=slots)))
    await asyncio.sleep(0)
    assert q.busy == 8 and not light[1].done()  # at the slots: the second waits for a free one
    q.release(heavy.pop(), slots=slots)
    await asyncio.sleep(0)
    assert light[1].done() and q.running["light"] == 2 and q.busy == 8


async def test_no_reserve_for_a_single_tenant_or_when_turned_off():
    q, slots = FairQueue(), 8
    alone = [await q.acquire("heavy", "normal", 0, 32, slots=slots) for _ in range(8)]
    assert q.busy == 8  # one tenant active: the whole batch
    q.release(alone[0], slots=slots)
    q.reserve_fraction = 0.0
    q.last_seen["light"] = q.last_seen["heavy"]  # two tenants active, but the reserve is off
    await asyncio.wait_for(q.acquire("heavy", "normal", 0, 32, slots=slots), 0.05)
    assert q.busy == 8


async def test_a_tenant_with_nothing_running_is_marked_ahead_for_the_worker():
    """`Grant.ahead` (admission.fair_priority: one priority ahead in a priority-aware worker): a
    request of a tenant with nothing running while another tenant runs; not a busy tenant's."""
    q = FairQueue()
    first = await q.acquire("heavy", "normal", 0, 32, slots=4)
    assert not first.ahead  # nothing else runs: no one to overtake
    second = await q.acquire("heavy", "normal", 0, 32, slots=4)
    light = await q.acquire("light", "normal", 0, 8, slots=4)
    assert not second.ahead and light.ahead
    assert not (await q.acquire("light", "normal", 0, 8, slots=4)).ahead  # light runs one already


async def test_the_reserve_is_one_slot_per_other_active_tenant_at_most():
    q, slots = FairQueue(), 64
    q.last_seen["light"] = 0.0
    q.release(await q.acquire("light", "normal", 0, 8, slots=slots), slots=slots)
    heavy = [await asyncio.wait_for(q.acquire("heavy", "normal", 0, 32, slots=slots), 0.05) for _ in range(63)]
    assert q.busy == 63  # two tenants: 1 slot reserved, not 64 / 8
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(q.acquire("heavy", "normal", 0, 32, slots=slots), 0.05)
    assert len(heavy) == 63
