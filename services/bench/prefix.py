"""`polyserve bench prefix`: what prefix-aware placement (gateway/prefixes.py) earns, SIMULATED.

A trace whose requests name their prompt's 512-token blocks by hash (Mooncake's FAST'25 trace:
`hash_ids`, equal ids = a reusable prefix) is replayed over N simulated workers, once per placement
rule. The placement is the gateway's own code (`routing.LocalRouter`, `prefixes.PrefixTable` and
`prefixes.choose`, on a prompt text built from the block ids: 2,048 characters per block); the
workers are a model, not an engine:

* each keeps a prefix cache of whole blocks, least recently used out, as large as the profile's KV
  capacity (vLLM's automatic prefix caching keeps freed blocks for reuse; the blocks that running
  requests pin are not subtracted);
* prefills run one at a time per worker, first come first served; a prefill computes the prompt's
  tokens past its longest cached start (at least one), in the profile's prefill time (Aladdin's
  k1·tokens + c1), and its blocks join the cache when it ends;
* decoding runs beside the prefills (as with chunked prefill; the interference is not modelled)
  for output × the profile's decode step at the worker's batch; a request counts as load on its
  worker (`LocalRouter`) from placement to its last token.

Rules `aladdin` and `caraserve` (`--rules`; not run by default) place as the dispatcher does: its
pure policy over the workers' views (`_Dispatcher`), and under `prefix:` with the gateway's hint
(`DispatchRequest.prefer`, `prefixes.hint`) followed by dispatcher/prefer.py's own rule.

Printed per rule: the share of prompt tokens served from a cache, the prefill tokens computed,
time to first token (queue + prefill) and how evenly requests spread. Every figure is simulated.
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from polyserve.core.names import MODEL_POLICIES
from polyserve.core.perf import WorkerPerf, load_perf
from polyserve.core.profiles import profile_path
from polyserve.dispatcher import prefer as prefer_mod
from polyserve.dispatcher.policy import PolicyState, RequestView, RunningRequest, WorkerView, get_policy
from polyserve.gateway import prefixes
from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.routing import AFFINITY_SLACK, LocalRouter
from polyserve.proto import Heartbeat
from polyserve.shared import machine
from polyserve.shared.paths import datasets_dir

TRACE = datasets_dir() / "traces" / "mooncake_fast25_synthetic_trace.jsonl"
PROFILE = "sim-llama2-70b-h100-tp4"
BLOCK_TOKENS = 512  # Mooncake's hash_ids name 512-token blocks
BLOCK_TEXT = 4 * BLOCK_TOKENS  # characters a block stands for in the prompt text the gateway hashes
RULES = ("round_robin", "least_outstanding", "prefix:round_robin", "prefix:least_outstanding")
# The dispatcher's policies (--rules): it places, with the gateway's hint under `prefix:` (prefer.py)
MODEL_RULES = ("aladdin", "caraserve", "prefix:aladdin", "prefix:caraserve")
PREDICTION_SIGMA = 0.3  # what the model policies are told of a request's output: its length x lognormal(0, 0.3)
DEPLOYMENT = "bench"


@dataclass
class Req:
    rid: str
    arrival: float
    input_len: int
    output_len: int
    blocks: list[int]  # the engine's cache blocks of its prompt, by hash
    text: str = ""  # its prompt ("": made of `blocks`, `prompt_text`)


@dataclass
class _Worker:
    hb: Heartbeat
    capacity: int  # blocks its prefix cache holds
    cache: OrderedDict = field(default_factory=OrderedDict)  # block id -> None, least recently used first
    queue: deque = field(default_factory=deque)  # requests waiting for their prefill
    busy: bool = False
    decoding: int = 0
    placed: int = 0
    live: dict = field(default_factory=dict)  # request id -> (Req, prefill end or None, decode seconds)

    def cached_start(self, blocks: list[int]) -> int:
        """Blocks of `blocks`' longest start in the cache (touched: they are used now)."""
        n = 0
        for b in blocks:
            if b not in self.cache:
                break
            self.cache.move_to_end(b)
            n += 1
        return n

    def keep(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the start last: the most recently used, the last to go
            self.cache[b] = None
            self.cache.move_to_end(b)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


def load_trace(path: Path, limit: int, rate_scale: float) -> list[Req]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(Req(f"r{n}", float(row["timestamp"]) / 1000.0 / rate_scale, int(row["input_length"]),
                               max(1, int(row["output_length"])), [int(h) for h in row["hash_ids"]]))
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}, line {n}: need a JSON object with timestamp (ms), input_length, "
                                 f"output_length and hash_ids (a Mooncake trace line): {type(exc).__name__}: {exc}")
            if limit and len(out) >= limit:
                break
    if not out:
        raise SystemExit(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival)
    t0 = out[0].arrival
    for r in out:
        r.arrival -= t0
    return out


