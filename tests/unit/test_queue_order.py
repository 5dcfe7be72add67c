"""Worker queue orders: FCFS unchanged, speculative SJF with aging (no starvation),
oracle SJF, and the static sort keys the simulator uses."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from polyserve.core import queue_order as wp

pytestmark = pytest.mark.unit


@dataclass
class Q:
    name: str
    arrival: float
    length_class: int = -1
    priority: int = 0
    true_tokens: int = 0


def names(xs) -> list[str]:
    return [x.name for x in xs]


def test_fcfs_and_priority_are_unchanged():
    qs = [Q("b", 2.0), Q("a", 1.0, priority=1), Q("c", 3.0)]
    assert names(wp.fcfs(qs)) == ["a", "b", "c"]
    assert names(wp.priority_fcfs(qs)) == ["b", "c", "a"]
    assert set(wp.ORDERS) >= {"fcfs", "priority", "ssjf"} and "sjf_oracle" not in wp.ORDERS


def test_ssjf_prefers_short_predictions_within_the_aging_window():
    qs = [Q("long", 0.0, 4), Q("mid", 0.1, 2), Q("short", 0.2, 0), Q("unknown", 0.3, -1)]
    assert names(wp.speculative_sjf(qs)) == ["short", "mid", "unknown", "long"]
    # equal classes keep arrival order
    assert names(wp.speculative_sjf([Q("x", 2.0, 1), Q("y", 1.0, 1)])) == ["y", "x"]


def test_aging_never_starves_a_long_request():
    """A class-4 request at t=0 under a stream of class-0 arrivals every 0.5 s, one served per
    arrival: it is overtaken only by requests that arrived before 4·AGING_S, then served."""
    long = Q("long", 0.0, 4)
    waiting, served, t = [long], [], 0.0
    for k in range(200):
        t = 0.5 * (k + 1)
        waiting.append(Q(f"s{k}", t, 0))
        head = wp.speculative_sjf(waiting)[0]
        waiting.remove(head)
        served.append(head)
        if head is long:
            break
    assert long in served, "the long request starved"
    overtook = [q for q in served if q is not long]
    assert overtook and all(q.arrival < 4 * wp.AGING_S for q in overtook)
    assert len(overtook) <= 4 * wp.AGING_S / 0.5
    # a faster aging period serves it sooner
    fast = wp.make_ssjf(1.0)
    assert names(fast([Q("long", 0.0, 4), Q("late", 4.5, 0)]))[0] == "long"
    assert names(fast([Q("long", 0.0, 4), Q("early", 3.5, 0)]))[0] == "early"
    with pytest.raises(ValueError):
        wp.make_ssjf(0)


def test_length_class_is_read_from_engine_requests():
    @dataclass
    class Inner:
        length_class: int

    @dataclass
    class EngineReq:  # the sim engine keeps the request under .req
        req: Inner
        arrival: float
        priority: int = 0

    assert wp.length_class_of(EngineReq(Inner(3), 0.0)) == 3
    assert wp.length_class_of(EngineReq(Inner(-1), 0.0)) == wp.UNKNOWN_CLASS
    assert [wp.length_class_of(r) for r in wp.speculative_sjf([EngineReq(Inner(3), 0.0),
                                                               EngineReq(Inner(0), 1.0)])] == [0, 3]


def test_oracle_sjf_uses_true_lengths():
    qs = [Q("a", 0.0, true_tokens=500), Q("b", 1.0, true_tokens=5), Q("c", 2.0, true_tokens=50)]
    assert names(wp.oracle_sjf(qs)) == ["b", "c", "a"]


@pytest.mark.parametrize("name", ["fcfs", "priority", "ssjf"])
def test_order_keys_agree_with_order_functions(name):
    qs = [Q(f"q{k}", (k * 7) % 5 * 1.3, length_class=k % 5, priority=k % 2) for k in range(12)]
    assert names(sorted(qs, key=wp.ORDER_KEYS[name])) == names(wp.ORDERS[name](qs))
