"""A loaded predictor artifact: prompts (+ target models) -> length class, token estimate, value.

Blocking and CPU-bound: the service calls it from a worker thread
(`runtime.ModelRunner`). A batch is padded only to its length bucket
(`buckets.bucket_length`: 64, 128, 192, ...), not to `max_length`; a lone prompt is not padded.

The encoder runs in float32, bfloat16 (default where the CPU has AMX /
AVX512-BF16: about 2x faster at batch 1 and 4x on batches, same test accuracy) or
dynamic int8 (CPU only; `resolve_precision`); the pooled
vectors and the head are float32. ``device`` puts encoder and head on a CUDA GPU
(``"cuda"``, ``"cuda:1"``); token ids go there per batch and the answers come back
to the CPU, so a prediction's time includes the GPU's synchronisation.

The same encoder pass also yields the semantic-cache key of each prompt: the
L2-normalised mean of the last hidden states (sentence-transformers' pooling
for all-MiniLM-L6-v2). ``cache_keys="tuned"`` (default) takes it from the
fine-tuned encoder, in the same pass; ``"base"`` from the published encoder
(adapter disabled: one more encoder pass) so that keys do not change when the
artifact is retrained. Measured with the shipped artifact, the tuned keys keep
the meaning of the 0.8 threshold: ten hand-written paraphrase pairs have cosine
0.85-0.97 either way, and 0.30% (tuned) vs 0.21% (base) of pairs of distinct
test prompts reach 0.8. `key_space` names the embedding, so a cache never
mixes keys of two encoders.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from polyserve.core.torch_cuda import planless_attention
from polyserve.predictor.proxy import artifact
from polyserve.predictor.proxy import encoder as enc_mod
from polyserve.predictor.proxy import model as M
from polyserve.predictor.proxy.buckets import bucket_length

logger = logging.getLogger(__name__)


def resolve_device(device: str | None) -> torch.device:
    """`device` ("cpu", "cuda", "cuda:N"; None/"" = cpu) as a torch device; ValueError when it
    names no device torch can use here (a CUDA one without a GPU, say)."""
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: give cpu, cuda or cuda:N") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: give cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU here")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def resolve_precision(meta: artifact.Meta, precision: str | None, device: torch.device | None = None) -> str:
    """The encoder precision to serve `meta`'s artifact with (see `ProxyPredictor.load`)."""
    cuda = device is not None and device.type == "cuda"
    if precision in (None, "", "auto"):
        # on a GPU fp32: MiniLM at these batch sizes is bound by kernel launches there, and bf16 was
        # no faster on an H100 (docs/benchmarks/gpu.md). On the CPU int8 only when the head was fitted
        # on int8 features; otherwise bf16 where the CPU runs it natively (measured: the fp32-fitted
        # shipped head keeps its test accuracy in bf16), else fp32
        if cuda:
            precision = "fp32"
        else:
            precision = "int8" if meta.precision == "int8" else "bf16" if M.bf16_fast() else "fp32"
    if precision not in M.PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of auto, {', '.join(M.PRECISIONS)}")
    if precision == "int8" and cuda:
        raise ValueError("precision int8 (torch's dynamic quantization) runs on the CPU only: "
                         "on a CUDA device give fp32 or bf16")
    return precision


@dataclass(frozen=True, slots=True)
class ProxyAnswer:
    length_class: int
    tokens: int
    value: float
    known_model: bool