def prompt_text(blocks: list[int]) -> str:
    """A prompt made of the blocks: each block id stands for BLOCK_TEXT characters of its own, so
    two prompts share a start exactly as far as their block ids do (only the first
    MAX_BLOCKS × BLOCK_CHARS characters are ever hashed: built that far)."""
    upto = -(-prefixes.MAX_BLOCKS * prefixes.BLOCK_CHARS // BLOCK_TEXT)
    return "".join((f"<{b}>" * BLOCK_TEXT)[:BLOCK_TEXT] for b in blocks[:upto])


def run(rule: str, reqs: list[Req], n_workers: int, perf: WorkerPerf, capacity: int, factor: float,
        table_blocks: int = 65536, block_tokens: int = BLOCK_TOKENS) -> dict:
    """One replay of `reqs` (their cache blocks of `block_tokens` tokens, `capacity` of them per
    worker, timed by `perf`) placed by `rule` (one of RULES or MODEL_RULES): its figures."""
    workers = {f"w{i}": _Worker(Heartbeat(worker_id=f"w{i}", deployment=DEPLOYMENT, model="m", engine="vllm"),
                                capacity) for i in range(n_workers)}
    router, table = LocalRouter(seed=0), prefixes.PrefixTable(table_blocks)
    outcomes: dict[str, int] = {}
    events: list[tuple[float, int, str, str, Req]] = []  # (time, seq, kind, worker, request)
    seq = 0
    ttft, computed, cached_tokens, total_tokens = [], 0, 0, 0

    def push(t: float, kind: str, wid: str, r: Req) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, wid, r))

    def start_prefill(now: float, w: _Worker) -> None:
        nonlocal computed, cached_tokens
        r = w.queue.popleft()
        hit = min(r.input_len - 1, w.cached_start(r.blocks) * block_tokens)
        computed += r.input_len - hit
        cached_tokens += hit
        w.busy = True
        push(now + perf.prefill_ms(r.input_len - hit) / 1e3, "prefilled", w.hb.worker_id, r)

    for r in reqs:
        push(r.arrival, "arrive", "", r)
    place, dispatcher = _placer(rule, reqs, workers, router, table, factor, perf, capacity * block_tokens)
    while events:
        now, _, kind, wid, r = heapq.heappop(events)
        if kind == "arrive":
            hb, outcome = place(r, now)
            if outcome:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            router.assign(r.rid, hb.worker_id)
            w = workers[hb.worker_id]
            w.live[r.rid] = (r, None, 0.0)
            w.placed += 1
            total_tokens += r.input_len
            w.queue.append(r)
            if not w.busy:
                start_prefill(now, w)
        elif kind == "prefilled":
            w = workers[wid]
            w.keep(r.blocks)
            ttft.append(now - r.arrival)
            w.decoding += 1
            step = perf.decode_ms(r.input_len + r.output_len / 2, w.decoding)
            w.live[r.rid] = (r, now, r.output_len * step / 1e3)
            push(now + r.output_len * step / 1e3, "done", wid, r)
            w.busy = False
            if w.queue:
                start_prefill(now, w)
        else:  # done
            workers[wid].decoding -= 1
            workers[wid].live.pop(r.rid)
            router.release(r.rid)
    arr = np.asarray(ttft)
    placed = [w.placed for w in workers.values()]
    return {"rule": rule, "requests": len(reqs), "cache_hit": cached_tokens / max(1, total_tokens),
            "prefill_mtok": computed / 1e6, "ttft_mean_s": float(arr.mean()), "ttft_p50_s": float(np.percentile(arr, 50)),
            "ttft_p99_s": float(np.percentile(arr, 99)), "spread": max(placed) / (sum(placed) / len(placed)),
            "outcomes": outcomes, **({"flagged": dispatcher.flagged} if dispatcher else {})}


