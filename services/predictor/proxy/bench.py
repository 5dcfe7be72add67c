"""`polyserve predictor bench`: latency and throughput of the proxy model on this machine.

* p50/p99 latency at batch 1 for prompts of 32, 128, 256 and 512 tokens (the served
  model truncates prompts to its ``max_length``, 128 by default, so a 512-token
  prompt costs what a 128-token one does; ``unclipped`` shows the cost at 512);
* predictions/s with 16 and 64 concurrent requests through the service's
  micro-batcher (`runtime.ModelRunner`), with batches padded to length buckets
  and, for comparison, to the model maximum;
* the semantic cache's exact-search lookup time as it fills.

With several encoder precisions (``--precision fp32,bf16,int8``) each gets its
block of figures, the batch-1 calls of all of them interleaved so that the
background load weighs on each alike, and a last line gives the speed-up ratios.

With ``--device cuda`` the MiniLM tier runs on the GPU (its name and the CUDA build are
recorded); the lexical tier always runs on the CPU.

Figures are measured, on whatever else this machine is running at the time.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import numpy as np

from polyserve.shared import machine

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
    return latencies({"": pred}, n_tokens, iterations, model)[""]


def latencies(preds: dict, n_tokens: int, iterations: int, model: str) -> dict[str, dict]:
    """Batch-1 latency of each predictor, measured interleaved (one call of each in turn), so that
    what else runs on the machine weighs on all of them alike and their ratios hold."""
    any_pred = next(iter(preds.values()))
    p = prompt_of(any_pred.tok, n_tokens, seed=n_tokens)
    for pred in preds.values():
        for _ in range(3):
            pred.predict([p], [model])
    ts: dict[str, list[float]] = {k: [] for k in preds}
    for _ in range(iterations):
        for k, pred in preds.items():
            t = time.perf_counter()
            pred.predict([p], [model])
            ts[k].append((time.perf_counter() - t) * 1000)
    return {k: {"prompt_tokens": n_tokens, "p50_ms": round(_pct(v, 50), 2), "p99_ms": round(_pct(v, 99), 2),
                "mean_ms": round(statistics.mean(v), 2)} for k, v in ts.items()}


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
        int8: bool = False, precisions: tuple[str, ...] = ("auto",), concurrency: tuple[int, ...] = (1, 16, 64),
        pad_to_max: bool = True, device: str = "cpu") -> dict:
    """All figures as one dict (see the module docstring); with several `precisions` (a list is
    given side by side: batch-1 latencies interleaved, throughput runs one after the other) the
    result holds one dict per precision under ``runs``."""
    from polyserve.predictor.proxy import artifact

    # "shipped" / "minilm" name the packaged artifacts, as the service's proxy_artifact setting does
    names = {"shipped": "lexical", "lexical": "lexical", "minilm": "minilm"}
    path = str(artifact.default_dir(names[artifact_dir])) if artifact_dir in names else \
        artifact_dir or str(artifact.default_dir())
    preds = _load(path, encoder_dir, threads, bucket_step, ("int8",) if int8 else precisions, device)
    first = next(iter(preds.values()))
    model = first.meta.models[0] if first.meta.models else "unknown"
    import os

    runs = {k: {"artifact": path, "kind": p.meta.kind, "torch_threads": _threads(p), "max_length": p.meta.max_length,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                "precision": p.precision, "int8": p.precision == "int8", "max_batch": max_batch,
                "device": _device_name(p),
                "batch_wait_ms": batch_wait_ms, "bucket_step": bucket_step, "cache_keys": p.cache_keys,
                "batch1": []} for k, p in preds.items()}
    for n in (32, 128, 256, 512):
        for k, r in latencies(preds, n, iterations, model).items():
            runs[k]["batch1"].append(r)
    saved = first.meta.max_length
    for p in preds.values():
        p.meta.max_length = 512
    for k, r in latencies(preds, 512, max(5, iterations // 5), model).items():
        runs[k]["batch1_unclipped_512"] = r
    for p in preds.values():
        p.meta.max_length = saved

    # a mix of prompt lengths like the training data (median ~30 tokens, some long)
    lengths = [12, 20, 28, 28, 35, 45, 60, 90, 128, 24, 16, 30]
    prompts = [prompt_of(first.tok, n, seed=i) for i, n in enumerate(lengths)]
    for k, pred in preds.items():
        runs[k]["micro_batching_bucketed"] = asyncio.run(_runner_figures(
            pred, path, encoder_dir, prompts, model, concurrency, seconds, max_batch, batch_wait_ms, bucket_step,
            False))
        if pad_to_max and getattr(pred, "bucketed", True):
            runs[k]["micro_batching_pad_to_max"] = asyncio.run(_runner_figures(
                pred, path, encoder_dir, prompts, model, concurrency, seconds, max_batch, batch_wait_ms,
                bucket_step, True))
    lookup: list[dict] = []
    skipped = ""
    if first.dim:  # the lexical tier has no cache keys
        try:
            lookup = cache_lookup(first.dim)
        except ImportError as exc:  # faiss comes with the hf extra; a bare GPU image may lack it
            skipped = f"semantic cache lookup not measured: {exc}"
    for r in runs.values():
        r["cache_lookup"] = lookup
        if skipped:
            r["cache_lookup_skipped"] = skipped
        r["machine"] = machine.describe()
    if len(runs) == 1:
        return next(iter(runs.values()))
    return {"runs": runs}


def _device_name(pred) -> str:
    """Where `pred` runs: "cpu", or the GPU's name and torch's CUDA version."""
    dev = getattr(pred, "device", None)
    if dev is None or dev.type == "cpu":
        return "cpu"
    import torch

    return f"{dev} {torch.cuda.get_device_name(dev)} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def _load(path: str, encoder_dir, threads: int, bucket_step: int, precisions: tuple[str, ...],
          device: str = "cpu") -> dict:
    """The predictors to measure: the lexical artifact as it is, or a MiniLM artifact per precision."""
    from polyserve.predictor.proxy import artifact

    if artifact.read_meta(path).kind == "lexical-gbm":
        from polyserve.predictor.proxy.lexical import LexicalPredictor

        return {"lexical": LexicalPredictor.load(path, encoder_dir)}
    from polyserve.predictor.proxy.runtime import passive_openmp

    passive_openmp()  # as the service does
    import torch
    from transformers.utils import logging as hf_logging

    from polyserve.predictor.proxy.infer import ProxyPredictor

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    preds: dict = {}
    for pr in precisions:
        pred = ProxyPredictor.load(path, encoder_dir, bucket_step=bucket_step, precision=pr, device=device)
        preds[pred.precision if pred.precision not in preds else f"{pred.precision}#{len(preds)}"] = pred
    return preds


def _threads(pred) -> int:
    """torch's intra-op threads for the MiniLM tier; the lexical tier predicts on one thread."""
    if getattr(pred, "precision", "") == "lexical":
        return 1
    import torch

    return torch.get_num_threads()


