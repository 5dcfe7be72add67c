"""Worker queue orders: FCFS unchanged, speculative SJF (by expected size with a bounded
overtake window; the earlier class rule with aging), oracle SJF, and the static sort keys
the simulator uses."""
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
    predicted_tokens: int = 0
    input_len: int = 0


def names(xs) -> list[str]:
    return [x.name for x in xs]


@pytest.fixture(autouse=True)
def fresh_default_rule(monkeypatch):
    """An empty live ssjf rule with the live one's settings for every test: the engines' tests feed
    the module's DEFAULT_RULE their completions (its window and guards), and an order here must
    neither see that state nor leave its own."""
    live = wp.DEFAULT_RULE
    rule = wp.SizeRule(live.input_weight, live.window_factor, live.window_s, live.history, tail_guard=live.tail_guard,
                       overtake_bound=live.overtake_bound)
    monkeypatch.setattr(wp, "DEFAULT_RULE", rule)
    return rule


def test_fcfs_and_priority_are_unchanged():
    qs = [Q("b", 2.0), Q("a", 1.0, priority=1), Q("c", 3.0)]
    assert names(wp.fcfs(qs)) == ["a", "b", "c"]
    assert names(wp.priority_fcfs(qs)) == ["b", "c", "a"]
    assert set(wp.ORDERS) >= {"fcfs", "priority", "ssjf", "ssjf_class"} and "sjf_oracle" not in wp.ORDERS


def test_ssjf_class_prefers_short_predictions_within_the_aging_window():
    qs = [Q("long", 0.0, 4), Q("mid", 0.1, 2), Q("short", 0.2, 0), Q("unknown", 0.3, -1)]
    assert names(wp.speculative_sjf_class(qs)) == ["short", "mid", "unknown", "long"]
    # equal classes keep arrival order
    assert names(wp.speculative_sjf_class([Q("x", 2.0, 1), Q("y", 1.0, 1)])) == ["y", "x"]


def test_aging_never_starves_a_long_request():
    """A class-4 request at t=0 under a stream of class-0 arrivals every 0.5 s, one served per
    arrival: it is overtaken only by requests that arrived before 4·AGING_S, then served."""
    long = Q("long", 0.0, 4)
    waiting, served, t = [long], [], 0.0
    for k in range(200):
        t = 0.5 * (k + 1)
        waiting.append(Q(f"s{k}", t, 0))
        head = wp.speculative_sjf_class(waiting)[0]
        waiting.remove(head)
        served.append(head)
        if head is long:
            break
    assert long in served, "the long request starved"
    overtook = [q for q in served if q is not long]
    assert overtook and all(q.arrival < 4 * wp.AGING_S for q in overtook)
    assert len(overtook) <= 4 * wp.AGING_S / 0.5
    # a faster aging period serves it sooner
    fast = wp.make_ssjf_class(1.0)
    assert names(fast([Q("long", 0.0, 4), Q("late", 4.5, 0)]))[0] == "long"
    assert names(fast([Q("long", 0.0, 4), Q("early", 3.5, 0)]))[0] == "early"
    with pytest.raises(ValueError):
        wp.make_ssjf_class(0)


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
    assert [wp.length_class_of(r) for r in wp.speculative_sjf_class([EngineReq(Inner(3), 0.0),
                                                               EngineReq(Inner(0), 1.0)])] == [0, 3]


def test_oracle_sjf_uses_true_lengths():
    qs = [Q("a", 0.0, true_tokens=500), Q("b", 1.0, true_tokens=5), Q("c", 2.0, true_tokens=50)]
    assert names(wp.oracle_sjf(qs)) == ["b", "c", "a"]


@pytest.mark.parametrize("name", ["fcfs", "priority", "ssjf", "ssjf_class"])
def test_order_keys_agree_with_order_functions(name):
    qs = [Q(f"q{k}", (k * 7) % 5 * 1.3, length_class=k % 5, priority=k % 2, predicted_tokens=(k * 37) % 400,
            input_len=(k * 101) % 3000) for k in range(12)]
    assert names(sorted(qs, key=wp.ORDER_KEYS[name])) == names(wp.ORDERS[name](qs))


