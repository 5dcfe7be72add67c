"""The profiling grid, run against the `Engine` interface (hf, sim, or any other engine).

What is measured, and how (no hooks inside the engine; everything is seen by a
client of `Engine.generate`, so the figures include the engine loop's own
scheduling overhead — asyncio hand-offs, `to_thread` — as a real caller sees it):

* prefill: `n` prompts of `l` tokens each, submitted together with
  `max_tokens=1`; the wall time from submission until the last one finishes is
  the prefill of Σl_in = n·l tokens (a request that stops at its first token
  never enters a decode step).
* decode: `b` prompts of `l` tokens with `min_tokens = max_tokens = T`
  (greedy), submitted together; each request's Deltas arrive once per engine
  iteration. Only the steady window — after the last request's first token and
  before the first request's last token, when all `b` rows are decoding — is
  used: the median gap between consecutive Deltas there is one decode step of
  batch `b` at mean context l_avg = l + T/2.
* KV: in that window `engine.load().kv_used` (what the engine reserves, in
  tokens) is recorded against Σ(l_in + l_out) of the batch.
* LoRA rank mixes: random PEFT adapters of the given ranks are created
  (`create_random_adapter`) and loaded (`Engine.load_adapter`; skipped, with a
  note, on an engine that serves no adapters), then decode steps are measured as above with requests spread over the adapters
  by a mix. This runs last: loading adapters wraps the hf engine's model in
  PEFT, which changes its base-model timings too ("base" mixes record that).

Prompt lengths are hit with the engine's own tokenizer (`count_tokens`), and the
token counts recorded are the real ones, not the targets.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from polyserve.proto import SamplingParams
from polyserve.worker.engine import Delta, Engine, EngineError, EngineRequest, Finished

Progress = Callable[[str], None]

WORDS = ("time", "model", "data", "world", "people", "system", "water", "light", "house", "music", "story",
         "paper", "night", "river", "city", "money", "power", "field", "table", "window", "market", "number",
         "voice", "state", "game", "place", "group", "point", "school", "company", "order", "value", "green",
         "small", "large", "early", "simple", "clear", "happy", "strong", "open", "short", "long", "fast")


@dataclass(frozen=True)
class GridSpec:
    """The points to measure. The default takes about a minute for the small CPU model on 2 cores."""

    prefill_lengths: tuple[int, ...] = (32, 128, 512, 1024)
    prefill_counts: tuple[int, ...] = (1, 2, 4)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 256, 768, 1536)
    decode_steps: int = 16
    lora_ranks: tuple[int, ...] = (4, 8, 16, 32)  # () = no LoRA grid
    lora_batches: tuple[int, ...] = (2, 4, 8, 16)
    lora_context: int = 128
    repeats: int = 3  # each point's figure is the fastest of its repeats
    warmup: int = 2
    seed: int = 0

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def max_batch(self) -> int:
        return max((*self.prefill_counts, *self.decode_batches, *self.lora_batches, 1))

    @property
    def max_input(self) -> int:
        return max((*self.prefill_lengths, *self.decode_contexts, self.lora_context))


def rank_mixes(ranks: Sequence[int], b: int) -> dict[str, list[int]]:
    """Adapter ranks for the `b` requests of each mix (0 = base model): uniform, skewed, round-robin."""
    ranks = sorted(ranks)
    lo, hi = ranks[0], ranks[-1]
    mixes = {f"uniform-r{r}": [r] * b for r in ranks}
    mixes[f"one-r{hi}-rest-r{lo}"] = [hi] + [lo] * (b - 1)
    mixes["round-robin"] = [ranks[i % len(ranks)] for i in range(b)]
    if len(ranks) >= 3:
        mid = ranks[len(ranks) // 2]
        mixes[f"half-r{mid}-half-r{lo}"] = [mid if i % 2 else lo for i in range(b)]
    mixes["base"] = [0] * b  # reference: no adapter, measured with adapters loaded; not fitted
    return mixes


class PromptMaker:
    """Prompts of a target token count under the engine's tokenizer (seeded, all different)."""

    def __init__(self, count_tokens: Callable[[str], int], seed: int = 0):
        self.count = count_tokens
        self.rng = random.Random(seed)

    def make(self, target: int) -> tuple[str, int]:
        """(prompt, its real token count): the longest prefix of random words with <= target tokens."""
        words = [self.rng.choice(WORDS) for _ in range(max(2, target + 8))]
        lo, hi = 1, len(words)  # largest n with count(words[:n]) <= target (count grows with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(" ".join(words[:mid])) <= target:
                lo = mid
            else:
                hi = mid - 1
        prompt = " ".join(words[:lo])
        return prompt, self.count(prompt)