def _placer(rule: str, reqs: list[Req], workers: dict[str, _Worker], router: LocalRouter,
            table: prefixes.PrefixTable, factor: float, perf: WorkerPerf, kv_tokens: int):
    """(place(request, now) -> (its worker's heartbeat, its prefix outcome or ""), the `_Dispatcher`
    of a model policy or None) for `rule`; a prefix rule records each placement in `table`."""
    by_prefix, policy = rule.startswith("prefix:"), rule.split(":")[-1]
    fits = [w.hb for w in workers.values()]
    dispatcher = None
    if policy in MODEL_POLICIES:
        draw = random.Random(0)
        predicted = {r.rid: max(1, round(r.output_len * draw.lognormvariate(0.0, PREDICTION_SIGMA))) for r in reqs}
        dispatcher = _Dispatcher(policy, perf, kv_tokens, predicted)

    def place(r: Req, now: float) -> tuple[Heartbeat, str]:
        if not by_prefix:
            return (dispatcher(r, now, workers, None)[0] if dispatcher else router.choose(policy, DEPLOYMENT, fits)), ""
        hashes = prefixes.blocks("", "", r.text or prompt_text(r.blocks))
        if dispatcher:
            hb, outcome = dispatcher(r, now, workers, prefixes.hint(router, table, hashes, fits, factor))
            outcome = outcome if hashes else "short"
        elif hashes:
            hb, outcome = prefixes.choose(router, table, hashes, policy, DEPLOYMENT, fits, factor)
        else:
            hb, outcome = router.choose(policy, DEPLOYMENT, fits), "short"
        table.record(hashes, hb.worker_id)
        return hb, outcome

    return place, dispatcher


class _Dispatcher:
    """The dispatcher's placement under a model policy (aladdin, caraserve): the pure policy over the
    workers' views (their requests: prompt, prediction, tokens so far), then, with the gateway's hint,
    `prefer.pick_among` over the preferred workers, kept where `prefer.follows` (the live rule). Outcome as the gateway counts it: "hit" (the hint followed), "spilled" (some worker held a start
    of the prompt, the policy placed elsewhere), "miss" (none did)."""

    def __init__(self, policy: str, perf: WorkerPerf, kv_tokens: int, predicted: dict[str, int]):
        self.policy, self.fn, self.perf, self.kv_tokens, self.predicted = \
            policy, get_policy(policy), perf, kv_tokens, predicted
        self.state, self.rng = PolicyState(), random.Random(0)
        self.flagged = 0  # placements the policy flagged (no worker met its SLO: it asks for one more)

    def view(self, w: _Worker, now: float) -> WorkerView:
        reqs = []
        for r, prefilled, decode_s in w.live.values():
            done = 0.0 if prefilled is None or decode_s <= 0 else min(1.0, (now - prefilled) / decode_s)
            reqs.append(RunningRequest(request_id=r.rid, input_tokens=r.input_len, predicted_tokens=self.predicted[r.rid],
                                       generated=int(done * (r.output_len - 1)), started=prefilled is not None,
                                       decode_ms=0.0 if prefilled is None else (now - prefilled) * 1e3))
        return WorkerView(worker_id=w.hb.worker_id, outstanding=len(reqs), running=w.decoding,
                          waiting=len(w.queue) + w.busy, kv_used=sum(q.input_tokens + q.generated for q in reqs),
                          kv_capacity=self.kv_tokens, requests=tuple(reqs), perf=self.perf)

    def __call__(self, r: Req, now: float, workers: dict[str, _Worker],
                 hint: tuple[list[str], bool] | None) -> tuple[Heartbeat, str]:
        views = {wid: self.view(w, now) for wid, w in workers.items()}
        req = RequestView(request_id=r.rid, input_tokens=r.input_len, predicted_tokens=self.predicted[r.rid])
        own = self.fn(list(views.values()), req, self.state, self.rng)
        choice = own.worker_id
        prefer, held = hint or ([], False)
        if prefer and choice not in prefer:
            pick = prefer_mod.pick_among(self.policy, [views[wid] for wid in prefer], req, self.state, self.rng)
            choice = pick.worker_id if prefer_mod.follows(own, pick) else choice
        self.flagged += own.scale_out
        outcome = "hit" if choice in prefer else "spilled" if held else "miss"
        return workers[choice].hb, outcome


