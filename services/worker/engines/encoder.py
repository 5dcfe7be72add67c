"""The `encoder` engine: one encoder runtime (Arlo polymorphing) behind `/v1/embeddings`.

A worker hosts exactly ONE runtime: a static shape `[batch_size, max_length]`
(inputs padded to that max_length only) or, for the DT baseline, one dynamic-shape
runtime. Sequences queue FIFO in a bounded queue; the loop takes up to
`batch_size` of them, runs the runtime in a thread (the event loop stays free)
and resolves each sequence's future.

Load as dispatchers see it (heartbeats): `running`/`waiting` count sequences; the
SLO capacity M_i of Arlo §3.3 (sequences one instance holds within the SLO) is
reported as a token budget, `kv_capacity = M_i × max_length`, with
`kv_used = (running + waiting) × max_length`, so `kv_capacity // max_input_len`
gives M_i back (the Arlo policies read it that way) and the generic policies'
KV-fullness tie-breaks work unchanged.

With `encoder_profile` set to a profile from `polyserve profile --encoder`, the
engine replays the profiled latency instead of computing (no model is loaded,
vectors are pseudo-random unit vectors): it says `simulated` everywhere. This is
the digital twin used to run many "GPU" instances on a small CPU.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from polyserve.proto import EncoderProfile
from polyserve.worker.engine import Engine, EngineError, EngineLoad, EngineOverloaded, EngineRequest

logger = logging.getLogger(__name__)


@dataclass
class EncoderConfig:
    """What the engine needs; `from_settings` maps the worker settings onto it."""

    model: str = ""
    model_path: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    max_length: int = 512  # the runtime's static max_length (clamped to the model's positions)
    batch_size: int = 1
    shape: str = "static"  # "static" | "dynamic" (DT)
    backend: str = "jit"  # "jit" | "compile" | "eager" (see encoder_runtime.py)
    slo_ms: float = 1000.0
    capacity: int = 0  # M_i; 0 = from the measured (or profiled) batch latency and the SLO
    max_waiting: int = 1024  # sequences queued beyond the running batch; beyond it 429
    threads: int = 0  # torch intra-op threads (process-wide); 0 = leave as is
    profile: str = ""  # EncoderProfile JSON: replay its latency (simulated) instead of computing
    time_scale: float = 1.0  # × replayed latency


@dataclass
class _Item:
    request_id: str
    ids: list[int]
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    started: float = 0.0
    compute_ms: float = 0.0


@dataclass
class EmbedResult:
    embeddings: list[list[float]]
    tokens: list[int]
    truncated: int
    queue_ms: float
    compute_ms: float


def capacity_within_slo(slo_ms: float, batch_ms: float, batch_size: int) -> int:
    """Arlo's M_i: sequences an instance can hold and still finish within the SLO,
    draining `batch_size` per `batch_ms` (at least one batch)."""
    if batch_ms <= 0:
        return batch_size
    return max(1, math.floor(slo_ms / batch_ms)) * batch_size


def interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation (clamped at the ends)."""
    if not xs:
        return 0.0
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(1e-9, x1 - x0)
    return ys[-1]


def replay_ms(profile: EncoderProfile, shape: str, batch_rows: int, batch_size: int, max_length: int,
              longest: int) -> float:
    """The profiled latency of one batch: a static runtime always costs its full shape;
    a dynamic one costs its actual rows and longest row."""
    if shape == "static":
        rows, length, grid = batch_size, max_length, profile.static_ms
    else:
        rows, length, grid = batch_rows, longest, profile.dynamic_ms or profile.static_ms
    # nearest measured batch size at or above `rows`
    bi = next((i for i, b in enumerate(profile.batches) if b >= rows), len(profile.batches) - 1)
    scale = rows / profile.batches[bi] if profile.batches[bi] < rows else 1.0
    return interp(profile.lengths, grid[bi], length) * scale


def pseudo_embedding(ids: list[int], dim: int) -> list[float]:
    """A deterministic unit vector for replayed (simulated) runs."""
    seed = hashlib.blake2b(msgspec.json.encode(ids), digest_size=8).digest()
    rng = random.Random(seed)
    v = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    n = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / n for x in v]


