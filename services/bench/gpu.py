"""`polyserve bench gpu energy|roofline`: the GPU checks that need a real device (read-only).

* `energy`: the NVML energy counter (`nvmlDeviceGetTotalEnergyConsumption`, Volta and later)
  against power samples (`nvmlDeviceGetPowerUsage`) integrated over the same window, idle and
  under a matmul load, as `polyserve.gpu_agent.gpu.NvmlGpu` reads them. The gpu-agent's energy
  per request uses the counter when the GPU has one (`services/gpu_agent/energy.py`).
* `roofline`: decode tokens/s at batch 1 of the hf engine's random Llama on CUDA (sized with
  `--hidden`/`--layers` so weights dominate), against the memory-bandwidth bound: every decode
  step reads all weights once, so tokens/s <= bandwidth / weight bytes. The peak bandwidth is
  NVML's max memory clock x bus width x 2 (DDR), or `--peak-gb-s` when given. Timed as the hf
  engine decodes (one forward per token over a `DynamicCache`, `decode_rate`, with cuDNN's
  attention off as in the engine: `core.torch_cuda.planless_attention`) over KV lengths it has not
  seen, then over the same lengths again (`first_pass_over_repeat` well under 1 means a kernel is
  planned per new shape, which a server pays on every request), and, for comparison, through
  transformers' `generate()` (docs/benchmarks/gpu.md). `static_decode` times the lever the
  host-bound eager loop leaves: a `StaticCache` whose decode step is captured once as a CUDA graph
  and replayed per token (`graph_decode_tokens_per_s`, with how many of its tokens match the same
  static cache run eagerly: the graph must change the speed, not the tokens). The hf engine does not
  decode through graphs yet; this measures what they would buy.

Nothing here changes clocks, power limits or modes. Without an NVIDIA GPU it says so and
exits 2. Figures are printed with the device's name; record them with the device.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any


class NoGpu(RuntimeError):
    """No NVIDIA GPU (or NVML, or CUDA) here; the message says which."""


def _nvml_handle(index: int) -> tuple[Any, Any]:
    try:
        import pynvml as nvml

        nvml.nvmlInit()
        return nvml, nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # noqa: BLE001 - ImportError, library missing, no device
        raise NoGpu(f"no NVIDIA GPU through NVML ({exc})") from exc


def _burn(seconds: float, index: int) -> None:
    """A matmul loop on the GPU for `seconds` (so power is not idle)."""
    import torch

    dev = torch.device("cuda", index)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize(dev)


def energy(args: argparse.Namespace) -> dict:
    """Counter delta vs integrated power, idle then under load."""
    nvml, h = _nvml_handle(args.index)
    out = {"device": nvml.nvmlDeviceGetName(h), "windows": []}
    for label in ("idle", "load"):
        import threading

        # the load runs past the window at both ends (CUDA start-up before, queued kernels after), so
        # counter and samples see the same steady load over the same window
        lead = min(4.0, args.seconds)
        worker = threading.Thread(target=_burn, args=(args.seconds + 2 * lead, args.index)) if label == "load" \
            else None
        if worker:
            worker.start()
            time.sleep(lead)
        e0, t0, p_prev = nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3, time.monotonic(), None
        integrated, samples = 0.0, 0
        while time.monotonic() - t0 < args.seconds:
            time.sleep(args.interval)
            p, t = nvml.nvmlDeviceGetPowerUsage(h) / 1e3, time.monotonic()
            integrated += (p if p_prev is None else (p + p_prev[0]) / 2) * (t - (p_prev[1] if p_prev else t0))
            p_prev, samples = (p, t), samples + 1
        counter = nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3 - e0  # the same window as the samples
        window = time.monotonic() - t0
        if worker:
            worker.join()
        out["windows"].append({"window": label, "seconds": round(window, 2), "samples": samples,
                               "counter_w": round(counter / window, 1), "samples_mean_w": round(integrated / window, 1),
                               "counter_j": round(counter, 1), "integrated_j": round(integrated, 1),
                               "integrated_over_counter": round(integrated / counter, 4) if counter else None})
    return out


def roofline(args: argparse.Namespace) -> dict:
    """Batch-1 decode tokens/s of a random Llama vs the memory-bandwidth bound."""
    import torch

    from polyserve.core.torch_cuda import planless_attention
    from polyserve.worker.engines.hf_model import build_random_model

    if not torch.cuda.is_available():
        raise NoGpu("torch sees no CUDA device")
    nvml, h = _nvml_handle(args.index)
    peak = args.peak_gb_s * 1e9 if args.peak_gb_s else (
        nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM) * 1e6 * nvml.nvmlDeviceGetMemoryBusWidth(h) / 8 * 2)
    arch = {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": max(1, args.hidden // 128), "num_key_value_heads": max(1, args.hidden // 128)}
    planless_attention(torch.device("cuda", args.index))  # as the hf engine decodes (core.torch_cuda)
    model = build_random_model(0, device=f"cuda:{args.index}", dtype=torch.bfloat16, arch=arch)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.ones(1, 16, dtype=torch.long, device=model.device)
    sync = torch.cuda.synchronize
    decode_rate(model, ids, 8, sync)  # warm-up
    tps = decode_rate(model, ids, args.tokens, sync)  # KV lengths mostly new: what a server meets
    repeat_tps = decode_rate(model, ids, args.tokens, sync)  # the same lengths again
    static_decode(model, ids, 8, sync, graph=True)  # warm-up
    static_tps, static_toks = static_decode(model, ids, args.tokens, sync, graph=False)
    graph_tps, graph_toks = static_decode(model, ids, args.tokens, sync, graph=True)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        sync()
        generate_tps = args.tokens / (time.perf_counter() - t)
    bound = peak / weight_bytes
    return {"device": nvml.nvmlDeviceGetName(h), "weights_gb": round(weight_bytes / 1e9, 3),
            "peak_gb_s": round(peak / 1e9, 1), "decode_tokens_per_s": round(tps, 1),
            "decode_repeat_tokens_per_s": round(repeat_tps, 1),
            # well under 1: some kernel is planned or compiled per new shape (cuDNN's attention was:
            # core.torch_cuda); a server pays the first pass
            "first_pass_over_repeat": round(tps / repeat_tps, 3),
            "generate_tokens_per_s": round(generate_tps, 1),
            "static_decode_tokens_per_s": round(static_tps, 1),
            "graph_decode_tokens_per_s": round(graph_tps, 1),
            "graph_tokens_same_as_static": f"{int((graph_toks == static_toks).sum())}/{args.tokens}",
            "graph_fraction_of_bound": round(graph_tps / bound, 3),
            "bound_tokens_per_s": round(bound, 1), "fraction_of_bound": round(tps / bound, 3),
            "achieved_gb_s": round(tps * weight_bytes / 1e9, 1)}


def decode_rate(model, ids, tokens: int, sync=lambda: None) -> float:
    """Greedy decode tokens/s at batch 1 after a prefill of `ids`, one forward per token over a
    `DynamicCache` as the hf engine decodes; `sync` waits for the device (CUDA) before each clock read."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        out = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync()
        t = time.perf_counter()
        for _ in range(tokens):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync()
        return tokens / (time.perf_counter() - t)


