"""Encoder runtimes for polymorphing (Arlo §2.3, §3.3): one BERT-family model prepared
for one input shape.

A *static* runtime takes exactly `[batch_size, max_length]`: every batch is padded
to that shape (missing rows too), so it pays for the padding but runs a graph
specialised for the shape. A *dynamic* runtime (Arlo's DT scheme) takes any
length: a batch is padded only to its longest row.

Backends (measured on this 2-core Xeon by `polyserve profile --encoder`):

* ``jit`` (default): TorchScript trace + freeze at the shape. On this CPU it runs
  as fast as `torch.compile(dynamic=False)` at batch 1 (12.1 / 21.4 / 94.9 ms vs
  12.3 / 22.8 / 96.9 ms at lengths 64 / 128 / 512, best of 15) and prepares a
  shape in 0.2-0.7 s instead of 5-20 s, with no C++ toolchain at run time. torch
  2.13 marks TorchScript deprecated (a warning); it is traced with a padded mask
  so no "mask is all ones" fast path is baked into the graph.
* ``compile``: `torch.compile(dynamic=False)` (Inductor C++/OpenMP kernels for the
  one shape; the dynamic runtime uses `dynamic=True`); cached on disk by Inductor.
* ``eager``: plain PyTorch on the padded tensors (no preparation). The default DT
  runtime: eager PyTorch on unpadded input is this CPU's dynamic-shape runtime,
  about 10% slower than a static graph of the same length.

Pooling and normalisation follow the checkpoint's sentence-transformers modules
(all-MiniLM-L6-v2: mean over real tokens, then L2-normalise), so the vectors
equal `SentenceTransformer.encode` within float tolerance.
"""
from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from polyserve.core.encoder_text import (
    DEFAULT_MODEL,
    EncoderNotFound,
    TextTokenizer,
    load_text_tokenizer,
    resolve_model_dir,
    truncate_ids,
)
from polyserve.core.torch_cuda import planless_attention

logger = logging.getLogger(__name__)

BACKENDS = ("compile", "jit", "eager")
SHAPES = ("static", "dynamic")


class EncoderRuntimeError(RuntimeError):
    """A runtime cannot be built or cannot take an input (message says why)."""


__all__ = ["BACKENDS", "SHAPES", "EncoderModel", "EncoderNotFound", "EncoderRuntimeError", "Pooled", "Pooling",
           "Runtime", "load_encoder", "read_pooling", "resolve_model_dir", "truncate_ids"]


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector (sentence-transformers' Pooling + Normalize)."""

    mode: str = "mean"  # "mean" | "cls" | "max"
    normalize: bool = True


def read_pooling(model_dir: Path) -> Pooling:
    """The pooling of a sentence-transformers checkpoint; mean + normalise when unspecified."""
    modules = model_dir / "modules.json"
    pool_dir, normalize = model_dir / "1_Pooling", True
    if modules.is_file():
        entries = json.loads(modules.read_text())
        types = [e.get("type", "") for e in entries]
        normalize = any(t.endswith("Normalize") for t in types)
        for e in entries:
            if e.get("type", "").endswith("Pooling"):
                pool_dir = model_dir / e.get("path", "1_Pooling")
    mode = "mean"
    cfg = pool_dir / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        if c.get("pooling_mode_cls_token"):
            mode = "cls"
        elif c.get("pooling_mode_max_tokens"):
            mode = "max"
    return Pooling(mode=mode, normalize=normalize)


class Pooled(torch.nn.Module):
    """Transformer + pooling + normalisation as one module: (ids, mask) -> [batch, dim]."""

    def __init__(self, model: torch.nn.Module, pooling: Pooling):
        super().__init__()
        self.model = model
        self.mode = pooling.mode
        self.normalize = pooling.normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.mode == "cls":
            emb = h[:, 0]
        elif self.mode == "max":
            emb = h.masked_fill(attention_mask.unsqueeze(-1) == 0, -1e9).max(dim=1).values
        else:
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            emb = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=1)
        return emb