def test_ssjf_orders_by_expected_size_including_the_prompt():
    """Short expected output first; a long prompt counts as a long job (INPUT_WEIGHT per token)."""
    rule, order = wp.make_ssjf()
    for k in range(50):  # recent sizes spread 0..490 tokens: ranks spread over the window
        rule.key(Q(f"seen{k}", -100.0 + k, predicted_tokens=10 * k))
    qs = [Q("long-out", 0.0, predicted_tokens=400), Q("short", 0.1, predicted_tokens=20),
          Q("long-prompt", 0.2, predicted_tokens=20, input_len=3000), Q("mid", 0.3, predicted_tokens=100)]
    assert names(order(qs)) == ["short", "mid", "long-prompt", "long-out"]
    assert [rule.key(q) for q in qs] == [rule.key(q) for q in qs]  # memoised: a key never changes
    # no token estimate: the unseen-model median of the class (class -1 -> UNKNOWN_CLASS)
    assert wp.predicted_tokens_of(Q("x", 0.0, 0)) == wp.UNSEEN_MEDIANS[0]
    assert wp.predicted_tokens_of(Q("x", 0.0, -1)) == wp.UNSEEN_MEDIANS[wp.UNKNOWN_CLASS]


def test_ssjf_starvation_bound_is_the_overtake_window():
    """A huge request under a stream of tiny ones: only arrivals within W of it go first, and
    W follows the recent JCT (WINDOW_FACTOR x its moving mean)."""
    rule = wp.SizeRule(input_weight=0.0, window_factor=2.0, window_s=30.0)
    assert rule.window == 30.0
    for k in range(20):
        rule.key(Q(f"warm{k}", -50.0 + k, predicted_tokens=1 + k))
    big = Q("big", 0.0, predicted_tokens=10_000)
    tiny = [Q(f"t{k}", 0.5 * (k + 1), predicted_tokens=1) for k in range(100)]
    order = names(sorted([big, *tiny], key=rule.key))
    ahead = {n for n in order[:order.index("big")]}
    assert ahead and all(q.arrival < 30.0 for q in tiny if q.name in ahead)
    assert not any(q.name in ahead for q in tiny if q.arrival >= 30.0)
    rule.observe(5.0)
    assert rule.window == 10.0
    for _ in range(500):
        rule.observe(50.0)
    assert 99.0 < rule.window <= 100.0
    with pytest.raises(ValueError):
        wp.SizeRule(window_s=0)
    with pytest.raises(ValueError):
        wp.make_ssjf(input_weight=-1)



def test_a_request_keyed_before_any_completion_takes_the_first_warm_window():
    """Keyed while W is still the cold window_s (no completion yet), a long request keeps its rank
    but not that W: with the first completion its key is fixed at arrival + warm W x rank, so later
    arrivals do not overtake it for the whole cold window (120 s), only within the warm one."""
    rule = wp.SizeRule(input_weight=0.0, window_factor=2.0, window_s=120.0)
    for k in range(20):
        rule.key(Q(f"seen{k}", -50.0 + k, predicted_tokens=1 + k))
    long = Q("long", 0.0, predicted_tokens=1000)
    assert not rule.warm and rule.key(long)[0] == pytest.approx(120.0)  # rank 1 under the cold W
    rule.observe(1.0)  # the first completion: W = 2 s
    assert rule.warm and rule.key(long) == (pytest.approx(2.0), 0.0)
    rule.observe(50.0)  # W moves on; a key, once warm, does not (heaps stay valid)
    assert rule.key(long) == (pytest.approx(2.0), 0.0) and rule.window > 3.0
    later = Q("short-later", 5.0, predicted_tokens=1)
    assert names(sorted([later, long], key=rule.key)) == ["long", "short-later"]


def test_ssjf_reads_what_each_engine_keeps():
    @dataclass
    class Req:  # EngineRequest: the estimate, no prompt token count
        predicted_tokens: int
        length_class: int = -1
        arrival: float = 0.0
        priority: int = 0

    @dataclass
    class SimReq:  # the sim engine's entry: prompt tokens beside the request
        req: Req
        input_tokens: int
        arrival: float = 0.0
        priority: int = 0

    assert wp.predicted_tokens_of(SimReq(Req(77), 10)) == 77 and wp.input_tokens_of(SimReq(Req(77), 10)) == 10
    assert wp.input_tokens_of(Req(5)) == 0
    assert wp.ORDER_KEYS["ssjf"](SimReq(Req(10), 8000, arrival=1.0)) > wp.ORDER_KEYS["ssjf"](Req(10, arrival=1.0))


