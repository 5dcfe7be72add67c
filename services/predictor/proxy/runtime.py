"""The proxy model inside the asyncio service: background loading and micro-batched inference.

* **Loading** runs in the model thread at start; until it is done (or when it
  failed: no artifact, no torch, wrong tokenizer) `ready` is False and the
  service answers from the historical mean.
* **Inference** runs in one dedicated thread (torch uses its own intra-op
  threads inside it), so the event loop never blocks. Requests wait in a bounded
  queue; the batcher takes what queued while the model was busy, up to
  ``max_batch`` requests, waiting at most ``batch_wait_ms`` for more (only when
  this batch or the one before it had more than one request), splits them
  by length bucket (64, 128, 192, ... tokens, Arlo's staircase) and runs one
  batch per bucket padded to the bucket (a lone request is not padded). A full
  queue or a result later than ``timeout_s`` makes the caller fall back
  (`Unavailable`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from polyserve.predictor.proxy.buckets import bucket_length

logger = logging.getLogger(__name__)


def passive_openmp() -> bool:
    """Let idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) unless the
    environment says otherwise; True if it applies (torch, hence libgomp, not loaded yet).

    Measured on the shared 2-core machine (load average 3.8, two torch threads,
    bf16 encoder, batch 1): p50 9.3 ms at 32 tokens and 14.8 ms at 128 with
    PASSIVE, 343 ms and 98 ms without: spinning workers wait for cores that
    other processes hold."""
    if "torch" in sys.modules:
        return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE"


class Unavailable(Exception):
    """The model cannot answer now: use the fallback. `reason` is one of
    not_loaded, queue_full, timeout, failed, stopping."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ModelResult:
    length_class: int
    tokens: int
    value: float
    known_model: bool
    key: np.ndarray | None  # the prompt's semantic-cache key
    batch_size: int
    infer_ms: float


@dataclass
class _Job:
    prompt: str
    model: str
    future: asyncio.Future
    n_tokens: int = 0


