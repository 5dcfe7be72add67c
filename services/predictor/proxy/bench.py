"""`polyserve predictor bench`: latency and throughput of the proxy model on this machine.

* p50/p99 latency at batch 1 for prompts of 32, 128 and 512 tokens (the served
  model truncates prompts to its ``max_length``, 128 by default, so a 512-token
  prompt costs what a 128-token one does; ``unclipped`` shows the cost at 512);
* predictions/s with 16 and 64 concurrent requests through the service's
  micro-batcher (`runtime.ModelRunner`), with batches padded to length buckets
  and, for comparison, to the model maximum;
* the semantic cache's exact-search lookup time as it fills.

Figures are measured, on whatever else this machine is running at the time.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import numpy as np

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "explain write summarise list compare describe translate code python function story poem").split()


def prompt_of(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """A prompt of about `n_tokens` tokens (without [CLS]/[SEP])."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < n_tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def latency(pred, n_tokens: int, iterations: int, model: str) -> dict:
    p = prompt_of(pred.tok, n_tokens, seed=n_tokens)
    for _ in range(3):
        pred.predict([p], [model])
    ts = []
    for _ in range(iterations):
        t = time.perf_counter()
        pred.predict([p], [model])
        ts.append((time.perf_counter() - t) * 1000)
    return {"prompt_tokens": n_tokens, "p50_ms": round(_pct(ts, 50), 2), "p99_ms": round(_pct(ts, 99), 2),
            "mean_ms": round(statistics.mean(ts), 2)}


async def throughput(runner, prompts: list[str], model: str, concurrency: int, seconds: float) -> dict:
    done = 0
    lat: list[float] = []
    stop = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal done
        k = i
        while time.monotonic() < stop:
            t = time.perf_counter()
            await runner.predict(prompts[k % len(prompts)], model, 30.0)
            lat.append((time.perf_counter() - t) * 1000)
            done += 1
            k += concurrency

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.monotonic() - t0
    return {"concurrency": concurrency, "predictions_per_s": round(done / wall, 1), "p50_ms": round(_pct(lat, 50), 1),
            "p99_ms": round(_pct(lat, 99), 1), "batches": runner.batches}


def cache_lookup(dim: int, sizes=(1_000, 10_000, 20_000, 50_000), queries: int = 200) -> list[dict]:
    from polyserve.predictor.proxy.cache import SemanticCache

    rng = np.random.default_rng(0)
    out = []
    for n in sizes:
        c = SemanticCache(dim, max_entries=n)
        vecs = rng.standard_normal((n, dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        idx = c._index("m")
        idx.add_with_ids(vecs, np.arange(1, n + 1, dtype=np.int64))
        ts = []
        for q in vecs[:queries]:
            t = time.perf_counter()
            idx.search(q[None, :], 1)
            ts.append((time.perf_counter() - t) * 1000)
        out.append({"entries": n, "p50_ms": round(_pct(ts, 50), 3), "p99_ms": round(_pct(ts, 99), 3)})
    return out


def run(artifact_dir: str | None, encoder_dir: str | None = None, *, threads: int = 0, iterations: int = 50,
        seconds: float = 5.0, max_batch: int = 16, batch_wait_ms: float = 2.0, bucket_step: int = 64,
        int8: bool = False) -> dict:
    """All figures as one dict (see the module docstring)."""
    import torch
    from transformers.utils import logging as hf_logging

    from polyserve.predictor.proxy import artifact
    from polyserve.predictor.proxy.infer import ProxyPredictor
    from polyserve.predictor.proxy.runtime import ModelRunner

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    path = artifact_dir or str(artifact.default_dir())
    pred = ProxyPredictor.load(path, encoder_dir, bucket_step=bucket_step, int8=int8)
    model = pred.meta.models[0] if pred.meta.models else "unknown"
    res: dict = {"artifact": path, "torch_threads": torch.get_num_threads(), "max_length": pred.meta.max_length,
                 "int8": int8, "max_batch": max_batch, "batch_wait_ms": batch_wait_ms, "bucket_step": bucket_step,
                 "cache_keys": pred.cache_keys, "batch1": [latency(pred, n, iterations, model) for n in (32, 128, 512)]}
    pred.meta.max_length, saved = 512, pred.meta.max_length
    res["batch1_unclipped_512"] = latency(pred, 512, max(5, iterations // 5), model)
    pred.meta.max_length = saved

    # a mix of prompt lengths like the training data (median ~30 tokens, some long)
    lengths = [12, 20, 28, 28, 35, 45, 60, 90, 128, 24, 16, 30]
    prompts = [prompt_of(pred.tok, n, seed=i) for i, n in enumerate(lengths)]

    async def runner_figures(pad_to_max: bool) -> list[dict]:
        runner = ModelRunner(path, encoder_dir, max_batch=max_batch, batch_wait_ms=batch_wait_ms, max_queue=1024,
                             bucket_step=bucket_step)
        runner.predictor, runner.state = pred, "ready"
        if pad_to_max:
            orig = pred.predict
            pred.predict = lambda ps, ms, **kw: orig(ps, ms, pad_to_max=True, ids=kw.get("ids"))  # type: ignore
        runner._task = asyncio.create_task(runner._batcher())
        try:
            return [await throughput(runner, prompts, model, c, seconds) for c in (1, 16, 64)]
        finally:
            if pad_to_max:
                pred.predict = orig  # type: ignore[method-assign]
            runner._task.cancel()
            runner.pool.shutdown(wait=False)

    res["micro_batching_bucketed"] = asyncio.run(runner_figures(False))
    res["micro_batching_pad_to_max"] = asyncio.run(runner_figures(True))
    res["cache_lookup"] = cache_lookup(pred.dim)
    return res


def render(res: dict) -> str:
    """The figures as text (measured on this machine; load average shown)."""
    import os

    lines = [f"artifact {res['artifact']}: torch threads {res['torch_threads']}, max_length {res['max_length']}, "
             f"cache keys {res['cache_keys']}{', int8' if res.get('int8') else ''}; micro-batches of <= {res['max_batch']}, wait {res['batch_wait_ms']} ms, "
             f"buckets of {res['bucket_step']} tokens; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
             "batch 1 latency:"]
    for r in res["batch1"] + [dict(res["batch1_unclipped_512"], prompt_tokens="512 unclipped")]:
        lines.append(f"  {r['prompt_tokens']!s:>14} tokens  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms")
    for key, name in (("micro_batching_bucketed", "bucketed padding"), ("micro_batching_pad_to_max", "pad to max")):
        lines.append(f"micro-batching, {name}:")
        for r in res[key]:
            lines.append(f"  {r['concurrency']:3d} concurrent  {r['predictions_per_s']:7.1f} predictions/s  "
                         f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms")
    lines.append("semantic cache exact search (1 query):")
    for r in res["cache_lookup"]:
        lines.append(f"  {r['entries']:7d} entries  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms")
    return "\n".join(lines)