def test_remaining_estimator_learns_per_class_survival_from_completions():
    est = wp.RemainingEstimator(min_samples=10)
    assert est.remaining(1, predicted=200, generated=50) == 150  # no completions yet: the prediction
    for k in range(100):  # class 0: all 10 tokens; class 1: half 100, half 1,000 tokens
        est.observe(0, 10)
        est.observe(1, 100 if k % 2 else 1000)
    short = est.remaining(0, predicted=500, generated=0)
    fresh = est.remaining(1, predicted=500, generated=0)
    outlived = est.remaining(1, predicted=500, generated=150)
    assert short < 100 < fresh < outlived  # class 0's table pulls it down; class 1: mean ~550
    # past 100 tokens, only the 1,000-token half is left: ~850 to go (shrunk a little to the pool)
    assert 750 < outlived < 860
    # beyond every completion seen: taken as about to finish, so the longest are never paused
    assert est.remaining(1, predicted=500, generated=5000) == 1.0


def test_remaining_estimator_by_client_shrinks_towards_the_class():
    est = wp.RemainingEstimator(min_samples=10, by_client=True)
    for _ in range(200):
        est.observe(2, 100, client="a")
        est.observe(2, 2000, client="b")
    est.observe(2, 5000, client="c")  # one sample: barely moves its client's estimate
    a, b, c = (est.remaining(2, 0, 0, client=x) for x in "abc")
    pooled = est.remaining(2, 0, 0)
    assert a < 150 and b > 1900 and pooled < c < pooled + 0.25 * (5000 - pooled)
    plain = wp.RemainingEstimator(min_samples=10)  # without by_client the client is ignored
    for _ in range(200):
        plain.observe(2, 100, client="a")
        plain.observe(2, 2000, client="b")
    assert plain.remaining(2, 0, 0, client="a") == plain.remaining(2, 0, 0, client="b")


def test_preemptor_pairs_worst_running_with_best_waiting_and_keeps_a_quantum():
    p = wp.Preemptor(quantum=16)
    running = [((50.0, 0.0), 40, "long"), ((30.0, 0.0), 40, "mid"), ((99.0, 0.0), 3, "fresh"),
               ((10.0, 0.0), 40, "short")]
    # fresh has run 3 steps < quantum: never paused; long is worst, then mid
    assert p.victims(running, [(5.0, 1.0), (20.0, 1.0), (40.0, 1.0)]) == ["long", "mid"]
    assert p.victims(running, [(60.0, 1.0)]) == []  # the best waiting sorts behind every running one
    assert p.victims([((None), 40, "x")], [(0.0, 0.0)]) == []  # no key: not a candidate
    with pytest.raises(ValueError):
        wp.Preemptor(quantum=0)


def test_refined_keys_keep_the_starvation_bound():
    rule = wp.SizeRule(window_s=100.0)
    est = wp.RemainingEstimator(min_samples=5)
    for k in range(50):
        rule.key(Q(f"w{k}", float(k), predicted_tokens=10 * (k + 1)))
        est.observe(-1, 10 * (k + 1))
    r = Q("r", 1000.0, predicted_tokens=400)
    for g in (0, 100, 300, 490, 10_000):
        key = wp.refined_ssjf_key(rule, est, r, g)
        assert r.arrival <= key[0] <= r.arrival + rule.window  # at most arrival + W, whatever it generated
    assert wp.refined_ssjf_key(rule, est, r, 450) < wp.refined_ssjf_key(rule, est, r, 0)  # nearly done: sooner
    assert wp.refined_ssjf_key(rule, est, r, 0, prefill_tokens=8000) > wp.refined_ssjf_key(rule, est, r, 0)
    o = Q("o", 5.0, true_tokens=300)
    assert wp.srpt_oracle_key(o, 200) == (100, 5.0)


def test_client_of_reads_engine_fields():
    assert wp.client_of(Q("x", 0.0)) is None

    @dataclass
    class R:
        tenant: str = "acme"

    @dataclass
    class E:
        req: R
        arrival: float = 0.0

    assert wp.client_of(E(R())) == "acme" and wp.client_of(E(R(tenant=""))) is None


