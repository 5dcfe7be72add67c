"""Prefix-aware placement's table (gateway/prefixes.py): chained block hashes, the longest start
among live workers, tenants and salts kept apart, a bounded table that forgets a prompt's tail
before its start, and a worker that went down forgotten."""
from __future__ import annotations

from polyserve.gateway import prefixes as P
from polyserve.gateway.prefixes import BLOCK_CHARS, MIN_BLOCKS, PrefixTable

SYSTEM = "You are a careful assistant for the billing team. " * 8  # 400 characters


def test_blocks_are_a_chain_over_whole_blocks_only():
    short = "x" * (BLOCK_CHARS * MIN_BLOCKS - 1)
    assert P.blocks("", "", short) == ()  # too short to move a request: nothing to hash
    a = P.blocks("", "", SYSTEM + "question one")
    b = P.blocks("", "", SYSTEM + "another question, longer than the first one")
    assert len(a) == len(SYSTEM + "question one") // BLOCK_CHARS
    n_same = len(SYSTEM) // BLOCK_CHARS
    assert a[:n_same] == b[:n_same]  # the same start: the same hashes
    c = P.blocks("", "", "Z" + SYSTEM[1:] + "question one")
    assert not set(a) & set(c)  # one character apart at the start: no block alike (a chain)
    assert len(P.blocks("", "", "y" * BLOCK_CHARS * (P.MAX_BLOCKS + 10))) == P.MAX_BLOCKS


def test_tenants_and_salts_never_share_a_start():
    a, b, c = P.blocks("acme", "", SYSTEM), P.blocks("globex", "", SYSTEM), P.blocks("acme", "s1", SYSTEM)
    assert not set(a) & set(b) and not set(a) & set(c)
    t = PrefixTable(1000)
    t.record(a, "w1")
    assert t.longest(b, {"w1", "w2"}) == (set(), 0)
    assert t.longest(a, {"w1", "w2"}) == ({"w1"}, len(a))


def test_longest_start_among_the_live_workers():
    t = PrefixTable(1000)
    conv = SYSTEM + "user: hi\nassistant: hello, how can I help with your invoice today?\n" * 4
    t.record(P.blocks("", "", SYSTEM), "w1")
    t.record(P.blocks("", "", conv), "w2")
    assert len(P.blocks("", "", conv)) > len(SYSTEM) // BLOCK_CHARS
    turn2 = P.blocks("", "", conv + "user: my invoice is wrong, it lists a plan I never had\n" * 3)
    assert t.longest(turn2, {"w1", "w2", "w3"}) == ({"w2"}, len(P.blocks("", "", conv)))
    assert t.longest(turn2, {"w1", "w3"}) == ({"w1"}, len(SYSTEM) // BLOCK_CHARS)  # w2 not a candidate
    assert t.longest(turn2, {"w3"}) == (set(), 0)
    other = P.blocks("", "", "An unrelated prompt about the weather in Lisbon. " * 8)
    assert t.longest(other, {"w1", "w2"}) == (set(), 0)


def test_a_full_table_forgets_old_prompts_tails_before_their_starts():
    n = len(P.blocks("", "", SYSTEM))
    t = PrefixTable(n + 2)
    long_one = P.blocks("", "", SYSTEM + "z" * BLOCK_CHARS * 4)
    t.record(long_one, "w1")  # n + 4 blocks in a table of n + 2: the last two go
    assert len(t) == n + 2
    assert t.longest(long_one, {"w1"}) == ({"w1"}, n + 2)  # the start is kept whole
    t.record(P.blocks("", "", "q" * BLOCK_CHARS * (n + 2)), "w2")  # fills the table anew
    assert t.longest(long_one, {"w1"}) == (set(), 0)
    assert PrefixTable(0).longest(long_one, {"w1"}) == (set(), 0)


def test_a_worker_that_went_down_is_forgotten():
    t = PrefixTable(1000)
    h = P.blocks("", "", SYSTEM)
    t.record(h, "w1")
    t.record(h, "w2")
    t.forget("w1")
    assert t.longest(h, {"w1", "w2"}) == ({"w2"}, len(h))
    t.forget("w2")
    assert len(t) == 0


def test_applies_to_caching_engines_under_auto():
    assert P.applies("auto", "vllm") and P.applies("auto", "openai-http")
    assert not P.applies("auto", "sim") and not P.applies("auto", "hf")
    assert P.applies("on", "sim") and not P.applies("off", "vllm")
