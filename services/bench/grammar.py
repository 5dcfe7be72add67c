"""Per-token overhead of structured outputs on the `hf` engine (docs/benchmarks/structured-outputs.md).

    HF_HUB_OFFLINE=1 polyserve bench grammar [--rows 8] [--tokens 64] [--repeats 3]

Runs the small random Llama on the CPU: `rows` rows decoding `tokens` tokens each, free and under
a regex that never ends early (`[a-z0-9]{N}`: every step masked, so the cost per token is the
mask's), and a small JSON schema (which ends when the object is complete). Prints tokens/s
(best of `repeats`) and the mask cost per row-token."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import types

from polyserve.proto import SamplingParams, StructuredOutput
from polyserve.worker.engine import Delta, EngineRequest
from polyserve.worker.engines import hf_grammar
from polyserve.worker.engines.hf import HfEngine

MASKED = {"s": 0.0, "rows": 0}  # time spent in hf_grammar.mask_rows, row-steps masked


def _timed(mask_rows):
    def wrapper(logits, rows):
        t = time.perf_counter()
        mask_rows(logits, rows)
        MASKED["s"] += time.perf_counter() - t
        MASKED["rows"] += sum(r.guide is not None for r in rows)
    return wrapper

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["color", "n", "tags"], "additionalProperties": False}


async def _run(engine: HfEngine, rid: str, rows: int, params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = 0
    async for ev in engine.generate(EngineRequest(rid, "benchmark prompt", params)):
        if isinstance(ev, Delta):
            tokens += ev.tokens
    return tokens, time.perf_counter() - start


async def run(rows: int, n_tokens: int, repeats: int) -> dict[str, tuple[float, int]]:
    engine = HfEngine(types.SimpleNamespace(model="tiny-random", model_path="", device="cpu", dtype="float32",
                                            max_batch=rows, max_waiting=8, kv_capacity_tokens=1 << 20,
                                            max_input_len=512))
    await engine.start()
    hf_grammar.mask_rows = _timed(hf_grammar.mask_rows)
    cases = {
        "free": SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens, n=rows, seed=1),
        "regex": SamplingParams(max_tokens=n_tokens, n=rows, seed=1,
                                structured=StructuredOutput(regex=f"[a-z0-9]{{{n_tokens * 8}}}")),
        "json_schema": SamplingParams(max_tokens=n_tokens, n=rows, seed=1,
                                      structured=StructuredOutput(json=json.dumps(SCHEMA))),
    }
    out = {}
    try:
        await _run(engine, "warm", rows, cases["regex"])
        for name, params in cases.items():
            runs = [await _run(engine, f"{name}-{i}", rows, params) for i in range(repeats)]
            best = max(runs, key=lambda r: r[0] / r[1])
            out[name] = (best[0] / best[1], best[0])
    finally:
        await engine.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="polyserve bench grammar", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.rows, a.tokens, a.repeats))
    free = res["free"][0]
    for name, (tps, tokens) in res.items():
        extra = (1 / tps - 1 / free) * 1e3 if name != "free" else 0.0
        print(f"{name:12s} {tps:8.1f} tokens/s ({tokens} tokens, {a.rows} rows)  "
              f"overhead {extra:+.3f} ms per generated token")
    print(f"mask (llguidance bitmask + unpack + fill): {MASKED['s'] / max(MASKED['rows'], 1) * 1e3:.3f} ms per "
          f"row-token over {MASKED['rows']} row-tokens")
    return 0