def test_tail_guard_is_a_quantile_of_recent_jcts_and_puts_overdue_requests_first(monkeypatch):
    assert wp.SizeRule().guard() is None  # off unless asked (the live rules ask: DEFAULT_RULE, REFINE_RULE)
    rule = wp.SizeRule(tail_guard=0.9)
    for k in range(wp.GUARD_MIN - 1):
        rule.observe(1.0)
    assert rule.guard() is None  # not before GUARD_MIN completions
    for k in range(1, 101):
        rule.observe(float(k))
    assert 85.0 <= rule.guard() <= 95.0
    with pytest.raises(ValueError):
        wp.SizeRule(tail_guard=1.0)
    monkeypatch.setattr(wp, "REFINE_RULE", rule)
    qs = [Q("big-old", 0.0, predicted_tokens=5000), Q("small", 99.0, predicted_tokens=5),
          Q("big-older", -10.0, predicted_tokens=5000), Q("mid", 98.0, predicted_tokens=300)]
    order = names(wp.speculative_sjf_refine(qs, now=100.0))
    assert order[:2] == ["big-older", "big-old"]  # waited 110 and 100 s > the guard: first, in arrival order
    assert names(wp.speculative_sjf_refine(qs, now=50.0)) == names(sorted(qs, key=rule.key))  # none overdue yet
    assert wp.overdue(rule, qs[0], 100.0) and not wp.overdue(rule, qs[1], 100.0)


def test_plain_ssjf_puts_a_request_overtaken_past_the_bound_first(fresh_default_rule):
    """The served `ssjf` carries the overtake bound (ε = 0.15) and no tail guard: a request noted
    when FCFS would have started it `ahead` completions later goes ahead of shorter later arrivals
    (first come first served among such) once the worker has completed more than M = ⌈ε × the
    completions of the last P99-JCT seconds⌉ beyond that; before GUARD_MIN completions, the size
    rule alone."""
    rule = fresh_default_rule
    assert rule.overtake_bound == wp.OVERTAKE_BOUND == 0.15 and rule.tail_guard == wp.TAIL_GUARD == 0.0
    assert rule.guard() is None
    for k in range(40):  # recent sizes 10..400 tokens: a 5,000-token request ranks last, a 5-token one first
        rule.key(Q(f"seen{k}", -200.0 + k, predicted_tokens=10 * (k + 1)))
    t = 0.0
    for _ in range(wp.GUARD_MIN - 1):
        t += 0.1
        rule.observe(10.0, now=t)  # JCTs of 10 s: the window W is 20 s, the P99 JCT 10 s
    qs = [Q("short1", 1.0, predicted_tokens=5), Q("long", 0.0, predicted_tokens=5000),
          Q("short2", 2.0, predicted_tokens=5)]
    by_size = ["short1", "short2", "long"]
    assert rule.overtake_limit(8.0) is None  # not before GUARD_MIN completions
    assert names(wp.speculative_sjf(qs, now=8.0)) == by_size  # and each is noted: "long" first by arrival
    t += 0.1
    rule.observe(10.0, now=t)
    assert rule.completions == 50 and rule.overtake_limit(8.0) == 8  # ⌈0.15 × 50⌉: all 50 within 10 s
    assert names(wp.speculative_sjf(qs, now=8.0)) == by_size  # 50 <= 49 + 8: not overtaken past the bound
    for _ in range(9):
        t += 0.1
        rule.observe(10.0, now=t)
    assert rule.overtake_limit(8.0) == 9  # ⌈0.15 × 59⌉
    # "long" (due at 49) is past 49 + 9; "short1" (50 + 9) is not
    assert names(wp.speculative_sjf(qs, now=8.0)) == ["long", "short1", "short2"]
    assert wp.overdue(rule, qs[1], 8.0) and not wp.overdue(rule, qs[0], 8.0)
    assert names(sorted(qs, key=wp.ORDER_KEYS["ssjf"])) == by_size  # the key alone
    # only the completions of the last P99-JCT seconds count: 30 s later there are none
    assert rule.overtake_limit(t + 30.0) == 1
    with pytest.raises(ValueError):
        wp.SizeRule(overtake_bound=1.5)