@dataclass
class EncoderModel:
    """A loaded encoder: the pooled module, its tokenizer and limits."""

    module: Pooled
    tokenizer: TextTokenizer
    name: str
    source: str
    max_positions: int
    dim: int
    pad_id: int
    cls_id: int | None
    sep_id: int | None
    device: torch.device

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the special tokens, untruncated."""
        return self.tokenizer.encode(texts)


def load_encoder(model_path: str = "", device: str = "cpu", dtype: str = "float32",
                 name: str = "") -> EncoderModel:
    """Load the checkpoint (default: packaged all-MiniLM-L6-v2) in eval mode."""
    from transformers import AutoConfig, AutoModel

    try:
        model_dir = resolve_model_dir(model_path)
        tok = load_text_tokenizer(str(model_dir))
    except EncoderNotFound as exc:
        raise EncoderRuntimeError(str(exc)) from exc
    dev = torch.device(device)
    planless_attention(dev)
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise EncoderRuntimeError(f"dtype {dtype!r} is not float32, float16 or bfloat16")
    cfg = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), dtype=dt).to(dev).eval()
    pooled = Pooled(model, read_pooling(model_dir)).eval()
    max_pos = int(getattr(cfg, "max_position_embeddings", 512) or 512)
    return EncoderModel(module=pooled, tokenizer=tok, name=name or (DEFAULT_MODEL if not model_path else
                                                                     model_dir.name),
                        source=str(model_dir), max_positions=max_pos, dim=int(cfg.hidden_size),
                        pad_id=tok.pad_id, cls_id=tok.cls_id, sep_id=tok.sep_id,
                        device=dev)


class Runtime:
    """One prepared shape of an encoder. `run(rows)` embeds up to `batch_size` rows of ids."""

    def __init__(self, enc: EncoderModel, *, batch_size: int, max_length: int, shape: str = "static",
                 backend: str = "compile"):
        if shape not in SHAPES:
            raise EncoderRuntimeError(f"shape {shape!r} is not one of {SHAPES}")
        if backend not in BACKENDS:
            raise EncoderRuntimeError(f"backend {backend!r} is not one of {BACKENDS}")
        if not 1 <= max_length <= enc.max_positions:
            raise EncoderRuntimeError(f"max_length {max_length} must be between 1 and the model's "
                                f"{enc.max_positions} positions")
        if batch_size < 1:
            raise EncoderRuntimeError("batch_size must be >= 1")
        self.enc = enc
        self.batch_size = batch_size
        self.max_length = max_length
        self.shape = shape
        self.backend = backend
        self._fn = None
        self.prepare_s = 0.0

    @property
    def name(self) -> str:
        if self.shape == "dynamic":
            return f"dynamic-b{self.batch_size}-{self.backend}"
        return f"static-b{self.batch_size}-l{self.max_length}-{self.backend}"

    def _example(self, length: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((rows, length), self.enc.pad_id, dtype=torch.long, device=self.enc.device)
        ids[:, 0] = self.enc.cls_id if self.enc.cls_id is not None else 1
        mask = torch.ones((rows, length), dtype=torch.long, device=self.enc.device)
        if length > 2:  # a padded row, so no "mask is all ones" fast path gets baked in
            mask[-1, length // 2:] = 0
        return ids, mask

    def prepare(self) -> "Runtime":
        """Build the graph for the shape and warm it up (blocking; call in a thread)."""
        t = time.perf_counter()
        module = self.enc.module
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.backend == "eager":
                self._fn = module
            elif self.backend == "jit":
                if self.shape == "dynamic":
                    raise EncoderRuntimeError("the jit backend traces one shape; use compile or eager for dynamic")
                ids, mask = self._example(self.max_length, self.batch_size)
                with torch.inference_mode():
                    traced = torch.jit.trace(module, (ids, mask), check_trace=False, strict=False)
                    self._fn = torch.jit.freeze(traced.eval())
            else:
                self._fn = torch.compile(module, dynamic=self.shape == "dynamic", fullgraph=False)
            # warm-up: compiling / trace optimisation happens on the first calls
            if self.shape == "static":
                lengths = [self.max_length]
            else:  # a dynamic graph is compiled on a short and a longer example; eager needs little
                lengths = [min(16, self.max_length)] + ([self.max_length] if self.backend == "compile" else [])
            for length in lengths:
                ids, mask = self._example(length, self.batch_size)
                with torch.inference_mode():
                    for _ in range(1 if self.backend == "eager" else 2):
                        self._fn(ids, mask)
        self.prepare_s = time.perf_counter() - t
        return self

    def tensors(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad `rows` to the runtime's shape: static -> [batch_size, max_length] (dummy rows
        are [CLS][SEP]); dynamic -> [len(rows), longest row]."""
        if not rows or len(rows) > self.batch_size:
            raise EncoderRuntimeError(f"a batch takes 1 to {self.batch_size} rows, got {len(rows)}")
        longest = max(len(r) for r in rows)
        if longest > self.max_length:
            raise EncoderRuntimeError(f"a row of {longest} tokens exceeds max_length {self.max_length}")
        if self.shape == "static":
            n, length = self.batch_size, self.max_length
        else:
            n, length = len(rows), max(1, longest)
        ids = torch.full((n, length), self.enc.pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i in range(n):
            row = rows[i] if i < len(rows) else self._dummy()
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        return ids.to(self.enc.device), mask.to(self.enc.device)

    def _dummy(self) -> list[int]:
        return [t for t in (self.enc.cls_id, self.enc.sep_id) if t is not None] or [self.enc.pad_id]

    def run(self, rows: list[list[int]]) -> torch.Tensor:
        """Embed the rows (blocking): a float32 CPU tensor [len(rows), dim]."""
        if self._fn is None:
            raise EncoderRuntimeError("runtime not prepared; call prepare() first")
        ids, mask = self.tensors(rows)
        with torch.inference_mode():
            out = self._fn(ids, mask)
        return out[:len(rows)].float().cpu()

    def time_batch(self, rows: int | None = None, length: int | None = None, repeats: int = 5) -> float:
        """Median latency (ms) of one full batch; `length`/`rows` pick the input for dynamic runtimes."""
        n = rows or self.batch_size
        length = length or self.max_length
        row = self._dummy()[:1] + [1000] * max(0, length - 2) + self._dummy()[1:]
        batch = [row[:length]] * n
        samples = []
        for _ in range(max(1, repeats)):
            t = time.perf_counter()
            self.run(batch)
            samples.append((time.perf_counter() - t) * 1e3)
        samples.sort()
        return samples[len(samples) // 2]