@dataclass
class Measurements:
    """Raw points of one grid run (times in ms of wall clock, as seen through the Engine interface)."""

    prefill: list[dict] = field(default_factory=list)  # n_prompts, l_in_total, ms, ms_all
    decode: list[dict] = field(default_factory=list)  # b, l_avg, ms, ms_all, steps
    lora: list[dict] = field(default_factory=list)  # mix, ranks, b, max_rank, sum_rank, l_avg, ms, ms_all
    kv: list[dict] = field(default_factory=list)  # seqs, tokens (Σ l_in + l_out), kv_used
    adapters: dict[str, int] = field(default_factory=dict)  # name -> rank
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class GridRunner:
    """Runs a GridSpec through a started engine and returns Measurements."""

    def __init__(self, engine: Engine, spec: GridSpec, progress: Progress | None = None,
                 adapter_base: str | None = "random", adapter_dir: str | Path | None = None):
        self.engine = engine
        self.spec = spec
        self.say = progress or (lambda _line: None)
        self.adapter_base = adapter_base
        self.adapter_dir = adapter_dir
        self.prompts = PromptMaker(engine.count_tokens, spec.seed)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ driving the engine
    def _request(self, prompt: str, max_tokens: int, adapter: str | None = None) -> EngineRequest:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
        return EngineRequest(f"profile-{next(self._ids)}", prompt, params, adapter=adapter)

    async def _consume(self, req: EngineRequest, on_first: Callable[[], None] | None = None) -> list[float]:
        """Arrival times (perf_counter) of the request's token-carrying Deltas."""
        times: list[float] = []
        async for ev in self.engine.generate(req):
            if isinstance(ev, Delta) and ev.tokens > 0:
                times.append(time.perf_counter())
                if len(times) == 1 and on_first is not None:
                    on_first()
            elif isinstance(ev, Finished):
                break
        return times

    async def measure_prefill(self, n: int, length: int) -> dict:
        made = [self.prompts.make(length) for _ in range(n)]
        reqs = [self._request(p, 1) for p, _ in made]
        t0 = time.perf_counter()
        await asyncio.gather(*(self._consume(r) for r in reqs))
        ms = (time.perf_counter() - t0) * 1e3
        return {"n_prompts": n, "l_in": length, "l_in_total": sum(c for _, c in made), "ms": ms}

    async def measure_decode(self, ranks: Sequence[int], length: int, names: dict[int, str | None]) -> dict | None:
        """One decode measurement of len(ranks) requests (rank 0 = base); None if no steady window."""
        b, steps = len(ranks), self.spec.decode_steps
        made = [self.prompts.make(length) for _ in range(b)]
        reqs = [self._request(p, steps, names.get(r)) for (p, _), r in zip(made, ranks)]
        firsts = 0
        kv: dict = {}

        def on_first():
            nonlocal firsts
            firsts += 1
            if firsts == b:  # every row admitted: what the engine reserves now is the whole batch's KV
                load = self.engine.load()
                kv.update(running=load.running, kv_used=load.kv_used)

        times = await asyncio.gather(*(self._consume(r, on_first) for r in reqs))
        start, end = max(t[0] for t in times), min(t[-1] for t in times)
        gaps = [y - x for t in times for x, y in itertools.pairwise(t) if x >= start and y <= end]
        if not gaps:
            return None
        l_in = statistics.fmean(c for _, c in made)
        point = {"b": b, "l_in": l_in, "l_avg": l_in + steps / 2, "ms": statistics.median(gaps) * 1e3,
                 "steps": len(gaps) // b}
        if kv:
            point["kv"] = {"seqs": b, "tokens": sum(c + steps for _, c in made), **kv}
        return point

    # ------------------------------------------------------------------ the grid
    async def _passes(self, points: list[tuple[str, Callable, tuple]]) -> dict[str, dict | None]:
        """Measure every (label, fn, args) `repeats` times in interleaved passes over the whole list, so a
        burst of load from other processes hits one repeat of many points rather than every repeat of
        one; keep each point's fastest run (interference on a shared host only adds time)."""
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in points}
        for rep in range(self.spec.repeats):
            for i, (label, fn, args) in enumerate(points):
                point = await fn(*args)
                if point is not None:
                    runs[label].append(point)
                ms = f"{point['ms']:.2f} ms" if point is not None else "no steady window"
                self.say(f"[pass {rep + 1}/{self.spec.repeats}] [{i + 1:3d}/{len(points)}] {label}: {ms}")
        best: dict[str, dict | None] = {}
        for label, got in runs.items():
            best[label] = None
            if got:
                best[label] = {**min(got, key=lambda r: r["ms"]), "ms_all": [round(r["ms"], 4) for r in got]}
        return best

    async def run(self) -> Measurements:
        """Warm up, then the prefill and decode grid, then the LoRA grid (last: loading adapters changes the model)."""
        s, m = self.spec, Measurements()
        t_start = time.perf_counter()
        self.say(f"warm-up ({s.warmup} requests)")
        for _ in range(s.warmup):
            await self.measure_decode([0, 0], min(64, s.max_input), {})
        pre = [(f"prefill n={n} l_in={length}", self.measure_prefill, (n, length))
               for length, n in itertools.product(s.prefill_lengths, s.prefill_counts)]
        dec = [(f"decode b={b} l_in={length}", self.measure_decode, ([0] * b, length, {}))
               for length, b in itertools.product(s.decode_contexts, s.decode_batches)]
        best = await self._passes(pre + dec)
        for label, _, _ in pre:
            m.prefill.append(best[label])
        for label, _, _ in dec:
            p = best[label]
            if p is None:
                m.notes.append(f"{label}: no steady window (raise decode_steps)")
                continue
            if "kv" in p:
                m.kv.append(p.pop("kv"))
            m.decode.append(p)
        names = await self._load_adapters(m) if s.lora_ranks else None
        if names is not None:
            mixes = [(f"lora {mix} b={b}", ranks) for b in s.lora_batches
                     for mix, ranks in rank_mixes(s.lora_ranks, b).items()]
            best = await self._passes([(label, self.measure_decode, (ranks, s.lora_context, names))
                                       for label, ranks in mixes])
            for label, ranks in mixes:
                p = best[label]
                if p is None:
                    m.notes.append(f"{label}: no steady window (raise decode_steps)")
                    continue
                p.pop("kv", None)
                p.update(mix=label.split()[1], ranks=list(ranks), max_rank=max(ranks), sum_rank=sum(ranks))
                m.lora.append(p)
        m.elapsed_s = time.perf_counter() - t_start
        return m

    async def _load_adapters(self, m: Measurements) -> dict[int, str | None] | None:
        """rank -> adapter name (0 -> None), after creating and loading random adapters; None if impossible."""
        names: dict[int, str | None] = {0: None}
        tmp = Path(self.adapter_dir) if self.adapter_dir else Path(tempfile.mkdtemp(prefix="polyserve-profile-"))
        try:
            from polyserve.worker.lora import create_random_adapter
            for r in sorted(set(self.spec.lora_ranks)):
                name = f"profile-r{r}"
                path = await asyncio.to_thread(create_random_adapter, self.adapter_base or "random", r, tmp / name,
                                               seed=r)
                await self.engine.load_adapter(name, str(path))
                names[r] = name
                m.adapters[name] = r
                self.say(f"loaded random adapter {name} (rank {r})")
        except (ImportError, EngineError) as exc:  # an engine without LoRA (501) or no torch/peft here
            m.notes.append(f"LoRA grid skipped: {exc}")
            self.say(f"LoRA grid skipped: {exc}")
            return None
        return names
