"""LoRA adapters of the `hf` engine: three tiers, background copies, PEFT install/evict, CPU-assisted hooks.

Adapters live in three tiers (`lora_cache`): disk, host (a CPU copy, pinned on CUDA
hosts) and device (installed in the PEFT model). `AdapterManager.load` reads the host
copy and, if the device has a free slot, starts the device copy in the background. A
request for an adapter that is not on the device starts its copy (evicting the
coldest unpinned device adapter if the device is full) and then, by `cold_start`
("auto", the default: on_demand on CUDA, cpu_assisted on the CPU; `cold_start_for`):
"cpu_assisted" (CaraServe §4) -> it is admitted at once and its prefill (and any
decode step before the copy lands) adds the LoRA delta computed on the CPU from the
host copy (`cpu_hooks`); "on_demand" -> it waits in the queue (not blocking others)
for the device copy. Copies run in one background thread; installing a landed copy
and evicting happen between steps (`manage`, called under the engine lock). Prefetch:
each pass asks the cache for adapters whose request rate is rising and starts their
copies.

The engine calls: `observe` when a request naming an adapter arrives, `ready` to learn
how a waiting request may run, `pin`/`unpin` around its run, `due` + `manage` between
steps, and `load`/`forget`/`ensure_on_device`/`demote`/`note_demand` for the admin API.
PEFT install/remove live in `hf_model`; the forward hooks of CPU-assisted rows here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from polyserve.proto import AdapterInfo
from polyserve.worker.engine import EngineError
from polyserve.worker.lora import (
    AdapterError,
    AdapterRegistry,
    AdapterSpec,
    HostLora,
    check_fits,
    check_name,
    copy_to_device,
    load_host_lora,
    lora_config,
    read_adapter,
    weight_bytes,
)
from polyserve.worker.lora_cache import DEVICE, DISK, HOST, AdapterCache, CacheError, CachePolicy

logger = logging.getLogger(__name__)

COLD_START = ("auto", "cpu_assisted", "on_demand")


def cold_start_for(setting: str, device: torch.device) -> str:
    """The cold-start rule an engine on `device` runs: "auto" is on_demand on CUDA and cpu_assisted on
    the CPU. Measured (docs/benchmarks/gpu.md, lora.md): on an H100 the CPU-assisted prefill, one
    device<->host round trip per targeted layer, took 6-10x the cached TTFT while waiting for the
    copy and PEFT's install took 3-5x; on the CPU, where the "copy" is a clone, CPU-assisted was
    0.92-0.96x and on-demand 1.4-1.5x."""
    if setting != "auto":
        return setting
    return "on_demand" if device.type == "cuda" else "cpu_assisted"
_HEARTBEAT_TIER = {DEVICE: "gpu", HOST: "host", DISK: "disk"}


class _Lora:
    """One adapter on this worker: its directory, host copy, the copy in flight, and readiness."""

    def __init__(self, spec: AdapterSpec, config):
        self.spec = spec
        self.config = config
        self.host: HostLora | None = None  # set by the copy thread or load
        self.job: concurrent.futures.Future | None = None  # disk/host -> device copy in flight
        self.on_device = asyncio.Event()  # also set when the device copy failed (`error`)
        self.error: str | None = None


class AdapterManager:
    """The adapters of one engine: registry, tier cache, copies, and the batch's PEFT model.

    `lock` is the engine's step lock (the model changes only under it); `wake` wakes the
    engine loop; `on_copy_failed(name, error)` fails the requests waiting for `name`."""

    def __init__(self, settings: Any, lock: asyncio.Lock, wake: asyncio.Event,
                 on_copy_failed: Callable[[str, EngineError], None]):
        self.cold_start = getattr(settings, "lora_cold_start", "auto") or "auto"  # resolved in `start`
        if self.cold_start not in COLD_START:
            raise EngineError(f"lora_cold_start {self.cold_start!r} is unknown; choose one of "
                              f"{', '.join(COLD_START)}", 400)
        self.prefetch = bool(getattr(settings, "lora_prefetch", True))
        try:
            self.cache = AdapterCache(CachePolicy.from_settings(settings))
        except CacheError as exc:
            raise EngineError(f"LoRA cache settings: {exc}", 400) from exc
        self.registry = AdapterRegistry()
        self.stats = {"cpu_assisted_requests": 0, "device_copies": 0, "prefetches": 0, "evictions": 0,
                      "host_evictions": 0}
        self.entries: dict[str, _Lora] = {}
        self.wanted: set[str] = set()  # adapters requests wait for on the device
        self.demand_seen = False  # a request (or note_demand) since the last prefetch pass
        # bench/test hooks, off by default: hold device copies until set; emulate a host->device link of
        # this many GB/s on a machine without one (figures made with it are labelled simulated)
        self.copy_gate: threading.Event | None = None
        self.sim_link_gb_s = 0.0
        self._lock, self._wake, self._on_copy_failed = lock, wake, on_copy_failed
        self._batch = None
        self._model_name = ""
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, batch, model_name: str) -> None:
        """Serve adapters into `batch` (an `hf_batch.Batch`); call on the event loop."""
        self._batch, self._model_name = batch, model_name
        self.cold_start = cold_start_for(self.cold_start, batch.device)
        self._loop = asyncio.get_running_loop()
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-copy")

    def stop(self) -> None:
        if self.copy_gate is not None:
            self.copy_gate.set()
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)
            self._copier = None

    # ------------------------------------------------------------ requests
    def tier(self, name: str) -> str:
        """Heartbeat tier of a loaded adapter: "gpu" (on the device), "loading", "host" or "disk"."""
        if self.cache.loading(name) is not None:
            return "loading"
        return _HEARTBEAT_TIER[self.cache.tier(name)]

    def infos(self) -> list[AdapterInfo]:
        return [AdapterInfo(name=n, rank=self.registry.rank(n), tier=self.tier(n)) for n in self.registry.names()]

    def observe(self, name: str) -> None:
        """A request naming `name` arrived: count it; want the adapter on the device if it is not."""
        self.cache.observe(name, time.monotonic())
        self.demand_seen = True
        if self.cache.tier(name) != DEVICE:
            self.wanted.add(name)  # the loop starts its copy before this request's prefill

    def ready(self, name: str | None) -> str | None:
        """How a request for `name` may run now: "device", "cpu" (CPU-assisted) or None (wait)."""
        if not name or self.cache.tier(name) == DEVICE:
            return "device"
        entry = self.entries[name]
        if self.cache.loading(name) is None:
            self.wanted.add(name)  # e.g. evicted while this request waited
        if name in self._batch.cpu_lora:
            return "cpu"
        if self.cold_start == "cpu_assisted" and entry.host is not None and entry.host.cpu_ok:
            return "cpu"
        return None

    def pin(self, name: str, how: str) -> None:
        """A request for `name` enters the batch (`how` from `ready`): keep it on its tier."""
        self.cache.pin(name)
        if how == "cpu":
            if name not in self._batch.cpu_lora:
                self._batch.cpu_lora[name] = self.entries[name].host
            self.stats["cpu_assisted_requests"] += 1

    def unpin(self, name: str) -> None:
        if name in self.cache:
            self.cache.unpin(name)

    # ------------------------------------------------------------ between steps
    def pending(self) -> bool:
        """A landed copy to install, or an adapter wanted on the device whose copy has not started."""
        return (any(e.job is not None and e.job.done() for e in self.entries.values())
                or any(n in self.cache and self.cache.loading(n) is None and self.cache.tier(n) != DEVICE
                       for n in self.wanted))

    def due(self) -> bool:
        """Whether the loop should call `manage` now (resets the demand flag)."""
        due = self.pending() or (self.prefetch and self.demand_seen)
        if due:
            self.demand_seen = False
        return due

    async def manage(self) -> None:
        """Between steps, under the engine lock: install landed copies, start wanted and prefetched ones."""
        for name, entry in list(self.entries.items()):
            if entry.job is None or not entry.job.done():
                continue
            job, entry.job = entry.job, None
            if entry.host is not None and self.cache.tier(name) == DISK:
                self.cache.landed(name, HOST)  # the copy thread read it from disk first
            try:
                state = job.result()
                t0 = time.perf_counter()
                await asyncio.to_thread(self._batch.install_adapter, name, entry.config, state)
                self.stats["last_install_ms"] = (time.perf_counter() - t0) * 1e3
                self.stats["slot_reuses"] = self._batch.slots.reused  # installs that copied into kept modules
            except Exception as exc:
                self.cache.failed(name)
                self.wanted.discard(name)
                logger.error("adapter %s: device copy failed: %s", name, exc)
                entry.error = str(exc) or type(exc).__name__
                entry.on_device.set()
                self._on_copy_failed(name, EngineError(f"adapter {name!r} could not be put on the device: {exc}",
                                                       500))
                continue
            self.cache.landed(name, DEVICE)
            entry.error = None
            self._batch.cpu_lora.pop(name, None)  # next steps use the device copy
            self.wanted.discard(name)
            entry.on_device.set()
            self.stats["device_copies"] += 1
        now = time.monotonic()
        for name in sorted(self.wanted, key=lambda n: -self.cache.score(n, now)):
            if name not in self.entries or self.cache.tier(name) == DEVICE:
                self.wanted.discard(name)
            elif self.cache.loading(name) is None:
                await self._promote(name, self.cache.victims(name, DEVICE, now))
        if self.prefetch:
            for name, victims in self.cache.prefetch(now, limit=1):
                if await self._promote(name, victims):
                    self.stats["prefetches"] += 1

    async def _promote(self, name: str, device_victims: list[str] | None) -> bool:
        """Start the copy of `name` to the device after making room; False if there is none now."""
        now = time.monotonic()
        entry = self.entries[name]
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

    def _fetch(self, entry: _Lora) -> dict:
        """Copy thread: disk -> host if needed (requests may start CPU-assisted then), host -> device."""
        if entry.host is None:
            entry.host = self._read_host(entry)
            self._notify()
        if self.copy_gate is not None:
            self.copy_gate.wait()
        t0 = time.perf_counter()
        if self.sim_link_gb_s > 0:
            time.sleep(entry.host.nbytes / (self.sim_link_gb_s * 1e9))
        state = copy_to_device(entry.host.state, self._batch.device)
        self.stats["last_copy_ms"] = (time.perf_counter() - t0) * 1e3
        return state

    def _notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def _read_host(self, entry: _Lora) -> HostLora:
        return load_host_lora(entry.spec, pin=self._batch.device.type == "cuda", config=entry.config)

    def _drop_host(self, names: list[str]) -> None:
        """Host eviction: forget the host copies of host-only adapters (they stay known, on disk)."""
        for n in names:
            self.cache.demote(n)
            self.entries[n].host = None
            self._batch.cpu_lora.pop(n, None)
            self.stats["host_evictions"] += 1

    def _evict_device(self, names: list[str]) -> None:
        """Device eviction (engine lock held): remove from the PEFT model, keep the host copy."""
        for n in names:
            self.cache.demote(n)
            self._batch.remove_adapter(n)
            self.entries[n].on_device.clear()
            self.stats["evictions"] += 1

    # ------------------------------------------------------------ admin
    async def load(self, name: str, path: str, wait: bool = False) -> AdapterInfo:
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
        if name in self.registry:
            raise EngineError(f"adapter {name!r} is already loaded; unload it first", 409)
        try:
            config, nbytes = await asyncio.to_thread(lambda: (lora_config(spec), weight_bytes(spec)))
        except Exception as exc:  # unreadable config or weights
            raise EngineError(f"adapter {name!r} at {spec.path}: {exc}", 400) from exc
        if name in self.registry:  # loaded by a concurrent call meanwhile
            raise EngineError(f"adapter {name!r} is already loaded; unload it first", 409)
        try:
            entry = _Lora(spec, config)
            self.cache.add(name, nbytes)
            self.entries[name] = entry
            self.registry.add(name, spec)
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
                self.wanted.add(name)
                self._wake.set()
        except Exception as exc:
            await self.forget(name)
            raise EngineError(f"adapter {name!r} at {spec.path} does not fit model {self._model_name}: {exc}",
                              400) from exc
        if wait:
            await self.ensure_on_device(name)
        logger.info("loaded adapter %s (rank %d) from %s: %s", name, spec.rank, spec.path, self.tier(name))
        return AdapterInfo(name=name, rank=spec.rank, tier=self.tier(name))

    def note_demand(self, name: str, now: float | None = None) -> None:
        """Demand for adapter `name` seen elsewhere (e.g. the router saw its rate rise): it counts
        towards the prefetch rule as a request here would, without a request."""
        if name not in self.entries:
            raise EngineError(self.registry.unknown_message(name), 404)
        self.cache.observe(name, time.monotonic() if now is None else now)
        self.demand_seen = True
        self._wake.set()

    async def ensure_on_device(self, name: str, timeout: float = 120.0) -> None:
        """Promote adapter `name` to the device (evicting the coldest unpinned one if needed); wait for it."""
        entry = self.entries.get(name)
        if entry is None:
            raise EngineError(self.registry.unknown_message(name), 404)
        if self.cache.tier(name) == DEVICE:
            return
        self.wanted.add(name)
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

    async def demote(self, name: str, to: str = HOST) -> None:
        """Evict adapter `name` from the device (to "host") or down to "disk"; 409 while requests use it."""
        if name not in self.entries:
            raise EngineError(self.registry.unknown_message(name), 404)
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

    async def forget(self, name: str) -> None:
        """Remove adapter `name` from every tier and the registry (the caller checked no request uses it)."""
        async with self._lock:
            entry = self.entries.pop(name, None)
            if entry is not None and name in self.cache and self.cache.tier(name) == DEVICE:
                await asyncio.to_thread(self._batch.remove_adapter, name, False)
            if self._batch is not None:  # no adapter left on the device: parked modules go too
                self._batch.slots.release(self._batch)
            self._batch.cpu_lora.pop(name, None)
            self.wanted.discard(name)
            if name in self.cache:
                self.cache.remove(name)
            if name in self.registry:
                self.registry.remove(name)


# ---------------------------------------------------------------- CPU-assisted rows
def cpu_hooks(root, cpu_lora: dict, assisted: dict[str, list[int]], n_rows: int, device) -> list:
    """Forward hooks adding x·A·B·scaling (on the CPU) to the base Linear outputs of `assisted` rows
    (adapter name -> row indices; `cpu_lora` maps names to their `HostLora`). Remove them after the forward."""
    per_module: dict[str, list] = {}
    for name, rows in assisted.items():
        host = cpu_lora[name]
        idx = None if len(rows) == n_rows else torch.tensor(rows, device=device)
        for path, (a, b) in host.modules.items():
            per_module.setdefault(path, []).append((idx, a, b, host.scaling))
    handles = []
    for path, entries in per_module.items():
        mod = root.get_submodule(path)
        handles.append(getattr(mod, "base_layer", mod).register_forward_hook(_cpu_delta(entries)))
    return handles


def _cpu_delta(entries):
    """A forward hook: for each (rows, A, B, scaling), out[rows] += (x[rows] on the CPU)·Aᵀ·Bᵀ·scaling.

    The same operations, in the same order, as PEFT's LoRA layer (F.linear with A,
    then B, then the scaling), so on a CPU the result is the device path's."""
    def hook(module, args, out):
        x = args[0]
        for idx, a, b, scaling in entries:
            xs = x if idx is None else x.index_select(0, idx)
            delta = F.linear(F.linear(xs.to("cpu", a.dtype), a), b) * scaling
            delta = delta.to(out.device, out.dtype)
            if idx is None:
                out = out + delta
            else:
                out = out.index_add(0, idx, delta)
        return out
    return hook
