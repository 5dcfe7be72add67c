"""The `sim` engine: a digital twin of a continuous-batching LLM engine.

It serves no model. Iteration-level batching follows vLLM's shape — a bounded
waiting queue, admission bounded by batch slots and a KV budget, and per
iteration one prefill of the newly admitted requests (which samples their first
token) and one decode step of everything already running (one token per
sequence) — and each iteration lasts what Aladdin's models (§3, see
`polyserve.core.queue_order`) say for a profile fitted from measurements
(`polyserve.core.profile_fit`), multiplied by `time_scale`.

Everything it produces is labelled simulated. Its tokenizer is a stand-in:
input tokens = ceil(1.3 × whitespace-separated words) (the usual words→tokens
ratio of BPE tokenizers on English); output tokens are pseudo-words drawn from a
small vocabulary with a seeded RNG, so the same seed gives the same text. The
`hf` engine uses a real tokenizer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from polyserve.core import perf as core_perf
from polyserve.core import profiles
from polyserve.core import queue_order as policy
from polyserve.core.profiles import profile_path
from polyserve.proto import AdapterInfo
from polyserve.worker.engine import (
    Delta,
    Engine,
    EngineError,
    EngineLoad,
    EngineOverloaded,
    EngineRequest,
    Finished,
    Withdrawn,
    free_adapter,
    kept_tokens,
    make_stats,
)
from polyserve.worker.engines import sim_json, sim_logprobs
from polyserve.worker.lora import AdapterError, AdapterRegistry, read_adapter

logger = logging.getLogger(__name__)

PROFILES_DIR = profiles.profiles_dir()
DEFAULT_PROFILE = profile_path(profiles.DEFAULT_SIM)
WORDS_TO_TOKENS = 1.3
VOCAB = (
    "the", "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "this",
    "by", "from", "we", "can", "model", "token", "request", "batch", "cache", "latency", "queue",
    "serve", "worker", "power", "length", "output", "input", "time", "system", "data", "will",
)


@dataclass(frozen=True)
class SimProfile:
    """What the sim needs from a profile file (see profile_fit for how one is made)."""

    perf: core_perf.PerfModel
    kv_capacity_tokens: int
    median_output_tokens: int = 129
    output_log_sigma: float = 0.86
    label: str = "inline"


def load_profile(path: str | Path = "") -> SimProfile:
    """Read a profile JSON written by `profile_fit` ("" = the shipped default)."""
    path = Path(path) if path else DEFAULT_PROFILE
    try:
        raw = json.loads(path.read_text())
        perf = core_perf.PerfModel(k1=raw["k1"], c1=raw["c1"], k2=raw["k2"], c2=raw["c2"], c3=raw["c3"],
                                h=raw.get("h", 1.0), j=raw.get("j", 0.0))
        return SimProfile(perf=perf, kv_capacity_tokens=int(raw["kv_capacity_tokens"]),
                          median_output_tokens=int(raw.get("median_output_tokens", 129)),
                          output_log_sigma=float(raw.get("output_log_sigma", 0.86)),
                          label=str(raw.get("name", path.stem)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"cannot read sim profile {path}: {type(exc).__name__}: {exc}", 500) from exc


def count_words_as_tokens(text: str) -> int:
    """The sim's token count: ceil(1.3 × whitespace-separated words)."""
    return math.ceil(len(text.split()) * WORDS_TO_TOKENS)


@dataclass(frozen=True)
class Iteration:
    """One simulated iteration, kept for tests and inspection."""

    kind: str  # "prefill" | "decode"
    size: int  # prefill: Σl_in; decode: batch size b
    l_avg: float  # decode: mean context length
    ms: float  # modelled duration (before time_scale)


@dataclass(eq=False)
class _Choice:
    index: int
    rng: random.Random
    limit: int  # min(max_tokens, natural length)
    reason_at_limit: str  # "length" when max_tokens cut it, else "stop"
    generated: int = 0
    text: str = ""
    sent: int = 0  # characters already emitted
    pending: int = 0  # tokens not yet reported in a Delta
    finish_reason: str | None = None
    seed: str = ""  # what `rng` was seeded with (the simulated logprobs derive from it)
    logprobs: list = field(default_factory=list)  # entries of the `pending` tokens (params.logprobs set)
    started: bool = False  # its first Delta went out
    script: list[str] | None = None  # structured outputs: the pieces of its schema-valid text (sim_json)


