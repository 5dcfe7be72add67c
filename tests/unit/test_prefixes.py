"""Prefix-aware placement's table (gateway/prefixes.py): chained hashes of a prompt's starts, the
longest start among live workers, tenants and salts kept apart, a bounded table that forgets a
prompt's long starts before its short ones, and a worker that went down forgotten."""
from __future__ import annotations

from polyserve.gateway import prefixes as P
from polyserve.gateway.prefixes import BLOCK_CHARS, CHECKPOINTS, MIN_BLOCKS, PrefixTable

SYSTEM = "You are a careful assistant for the billing team. " * 8  # 400 characters: 3 whole blocks


def starts(text: str) -> int:
    """How many of `blocks`' checkpoints a text of this length reaches."""
    return sum(1 for k in CHECKPOINTS if k <= len(text) // BLOCK_CHARS)


def test_blocks_hash_the_starts_at_the_checkpoints_as_a_chain():
    assert P.blocks("", "", "x" * (BLOCK_CHARS * MIN_BLOCKS - 1)) == ()  # too short to move a request
    a = P.blocks("", "", SYSTEM + "question one" * 60)
    b = P.blocks("", "", SYSTEM + "another question" * 60)
    assert len(a) == starts(SYSTEM + "question one" * 60) and CHECKPOINTS[:3] == (2, 3, 4)
    assert a[:2] == b[:2] and a[2] != b[2]  # alike for the first 3 blocks (384 characters), not the 4th
    c = P.blocks("", "", "Z" + SYSTEM[1:] + "question one" * 60)
    assert not set(a) & set(c)  # one character apart at the start: no start alike (a chain)
    assert len(P.blocks("", "", "y" * BLOCK_CHARS * (P.MAX_BLOCKS + 10))) == len(CHECKPOINTS)
    assert CHECKPOINTS[-1] == P.MAX_BLOCKS and list(CHECKPOINTS) == sorted(set(CHECKPOINTS))


def test_tenants_and_salts_never_share_a_start():
    a, b, c = P.blocks("acme", "", SYSTEM), P.blocks("globex", "", SYSTEM), P.blocks("acme", "s1", SYSTEM)
    assert not set(a) & set(b) and not set(a) & set(c)
    t = PrefixTable(1000)
    t.record(a, "w1")
    assert t.longest(b, {"w1", "w2"}) == (set(), 0)
    assert t.longest(a, {"w1", "w2"}) == ({"w1"}, 3)


def test_each_lora_adapter_has_its_own_starts_and_the_base_model_hashes_as_before():
    """An engine's prefix cache is per adapter (vLLM hashes a block with its request's LoRA), so a
    start placed for one adapter, or for the base model, does not steer a request with another."""
    base, a1, a2 = (P.blocks("acme", "", SYSTEM, adapter) for adapter in ("", "sql-lora", "chat-lora"))
    assert base == P.blocks("acme", "", SYSTEM)  # a base-model prompt: the same hashes as without the argument
    assert len(base) == len(a1) == len(a2) and not set(base) & set(a1) and not set(a1) & set(a2)
    assert a1 == P.blocks("acme", "", SYSTEM, "sql-lora")  # stable: gateways share them
    t = PrefixTable(1000)
    t.record(a1, "w1")
    assert t.longest(base, {"w1"}) == (set(), 0) and t.longest(a2, {"w1"}) == (set(), 0)
    assert t.longest(a1, {"w1"}) == ({"w1"}, 3)


def test_longest_start_among_the_live_workers():
    t = PrefixTable(1000)
    conv = SYSTEM + "user: hi\nassistant: hello, how can I help with your invoice today?\n" * 12  # 9 blocks
    t.record(P.blocks("", "", SYSTEM), "w1")
    t.record(P.blocks("", "", conv), "w2")
    turn2 = P.blocks("", "", conv + "user: my invoice is wrong, it lists a plan I never had\n" * 6)
    assert t.longest(turn2, {"w1", "w2", "w3"}) == ({"w2"}, 8)
    assert t.longest(turn2, {"w1", "w3"}) == ({"w1"}, 3)  # w2 not a candidate: w1 has 3 blocks of it
    assert t.longest(turn2, {"w3"}) == (set(), 0)
    other = P.blocks("", "", "An unrelated prompt about the weather in Lisbon. " * 8)
    assert t.longest(other, {"w1", "w2"}) == (set(), 0)


def test_a_full_table_forgets_a_prompts_long_starts_before_its_short_ones():
    t = PrefixTable(3)
    long_one = P.blocks("", "", SYSTEM + "z" * BLOCK_CHARS * 10)  # 13 blocks: starts of 2, 3, 4, 6, 8, 12
    t.record(long_one, "w1")
    assert len(t) == 3
    assert t.longest(long_one, {"w1"}) == ({"w1"}, 4)  # the three shortest starts are kept
    t.record(P.blocks("", "", "q" * BLOCK_CHARS * 4), "w2")  # three more starts: the table anew
    assert t.longest(long_one, {"w1"}) == (set(), 0)
    assert PrefixTable(0).longest(long_one, {"w1"}) == (set(), 0)


def test_a_worker_that_went_down_is_forgotten():
    t = PrefixTable(1000)
    h = P.blocks("", "", SYSTEM)
    t.record(h, "w1")
    t.record(h, "w2")
    assert t.holds("w1") and t.holds("w2")
    t.forget("w1")
    assert t.longest(h, {"w1", "w2"}) == ({"w2"}, 3) and not t.holds("w1")
    t.forget("w2")
    assert len(t) == 0


def test_applies_to_caching_engines_under_auto_whatever_the_policy():
    from polyserve.proto import Deployment

    def dep(engine: str, policy: str = "least_outstanding") -> Deployment:
        return Deployment(id="d", model="m", engine=engine, policy=policy)

    assert P.applies("auto", dep("vllm")) and P.applies("auto", dep("openai-http", "round_robin"))
    assert not P.applies("auto", dep("sim")) and not P.applies("auto", dep("hf"))
    assert P.applies("on", dep("sim")) and not P.applies("off", dep("vllm"))
    assert P.applies("auto", dep("vllm", "aladdin"))  # the dispatcher places, with the holders as a hint


def test_prefer_names_the_live_holders_of_the_longest_start_sorted_and_bounded():
    t = PrefixTable(1000)
    h = P.blocks("", "", SYSTEM)
    for w in ("w3", "w1", "w2"):
        t.record(h[:1], w)  # three hold the first checkpoint
    t.record(h, "w2")  # one holds all of it
    assert P.prefer(t, h, {"w1", "w2", "w3"}) == ["w2"]
    assert P.prefer(t, h, {"w1", "w3"}) == ["w1", "w3"]  # w2 not live: the next longest start
    assert P.prefer(t, h, set()) == [] and P.prefer(t, (), {"w1"}) == []
    for i in range(40):
        t.record(h[:1], f"x{i:02d}")
    assert len(P.prefer(t, h[:1], {f"x{i:02d}" for i in range(40)})) == P.MAX_PREFER