async def _runner_figures(pred, path, encoder_dir, prompts, model, concurrency, seconds, max_batch, batch_wait_ms,
                          bucket_step, pad_to_max: bool) -> list[dict]:
    from polyserve.predictor.proxy.runtime import ModelRunner

    runner = ModelRunner(path, encoder_dir, max_batch=max_batch, batch_wait_ms=batch_wait_ms, max_queue=1024,
                         bucket_step=bucket_step)
    runner.predictor, runner.state = pred, "ready"
    if pad_to_max:
        orig = pred.predict
        pred.predict = lambda ps, ms, **kw: orig(ps, ms, pad_to_max=True, ids=kw.get("ids"))  # type: ignore
    runner._task = asyncio.create_task(runner._batcher())
    try:
        return [await throughput(runner, prompts, model, c, seconds) for c in concurrency]
    finally:
        if pad_to_max:
            del pred.predict  # back to the method
        runner._task.cancel()
        runner.pool.shutdown(wait=False)


def render(res: dict) -> str:
    """The figures as text (measured on this machine; load average shown)."""
    if "runs" in res:
        blocks = [render(r) for r in res["runs"].values()]
        names = list(res["runs"])
        base = res["runs"][names[0]]
        ratio = [f"side by side (batch-1 p50 of {names[0]} / each):"]
        for k in names[1:]:
            cells = [f"{b['prompt_tokens']} tok {b['p50_ms'] / max(1e-9, r['p50_ms']):.2f}x"
                     for b, r in zip(base["batch1"], res["runs"][k]["batch1"])]
            ratio.append(f"  {k}: " + ", ".join(cells))
        return "\n\n".join(blocks + ["\n".join(ratio)])
    import os

    lines = [(f"artifact {res['artifact']}: torch threads {res['torch_threads']} "
              f"(OpenMP wait {res.get('omp_wait_policy', 'default')}), max_length {res['max_length']}, "
              f"encoder {res.get('precision', 'int8' if res.get('int8') else 'fp32')} on {res.get('device', 'cpu')}, "
              f"cache keys {res['cache_keys']}; {res.get('machine', {}).get('cpu', '')} "
              f"{'+'.join(res.get('machine', {}).get('simd', []))}; micro-batches of <= {res['max_batch']}, "
              f"wait {res['batch_wait_ms']} ms, buckets of {res['bucket_step']} tokens; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"),
             "batch 1 latency:"]
    for r in res["batch1"] + [dict(res["batch1_unclipped_512"], prompt_tokens="512 unclipped")]:
        lines.append(f"  {r['prompt_tokens']!s:>14} tokens  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms")
    for key, name in (("micro_batching_bucketed", "bucketed padding"), ("micro_batching_pad_to_max", "pad to max")):
        if key not in res:
            continue
        lines.append(f"micro-batching, {name}:")
        for r in res[key]:
            lines.append(f"  {r['concurrency']:3d} concurrent  {r['predictions_per_s']:7.1f} predictions/s  "
                         f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms")
    if "micro_batching_pad_to_max" in res:
        gains = [f"{b['concurrency']} concurrent {b['predictions_per_s'] / max(1e-9, m['predictions_per_s']):.2f}x"
                 for b, m in zip(res["micro_batching_bucketed"], res["micro_batching_pad_to_max"])]
        lines.append("padding gain (bucketed / pad to max, predictions/s): " + ", ".join(gains))
    if res.get("cache_lookup_skipped"):
        lines.append(res["cache_lookup_skipped"])
    if res["cache_lookup"]:
        lines.append("semantic cache exact search (1 query):")
        for r in res["cache_lookup"]:
            lines.append(f"  {r['entries']:7d} entries  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms")
    return "\n".join(lines)