class EncoderEngine(Engine):
    """Embeds with one runtime; refuses generate (400)."""

    name = "encoder"

    def __init__(self, config: EncoderConfig):
        self.cfg = config
        self.simulated = bool(config.profile)
        self.model_name = config.model or ""
        self.enc = None  # EncoderModel (real compute)
        self.runtime = None  # Runtime (real compute)
        self.profile: EncoderProfile | None = None
        self.max_length = config.max_length
        self.capacity = config.capacity
        self.batch_ms = 0.0
        self.dim = 384
        self._queue: collections.deque[_Item] = collections.deque()
        self._running = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.completed = 0

    @classmethod
    def from_settings(cls, settings: Any) -> "EncoderEngine":
        """Map worker settings (`encoder_*` fields, falling back to the generic ones)."""
        g = lambda k, d: getattr(settings, k, d)  # noqa: E731
        max_len = int(g("encoder_max_length", 0) or 0) or min(int(g("max_input_len", 512) or 512), 512)
        return cls(EncoderConfig(
            model=g("model", ""), model_path=g("model_path", "") or "", device=g("device", "cpu") or "cpu",
            dtype=g("dtype", "float32") or "float32", max_length=max_len,
            batch_size=int(g("encoder_batch", 1) or 1), shape=g("encoder_shape", "static") or "static",
            backend=g("encoder_backend", "jit") or "jit", slo_ms=float(g("encoder_slo_ms", 1000.0)),
            capacity=int(g("encoder_capacity", 0) or 0), max_waiting=int(g("max_waiting", 1024)),
            threads=int(g("encoder_threads", 1) or 0), profile=g("encoder_profile", "") or "",
            time_scale=float(g("time_scale", 1.0))))

    # ----------------------------------------------------------------- lifecycle
    @property
    def runtime_name(self) -> str:
        c = self.cfg
        if c.shape == "dynamic":
            return f"dynamic-b{c.batch_size}-{c.backend}" + ("-replay" if self.simulated else "")
        return f"static-b{c.batch_size}-l{self.max_length}-{c.backend}" + ("-replay" if self.simulated else "")

    async def start(self) -> None:
        """Load the model and prepare the runtime (or read the profile to replay)."""
        c = self.cfg
        if c.shape not in ("static", "dynamic"):
            raise EngineError(f"encoder_shape {c.shape!r} is not 'static' or 'dynamic'", 400)
        if c.profile:
            self.profile = msgspec.json.decode(Path(c.profile).read_bytes(), type=EncoderProfile)
            self.model_name = self.model_name or self.profile.model
            self.max_length = min(c.max_length, max(self.profile.lengths))
            self.batch_ms = replay_ms(self.profile, c.shape, c.batch_size, c.batch_size, self.max_length,
                                      self.max_length)
        else:
            await asyncio.to_thread(self._load)
        if self.capacity <= 0:
            self.capacity = capacity_within_slo(c.slo_ms, self.batch_ms, c.batch_size)
        self._task = asyncio.create_task(self._loop(), name=f"encoder:{self.runtime_name}")
        logger.info("encoder runtime %s ready: %.1f ms per batch, capacity %d within %.0f ms%s",
                    self.runtime_name, self.batch_ms, self.capacity, c.slo_ms,
                    " (simulated: replaying a profile)" if self.simulated else "")

    def _load(self) -> None:
        import torch

        from polyserve.worker.engines.encoder_runtime import EncoderRuntimeError, Runtime, load_encoder

        c = self.cfg
        if c.threads > 0:
            torch.set_num_threads(c.threads)
        try:
            self.enc = load_encoder(c.model_path, c.device, c.dtype, c.model)
            self.model_name = self.model_name or self.enc.name
            self.max_length = min(c.max_length, self.enc.max_positions)
            self.dim = self.enc.dim
            self.runtime = Runtime(self.enc, batch_size=c.batch_size, max_length=self.max_length,
                                   shape=c.shape, backend=c.backend).prepare()
        except EncoderRuntimeError as exc:
            raise EngineError(str(exc), 400) from exc
        self.batch_ms = self.runtime.time_batch(repeats=3)

    async def stop(self, drain_s: float = 5.0) -> None:
        """Let queued sequences finish (up to `drain_s`), then fail the rest with 503."""
        deadline = time.monotonic() + drain_s
        while (self._queue or self._running) and time.monotonic() < deadline and \
                self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)
        self._stopping = True
        self._wake.set()
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(EngineError("worker shutting down", 503))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ----------------------------------------------------------------- serving
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if self.enc is None:  # replay: a whitespace estimate (1.3 tokens per word, + 2 specials)
            return [[101] + [1000] * max(0, math.ceil(len(t.split()) * 1.3)) + [102] for t in texts]
        return self.enc.tokenize(texts)

    async def embed(self, request_id: str, rows: list[list[int]], truncate: bool = False) -> EmbedResult:
        """Embed token-id rows (special tokens included); 400 when one exceeds max_length and
        `truncate` is off, 429 when the queue is full, 503 when stopping."""
        if self._stopping:
            raise EngineError("worker shutting down", 503)
        if not rows or any(len(r) == 0 for r in rows):
            raise EngineError("every input needs at least one token", 400)
        vocab = self.enc.tokenizer.vocab_size if self.enc is not None else None
        for i, r in enumerate(rows):  # a bad id would fail the whole batch, other requests' rows too
            if min(r) < 0 or (vocab is not None and max(r) >= vocab):
                raise EngineError(f"input {i} has a token id outside the vocabulary (0..{(vocab or 0) - 1})", 400)
        sep = self.enc.sep_id if self.enc is not None else 102
        truncated = 0
        fitted = []
        for i, r in enumerate(rows):
            if len(r) > self.max_length:
                if not truncate:
                    raise EngineError(f"input {i} has {len(r)} tokens; this runtime takes at most "
                                      f"{self.max_length} (set truncate to cut it)", 400)
                from polyserve.core.encoder_text import truncate_ids

                r = truncate_ids(r, self.max_length, sep)
                truncated += 1
            fitted.append(r)
        if len(self._queue) + len(fitted) > self.cfg.max_waiting:
            raise EngineOverloaded(f"encoder queue full ({len(self._queue)} sequences waiting, limit "
                                   f"{self.cfg.max_waiting}); retry shortly")
        loop = asyncio.get_running_loop()
        items = [_Item(request_id, r, loop.create_future()) for r in fitted]
        self._queue.extend(items)
        self._wake.set()
        try:
            vectors = await asyncio.gather(*(it.future for it in items))
        except BaseException:
            self._drop(request_id)
            raise
        self.completed += 1
        return EmbedResult(embeddings=list(vectors), tokens=[len(r) for r in fitted], truncated=truncated,
                           queue_ms=max((it.started - it.arrival) * 1e3 for it in items),
                           compute_ms=max(it.compute_ms for it in items))

    def _drop(self, request_id: str) -> int:
        keep = collections.deque(it for it in self._queue if it.request_id != request_id)
        n = len(self._queue) - len(keep)
        self._queue = keep
        return n

    async def _loop(self) -> None:
        bs = self.cfg.batch_size
        while not self._stopping:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(bs, len(self._queue)))]
            batch = [it for it in batch if not it.future.done()]
            if not batch:
                continue
            now = time.monotonic()
            for it in batch:
                it.started = now
            self._running = len(batch)
            try:
                vectors, ms = await self._run([it.ids for it in batch])
            except asyncio.CancelledError:
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(EngineError("worker shutting down", 503))
                raise
            except Exception as exc:  # noqa: BLE001 - a runtime fault fails this batch, not the loop
                logger.exception("encoder runtime %s failed a batch", self.runtime_name)
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(EngineError(f"runtime failed: {type(exc).__name__}: {exc}"))
                continue
            finally:
                self._running = 0
            for it, vec in zip(batch, vectors):
                it.compute_ms = ms
                if not it.future.done():
                    it.future.set_result(vec)

    async def _run(self, rows: list[list[int]]) -> tuple[list[list[float]], float]:
        t = time.perf_counter()
        if self.profile is not None:
            ms = replay_ms(self.profile, self.cfg.shape, len(rows), self.cfg.batch_size, self.max_length,
                           max(len(r) for r in rows))
            await asyncio.sleep(ms * self.cfg.time_scale / 1e3)
            return [pseudo_embedding(r, self.dim) for r in rows], ms
        out = await asyncio.to_thread(self.runtime.run, rows)
        return out.tolist(), (time.perf_counter() - t) * 1e3

    # ----------------------------------------------------------------- Engine interface
    def generate(self, req: EngineRequest) -> AsyncIterator:
        raise EngineError(f"this worker hosts an encoder runtime ({self.runtime_name}); it serves "
                          "POST /v1/embeddings, not completions", 400)

    def cancel(self, request_id: str) -> bool:
        """Drop the request's queued sequences (a running batch finishes)."""
        items = [it for it in self._queue if it.request_id == request_id]
        for it in items:
            if not it.future.done():
                it.future.set_exception(EngineError("cancelled", 499))
        return bool(self._drop(request_id))

    def load(self) -> EngineLoad:
        held = self._running + len(self._queue)
        return EngineLoad(running=self._running, waiting=len(self._queue), kv_used=held * self.max_length,
                          kv_capacity=self.capacity * self.max_length, max_input_len=self.max_length)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize([text])[0])

    def model_card(self) -> dict:
        card = {"engine": self.name, "simulated": self.simulated, "runtime": self.runtime_name,
                "max_length": self.max_length, "batch_size": self.cfg.batch_size, "shape": self.cfg.shape,
                "backend": self.cfg.backend, "batch_ms": round(self.batch_ms, 3), "capacity": self.capacity,
                "slo_ms": self.cfg.slo_ms}
        if self.enc is not None:
            card.update(source=self.enc.source, dim=self.enc.dim)
        return card
