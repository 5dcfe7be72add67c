"""The `hf` engine: transformers + PEFT, continuous batching, multi-LoRA, on CPU or CUDA.

Scheduling (this module) runs on the event loop; every model call runs in a worker
thread (`asyncio.to_thread`) under one lock, so the loop stays responsive while a
step computes and adapter loads never interleave with a step. One iteration of the
loop: admit waiting requests in queue order while batch rows and the KV budget allow
(each is prefilled alone and joins the batch), then one batched decode step for
every running row (see `hf_batch` for the KV layout and why it is our own loop).

Admission (`generate`'s first `__anext__`): a full waiting queue is EngineOverloaded
(429); an input over `max_input_len`, or a request whose KV reservation could never
fit, is a 400; an unknown adapter is a 404 naming the loaded ones.

LoRA adapters live in three tiers (`lora_cache`): disk, host (a CPU copy, pinned on
CUDA hosts) and device (installed in the PEFT model). `load_adapter` reads the host
copy and, if the device has a free slot, starts the device copy in the background.
A request for an adapter that is not on the device starts its copy (evicting the
coldest unpinned device adapter if the device is full) and then, by `cold_start`:
"cpu_assisted" (CaraServe §4) -> it is admitted at once and its prefill (and any
decode step before the copy lands) adds the LoRA delta computed on the CPU from the
host copy; "on_demand" -> it waits in the queue (not blocking others) for the
device copy. Copies run in one background thread; installing a landed copy and
evicting happen between steps under the engine lock. Prefetch: each loop pass asks
the cache for adapters whose request rate is rising and starts their copies.

KV accounting: a running request reserves `n * (input + max_tokens)` tokens of the
`kv_capacity_tokens` budget from admission until it ends; `load().kv_used` reports
those reservations, so capacity - used is exactly what the next admission may take.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

from polyserve.proto import AdapterInfo

from polyserve.worker import policy as worker_policy
from polyserve.worker.engine import (Delta, Engine, EngineError, EngineLoad, EngineOverloaded, EngineRequest,
                                     Finished, check_request, free_adapter, make_stats, relay)
from polyserve.worker.engines.hf_batch import Batch, Row
from polyserve.worker.lora import (AdapterError, AdapterRegistry, AdapterSpec, HostLora, check_fits, check_name,
                                   copy_to_device, load_host_lora, lora_config, read_adapter, weight_bytes)
from polyserve.worker.lora_cache import DEVICE, DISK, HOST, AdapterCache, CachePolicy, CacheError

logger = logging.getLogger(__name__)

OrderKey = Callable[[EngineRequest], Any]
# Queue orders as sort keys (fcfs, priority, ssjf): the same code the sim engine and the simulator use.
ORDERS: dict[str, OrderKey] = {k: v for k, v in worker_policy.ORDER_KEYS.items() if k != "sjf_oracle"}
COLD_START = ("cpu_assisted", "on_demand")
_HEARTBEAT_TIER = {DEVICE: "gpu", HOST: "host", DISK: "disk"}


class _Lora:
    """One adapter on this worker: its directory, host copy, the copy in flight, and readiness."""

    def __init__(self, spec: AdapterSpec, config):
        self.spec = spec
        self.config = config
        self.host: HostLora | None = None  # set by the copy thread or load_adapter
        self.job: concurrent.futures.Future | None = None  # disk/host -> device copy in flight
        self.on_device = asyncio.Event()  # also set when the device copy failed (`error`)
        self.error: str | None = None


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


class HfEngine(Engine):
    """Serves a Hugging Face causal LM (or the small random Llama) with PEFT adapters."""

    name = "hf"
    simulated = False

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
        if order is None and scheduling not in ORDERS:
            raise EngineError(f"scheduling {scheduling!r} is unknown; choose one of {', '.join(ORDERS)}", 400)
        self.order: OrderKey = order or ORDERS[scheduling]
        self.adapters = AdapterRegistry()
        self.cold_start = getattr(settings, "lora_cold_start", "cpu_assisted") or "cpu_assisted"
        if self.cold_start not in COLD_START:
            raise EngineError(f"lora_cold_start {self.cold_start!r} is unknown; choose one of "
                              f"{', '.join(COLD_START)}", 400)
        self.prefetch = bool(getattr(settings, "lora_prefetch", True))
        try:
            self.cache = AdapterCache(CachePolicy.from_settings(settings))
        except CacheError as exc:
            raise EngineError(f"LoRA cache settings: {exc}", 400) from exc
        self.lora_stats = {"cpu_assisted_requests": 0, "device_copies": 0, "prefetches": 0, "evictions": 0,
                           "host_evictions": 0}
        self._loras: dict[str, _Lora] = {}
        self._wanted: set[str] = set()  # adapters requests wait for on the device
        self._demand_seen = False  # a request (or note_demand) since the last prefetch pass
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        # bench/test hooks, off by default: hold device copies until set; emulate a host->device link of
        # this many GB/s on a machine without one (figures made with it are labelled simulated)
        self._copy_gate: threading.Event | None = None
        self._sim_link_gb_s = 0.0
        self._bundle = None
        self._batch: Batch | None = None
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._waiting: list[_Active] = []
        self._running: dict[str, _Active] = {}
        self._known: dict[str, _Active] = {}
        self._kv_reserved = 0
        self._seq = itertools.count()
        self._stopping = False
        self._loop_ref: asyncio.AbstractEventLoop | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        from polyserve.worker.engines.hf_model import auto_kv_capacity, load_bundle
        self._bundle = await asyncio.to_thread(load_bundle, self.model_name, self.model_path, self.device,
                                               self.dtype, self.seed, self.random_arch)
        self.model_name = self._bundle.name
        if self.kv_capacity <= 0:
            self.kv_capacity = auto_kv_capacity(self._bundle)
        self.max_input_len = min(self.max_input_len, self._bundle.max_positions - 1)
        self._batch = Batch(self._bundle.model, self._bundle.device, self._bundle.suppress_ids)
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-copy")
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name=f"hf-engine-{self.model_name}")
        logger.info("hf engine serving %s (%s) on %s", self.model_name, self._bundle.source, self._bundle.device)

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
        if self._copy_gate is not None:
            self._copy_gate.set()
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)
            self._copier = None

    def set_order(self, order: OrderKey) -> None:
        """Change the waiting queue's order (e.g. shortest-predicted-first with aging)."""
        self.order = order

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
        ids = self._bundle.encode(req.prompt)
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
        act = _Active(req, ids, next(self._seq), reserve)
        if req.adapter:
            self.cache.observe(req.adapter, time.monotonic())
            self._demand_seen = True
            if self.cache.tier(req.adapter) != DEVICE:
                self._wanted.add(req.adapter)  # the loop starts its copy before this request's prefill
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

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), waiting=len(self._waiting), kv_used=self._kv_reserved,
                          kv_capacity=self.kv_capacity, max_input_len=self.max_input_len,
                          adapters=[AdapterInfo(name=n, rank=self.adapters.rank(n), tier=self.adapter_tier(n))
                                    for n in self.adapters.names()])

    @property
    def max_adapters(self) -> int:
        """Adapters the device holds at once (heartbeat `max_adapters`)."""
        return self.cache.policy.device_slots

    def adapter_tier(self, name: str) -> str:
        """Heartbeat tier of a loaded adapter: "gpu" (on the device), "loading", "host" or "disk"."""
        if self.cache.loading(name) is not None:
            return "loading"
        return _HEARTBEAT_TIER[self.cache.tier(name)]

    def count_tokens(self, text: str) -> int:
        if self._bundle is None:
            raise EngineError("the hf engine is not started", 503)
        return len(self._bundle.encode(text))

    def model_card(self) -> dict:
        card = {"engine": self.name, "simulated": False, "model": self.model_name,
                "max_input_len": self.max_input_len, "kv_capacity_tokens": self.kv_capacity}
        if self._bundle is not None:
            card.update(self._bundle.card())
        return card

    def format_chat(self, messages: list[dict]) -> str:
        """Chat messages as one prompt, with the model's chat template when it has one."""
        from polyserve.worker.engines.hf_model import format_chat
        return format_chat(self._bundle.tokenizer, messages)

    # ----------------------------------------------------------------- adapters
    async def load_adapter(self, name: str, path: str, wait: bool = False) -> AdapterInfo:
        """Register a PEFT LoRA adapter at runtime; requests may name it as soon as this returns.

        Reads the host copy now (disk -> host); the device copy starts in the background when
        the device has a free slot, else on the first request. `wait`: return only once the
        adapter is on the device."""
        if self._batch is None:
            raise EngineError("the hf engine is not started", 503)
        try:
            check_name(name)
            spec = read_adapter(path)
        except AdapterError as exc:
            raise EngineError(str(exc), exc.status) from exc
        if name in self.adapters:
            raise EngineError(f"adapter {name!r} is already loaded; unload it first", 409)
        try:
            config, nbytes = await asyncio.to_thread(lambda: (lora_config(spec), weight_bytes(spec)))
        except Exception as exc:  # unreadable config or weights
            raise EngineError(f"adapter {name!r} at {spec.path}: {exc}", 400) from exc
        if name in self.adapters:  # loaded by a concurrent call meanwhile
            raise EngineError(f"adapter {name!r} is already loaded; unload it first", 409)
        try:
            entry = _Lora(spec, config)
            self.cache.add(name, nbytes)
            self._loras[name] = entry
            self.adapters.add(name, spec)
        except (AdapterError, CacheError) as exc:
            raise EngineError(f"adapter {name!r} at {spec.path}: {exc}", 400) from exc
        try:
            host_victims = self.cache.victims(name, HOST, time.monotonic())
            if host_victims is not None:
                async with self._lock:  # host copies are shared with the loop
                    self._drop_host(host_victims)
                    self.cache.start(name, HOST)
                try:
                    host = await asyncio.to_thread(self._read_host, entry)
                    async with self._lock:  # the model's modules change only under the lock
                        check_fits(host, self._batch.model)
                    entry.host = host
                except Exception:
                    self.cache.failed(name)
                    raise
                self.cache.landed(name, HOST)
            if self.cache.victims(name, DEVICE, time.monotonic()) == []:
                self._wanted.add(name)
                self._wake.set()
        except Exception as exc:
            await self._forget(name)
            raise EngineError(f"adapter {name!r} at {spec.path} does not fit model {self.model_name}: {exc}",
                              400) from exc
        if wait:
            await self.ensure_on_device(name)
        logger.info("loaded adapter %s (rank %d) from %s: %s", name, spec.rank, spec.path, self.adapter_tier(name))
        return AdapterInfo(name=name, rank=spec.rank, tier=self.adapter_tier(name))

    def note_demand(self, name: str, now: float | None = None) -> None:
        """Demand for adapter `name` seen elsewhere (e.g. the router saw its rate rise): it counts
        towards the prefetch rule as a request here would, without a request."""
        if name not in self._loras:
            raise EngineError(self.adapters.unknown_message(name), 404)
        self.cache.observe(name, time.monotonic() if now is None else now)
        self._demand_seen = True
        self._wake.set()

    async def ensure_on_device(self, name: str, timeout: float = 120.0) -> None:
        """Promote adapter `name` to the device (evicting the coldest unpinned one if needed); wait for it."""
        entry = self._loras.get(name)
        if entry is None:
            raise EngineError(self.adapters.unknown_message(name), 404)
        if self.cache.tier(name) == DEVICE:
            return
        self._wanted.add(name)
        self._wake.set()
        entry.error = None
        entry.on_device.clear()
        try:
            await asyncio.wait_for(entry.on_device.wait(), timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"adapter {name!r} did not reach the device in {timeout:.0f} s "
                              f"(device slots full of adapters in use?)", 503) from None
        if entry.error:
            raise EngineError(f"adapter {name!r} could not be put on the device: {entry.error}", 500)

    async def demote_adapter(self, name: str, to: str = HOST) -> None:
        """Evict adapter `name` from the device (to "host") or down to "disk"; 409 while requests use it."""
        if name not in self._loras:
            raise EngineError(self.adapters.unknown_message(name), 404)
        if to not in (HOST, DISK):
            raise EngineError(f"demote to {HOST!r} or {DISK!r}, not {to!r}", 400)
        async with self._lock:
            try:
                if self.cache.tier(name) == DEVICE:
                    await asyncio.to_thread(self._evict_device, [name])
                if to == DISK and self.cache.tier(name) == HOST:
                    self._drop_host([name])
            except CacheError as exc:
                raise EngineError(f"adapter {name!r}: {exc}", 409) from exc

    async def unload_adapter(self, name: str, force: bool = False) -> None:
        """Remove an adapter; refused (409) while requests use it, unless `force` cancels them."""
        free_adapter(name, self.adapters, list(self._known.values()), force, self.cancel)
        await self._forget(name)
        logger.info("unloaded adapter %s", name)

    async def _forget(self, name: str) -> None:
        async with self._lock:
            entry = self._loras.pop(name, None)
            if entry is not None and name in self.cache and self.cache.tier(name) == DEVICE:
                await asyncio.to_thread(self._batch.remove_adapter, name)
            self._batch.cpu_lora.pop(name, None)
            self._wanted.discard(name)
            if name in self.cache:
                self.cache.remove(name)
            if name in self.adapters:
                self.adapters.remove(name)

    def _read_host(self, entry: _Lora) -> HostLora:
        pin = self._bundle.device.type == "cuda"
        return load_host_lora(entry.spec, pin=pin, config=entry.config)

    def _drop_host(self, names: list[str]) -> None:
        """Host eviction: forget the host copies of host-only adapters (they stay known, on disk)."""
        for n in names:
            self.cache.demote(n)
            self._loras[n].host = None
            self._batch.cpu_lora.pop(n, None)
            self.lora_stats["host_evictions"] += 1

    def _evict_device(self, names: list[str]) -> None:
        """Device eviction (engine lock held): remove from the PEFT model, keep the host copy."""
        for n in names:
            self.cache.demote(n)
            self._batch.remove_adapter(n)
            self._loras[n].on_device.clear()
            self.lora_stats["evictions"] += 1

    def _fetch(self, entry: _Lora) -> dict:
        """Copy thread: disk -> host if needed (requests may start CPU-assisted then), host -> device."""
        if entry.host is None:
            entry.host = self._read_host(entry)
            self._notify()
        if self._copy_gate is not None:
            self._copy_gate.wait()
        t0 = time.perf_counter()
        if self._sim_link_gb_s > 0:
            time.sleep(entry.host.nbytes / (self._sim_link_gb_s * 1e9))
        state = copy_to_device(entry.host.state, self._bundle.device)
        self.lora_stats["last_copy_ms"] = (time.perf_counter() - t0) * 1e3
        return state

    def _notify(self) -> None:
        loop = self._loop_ref
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    async def _manage_adapters(self) -> None:
        """Between steps, under the engine lock: install landed copies, start wanted and prefetched ones."""
        for name, entry in list(self._loras.items()):
            if entry.job is None or not entry.job.done():
                continue
            job, entry.job = entry.job, None
            if entry.host is not None and self.cache.tier(name) == DISK:
                self.cache.landed(name, HOST)  # the copy thread read it from disk first
            try:
                state = job.result()
                t0 = time.perf_counter()
                await asyncio.to_thread(self._batch.install_adapter, name, entry.config, state)
                self.lora_stats["last_install_ms"] = (time.perf_counter() - t0) * 1e3
            except Exception as exc:
                self.cache.failed(name)
                self._wanted.discard(name)
                logger.error("adapter %s: device copy failed: %s", name, exc)
                entry.error = str(exc) or type(exc).__name__
                entry.on_device.set()
                for act in [a for a in self._waiting if a.req.adapter == name]:
                    self._fail(act, EngineError(f"adapter {name!r} could not be put on the device: {exc}", 500))
                continue
            self.cache.landed(name, DEVICE)
            entry.error = None
            self._batch.cpu_lora.pop(name, None)  # next steps use the device copy
            self._wanted.discard(name)
            entry.on_device.set()
            self.lora_stats["device_copies"] += 1
        now = time.monotonic()
        for name in sorted(self._wanted, key=lambda n: -self.cache.score(n, now)):
            if name not in self._loras or self.cache.tier(name) == DEVICE:
                self._wanted.discard(name)
            elif self.cache.loading(name) is None:
                await self._promote(name, self.cache.victims(name, DEVICE, now))
        if self.prefetch:
            for name, victims in self.cache.prefetch(now, limit=1):
                if await self._promote(name, victims):
                    self.lora_stats["prefetches"] += 1

    async def _promote(self, name: str, device_victims: list[str] | None) -> bool:
        """Start the copy of `name` to the device after making room; False if there is none now."""
        now = time.monotonic()
        entry = self._loras[name]
        host_victims: list[str] | None = []
        if self.cache.tier(name) == DISK:
            host_victims = self.cache.victims(name, HOST, now)
        if device_victims is None or host_victims is None:
            return False
        self._drop_host(host_victims)
        if device_victims:
            await asyncio.to_thread(self._evict_device, device_victims)
        self.cache.start(name, DEVICE)
        entry.job = self._copier.submit(self._fetch, entry)
        entry.job.add_done_callback(lambda _f: self._notify())
        return True

    def _adapter_ready(self, act: _Active) -> str | None:
        """How `act` may run now: "device", "cpu" (CPU-assisted) or None (wait for the device copy)."""
        name = act.req.adapter
        if not name or self.cache.tier(name) == DEVICE:
            return "device"
        entry = self._loras[name]
        if self.cache.loading(name) is None:
            self._wanted.add(name)  # e.g. evicted while this request waited
        if name in self._batch.cpu_lora:
            return "cpu"
        if self.cold_start == "cpu_assisted" and entry.host is not None and entry.host.cpu_ok:
            return "cpu"
        return None

    # ----------------------------------------------------------------- the loop
    def _adapter_work(self) -> bool:
        """A landed copy to install, or an adapter wanted on the device whose copy has not started."""
        return (any(e.job is not None and e.job.done() for e in self._loras.values())
                or any(n in self.cache and self.cache.loading(n) is None and self.cache.tier(n) != DEVICE
                       for n in self._wanted))

    async def _idle(self, timeout: float | None) -> None:
        """Sleep until woken (a request, a landed copy) or `timeout`; short naps while adapter work
        is pending but cannot start (no room on the device yet), so the loop never spins."""
        self._wake.clear()
        if self._adapter_work():
            timeout = 0.02
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _loop(self) -> None:
        self._loop_ref = asyncio.get_running_loop()
        while not self._stopping:
            if self._adapter_work() or (self.prefetch and self._demand_seen):
                self._demand_seen = False
                try:
                    async with self._lock:
                        await self._manage_adapters()
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
                    await self._admit_waiting()
                    if self._batch.rows:
                        self._dispatch(await asyncio.to_thread(self._batch.decode))
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
        for act in [a for a in self._waiting if now - a.req.arrival > self.queue_timeout_s]:
            self._fail(act, EngineOverloaded(f"waited over {self.queue_timeout_s:.0f} s in the queue"))

    async def _admit_waiting(self) -> None:
        """Move waiting requests into the batch (queue order; stop at the first that does not fit)."""
        self._expire_waiting()
        prefilled = 0  # prompt tokens this iteration: bounds the pause that prefills add to running decodes
        self._waiting.sort(key=lambda a: (self.order(a.req), a.seq))
        i = 0
        while i < len(self._waiting) and not self._stopping:
            act = self._waiting[i]
            how = self._adapter_ready(act)
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
                self.cache.pin(act.req.adapter)
                if how == "cpu" and act.req.adapter not in self._batch.cpu_lora:
                    self._batch.cpu_lora[act.req.adapter] = self._loras[act.req.adapter].host
                if how == "cpu":
                    self.lora_stats["cpu_assisted_requests"] += 1
            act.start = time.monotonic()
            b = self._bundle
            try:
                act.rows = [Row(act, i, act.req.params, act.req.adapter, b.tokenizer, act.ids, b.eos_ids,
                                b.max_positions, b.device) for i in range(act.req.params.n)]
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
        if self._running.pop(act.req.request_id, None) is not None:
            self._kv_reserved -= act.reserve
            if act.req.adapter and act.req.adapter in self.cache:
                self.cache.unpin(act.req.adapter)
        elif act in self._waiting:
            self._waiting.remove(act)