class ModelRunner:
    """Owns a `ProxyPredictor` living in one worker thread."""

    def __init__(self, artifact_dir: str, encoder_dir: str | None = None, *, max_batch: int = 16,
                 batch_wait_ms: float = 2.0, max_queue: int = 256, bucket_step: int = 64, threads: int = 0,
                 cache_keys: str = "tuned", int8: bool = False, precision: str | None = None, calibrate: bool = True,
                 device: str = "cpu"):
        self.artifact_dir = artifact_dir
        self.encoder_dir = encoder_dir
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_ms / 1000
        self.bucket_step = bucket_step
        self.threads = threads
        self.cache_keys = cache_keys
        self.int8 = int8
        self.precision = precision
        self.calibrate = calibrate
        self.device = device  # the MiniLM tier's torch device; the lexical tier always runs on the CPU
        self.queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=max_queue)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor-model")
        self.predictor = None
        self.state = "idle"  # idle | loading | ready | failed | stopped
        self.error = ""
        self.load_s = 0.0
        self.batches = 0
        self._last_batch = 0  # requests the batcher took last time (the wait rule in `_batcher`)
        self.items = 0
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def meta(self):
        return self.predictor.meta if self.predictor is not None else None

    # ------------------------------------------------------------------ loading
    def _load(self):
        from polyserve.predictor.proxy import artifact

        meta = artifact.read_meta(self.artifact_dir)  # fail fast, before importing torch, when it is absent
        t = time.monotonic()
        if meta.kind == "lexical-gbm":  # the fast tier: no torch, no encoder pass
            from polyserve.predictor.proxy.lexical import LexicalPredictor

            pred = LexicalPredictor.load(self.artifact_dir, self.encoder_dir, calibrate_classes=self.calibrate)
            pred.predict(["warm up"], [pred.meta.models[0] if pred.meta.models else ""])
            if pred.calibrator is not None:  # the warm-up is not traffic
                pred.calibrator = type(pred.calibrator).from_json(pred.calibrator.to_json())
            return pred, time.monotonic() - t
        passive_openmp()
        import torch
        from transformers.utils import logging as hf_logging

        from polyserve.predictor.proxy.infer import ProxyPredictor

        hf_logging.disable_progress_bar()
        if self.threads:
            torch.set_num_threads(self.threads)
        pred = ProxyPredictor.load(self.artifact_dir, self.encoder_dir, bucket_step=self.bucket_step,
                                   cache_keys=self.cache_keys, int8=self.int8, precision=self.precision,
                                   device=self.device)
        pred.predict(["warm up"], [pred.meta.models[0] if pred.meta.models else ""])  # first-call costs
        return pred, time.monotonic() - t

    async def start(self) -> None:
        """Load in the model thread (never blocks the loop); start the batcher when loaded."""
        self.state = "loading"
        loop = asyncio.get_running_loop()
        try:
            self.predictor, self.load_s = await loop.run_in_executor(self.pool, self._load)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means: serve from the fallback
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            logger.warning("predictor: proxy model not loaded (%s); answering from the historical mean",
                           self.error)
            return
        self.state = "ready"
        self._task = asyncio.create_task(self._batcher(), name="predictor:batcher")
        logger.info("predictor: proxy model %s loaded in %.1fs (%s, %s pooling, encoder %s, %d target models)",
                    self.artifact_dir, self.load_s, self.predictor.meta.objective, self.predictor.meta.pooling,
                    getattr(self.predictor, "precision", "fp32"), len(self.predictor.meta.models))

    async def stop(self) -> None:
        self.state = "stopped"
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self.queue.empty():
            job = self.queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(Unavailable("stopping"))
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ inference
    async def predict(self, prompt: str, model: str, timeout_s: float) -> ModelResult:
        """The model's answer within `timeout_s`, else Unavailable."""
        if not self.ready:
            raise Unavailable("not_loaded", self.state)
        fut = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait(_Job(prompt, model, fut))
        except asyncio.QueueFull as exc:
            raise Unavailable("queue_full") from exc
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError as exc:
            fut.cancel()  # the batch may still run; its result is dropped
            raise Unavailable("timeout", f"no answer within {timeout_s * 1000:.0f} ms") from exc

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        ran = False  # the last pass ran the model: what is queued now came meanwhile
        while True:
            queued_meanwhile, ran = ran and not self.queue.empty(), False
            jobs = [await self.queue.get()]
            while len(jobs) < self.max_batch and not self.queue.empty():  # what queued while the model ran
                jobs.append(self.queue.get_nowait())
            # Wait for more only when there is company: a lone request reaching an idle batcher after
            # a batch that ran alone runs at once (at one request in flight the wait was pure latency);
            # one that queued while the model ran, or a batch of several before, waits as before.
            company = queued_meanwhile or len(jobs) > 1 or self._last_batch > 1
            deadline = loop.time() + self.batch_wait_s
            while company and len(jobs) < self.max_batch and self.batch_wait_s > 0:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    jobs.append(await asyncio.wait_for(self.queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            self._last_batch = len(jobs)
            jobs = [j for j in jobs if not j.future.done()]  # callers that gave up
            if not jobs:
                continue
            ran = True
            try:
                results = await loop.run_in_executor(self.pool, self._run, [(j.prompt, j.model) for j in jobs])
            except Exception as exc:  # noqa: BLE001 - answer every waiting caller
                logger.exception("predictor: proxy model batch of %d failed", len(jobs))
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(Unavailable("failed", str(exc)))
                continue
            for j, r in zip(jobs, results):
                if not j.future.done():
                    j.future.set_result(r)

    def _run(self, items: list[tuple[str, str]]) -> list[ModelResult]:
        """In the model thread: one padded batch per length bucket (one batch for the lexical tier)."""
        pred = self.predictor
        ids = pred.token_ids([p for p, _ in items])
        groups: dict[int, list[int]] = {}
        bucketed = getattr(pred, "bucketed", True)
        for i, x in enumerate(ids):
            key = bucket_length(len(x), self.bucket_step, pred.meta.max_length) if bucketed else 0
            groups.setdefault(key, []).append(i)
        out: list[ModelResult | None] = [None] * len(items)
        for idx in groups.values():
            t = time.perf_counter()
            answers, keys = pred.predict([items[i][0] for i in idx], [items[i][1] for i in idx],
                                         ids=[ids[i] for i in idx])
            ms = (time.perf_counter() - t) * 1000
            for k, i in enumerate(idx):
                a = answers[k]
                out[i] = ModelResult(a.length_class, a.tokens, a.value, a.known_model,
                                     None if keys is None else keys[k], len(idx), ms)
            self.batches += 1
        self.items += len(items)
        return out  # type: ignore[return-value]
