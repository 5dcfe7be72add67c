"""`polyserve bench prefix` (bench/prefix.py) on a small trace of its own: conversations whose
turns extend the turn before (Mooncake's hash_ids form). Prefix-aware placement must serve more of
the prompts from the workers' caches than the load-only rules, close to the pooled ceiling, and
every figure is labelled simulated."""
from __future__ import annotations

import json
import random

from polyserve.bench import prefix as B


def _trace(path, conversations: int = 30, turns: int = 4, seed: int = 3) -> None:
    rng, rows, next_id = random.Random(seed), [], 0
    for c in range(conversations):
        blocks: list[int] = []
        t = rng.uniform(0, 60_000)
        for _ in range(turns):
            add = rng.randint(2, 6)
            blocks += list(range(next_id, next_id + add))
            next_id += add
            rows.append({"timestamp": int(t), "input_length": 512 * len(blocks) - rng.randint(0, 300),
                         "output_length": rng.randint(20, 200), "hash_ids": list(blocks)})
            t += rng.uniform(5_000, 20_000)  # the user reads, then asks again
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_prefix_rules_serve_more_from_cache_than_load_only_ones(tmp_path, capsys):
    trace, out = tmp_path / "conv.jsonl", tmp_path / "out.json"
    _trace(trace)
    parser = __import__("argparse").ArgumentParser()
    B.add_arguments(parser)
    assert B.main(parser.parse_args(["--trace", str(trace), "--workers", "4", "--json", str(out)])) == 0
    printed = capsys.readouterr().out
    assert "SIMULATED" in printed
    res = json.loads(out.read_text())
    hit = {r["rule"]: r["cache_hit"] for r in res["rows"]}
    assert res["simulated"] and len(hit) == 4
    for rule in ("prefix:round_robin", "prefix:least_outstanding"):
        assert hit[rule] > 2 * max(hit["round_robin"], hit["least_outstanding"]), hit
        assert hit[rule] >= 0.9 * res["pooled_hit"], (hit, res["pooled_hit"])
    assert res["pooled_hit"] <= res["ceiling_hit"] + 1e-12
    outcomes = next(r["outcomes"] for r in res["rows"] if r["rule"] == "prefix:least_outstanding")
    assert outcomes["miss"] == 30 and outcomes["hit"] >= 80  # every first turn misses; most later turns hit


def test_real_conversations_each_turn_starts_with_the_one_before(tmp_path):
    """The out-of-distribution workloads (bench/prefix_conversations.py): MT-bench's second turns
    carry the first turn's prompt and answer; prefix-aware placement comes close to the pooled
    ceiling on them."""
    from polyserve.bench import prefix_conversations as conv

    reqs = conv.conversations("mt_bench", rate=2.0, limit=40)
    by_conv: dict[str, list] = {}
    for r in reqs:
        by_conv.setdefault(r.rid.split("t")[0], []).append(r)
    two = [sorted(v, key=lambda r: r.rid) for v in by_conv.values() if len(v) == 2]
    assert len(two) >= 30
    for first, second in two:
        assert second.text.startswith(first.text) and second.arrival > first.arrival
        assert second.blocks[:len(first.blocks)] == first.blocks
    out = tmp_path / "mt.json"
    parser = __import__("argparse").ArgumentParser()
    B.add_arguments(parser)
    B.main(parser.parse_args(["--conversations", "mt_bench", "--limit", "200", "--workers", "4",
                              "--rules", "round_robin", "prefix:round_robin", "--json", str(out)]))
    res = json.loads(out.read_text())
    hit = {r["rule"]: r["cache_hit"] for r in res["rows"]}
    assert hit["prefix:round_robin"] > hit["round_robin"] and hit["prefix:round_robin"] >= res["pooled_hit"] - 0.03, hit


def test_the_dispatchers_policies_follow_the_gateways_hint(tmp_path):
    """--rules aladdin / caraserve: the dispatcher's pure policy places (over the simulated workers'
    views), with the gateway's hint under prefix: (dispatcher/prefer.py's rule): more of the prompts
    from cache than the policy alone, every request counted once in the outcomes."""
    trace, out = tmp_path / "conv.jsonl", tmp_path / "out.json"
    _trace(trace, conversations=40)
    parser = __import__("argparse").ArgumentParser()
    B.add_arguments(parser)
    rules = ["aladdin", "prefix:aladdin", "caraserve", "prefix:caraserve"]
    assert B.main(parser.parse_args(["--trace", str(trace), "--workers", "4", "--rules", *rules,
                                     "--json", str(out)])) == 0
    rows = {r["rule"]: r for r in json.loads(out.read_text())["rows"]}
    for policy in ("aladdin", "caraserve"):
        plain, hinted = rows[policy], rows[f"prefix:{policy}"]
        assert hinted["cache_hit"] > 1.5 * plain["cache_hit"], (policy, plain["cache_hit"], hinted["cache_hit"])
        assert sum(hinted["outcomes"].values()) == hinted["requests"] == 160
        assert hinted["outcomes"]["hit"] >= 60 and plain["outcomes"] == {}
        assert "flagged" in plain and "flagged" in hinted
