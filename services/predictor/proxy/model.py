"""The proxy network: encoder (+ LoRA) -> pooled vector ++ target-model embedding -> 2-layer head.

µ-Serve §3.3 takes the last hidden state of [CLS] through a two-layer
feed-forward network to one real value. Here:

* **pooling** is ``cls`` (µ-Serve) or ``mean`` (mask-weighted mean of the last
  hidden states, what all-MiniLM-L6-v2 was trained with); training compares
  both and keeps the better (see `train.select_pooling`).
* **the target model is part of the input** as a learned embedding (32 values)
  concatenated to the pooled vector, so one shared predictor serves all models
  and the encoder runs once per prompt, whatever the number of models. Index 0 is
  "unknown model" (trained by dropping the model id of 10% of the rows), used
  for models the artifact has not seen.
* **the encoder is fine-tuned through LoRA** (rank 8 on every linear layer of
  the encoder by default, or on the attention query and value projections only),
  so that the artifact holds only the adapter and the head (about 1.1 MB) while
  the encoder weights come from their package.

Objectives (`OBJECTIVES`), as in µ-Serve Table 2: ``ordinal_mse`` (ours: one
value, MSE to the class index), ``ordinal_l1``, ``ce`` (five logits,
cross-entropy), ``reg_log_mse`` and ``reg_log_l1`` (one value, the standardised
log of the output length).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from polyserve.predictor.proxy import labels

OBJECTIVES = ("ordinal_mse", "ordinal_l1", "ce", "reg_log_mse", "reg_log_l1")
POOLINGS = ("cls", "mean")
UNKNOWN_MODEL = 0
LORA_TARGETS = ("query", "value")
LORA_ALL = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # of the encoder
    num_models: int  # known target models (the embedding has one more row: unknown)
    objective: str = "ordinal_mse"
    model_dim: int = 32
    head_hidden: int = 256
    dropout: float = 0.1

    @property
    def out_dim(self) -> int:
        return labels.NUM_CLASSES if self.objective == "ce" else 1


class Head(nn.Module):
    """[pooled ++ model embedding] -> Linear -> GELU -> Dropout -> Linear."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.model_emb = nn.Embedding(cfg.num_models + 1, cfg.model_dim)
        self.fc1 = nn.Linear(cfg.hidden_size + cfg.model_dim, cfg.head_hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.fc2 = nn.Linear(cfg.head_hidden, cfg.out_dim)
        nn.init.normal_(self.model_emb.weight, std=0.1)

    def forward(self, pooled: torch.Tensor, model_idx: torch.Tensor) -> torch.Tensor:
        x = torch.cat([pooled, self.model_emb(model_idx)], dim=-1)
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """[CLS] hidden state or the mask-weighted mean of the last hidden states."""
    if how == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def load_encoder(encoder_dir: str, lora_rank: int = 8, lora_state: dict | None = None,
                 targets: tuple[str, ...] | list[str] = LORA_TARGETS):
    """The BERT encoder from `encoder_dir`, with LoRA adapters (rank 0: none).

    With `lora_state` the adapters get those weights (an artifact); otherwise
    they start as peft initialises them (B = 0, so the encoder is unchanged)."""
    from transformers import AutoModel

    enc = AutoModel.from_pretrained(encoder_dir)
    if lora_rank <= 0:
        return enc
    import warnings

    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    # peft (get_peft_model, merge_and_unload) calls a transformers API deprecated in v5; this
    # narrow filter is global because catch_warnings() is not thread-safe (we load in a thread)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    cfg = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.05,
                     target_modules=list(targets), bias="none")
    enc = get_peft_model(enc, cfg)
    if lora_state is not None:
        result = set_peft_model_state_dict(enc, lora_state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"LoRA weights do not fit the encoder: unexpected {unexpected[:3]}")
    return enc