class ProxyPredictor:
    """Encoder + LoRA + head of one artifact, ready for inference (eval mode, no grad)."""

    def __init__(self, meta: artifact.Meta, encoder, head: M.Head, tokenizer, *, bucket_step: int = 64,
                 cache_keys: str = "tuned", key_space: str = "base", precision: str = "fp32",
                 device: torch.device | str = "cpu"):
        self.meta = meta
        self.device = torch.device(device)
        planless_attention(self.device)  # bf16 MiniLM on CUDA: see core.torch_cuda
        self.encoder = encoder.eval().to(self.device)
        self.head = head.eval().to(self.device)
        self.tok = tokenizer
        self.pad_id = tokenizer.pad_token_id or 0
        self.bucket_step = bucket_step
        self.cache_keys = cache_keys  # "base" | "tuned" | "none"
        self.key_space = key_space
        self.scale = M.LogScale(meta.log_mean, meta.log_std)
        self.dim = encoder.config.hidden_size
        self.precision = precision

    @classmethod
    def load(cls, path: str | Path, encoder_dir: str | None = None, *, bucket_step: int = 64,
             cache_keys: str = "tuned", int8: bool = False, precision: str | None = None,
             device: str | None = None) -> "ProxyPredictor":
        """Load an artifact; ArtifactError when it is missing or was trained with another tokenizer.

        `precision` of the encoder (`model.to_precision`): ``fp32``, ``bf16`` or
        ``int8``; None or ``auto``: int8 when the artifact's head was fitted on
        int8 features (`Meta.precision`), else bf16 when this CPU runs bfloat16
        natively (`model.bf16_fast`: AMX or AVX512-BF16), else fp32.
        `int8=True` is ``precision="int8"``. `device`: see `resolve_device` (int8 is CPU-only;
        ``auto`` on a GPU is fp32)."""
        meta = artifact.read_meta(path)
        dev = resolve_device(device)
        precision = resolve_precision(meta, "int8" if int8 else precision, dev)
        enc_dir = enc_mod.resolve_encoder_dir(encoder_dir)
        fp = enc_mod.tokenizer_fingerprint(enc_dir)
        if fp != meta.tokenizer_fingerprint:
            raise artifact.ArtifactError(f"artifact {path} was trained with tokenizer {meta.tokenizer} "
                                         f"({meta.tokenizer_fingerprint}), the encoder at {enc_dir} has {fp}")
        meta, head_state, lora_state = artifact.load(path)
        tok = enc_mod.load_tokenizer(str(enc_dir))
        if meta.lora_rank > 0 and cache_keys != "base":
            # the adapter folded into the weights: a plain BERT forward, no per-layer LoRA matmuls
            encoder = M.load_merged_encoder(str(enc_dir), meta.lora_rank, lora_state)
        else:  # keep the adapter apart: cache keys come from the encoder with it disabled
            encoder = M.load_encoder(str(enc_dir), meta.lora_rank, lora_state, meta.lora_targets)
        head = M.Head(M.HeadConfig(hidden_size=encoder.config.hidden_size, num_models=len(meta.models),
                                   objective=meta.objective, model_dim=meta.model_dim,
                                   head_hidden=meta.head_hidden))
        head.load_state_dict(head_state)
        encoder = M.to_precision(encoder.eval(), precision)
        space = "base" if not encoder_dir else \
            "base-" + hashlib.sha256(str(enc_dir.resolve()).encode()).hexdigest()[:8]
        if meta.lora_rank > 0 and cache_keys == "tuned":
            space = "lora-" + hashlib.sha256((Path(path) / artifact.LORA).read_bytes()).hexdigest()[:12]
        return cls(meta, encoder, head, tok, bucket_step=bucket_step, cache_keys=cache_keys, key_space=space,
                   precision=precision, device=dev)

    # ---------------------------------------------------------------- inference
    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt, truncated to the artifact's max_length."""
        return self.tok(prompts, truncation=True, max_length=self.meta.max_length)["input_ids"]

    def _batch(self, ids: list[list[int]], pad_to_max: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(x) for x in ids)
        if pad_to_max:
            n = self.meta.max_length
        elif len(ids) == 1:
            n = longest  # nothing to align with: no padding at all
        else:
            n = bucket_length(longest, self.bucket_step, self.meta.max_length)
        n = max(n, longest)
        input_ids = torch.full((len(ids), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), n), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.as_tensor(x)
            mask[i, :len(x)] = 1
        if self.device.type != "cpu":
            return input_ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        return input_ids, mask

    @torch.inference_mode()
    def encode(self, prompts: list[str], *, with_keys: bool = True, pad_to_max: bool = False,
               ids: list[list[int]] | None = None) -> tuple[torch.Tensor, np.ndarray | None]:
        """(pooled vectors for the head, normalised cache keys or None); `ids` if already tokenized."""
        input_ids, mask = self._batch(ids if ids is not None else self.token_ids(prompts), pad_to_max)
        hidden = self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        pooled = M.pool(hidden, mask, self.meta.pooling)
        keys = None
        if with_keys and self.cache_keys != "none":
            if self.cache_keys == "base" and self.meta.lora_rank > 0:
                with self.encoder.disable_adapter():
                    base = self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
                keys = M.pool(base, mask, "mean")
            else:
                keys = M.pool(hidden, mask, "mean")
            keys = torch.nn.functional.normalize(keys.float(), dim=-1).cpu().numpy().astype(np.float32)
        return pooled, keys

    @torch.inference_mode()
    def answer(self, pooled: torch.Tensor, models: list[str]) -> list[ProxyAnswer]:
        midx = torch.as_tensor([self.meta.model_index(m) for m in models])
        out = self.head(pooled, midx.to(self.device)).float().cpu().numpy()
        mcs = [self.meta.classes_for(m) for m in models]
        value, cls, tokens = M.decode_outputs(self.meta.objective, out, mcs, self.scale)
        return [ProxyAnswer(int(c), int(t), float(v), bool(i)) for c, t, v, i in
                zip(cls, tokens, value, midx.tolist())]

    def predict(self, prompts: list[str], models: list[str], *, with_keys: bool = True,
                pad_to_max: bool = False,
                ids: list[list[int]] | None = None) -> tuple[list[ProxyAnswer], np.ndarray | None]:
        """Answers for (prompt, target model) pairs, and the prompts' cache keys."""
        if len(prompts) != len(models):
            raise ValueError("one target model per prompt")
        if not prompts:
            return [], None
        pooled, keys = self.encode(prompts, with_keys=with_keys, pad_to_max=pad_to_max, ids=ids)
        return self.answer(pooled, models), keys

    def cache_keys_of(self, prompts: list[str]) -> np.ndarray:
        """Normalised cache keys only (one or two encoder passes)."""
        _, keys = self.encode(prompts, with_keys=True)
        assert keys is not None
        return keys