def pooled_hit(reqs: list[Req], capacity: int, block_tokens: int = BLOCK_TOKENS) -> float:
    """Prompt tokens served from cache if every request saw one cache of `capacity` blocks (0 = no
    limit), least recently used out: what no placement over separate caches can beat by much."""
    pool = _Worker(Heartbeat(worker_id="pool", deployment=DEPLOYMENT, model="m", engine="vllm"),
                   capacity or 1 << 62)
    hit = total = 0
    for r in reqs:
        hit += min(r.input_len - 1, pool.cached_start(r.blocks) * block_tokens)
        total += r.input_len
        pool.keep(r.blocks)
    return hit / max(1, total)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=TRACE, help="JSONL with timestamp (ms), input_length, "
                   "output_length, hash_ids (default: Mooncake's FAST'25 synthetic trace)")
    p.add_argument("--conversations", choices=("hh_rlhf", "mt_bench"),
                   help="instead of --trace: real multi-turn text (bench/prefix_conversations.py)")
    p.add_argument("--conv-rate", type=float, default=2.0, help="conversations starting per second (--conversations)")
    p.add_argument("--profile", default=PROFILE, help="engine profile (name or path): prefill/decode times, KV capacity")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times faster (--trace)")
    p.add_argument("--limit", type=int, default=0, help="first N requests (--trace) or conversations only (0 = all)")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES + MODEL_RULES,
                   help="placement rules; the model policies' (aladdin, caraserve: the dispatcher places, "
                        "with the gateway's hint under prefix:) are not run by default")
    p.add_argument("--table-blocks", type=int, default=GatewaySettings().prefix_table_blocks,
                   help="the gateway's prefix_table_blocks")
    p.add_argument("--load-factor", type=float, default=1.25, help="the gateway's affinity_load_factor")
    p.add_argument("--json", type=Path, help="also write the figures here")


def main(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.rate_scale <= 0 or args.load_factor < 1 or args.conv_rate <= 0:
        raise SystemExit("need --workers >= 1, --rate-scale > 0, --conv-rate > 0 and --load-factor >= 1")
    if args.conversations:
        from polyserve.bench import prefix_conversations as conv

        reqs, block_tokens, source = conv.conversations(args.conversations, args.conv_rate, args.limit), \
            conv.BLOCK_TOKENS, f"{args.conversations} conversations at {args.conv_rate}/s"
    else:
        if not args.trace.exists():
            raise SystemExit(f"trace not found: {args.trace} (set --trace or POLYSERVE_DATASETS)")
        reqs, block_tokens, source = load_trace(args.trace, args.limit, args.rate_scale), BLOCK_TOKENS, args.trace.name
    print(machine.line(), flush=True)
    print(f"bench prefix (SIMULATED workers, the gateway's real placement code): {len(reqs)} requests of "
          f"{source} over {reqs[-1].arrival:.0f} s, {args.workers} workers, profile {args.profile}; "
          f"load bound {args.load_factor} x mean + {AFFINITY_SLACK}", flush=True)
    perf, raw = load_perf(profile_path(args.profile))
    per_worker = int(raw.get("kv_capacity_tokens", 500_000)) // block_tokens  # blocks of one worker's cache
    rows = []
    for rule in args.rules:
        rows.append(run(rule, reqs, args.workers, perf, per_worker, args.load_factor, args.table_blocks, block_tokens))
        print(f"  {rule}: done", flush=True)
    print(f"\n{'rule (SIMULATED)':<26}{'cache hit':>10}{'prefill Mtok':>13}{'TTFT mean s':>12}{'p50 s':>8}"
          f"{'p99 s':>9}{'max/mean placed':>16}  prefix outcomes")
    for r in rows:
        print(f"{r['rule']:<26}{r['cache_hit']:>10.1%}{r['prefill_mtok']:>13.1f}{r['ttft_mean_s']:>12.2f}"
              f"{r['ttft_p50_s']:>8.2f}{r['ttft_p99_s']:>9.2f}{r['spread']:>16.2f}  {r['outcomes'] or ''}"
              + (f" ({r['flagged']} flagged by the policy)" if "flagged" in r else ""))
    ceiling, pooled = pooled_hit(reqs, 0, block_tokens), pooled_hit(reqs, per_worker * args.workers, block_tokens)
    print(f"ceilings: one cache of every worker's blocks ({per_worker * args.workers:,} of {block_tokens} tokens) "
          f"seen by every request would serve {pooled:.1%} of prompt tokens, an unbounded one {ceiling:.1%}")
    if args.json:
        args.json.write_text(json.dumps({"simulated": True, "machine": machine.describe(), "rows": rows,
                                         "ceiling_hit": ceiling, "pooled_hit": pooled,
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    return 0
