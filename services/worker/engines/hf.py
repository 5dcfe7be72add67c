"""The `hf` engine: transformers + PEFT, continuous batching, multi-LoRA, on CPU or CUDA.

Scheduling (this module) runs on the event loop; every model call runs in a worker
thread (`asyncio.to_thread`) under one lock, so the loop stays responsive while a
step computes and adapter loads never interleave with a step. One iteration of the
loop: admit waiting requests in queue order while batch rows and the KV budget allow
(each is prefilled alone and joins the batch), then one batched decode step for
every running row (see `hf_batch` for the KV layouts and why it is our own loop; setting
`kv_layout`: auto = ragged on CPU, padded on CUDA).

Admission (`generate`'s first `__anext__`): a full waiting queue is EngineOverloaded
(429); an input over `max_input_len`, or a request whose KV reservation could never
fit, is a 400; an unknown adapter is a 404 naming the loaded ones.

Scheduling `ssjf` and `ssjf_refine` (an order made afresh at each admission, the overtake
bound's overdue requests first; ssjf_refine's pauses with the KV kept): `hf_refine.Refine`.

LoRA adapters (tiers, background copies, CPU-assisted cold start, prefetch) are managed
by `hf_lora.AdapterManager`; the loop calls it between steps under the engine lock.

Withdraw (Aladdin Alg. 2 moves): a request still in the waiting queue can be given back
(`withdraw`); its stream ends with `Withdrawn` and the worker asks the gateway to send it
elsewhere. Once prefilled (a paused one included) it runs here to the end.

KV accounting: a running request reserves `n * (input + max_tokens)` tokens of the
`kv_capacity_tokens` budget from admission until it ends, paused or not (a paused request
keeps its KV, and its adapter pinned); `load().kv_used` reports those reservations, so
capacity - used is exactly what the next admission may take.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

from polyserve.core import queue_order
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
    check_request,
    free_adapter,
    make_stats,
    relay,
    templated_chat,
    truncated,
)
from polyserve.worker.engines import hf_grammar
from polyserve.worker.engines.hf_batch import LAYOUTS, Batch, Paused, Row
from polyserve.worker.engines.hf_lora import COLD_START, AdapterManager  # noqa: F401 (COLD_START re-exported)
from polyserve.worker.engines.hf_refine import Refine
from polyserve.worker.lora_cache import HOST

logger = logging.getLogger(__name__)

OrderKey = Callable[[EngineRequest], Any]
# Queue orders as sort keys (fcfs, priority, ssjf, ssjf_class): the same code the sim engine and the
# simulator use. ssjf and ssjf_refine are not static keys (overdue requests are promoted, paused ones
# re-keyed): the engine orders its queue with `queue_order.ORDERS[...]` (DYNAMIC), ssjf_refine also
# pauses with a `Preemptor`.
ORDERS: dict[str, OrderKey] = {k: v for k, v in queue_order.ORDER_KEYS.items() if k != "sjf_oracle"}
REFINE = "ssjf_refine"
DYNAMIC = ("ssjf", REFINE)


class _Active:
    """One admitted request: its rows, its event queue, its timings."""

    def __init__(self, req: EngineRequest, ids: list[int], seq: int, reserve: int):
        self.req = req
        self.ids = ids
        self.seq = seq
        self.reserve = reserve
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rows: list[Row] = []
        self.ended: set[int] = set()  # choices whose last Delta went out (loop side, not the rows' own state)
        self.start: float | None = None
        self.step_times: list[float] = []
        self.out_tokens = 0
        self.cancelled = False
        self.done = False
        self.paused: Paused | None = None  # ssjf_refine: back in the queue, its rows and KV set aside
        self.ran_from = 0  # decode steps it had when last (re)admitted (the Preemptor's quantum)

    # what `queue_order`'s ssjf and ssjf_refine read of a queued request (the rest they find on `req`)
    arrival = property(lambda self: self.req.arrival)
    priority = property(lambda self: self.req.priority)
    input_tokens = property(lambda self: len(self.ids))  # ssjf's prompt term (a prefill's cost)

    @property
    def generated(self) -> int:
        """Tokens the longest choice has produced so far."""
        return max((r.n_out for r in self.rows), default=0)


class HfEngine(Refine, Engine):
    """Serves a Hugging Face causal LM (or the small random Llama) with PEFT adapters."""

    name = "hf"
    simulated = False
    resumable = True  # request migration: the prompt + the output so far are tokenized and prefilled afresh

    def __init__(self, settings: Any, order: OrderKey | None = None):
        self.model_path = getattr(settings, "model_path", "") or ""
        self.model_name = getattr(settings, "model", "") or (Path(self.model_path).name if self.model_path
                                                             else "random-llama")
        self.device = getattr(settings, "device", "cpu") or "cpu"
        self.dtype = getattr(settings, "dtype", "float32") or "float32"
        self.max_waiting = int(getattr(settings, "max_waiting", 64))
        self.max_batch = int(getattr(settings, "max_batch", 16))
        self.kv_capacity = int(getattr(settings, "kv_capacity_tokens", 0) or 0)  # 0 = sized at start
        self.max_input_len = int(getattr(settings, "max_input_len", 2048))
        self.queue_timeout_s = float(getattr(settings, "queue_timeout_s", 120.0))
        self.prefill_tokens_per_step = int(getattr(settings, "prefill_tokens_per_step", 4096))
        self.seed = int(getattr(settings, "seed", 0) or 0)
        arch = getattr(settings, "random_arch", None) or None  # dict or JSON: a bigger random model
        self.random_arch = json.loads(arch) if isinstance(arch, str) else arch
        scheduling = getattr(settings, "scheduling", "fcfs") or "fcfs"
        if order is None and scheduling not in (*ORDERS, REFINE):
            raise EngineError(f"scheduling {scheduling!r} is unknown; choose one of {', '.join((*ORDERS, REFINE))}",
                              400)
        self.order: OrderKey = order or ORDERS.get(scheduling, ORDERS["fcfs"])  # ssjf, ssjf_refine: unused
        # ssjf, ssjf_refine: the queue is ordered by this afresh at each admission (see _ordered)
        self.dynamic_order = queue_order.ORDERS[scheduling] if order is None and scheduling in DYNAMIC else None
        # ssjf_refine: also pauses running requests for shorter ones
        self.preemptor = queue_order.Preemptor() if order is None and scheduling == REFINE else None
        self._decode_steps = 0
        self.kv_layout = getattr(settings, "kv_layout", "auto") or "auto"
        if self.kv_layout not in ("auto", *LAYOUTS):
            raise EngineError(f"kv_layout {self.kv_layout!r} is unknown; choose auto, {', '.join(LAYOUTS)}", 400)
        self._bundle = None
        self._batch: Batch | None = None
        self._grammars: hf_grammar.Grammars | None = None
        self._vocab = 0  # the model's vocabulary size (logit_bias ids are checked against it)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.loras = AdapterManager(settings, self._lock, self._wake, self._fail_waiting_for)
        self.adapters = self.loras.registry
        self._task: asyncio.Task | None = None
        self._waiting: list[_Active] = []
        self._running: dict[str, _Active] = {}
        self._known: dict[str, _Active] = {}
        self._kv_reserved = 0
        self._seq = itertools.count()
        self._stopping = False

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        from polyserve.worker.engines.hf_model import auto_kv_capacity, load_bundle
        self._bundle = await asyncio.to_thread(load_bundle, self.model_name, self.model_path, self.device,
                                               self.dtype, self.seed, self.random_arch)
        self.model_name = self._bundle.name
        if self.kv_capacity <= 0:
            self.kv_capacity = auto_kv_capacity(self._bundle)
        self.max_input_len = min(self.max_input_len, self._bundle.max_positions - 1)
        layout = self.kv_layout
        if layout == "auto":  # per-row attention is a loop of small kernels: cheap on a CPU, not on a GPU
            layout = "ragged" if self._bundle.device.type == "cpu" else "padded"
        self._batch = Batch(self._bundle.model, self._bundle.device, self._bundle.suppress_ids, layout)
        b = self._bundle
        vocab = max(len(b.tokenizer), int(getattr(b.model.config, "vocab_size", 0) or 0))
        self._grammars = hf_grammar.Grammars(b.tokenizer, b.eos_ids, vocab)
        self._vocab = vocab
        if hf_grammar.available():  # the grammar tokenizer once, off the loop (structured outputs)
            await asyncio.to_thread(lambda: self._grammars.lltokenizer)
        self.loras.start(self._batch, self.model_name)
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name=f"hf-engine-{self.model_name}")
        logger.info("hf engine serving %s (%s) on %s, %s KV layout", self.model_name, self._bundle.source,
                    self._bundle.device, self._batch.layout)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for act in list(self._known.values()):
            self._fail(act, EngineError("the worker's engine is stopping", 503))
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None
        if self._batch is not None:
            self._batch.clear()
        self.loras.stop()

    def set_order(self, order: OrderKey) -> None:
        """Change the waiting queue's order (e.g. shortest-predicted-first with aging); a static key
        replaces ssjf / ssjf_refine and its pauses (requests paused now still resume)."""
        self.order = order
        self.dynamic_order = None
        self.preemptor = None

    # ----------------------------------------------------------------- requests
    async def generate(self, req: EngineRequest) -> AsyncIterator[Delta | Finished]:
        act = self._admit(req)  # raises before any token
        async with contextlib.aclosing(relay(act.queue, req.request_id, lambda: act.done, self.cancel)) as events:
            async for event in events:
                yield event

    def _admit(self, req: EngineRequest) -> _Active:
        if self._bundle is None or self._stopping:
            raise EngineError("the hf engine is not running", 503)
        p = req.params
        check_request(req, max_batch=self.max_batch, adapters=self.adapters, known=self._known)
        ids = truncated(self._bundle.encode(req.prompt), p.truncate_prompt_tokens, self.max_input_len)
        if not ids:
            raise EngineError("the prompt encodes to no tokens", 400)
        if len(ids) > self.max_input_len:
            raise EngineError(f"input is {len(ids)} tokens, over this worker's max_input_len of "
                              f"{self.max_input_len}", 400)
        reserve = p.n * (len(ids) + p.max_tokens)
        if reserve > self.kv_capacity:
            raise EngineError(f"request needs {reserve} KV tokens (n x (input + max_tokens)), over this worker's "
                              f"kv_capacity_tokens of {self.kv_capacity}", 400)
        if len(self._waiting) >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue full ({self.max_waiting} requests); retry later")
        if p.structured is not None:
            self._grammars.check(p.structured)  # a bad schema or grammar is a 400 before any token
        for field, named in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids),
                             ("allowed_token_ids", p.allowed_token_ids)):
            if named and max(named) >= self._vocab:
                raise EngineError(f"{field} names token id {max(named)}; this model's vocabulary has "
                                  f"{self._vocab} tokens (ids 0 to {self._vocab - 1})", 400)
        act = _Active(req, ids, next(self._seq), reserve)
        if req.adapter:
            self.loras.observe(req.adapter)
        self._waiting.append(act)
        self._known[req.request_id] = act
        self._wake.set()
        return act

    def cancel(self, request_id: str) -> bool:
        act = self._known.get(request_id)
        if act is None or act.done:
            return False
        act.cancelled = True  # the batch drops its rows before the next step
        for index in sorted(set(range(act.req.params.n)) - act.ended):
            act.queue.put_nowait(Delta(index=index, text="", tokens=0, finish_reason="cancelled"))
        self._finish(act)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Give back a request still in the waiting queue (Aladdin Alg. 2 move): its stream ends with
        `Withdrawn` and no output. False once it is prefilled (running or paused), over, or unknown."""
        act = self._known.get(request_id)
        if act is None or act.done or act not in self._waiting or act.paused is not None:
            return False
        self._release(act)
        act.queue.put_nowait(Withdrawn(request_id))
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), waiting=len(self._waiting), kv_used=self._kv_reserved,
                          kv_capacity=self.kv_capacity, max_input_len=self.max_input_len,
                          adapters=self.loras.infos())

    @property
    def max_adapters(self) -> int:
        """Adapters the device holds at once (heartbeat `max_adapters`)."""
        return self.cache.policy.device_slots

    def adapter_tier(self, name: str) -> str:
        """Heartbeat tier of a loaded adapter: "gpu" (on the device), "loading", "host" or "disk"."""
        return self.loras.tier(name)

    def count_tokens(self, text: str) -> int:
        if self._bundle is None:
            raise EngineError("the hf engine is not started", 503)
        return len(self._bundle.encode(text))

    def model_card(self) -> dict:
        card = {"engine": self.name, "simulated": False, "model": self.model_name,
                "max_input_len": self.max_input_len, "kv_capacity_tokens": self.kv_capacity}
        if self._bundle is not None:
            card.update(self._bundle.card())
        if self._batch is not None:  # the layout in use (a model whose attention cannot be ragged runs padded)
            card["kv_layout"] = self._batch.layout
        return card

    def format_chat(self, messages: list[dict]) -> str:
        """Chat messages as one prompt, with the model's chat template when it has one."""
        from polyserve.worker.engines.hf_model import format_chat
        return format_chat(self._bundle.tokenizer, messages)

    def chat_prompt(self, messages: list[dict], end: str = "open", tools: list[dict] | None = None,
                    extra: dict | None = None) -> str | None:
        """The checkpoint's chat template applied to `messages` (None: it has none, or no model yet)."""
        b = self._bundle
        if b is None or not getattr(b.tokenizer, "chat_template", None):
            return None  # (before the BOS probe: most chats on the random model have no template)
        return templated_chat(b.tokenizer, messages, adds_bos=b.bos_id is not None and b.encode("")[:1] == [b.bos_id],
                              end=end, tools=tools, extra=extra)

    # ----------------------------------------------------------------- adapters (see hf_lora)
    async def load_adapter(self, name: str, path: str, wait: bool = False) -> AdapterInfo:
        """Register a PEFT LoRA adapter at runtime (`AdapterManager.load`)."""
        return await self.loras.load(name, path, wait)

    def note_demand(self, name: str, now: float | None = None) -> None:
        """Demand for adapter `name` seen elsewhere: counts towards prefetch (`AdapterManager.note_demand`)."""
        self.loras.note_demand(name, now)

    async def ensure_on_device(self, name: str, timeout: float = 120.0) -> None:
        """Promote adapter `name` to the device (evicting the coldest unpinned one if needed); wait for it."""
        await self.loras.ensure_on_device(name, timeout)

    async def demote_adapter(self, name: str, to: str = HOST) -> None:
        """Evict adapter `name` from the device (to "host") or down to "disk"; 409 while requests use it."""
        await self.loras.demote(name, to)

    async def unload_adapter(self, name: str, force: bool = False) -> None:
        """Remove an adapter; refused (409) while requests use it, unless `force` cancels them."""
        free_adapter(name, self.adapters, list(self._known.values()), force, self.cancel)
        await self.loras.forget(name)
        logger.info("unloaded adapter %s", name)

    def _fail_waiting_for(self, name: str, exc: EngineError) -> None:
        """Adapter `name` could not reach the device: fail the requests waiting for it."""
        for act in [a for a in self._waiting if a.req.adapter == name and a.paused is None]:  # paused: pinned
            self._fail(act, exc)

    # the adapter state under its former engine attributes (bench_lora, tests)
    cache = property(lambda self: self.loras.cache)
    lora_stats = property(lambda self: self.loras.stats)
    _loras = property(lambda self: self.loras.entries)
    cold_start = property(lambda self: self.loras.cold_start,
                          lambda self, v: setattr(self.loras, "cold_start", v))
    _copy_gate = property(lambda self: self.loras.copy_gate, lambda self, v: setattr(self.loras, "copy_gate", v))
    _sim_link_gb_s = property(lambda self: self.loras.sim_link_gb_s,
                              lambda self, v: setattr(self.loras, "sim_link_gb_s", v))

    # ----------------------------------------------------------------- the loop
    async def _idle(self, timeout: float | None) -> None:
        """Sleep until woken (a request, a landed copy) or `timeout`; short naps while adapter work
        is pending but cannot start (no room on the device yet), so the loop never spins."""
        self._wake.clear()
        if self.loras.pending():
            timeout = 0.02
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _loop(self) -> None:
        while not self._stopping:
            if self.loras.due():
                try:
                    async with self._lock:
                        await self.loras.manage()
                except Exception:  # never let adapter bookkeeping stop serving
                    logger.exception("hf engine: adapter management failed")
            if not self._waiting and not self._running:
                if self._batch.rows:  # cancelled or finished rows: free their KV now, not at the next request
                    async with self._lock:
                        await asyncio.to_thread(self._batch.reap)
                await self._idle(None)
                continue
            try:
                async with self._lock:
                    if self.preemptor is not None and self._decode_steps % self.preemptor.quantum == 0:
                        await self._pause_for_shorter()
                    await self._admit_waiting()
                    if self._batch.rows:
                        self._dispatch(await asyncio.to_thread(self._batch.decode))
                        self._decode_steps += 1
                    elif self._running:  # cannot happen; never spin on requests that have no rows
                        for act in list(self._running.values()):
                            self._fail(act, EngineError("request lost its batch rows", 500))
            except Exception as exc:  # a failed step: fail what ran, keep serving
                logger.exception("hf engine step failed")
                for act in list(self._running.values()):
                    self._fail(act, EngineError(f"engine step failed: {exc}", 500))
                self._batch.clear()
            if not self._batch.rows and self._waiting and not self._running:
                await self._idle(0.5)  # all that waits, waits for an adapter copy: sleep until one lands
            await asyncio.sleep(0)

    def _rows_in_use(self) -> int:
        return sum(a.req.params.n for a in self._running.values())

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for act in [a for a in self._waiting if a.paused is None and now - a.req.arrival > self.queue_timeout_s]:
            self._fail(act, EngineOverloaded(f"waited over {self.queue_timeout_s:.0f} s in the queue"))

    async def _admit_waiting(self) -> None:
        """Move waiting requests into the batch (queue order; stop at the first that does not fit).
        A paused request rejoins with its own KV: no prefill, no new reservation."""
        self._expire_waiting()
        prefilled = 0  # prompt tokens this iteration: bounds the pause that prefills add to running decodes
        self._waiting = self._ordered()
        i = 0
        while i < len(self._waiting) and not self._stopping:
            act = self._waiting[i]
            if act.paused is not None:
                if self._rows_in_use() + act.req.params.n > self.max_batch:
                    return
                self._waiting.pop(i)
                held, act.paused = act.paused, None
                self._running[act.req.request_id] = act  # its reservation and adapter pin were kept
                act.ran_from = len(act.step_times)
                await asyncio.to_thread(self._batch.resume, held)
                continue
            how = self.loras.ready(act.req.adapter)
            if how is None:  # on_demand (or no host copy yet): wait for the device copy, let others pass
                i += 1
                continue
            fits_rows = self._rows_in_use() + act.req.params.n <= self.max_batch
            fits_kv = self._kv_reserved + act.reserve <= self.kv_capacity
            fits_step = prefilled == 0 or prefilled + len(act.ids) <= self.prefill_tokens_per_step
            if not (fits_rows and fits_kv and fits_step):
                return
            self._waiting.pop(i)
            prefilled += len(act.ids)
            self._running[act.req.request_id] = act
            self._kv_reserved += act.reserve
            if act.req.adapter:
                self.loras.pin(act.req.adapter, how)
            act.start = time.monotonic()
            b = self._bundle
            try:
                spec = act.req.params.structured
                act.rows = [Row(act, i, act.req.params, act.req.adapter, b.tokenizer, act.ids, b.eos_ids,
                                b.max_positions, b.device, guide=self._grammars.guide(spec) if spec else None)
                            for i in range(act.req.params.n)]
                events = await asyncio.to_thread(self._batch.prefill, act.rows, act.ids)
            except Exception as exc:  # the batch is untouched when a prefill fails: fail this request only
                logger.exception("prefill of %s failed", act.req.request_id)
                self._fail(act, EngineError(f"prefill failed: {exc}", 500))
                continue
            self._dispatch(events)

    def _dispatch(self, events: list[tuple[Row, Delta]]) -> None:
        """Hand a step's deltas to their requests (on the loop); finish requests whose choices all ended."""
        now = time.monotonic()
        stamped: set[int] = set()
        for row, delta in events:
            act: _Active = row.owner
            if act.done:
                continue
            if id(act) not in stamped:
                stamped.add(id(act))
                act.step_times.append(now)
            act.out_tokens += delta.tokens
            act.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                act.ended.add(delta.index)
                if len(act.ended) == act.req.params.n:
                    self._finish(act)

    def _finish(self, act: _Active) -> None:
        """The request is over (done, cancelled): release its slot and reservation, send Finished."""
        self._release(act)
        start = act.start if act.start is not None else time.monotonic()
        stats = make_stats(len(act.ids), len(act.step_times), act.req.arrival, start, act.step_times)
        jct = time.monotonic() - act.req.arrival
        if not act.cancelled:  # a cancelled request's time and length are not its natural ones
            queue_order.DEFAULT_RULE.observe(jct)  # ssjf's window W and guards follow the completions
            if self.preemptor is not None:  # ssjf_refine learns W and lengths from completions
                queue_order.REFINE_RULE.observe(jct)
                queue_order.REFINE_RULE.estimator.observe(act.req.length_class, act.generated,
                                                          queue_order.client_of(act.req))
        act.queue.put_nowait(Finished(stats=msgspec.structs.replace(stats, output_tokens=act.out_tokens)))

    def _fail(self, act: _Active, exc: EngineError) -> None:
        if act.done:
            return
        act.cancelled = True
        self._release(act)
        act.queue.put_nowait(exc)

    def _release(self, act: _Active) -> None:
        act.done = True
        self._known.pop(act.req.request_id, None)
        held = self._running.pop(act.req.request_id, None) is not None
        if act in self._waiting:
            self._waiting.remove(act)
            held = act.paused is not None  # a paused request holds its reservation and adapter pin
            act.paused = None  # its set-aside KV is freed with it
        if held:
            self._kv_reserved -= act.reserve
            if act.req.adapter:
                self.loras.unpin(act.req.adapter)