def load_merged_encoder(encoder_dir: str, lora_rank: int, lora_state: dict[str, torch.Tensor]):
    """The encoder with a LoRA adapter folded into its weights: W += (alpha / r) * B @ A.

    For inference: a plain BERT forward, and no peft at serving time. Gives the
    same weights as peft's `merge_and_unload` (tested)."""
    from transformers import AutoModel

    enc = AutoModel.from_pretrained(encoder_dir)
    modules = dict(enc.named_modules())
    scale = (2 * lora_rank) / lora_rank  # lora_alpha = 2r, as in `load_encoder`
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in lora_state.items():
        # peft keys: base_model.model.<module path>.lora_A.weight / .lora_B.weight
        path, _, rest = key.removeprefix("base_model.model.").partition(".lora_")
        pairs.setdefault(path, {})[rest.split(".")[0]] = tensor
    with torch.no_grad():
        for path, ab in pairs.items():
            if path not in modules or set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA weights do not fit the encoder: {path}")
            lin = modules[path]
            lin.weight += scale * (ab["B"].float() @ ab["A"].float()).to(lin.weight.dtype)
    return enc


# ------------------------------------------------------------------ serving precision
PRECISIONS = ("fp32", "bf16", "int8")


def bf16_fast() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (oneDNN: AVX512-BF16 or AMX); elsewhere bf16 is
    emulated and slower than float32."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def to_precision(encoder, precision: str):
    """The (merged, eval-mode) encoder for serving in `precision`.

    * ``fp32``: unchanged;
    * ``bf16``: every weight in bfloat16 (oneDNN runs the matmuls on AMX / AVX512-BF16
      where the CPU has them); the caller pools the hidden states in float32;
    * ``int8``: dynamic int8 quantization of the linear layers (weights int8,
      activations quantized per batch, fbgemm).

    Phase 2 of training can fit the head on the features of this very encoder
    (`train.TrainConfig.phase2_precision`), so that the head adapts to its rounding."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    if precision == "bf16":
        return encoder.to(torch.bfloat16)
    if precision == "int8":
        import warnings

        with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao
            warnings.simplefilter("ignore")
            return torch.ao.quantization.quantize_dynamic(encoder, {nn.Linear}, dtype=torch.qint8)
    return encoder


def lora_state_dict(encoder) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(encoder).items()}


# ------------------------------------------------------------------ objectives
@dataclass(frozen=True)
class LogScale:
    """Standardisation of log(1 + length) for the regression objectives."""

    mean: float = 0.0
    std: float = 1.0

    @classmethod
    def fit(cls, lengths: np.ndarray) -> "LogScale":
        y = np.log1p(np.asarray(lengths, dtype=np.float64))
        return cls(float(y.mean()), float(max(y.std(), 1e-6)))

    def encode(self, lengths: np.ndarray) -> np.ndarray:
        return (np.log1p(np.asarray(lengths, dtype=np.float64)) - self.mean) / self.std

    def decode(self, values: np.ndarray) -> np.ndarray:
        return np.expm1(np.asarray(values, dtype=np.float64) * self.std + self.mean)


def targets(objective: str, classes: np.ndarray, lengths: np.ndarray, scale: LogScale) -> torch.Tensor:
    """Training target of each row for `objective`."""
    if objective == "ce":
        return torch.as_tensor(classes, dtype=torch.long)
    if objective.startswith("ordinal"):
        return torch.as_tensor(classes, dtype=torch.float32)
    return torch.as_tensor(scale.encode(lengths), dtype=torch.float32)


def loss_fn(objective: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if objective == "ce":
        return F.cross_entropy(out, target)
    pred = out[:, 0]
    return F.l1_loss(pred, target) if objective.endswith("l1") else F.mse_loss(pred, target)


def decode_outputs(objective: str, out: np.ndarray, model_classes: list[labels.ModelClasses],
                   scale: LogScale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(value, class, tokens estimate) of each row from the head outputs.

    value is what ranks requests (Kendall's tau): the real output for the
    ordinal objectives, the expected class for ``ce``, the predicted log length
    for regression. Tokens: the class median, except for regression which
    predicts a length itself."""
    out = np.asarray(out, dtype=np.float64)
    n = out.shape[0]
    if objective == "ce":
        z = out - out.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        value = p @ np.arange(out.shape[1])
        cls = out.argmax(axis=1)
    elif objective.startswith("ordinal"):
        value = out[:, 0]
        cls = labels.round_to_class(value)
    else:
        value = out[:, 0]
        length = scale.decode(value)
        cls = np.array([mc.classes([ln])[0] for mc, ln in zip(model_classes, length)], dtype=np.int64)
        return value, cls, np.maximum(1, np.round(length)).astype(np.int64)
    tokens = np.array([model_classes[i].tokens(cls[i]) for i in range(n)], dtype=np.int64)
    return value, cls.astype(np.int64), tokens