def static_decode(model, ids, tokens: int, sync=lambda: None, graph: bool = False):
    """Greedy decode at batch 1 over a `StaticCache` (fixed shapes: every step the same kernels on
    the same buffers), eagerly or (`graph`, CUDA only) by replaying one captured CUDA graph per token.
    Returns (tokens/s, the token ids). Nothing about the KV length may be decided on the host inside
    the graph, so the step gets an explicit additive mask and its position as device tensors, updated
    in place between replays."""
    import torch
    from transformers import StaticCache

    n = ids.shape[1]
    dev, dtype = ids.device, model.dtype
    with torch.inference_mode():
        cache = StaticCache(config=model.config, max_cache_len=n + tokens + 1)
        out = model(ids, past_key_values=cache, cache_position=torch.arange(n, device=dev), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        tok, pos = nxt.clone(), torch.tensor([n], device=dev)
        mask = torch.full((1, 1, 1, n + tokens + 1), torch.finfo(dtype).min, dtype=dtype, device=dev)
        mask[..., : n + 1] = 0

        def step():
            return model(tok, attention_mask=mask, past_key_values=cache, cache_position=pos,
                         use_cache=True).logits

        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                logits = step()
            # the warm-ups advanced each layer's write counter (a device tensor in transformers'
            # StaticLayer, which writes there, not at `cache_position`): back to the prompt's end
            for layer in cache.layers:
                layer.cumulative_length.fill_(n)
        sync()
        t = time.perf_counter()
        out_ids = []
        for i in range(tokens):
            tok.copy_(nxt)
            pos.fill_(n + i)
            mask[..., n + i] = 0
            if graph:
                g.replay()
            else:
                logits = step()
            nxt = logits[:, -1:].argmax(-1)
            out_ids.append(nxt)
        sync()
        return tokens / (time.perf_counter() - t), torch.cat(out_ids, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="polyserve bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=int, default=0, help="GPU index")
    ap.add_argument("--json", help="also write the figures to this file")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("energy", help="NVML energy counter vs integrated power samples, idle and under load")
    e.add_argument("--seconds", type=float, default=10.0)
    e.add_argument("--interval", type=float, default=0.05, help="seconds between power samples")
    e.set_defaults(fn=energy)
    r = sub.add_parser("roofline", help="batch-1 decode tokens/s vs the memory-bandwidth bound")
    r.add_argument("--hidden", type=int, default=2048)
    r.add_argument("--layers", type=int, default=16)
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--peak-gb-s", type=float, default=0.0, help="peak memory bandwidth (default: from NVML)")
    r.set_defaults(fn=roofline)
    args = ap.parse_args(argv)
    try:
        res = args.fn(args)
    except NoGpu as exc:
        print(f"polyserve bench gpu {args.cmd}: {exc}; nothing to measure on this machine")
        return 2
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