@dataclass(eq=False)
class _Req:
    req: EngineRequest
    input_tokens: int
    choices: list[_Choice]
    kv_demand: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # bounded by n·max_tokens + 1
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prefilled: bool = False
    done: bool = False
    stops: list[str] = field(default_factory=list)  # params.stop without empty strings (set once, not per token)
    hold: int = 0  # chars that may start a stop string: held back until they cannot
    paused: bool = False  # ssjf_refine: back in the queue, its KV still reserved (no prefill to resume)
    ran_from: int = 0  # tokens it had when last (re)admitted

    @property
    def arrival(self) -> float:
        return self.req.arrival

    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def seqs(self) -> int:
        return sum(1 for c in self.choices if c.finish_reason is None)


class SimEngine(Engine):
    """Continuous-batching simulator driven by Aladdin's performance models."""

    name = "sim"
    simulated = True
    resumable = True  # a migrated stream goes on from prompt + output (EngineRequest.continuation)

    def __init__(self, profile: SimProfile, *, model_name: str = "sim", max_waiting: int = 256,
                 max_batch: int = 64, kv_capacity_tokens: int = 0, time_scale: float = 1.0,
                 max_input_len: int = 4096, order: policy.OrderFn = policy.fcfs):
        self.profile = profile
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.max_batch = max_batch
        self.kv_capacity = kv_capacity_tokens or profile.kv_capacity_tokens
        self.time_scale = time_scale
        self.max_input_len = max_input_len
        self.order = order
        self.preemptor = policy.Preemptor() if order is policy.speculative_sjf_refine else None
        self._decode_steps = 0
        self.sim_time_ms = 0.0  # modelled compute time so far, independent of time_scale
        self.iterations: deque[Iteration] = deque(maxlen=4096)
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._requests: dict[str, _Req] = {}
        self._kv_used = 0
        self._adapters = AdapterRegistry()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings) -> "SimEngine":
        """Build from WorkerSettings (profile path, limits, time_scale, scheduling order)."""
        return cls(load_profile(settings.profile), model_name=settings.model,
                   max_waiting=settings.max_waiting, max_batch=settings.max_batch,
                   kv_capacity_tokens=settings.kv_capacity_tokens, time_scale=settings.time_scale,
                   max_input_len=settings.max_input_len,
                   order=policy.ORDERS[getattr(settings, "scheduling", "fcfs")])

    # ------------------------------------------------------------------ Engine API
    async def start(self) -> None:
        """Start the scheduling loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="sim-engine-loop")
            self._task.add_done_callback(self._on_loop_exit)
        logger.info("sim engine up: profile %s, kv capacity %d tokens, max batch %d, time_scale %g",
                    self.profile.label, self.kv_capacity, self.max_batch, self.time_scale)

    async def stop(self) -> None:
        """Stop the loop; every request still open ends with an EngineError."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all(EngineError("engine stopped", 503))

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta | Finished]:
        """Admit `req` now — raising EngineOverloaded/EngineError from this call — and
        return the iterator of its Deltas and final Finished."""
        r = self._admit(req)
        return self._stream(r)

    def cancel(self, request_id: str) -> bool:
        """End a request now: open choices finish "cancelled"; its slot and KV are freed."""
        r = self._requests.get(request_id)
        if r is None or r.done:
            return False
        for ch in r.choices:
            if ch.finish_reason is None:
                self._finish_choice(r, ch, "cancelled")
        self._finish(r)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Give back a waiting request (Aladdin Alg. 2 move); False once it has started."""
        r = self._requests.get(request_id)
        if r is None or r.done or r not in self._waiting or r.paused:
            return False
        self._drop(r)
        r.done = True
        r.events.put_nowait(Withdrawn(request_id))
        return True

    def load(self) -> EngineLoad:
        """Requests running and waiting, KV reserved and capacity (tokens), adapters."""
        return EngineLoad(running=len(self._running), waiting=len(self._waiting), kv_used=self._kv_used,
                          kv_capacity=self.kv_capacity, max_input_len=self.max_input_len,
                          adapters=self._adapters.infos())

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Register a PEFT adapter by name (its rank is read; no weights are used: simulated)."""
        try:
            return self._adapters.add(name, read_adapter(path))
        except AdapterError as exc:
            raise EngineError(str(exc), exc.status) from exc

    async def unload_adapter(self, name: str, force: bool = False) -> None:
        """Forget an adapter; 409 while requests use it unless `force` cancels them."""
        free_adapter(name, self._adapters, list(self._requests.values()), force, self.cancel)
        self._adapters.remove(name)

    def count_tokens(self, text: str) -> int:
        """ceil(1.3 × words): the sim's stand-in tokenizer."""
        return count_words_as_tokens(text)

    def model_card(self) -> dict:
        """Labelled simulated, naming the profile that drives the timings."""
        return {"simulated": True, "engine": self.name, "profile": self.profile.label,
                "model": self.model_name, "max_input_len": self.max_input_len}

    # ------------------------------------------------------------------ admission
    def _admit(self, req: EngineRequest) -> _Req:
        if self._task is None or self._task.done():
            raise EngineError("sim engine is not running", 503)
        p = req.params
        if req.request_id in self._requests:
            raise EngineError(f"request_id {req.request_id!r} is already in flight on this worker", 409)
        if p.max_tokens < 1 or p.n < 1 or p.min_tokens < 0 or p.min_tokens > p.max_tokens:
            raise EngineError("need max_tokens >= 1, n >= 1 and 0 <= min_tokens <= max_tokens", 400)
        if p.n > self.max_batch:
            raise EngineError(f"n={p.n} exceeds this worker's batch size {self.max_batch}", 400)
        if p.return_token_ids:
            raise EngineError("return_token_ids: the sim draws pseudo-words, it has no token ids", 400)
        if req.adapter and req.adapter not in self._adapters:
            raise EngineError(self._adapters.unknown_message(req.adapter), 404)
        l_in = kept_tokens(self.count_tokens(req.prompt), p.truncate_prompt_tokens, self.max_input_len)
        if l_in > self.max_input_len:
            raise EngineError(f"prompt has {l_in} tokens; this worker accepts at most "
                              f"max_input_len={self.max_input_len} input tokens", 400)
        l_out = min(req.predicted_tokens, p.max_tokens) if req.predicted_tokens > 0 else p.max_tokens
        demand = core_perf.kv_demand(self.profile.perf, l_in, l_out, p.n)
        if demand > self.kv_capacity:
            raise EngineError(f"request needs {demand} KV tokens (n × (input + output)); this worker "
                              f"holds {self.kv_capacity}: lower max_tokens or n", 400)
        if len(self._waiting) >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue is full ({self.max_waiting} requests); retry later")
        stops = [s for s in p.stop if s]
        r = _Req(req=req, input_tokens=l_in, choices=self._choices(req), kv_demand=demand, stops=stops,
                 hold=max((len(s) for s in stops), default=1) - 1)
        self._requests[req.request_id] = r
        self._waiting.append(r)
        self._wake.set()
        return r

    def _choices(self, req: EngineRequest) -> list[_Choice]:
        p = req.params
        if p.seed is not None:
            base = str(p.seed)
        elif p.temperature == 0:  # greedy: same prompt, same text
            base = f"greedy:{zlib.crc32(req.prompt.encode())}"
        else:
            base = f"id:{zlib.crc32(req.request_id.encode())}"
        choices = []
        for i in range(p.n):
            rng = random.Random(f"{base}:{i}")
            natural = max(1, p.min_tokens, round(self.profile.median_output_tokens
                                                 * math.exp(self.profile.output_log_sigma * rng.gauss(0, 1))))
            limit = min(p.max_tokens, natural)
            script = None
            if p.structured is not None:  # the whole schema-valid text, cut at max_tokens like any other
                try:
                    script = sim_json.pieces(sim_json.text(p.structured, rng))
                    # a thinking model constrained after its thinking: the sim's thinking is empty
                    script = ["".join(p.think)] + script if p.think else script
                except (sim_json.UnsupportedSchema, ValueError) as exc:
                    raise EngineError(f"structured output: {exc}", 400) from exc
                natural = len(script)
                limit = min(p.max_tokens, natural)
            choices.append(_Choice(index=i, rng=rng, limit=limit, seed=f"{base}:{i}", script=script,
                                   reason_at_limit="stop" if natural < p.max_tokens or (
                                       script is not None and natural == p.max_tokens) else "length"))
        return choices

    async def _stream(self, r: _Req) -> AsyncIterator[Delta | Finished]:
        try:
            while True:
                ev = await r.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if isinstance(ev, Finished):
                    return
        finally:
            if not r.done:  # the consumer went away: free the slot without telling anyone
                self._drop(r)
                r.done = True

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.preemptor is not None and self._decode_steps % self.preemptor.quantum == 0:
                self._pause_for_shorter()
            new = self._admit_waiting()
            if new:
                now = time.monotonic()
                for r in new:
                    r.start = now
                total = sum(r.input_tokens for r in new)
                await self._spend(Iteration("prefill", total, 0.0, core_perf.prefill_ms(self.profile.perf, total)))
                for r in new:
                    if not r.done:
                        r.prefilled = True
                        self._step(r)  # prefill samples the first token
            old = [r for r in self._running if r.prefilled and r not in new and not r.done]
            if old:
                ctx = [r.input_tokens + c.generated for r in old for c in r.choices if c.finish_reason is None]
                l_avg = sum(ctx) / len(ctx)
                await self._spend(Iteration("decode", len(ctx), l_avg,
                                            core_perf.decode_ms(self.profile.perf, l_avg, len(ctx))))
                self._decode_steps += 1
                for r in old:
                    if not r.done:
                        self._step(r)
            if not new and not old:  # nothing admissible and nothing running: wait for a change
                self._wake.clear()
                await self._wake.wait()

    def _admit_waiting(self) -> list[_Req]:
        if not self._waiting:  # the common case mid-batch: skip ordering and the seq count
            return []
        ordered = self.order(self._waiting)
        running_seqs = sum(r.seqs for r in self._running)
        held = [policy.Held(r.seqs, 0) if r.paused else r for r in ordered]  # a paused request's KV is reserved
        k = policy.admit_count(held, running_seqs, self._kv_used, self.max_batch, self.kv_capacity)
        new = ordered[:k]
        for r in new:
            self._waiting.remove(r)
            self._running.append(r)
            self._kv_used += 0 if r.paused else r.kv_demand
            r.ran_from = len(r.token_times)
        resumed = {id(r) for r in new if r.paused}
        for r in new:
            r.paused = False
        return [r for r in new if id(r) not in resumed]  # resumed ones decode on, no prefill

    def _pause_for_shorter(self) -> None:
        """ssjf_refine, with a full batch: pause the running requests whose key now (remaining
        length given what they generated, `queue_order.refined_ssjf_key`) sorts behind the best
        waiting keys (`queue_order.Preemptor`); they keep their KV and resume where they were."""
        if not self._waiting or sum(r.seqs for r in self._running) < self.max_batch:
            return
        running = [(r, max(c.generated for c in r.choices), len(r.token_times) - r.ran_from)
                   for r in self._running if r.prefilled and not r.done]
        for r in policy.refine_pauses(self.preemptor, running, self.order(self._waiting)):
            self._running.remove(r)
            self._waiting.append(r)
            r.paused = True

    async def _spend(self, it: Iteration) -> None:
        self.sim_time_ms += it.ms
        self.iterations.append(it)
        delay = it.ms / 1000.0 * self.time_scale
        await asyncio.sleep(delay if delay > 0 else 0)

    def _step(self, r: _Req) -> None:
        """One token for each open choice of `r`."""
        r.token_times.append(time.monotonic())
        stops, hold = r.stops, r.hold
        for ch in r.choices:
            if ch.finish_reason is not None:
                continue
            if ch.script is not None:
                piece = ch.script[ch.generated]
            else:
                word = ch.rng.choice(VOCAB)
                piece = word if ch.generated == 0 and not r.req.continuation else " " + word
            search_from = max(0, len(ch.text) - hold)
            ch.text += piece
            ch.generated += 1
            ch.pending += 1
            if r.req.params.logprobs is not None:
                ch.logprobs.append(sim_logprobs.generated(ch.seed, ch.generated, piece, r.req.params.logprobs, VOCAB))
            pos, end = policy.stop_span(ch.text, stops, search_from) \
                if stops and ch.generated >= r.req.params.min_tokens else (-1, -1)
            if pos >= 0:  # what follows the stop string is not emitted, nor the string unless asked
                ch.text = ch.text[:end if r.req.params.include_stop else pos]
                self._finish_choice(r, ch, "stop")
            elif ch.generated >= ch.limit:
                self._finish_choice(r, ch, ch.reason_at_limit)
            else:
                safe = len(ch.text) - hold
                if safe > ch.sent:
                    r.events.put_nowait(self._delta(r, ch, ch.text[ch.sent:safe]))
                    ch.sent = safe
        if all(c.finish_reason is not None for c in r.choices):
            self._finish(r)

    def _finish_choice(self, r: _Req, ch: _Choice, reason: str) -> None:
        ch.finish_reason = reason
        r.events.put_nowait(self._delta(r, ch, ch.text[ch.sent:], reason))
        ch.sent = len(ch.text)

    @staticmethod
    def _delta(r: _Req, ch: _Choice, text: str, reason: str | None = None) -> Delta:
        """The Delta of `ch`'s pending tokens (their simulated logprobs; the prompt's on the first)."""
        k = r.req.params.prompt_logprobs
        delta = Delta(ch.index, text, ch.pending, reason, logprobs=ch.logprobs or None,
                      prompt_logprobs=sim_logprobs.prompt(r.req.prompt, k, VOCAB)
                      if k is not None and not ch.started else None)
        ch.pending, ch.logprobs, ch.started = 0, [], True
        return delta

    def _finish(self, r: _Req) -> None:
        self._drop(r)
        r.done = True
        out = sum(c.generated for c in r.choices)
        stats = make_stats(r.input_tokens, out, r.req.arrival, r.start or time.monotonic(), r.token_times)
        if not any(c.finish_reason == "cancelled" for c in r.choices):  # a cancel's time is not a JCT
            policy.DEFAULT_RULE.observe(time.monotonic() - r.req.arrival)  # ssjf's window W and guards
            if self.preemptor is not None:  # ssjf_refine learns its window and lengths from completions
                policy.REFINE_RULE.observe(time.monotonic() - r.req.arrival)
                policy.REFINE_RULE.estimator.observe(r.req.length_class, max(c.generated for c in r.choices),
                                                     policy.client_of(r.req))
        if len(r.choices) > 1 and len(r.token_times) > 1:  # n sequences advance together: per-step ATGT
            stats = msgspec.structs.replace(stats, atgt_ms=stats.decode_ms / (len(r.token_times) - 1))
        r.events.put_nowait(Finished(stats))

    def _drop(self, r: _Req) -> None:
        if r in self._running:
            self._running.remove(r)
            self._kv_used -= r.kv_demand
        elif r in self._waiting:
            self._waiting.remove(r)
            self._kv_used -= r.kv_demand if r.paused else 0
        self._requests.pop(r.req.request_id, None)
        self._wake.set()  # freed capacity may admit a waiting request

    def _fail_all(self, exc: EngineError) -> None:
        for r in list(self._requests.values()):
            self._drop(r)
            r.done = True
            r.events.put_nowait(exc)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("sim engine loop failed: %r", task.exception())
            self._fail_all(EngineError(f"sim engine loop failed: {task.exception()}", 500))

    def open_requests(self) -> Sequence[str]:
        """Ids of requests waiting or running (for tests and drain)."""
        return list(self._requests)
