"""Process-wide torch settings for a CUDA device that every model runner here shares (the hf
engine, the encoder engine, the predictor's MiniLM tier, the GPU benches). torch is imported only
when a CUDA device is named, so CPU-only callers pay nothing."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def planless_attention(device: "torch.device") -> None:
    """On CUDA, keep scaled-dot-product attention off cuDNN's backend (process-wide: a worker
    serves one model, a predictor one encoder).

    cuDNN builds an execution plan for each attention shape the first time it sees it (cuDNN's
    attention takes half types only, so float32 never reaches it). On an H200 (torch 2.11,
    docs/benchmarks/gpu.md) a 16-layer 2.4 GB bfloat16 Llama decoded at 88 ms/token over KV
    lengths it had not seen and 17 ms/token over the same lengths again, against 16-17 ms/token on
    the first pass with the flash / memory-efficient kernels. A server meets new lengths with every
    request, so the first pass is the one that counts."""
    if device.type == "cuda":
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
