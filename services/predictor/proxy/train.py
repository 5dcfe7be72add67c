"""Two-phase fine-tuning of the proxy model (µ-Serve §3.3).

1. **Pooling probe** (``pooling="auto"``): one pass of the untouched encoder over
   the training and validation prompts gives both the [CLS] and the mean-pooled
   vectors; a head trained on each (encoder frozen) is scored on the validation
   split, and the pooling with the lower validation loss is kept.
2. **Phase 1**: the encoder (through its LoRA adapter) and the head are trained
   together for ``phase1_epochs`` passes over the training prompts. The encoder
   runs once per prompt; the head scores every (prompt, target model) row of the
   batch, so the five alpaca_eval answers of a prompt cost one encoder pass.
3. **Phase 2**: the encoder is frozen, its pooled vectors of all training and
   validation prompts are computed once, and only the head is trained for
   ``phase2_epochs`` epochs on them; the epoch with the lowest validation loss is kept.

Budget on a 2-core CPU: see `TrainConfig` defaults and the README of
`polyserve predictor`; prompts are truncated to ``max_length`` tokens and each
batch is padded only to its longest prompt (batches are formed from prompts of
similar length).
"""
from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from polyserve.core.model_names import ModelResolver, canonical
from polyserve.predictor.proxy import artifact, data, labels
from polyserve.predictor.proxy import encoder as enc_mod
from polyserve.predictor.proxy import model as M

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    objective: str = "ordinal_mse"
    pooling: str = "auto"  # "cls" | "mean" | "auto"
    encoder_dir: str | None = None
    max_length: int = 128
    lora_rank: int = 8
    lora_targets: str = "all"  # "all": every linear layer of the encoder; "qv": attention query and value
    batch_size: int = 32  # prompts per phase-1 step
    phase1_epochs: float = 2.0
    lr_encoder: float = 5e-4  # LoRA
    lr_head: float = 1e-3
    phase2_epochs: int = 30
    phase2_batch: int = 256
    phase2_lr: float = 5e-4
    phase2_precision: str = "fp32"  # encoder precision of the phase-2 features (= served precision)
    probe_epochs: int = 15
    model_dropout: float = 0.1  # share of rows trained as "unknown model"
    max_train_prompts: int = 0  # 0 = all; a subset for quick runs
    seed: int = 0
    threads: int = 0  # torch threads; 0 = auto (`auto_threads`)
    progress: bool = True

    def validate(self) -> None:
        if self.objective not in M.OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {M.OBJECTIVES}")
        if self.lora_targets not in ("qv", "all"):
            raise ValueError(f"lora_targets {self.lora_targets!r} is not qv or all")
        if self.phase2_precision not in M.PRECISIONS:
            raise ValueError(f"phase2_precision {self.phase2_precision!r} is not one of {M.PRECISIONS}")
        if self.pooling not in (*M.POOLINGS, "auto"):
            raise ValueError(f"pooling {self.pooling!r} is not cls, mean or auto")
        if self.max_length < 8 or self.batch_size < 1 or self.phase1_epochs < 0 or self.phase2_epochs < 0:
            raise ValueError("max_length >= 8, batch_size >= 1 and epochs >= 0 are required")


def auto_threads() -> int:
    """All cores on an idle machine, one on a busy one.

    On a 2-core machine shared with other work, OpenMP's threads wait on each
    other at every barrier: we measured a MiniLM training step 6x slower with 2
    threads than with 1 at load average 6, and 1.7x faster with 2 when idle."""
    import os

    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] > 0.5 * cores
    except OSError:
        busy = False
    return 1 if busy else cores


@dataclass
class SplitData:
    """Unique prompts of one split and its rows (prompt index, model index, class, length)."""

    prompts: list[str]
    prompt_idx: np.ndarray
    model_idx: np.ndarray
    models: list[str]  # target model name of each row
    classes: np.ndarray
    lengths: np.ndarray
    input_tokens: np.ndarray
    rows_of: dict[int, list[int]] = field(default_factory=dict)


def fit_classes(rows: list[data.Row]) -> tuple[list[str], dict[str, labels.ModelClasses], labels.ModelClasses]:
    """Per-model class bounds/medians from the training rows, and pooled ones (kept for reference).

    Rows whose model names share a `canonical` key are one model, named by the first of its
    spellings; `labels.ModelClasses.unseen` of the result decodes the unknown-model row."""
    name_of: dict[str, str] = {}
    for m in sorted({r.model for r in rows}):
        name_of.setdefault(canonical(m), m)
    by_model: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        by_model[name_of[canonical(r.model)]].append(r.output_tokens)
    models = sorted(by_model)
    classes = {m: labels.ModelClasses.fit(by_model[m]) for m in models}
    return models, classes, labels.ModelClasses.fit([r.output_tokens for r in rows])


def split_data(rows: list[data.Row], models: list[str], classes: dict[str, labels.ModelClasses],
               default: labels.ModelClasses) -> SplitData:
    """Rows as arrays; model names resolved as served (`artifact.Meta.resolve`), labels in the
    resolved model's classes, `default` (the unseen-model classes) for unknown models."""
    resolver = ModelResolver(models)
    index: dict[str, int] = {}
    prompts: list[str] = []
    pidx, midx, cls, lens, inp, names = [], [], [], [], [], []
    for r in rows:
        if r.prompt not in index:
            index[r.prompt] = len(prompts)
            prompts.append(r.prompt)
        pidx.append(index[r.prompt])
        known = resolver.resolve(r.model).known
        midx.append(models.index(known) + 1 if known is not None else M.UNKNOWN_MODEL)
        cls.append((classes[known] if known is not None else default).classes([r.output_tokens])[0])
        lens.append(r.output_tokens)
        inp.append(r.input_tokens)
        names.append(r.model)
    sd = SplitData(prompts, np.array(pidx, dtype=np.int64), np.array(midx, dtype=np.int64), names,
                   np.array(cls, dtype=np.int64), np.array(lens, dtype=np.int64), np.array(inp, dtype=np.int64))
    for i, p in enumerate(sd.prompt_idx):
        sd.rows_of.setdefault(int(p), []).append(i)
    return sd


def subset(sd: SplitData, max_prompts: int, seed: int) -> SplitData:
    if not max_prompts or max_prompts >= len(sd.prompts):
        return sd
    keep = sorted(random.Random(seed).sample(range(len(sd.prompts)), max_prompts))
    rows = [i for p in keep for i in sd.rows_of[p]]
    remap = {p: j for j, p in enumerate(keep)}
    out = SplitData([sd.prompts[p] for p in keep], np.array([remap[int(sd.prompt_idx[i])] for i in rows]),
                    sd.model_idx[rows], [sd.models[i] for i in rows], sd.classes[rows], sd.lengths[rows],
                    sd.input_tokens[rows])
    for i, p in enumerate(out.prompt_idx):
        out.rows_of.setdefault(int(p), []).append(i)
    return out


# ------------------------------------------------------------------ encoding
def tokenize(tok, prompts: list[str], max_length: int) -> list[list[int]]:
    return tok(prompts, truncation=True, max_length=max_length)["input_ids"]


def collate(ids: list[list[int]], pad_id: int, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(x) for x in ids) if pad_to is None else pad_to
    input_ids = torch.full((len(ids), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), n), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)] = torch.as_tensor(x)
        mask[i, :len(x)] = 1
    return input_ids, mask


def length_batches(ids: list[list[int]], batch: int, rng: random.Random | None) -> list[list[int]]:
    """Batches of prompts of similar length (shuffled in chunks when `rng` is given)."""
    order = list(range(len(ids)))
    if rng is None:
        order.sort(key=lambda i: len(ids[i]))
        return [order[i:i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(order)
    chunk = batch * 50
    batches = []
    for c in range(0, len(order), chunk):
        part = sorted(order[c:c + chunk], key=lambda i: len(ids[i]))
        batches += [part[i:i + batch] for i in range(0, len(part), batch)]
    rng.shuffle(batches)
    return batches


@torch.inference_mode()
def embed(encoder, ids: list[list[int]], pad_id: int, poolings: tuple[str, ...], batch: int = 64,
          progress: bool = False, desc: str = "encode") -> dict[str, torch.Tensor]:
    """Pooled vectors of every prompt, for each pooling in `poolings` (one encoder pass)."""
    from tqdm.auto import tqdm

    encoder.eval()
    out = {p: torch.zeros(len(ids), encoder.config.hidden_size) for p in poolings}
    batches = length_batches(ids, batch, None)
    for b in tqdm(batches, desc=desc, disable=not progress, leave=False):
        input_ids, mask = collate([ids[i] for i in b], pad_id)
        hidden = encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        for p in poolings:
            out[p][b] = M.pool(hidden, mask, p).float()
    return out


# ------------------------------------------------------------------ head training
def head_loss(head: M.Head, objective: str, pooled: torch.Tensor, sd: SplitData, target: torch.Tensor,
              batch: int = 4096) -> float:
    head.eval()
    total = 0.0
    with torch.inference_mode():
        for i in range(0, len(sd.prompt_idx), batch):
            sl = slice(i, i + batch)
            out = head(pooled[torch.as_tensor(sd.prompt_idx[sl])], torch.as_tensor(sd.model_idx[sl]))
            total += float(M.loss_fn(objective, out, target[sl])) * len(sd.prompt_idx[sl])
    return total / max(1, len(sd.prompt_idx))


def head_outputs(head: M.Head, pooled: torch.Tensor, sd: SplitData) -> np.ndarray:
    head.eval()
    with torch.inference_mode():
        return head(pooled[torch.as_tensor(sd.prompt_idx)], torch.as_tensor(sd.model_idx)).numpy()


def drop_models(model_idx: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    if p <= 0:
        return model_idx
    return torch.where(torch.rand(model_idx.shape, generator=gen) < p, torch.zeros_like(model_idx), model_idx)


def train_head(head: M.Head, objective: str, pooled_tr: torch.Tensor, tr: SplitData, y_tr: torch.Tensor,
               pooled_va: torch.Tensor, va: SplitData, y_va: torch.Tensor, *, epochs: int, batch: int, lr: float,
               model_dropout: float, seed: int, progress: bool, desc: str) -> tuple[float, int]:
    """Train the head alone on fixed pooled vectors; keep the epoch with the best validation loss.

    Runs on one torch thread: the head's matrices are small, and OpenMP's
    waiting threads cost more than they give (8x slower with 2 threads on a
    busy 2-core machine, measured)."""
    from tqdm.auto import tqdm

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_head(head, objective, pooled_tr, tr, y_tr, pooled_va, va, y_va, epochs=epochs, batch=batch,
                           lr=lr, model_dropout=model_dropout, seed=seed, progress=progress, desc=desc, tqdm=tqdm)
    finally:
        torch.set_num_threads(saved_threads)


def _train_head(head, objective, pooled_tr, tr, y_tr, pooled_va, va, y_va, *, epochs, batch, lr, model_dropout,
                seed, progress, desc, tqdm) -> tuple[float, int]:

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    n = len(tr.prompt_idx)
    pidx, midx = torch.as_tensor(tr.prompt_idx), torch.as_tensor(tr.model_idx)
    best = (head_loss(head, objective, pooled_va, va, y_va), 0)
    best_state = {k: v.clone() for k, v in head.state_dict().items()}
    for epoch in tqdm(range(1, epochs + 1), desc=desc, disable=not progress, leave=False):
        head.train()
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, batch):
            b = perm[i:i + batch]
            out = head(pooled_tr[pidx[b]], drop_models(midx[b], model_dropout, gen))
            loss = M.loss_fn(objective, out, y_tr[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        val = head_loss(head, objective, pooled_va, va, y_va)
        if val < best[0]:
            best = (val, epoch)
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
    head.load_state_dict(best_state)
    return best


def phase1(encoder, head: M.Head, objective: str, ids: list[list[int]], pad_id: int, tr: SplitData,
           y_tr: torch.Tensor, cfg: TrainConfig) -> dict:
    """Encoder (LoRA) and head together; returns the step count and mean loss of the last 50 steps."""
    from tqdm.auto import tqdm

    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    enc_params = [p for p in encoder.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": enc_params, "lr": cfg.lr_encoder},
                             {"params": list(head.parameters()), "lr": cfg.lr_head}], weight_decay=0.01)
    per_epoch = len(length_batches(ids, cfg.batch_size, None))
    total = max(1, int(round(cfg.phase1_epochs * per_epoch)))
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, (total - s) / max(1, total - warmup)))
    encoder.train()
    head.train()
    losses: list[float] = []
    step = 0
    bar = tqdm(total=total, desc=f"phase 1 ({objective}, encoder+head)", disable=not cfg.progress)
    while step < total:
        for b in length_batches(ids, cfg.batch_size, rng):
            if step >= total:
                break
            input_ids, mask = collate([ids[i] for i in b], pad_id)
            hidden = encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
            pooled = M.pool(hidden, mask, head_pooling(head))
            local = {p: j for j, p in enumerate(b)}
            rows = [r for p in b for r in tr.rows_of[p]]
            pj = torch.as_tensor([local[int(tr.prompt_idx[r])] for r in rows])
            midx = drop_models(torch.as_tensor(tr.model_idx[rows]), cfg.model_dropout, gen)
            loss = M.loss_fn(objective, head(pooled[pj], midx), y_tr[rows])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(enc_params + list(head.parameters()), 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
            if not cfg.progress and step % 50 == 0:
                logger.info("phase 1: step %d/%d, loss %.3f", step, total, np.mean(losses[-50:]))
    bar.close()
    return {"steps": step, "steps_per_epoch": per_epoch, "final_loss": float(np.mean(losses[-50:]) if losses else 0)}


def head_pooling(head: M.Head) -> str:
    return getattr(head, "pooling", "cls")


def val_scores(objective: str, out: np.ndarray, sd: SplitData, classes: dict[str, labels.ModelClasses],
               default: labels.ModelClasses, scale: M.LogScale) -> dict[str, float]:
    resolver = ModelResolver(list(classes))
    mcs = [classes.get(resolver.resolve(m).known or "", default) for m in sd.models]
    value, cls, _ = M.decode_outputs(objective, out, mcs, scale)
    sc = labels.scores(sd.classes, cls, value, sd.lengths)
    sc["kendall_tau"] = labels.mean_group_tau(sd.models, value, sd.lengths)  # as `evaluate` reports it
    return sc


def select_pooling(base_encoder, ids_tr, ids_va, pad_id, tr, va, y_tr, y_va, make_head, cfg, classes, default,
                   scale) -> tuple[str, dict]:
    """Frozen-encoder probe of [CLS] vs mean pooling; the lower validation loss wins."""
    pooled_tr = embed(base_encoder, ids_tr, pad_id, M.POOLINGS, progress=cfg.progress, desc="probe: encode train")
    pooled_va = embed(base_encoder, ids_va, pad_id, M.POOLINGS, progress=cfg.progress, desc="probe: encode val")
    report = {}
    for p in M.POOLINGS:
        torch.manual_seed(cfg.seed)
        head = make_head(p)
        loss, _ = train_head(head, cfg.objective, pooled_tr[p], tr, y_tr, pooled_va[p], va, y_va,
                             epochs=cfg.probe_epochs, batch=cfg.phase2_batch, lr=cfg.lr_head,
                             model_dropout=cfg.model_dropout, seed=cfg.seed, progress=cfg.progress,
                             desc=f"probe: head on {p}")
        sc = val_scores(cfg.objective, head_outputs(head, pooled_va[p], va), va, classes, default, scale)
        report[p] = {"val_loss": loss, "val_accuracy": sc["accuracy"], "val_kendall_tau": sc["kendall_tau"]}
        logger.info("pooling probe %s: val loss %.4f accuracy %.3f tau %.3f", p, loss, sc["accuracy"],
                    sc["kendall_tau"])
    return min(M.POOLINGS, key=lambda p: report[p]["val_loss"]), report


def served_encoder(encoder, enc_dir: str, cfg: TrainConfig, lora: dict | None):
    """The encoder as `infer.ProxyPredictor` serves it, for the phase-2 features: the LoRA adapter
    rounded to float16 (as the artifact stores it) and merged, then in `cfg.phase2_precision`.

    Quantisation-aware phase 2: with ``phase2_precision="int8"`` (or ``"bf16"``)
    the head is fitted on the features of the quantised encoder, so it adapts to
    its rounding. With fp32 the trained encoder is used as it is (as before)."""
    if cfg.phase2_precision == "fp32":
        return encoder
    if lora is not None:
        merged = M.load_merged_encoder(enc_dir, cfg.lora_rank, {k: v.half().float() for k, v in lora.items()})
    else:
        merged = M.load_encoder(enc_dir, 0)
    return M.to_precision(merged.eval(), cfg.phase2_precision)


def train(ds: data.Dataset, cfg: TrainConfig, out_dir: str | Path) -> artifact.Meta:
    """Train one objective end to end and write its artifact to `out_dir`."""
    cfg.validate()
    t_start = time.monotonic()
    torch.set_num_threads(cfg.threads or auto_threads())
    torch.manual_seed(cfg.seed)
    enc_dir = enc_mod.resolve_encoder_dir(cfg.encoder_dir)
    tok = enc_mod.load_tokenizer(str(enc_dir))
    fingerprint = enc_mod.tokenizer_fingerprint(enc_dir)
    train_rows, val_rows = ds.split("train"), ds.split("val")
    models, classes, pooled = fit_classes(train_rows)
    default = labels.ModelClasses.unseen(list(classes.values()))  # decodes the unknown-model row
    scale = M.LogScale.fit(np.array([r.output_tokens for r in train_rows]))
    tr = subset(split_data(train_rows, models, classes, default), cfg.max_train_prompts, cfg.seed)
    va = split_data(val_rows, models, classes, default)
    y_tr = M.targets(cfg.objective, tr.classes, tr.lengths, scale)
    y_va = M.targets(cfg.objective, va.classes, va.lengths, scale)
    ids_tr, ids_va = tokenize(tok, tr.prompts, cfg.max_length), tokenize(tok, va.prompts, cfg.max_length)
    pad_id = tok.pad_token_id or 0
    targets = M.LORA_TARGETS if cfg.lora_targets == "qv" else M.LORA_ALL
    encoder = M.load_encoder(str(enc_dir), cfg.lora_rank, targets=targets)
    hidden = encoder.config.hidden_size

    def make_head(pooling: str) -> M.Head:
        h = M.Head(M.HeadConfig(hidden_size=hidden, num_models=len(models), objective=cfg.objective))
        h.pooling = pooling  # type: ignore[attr-defined]
        return h

    extra: dict = {"config": asdict(cfg), "train_prompts": len(tr.prompts), "train_rows": len(tr.prompt_idx),
                   "val_prompts": len(va.prompts), "val_rows": len(va.prompt_idx)}
    pooling = cfg.pooling
    if pooling == "auto":
        t = time.monotonic()
        pooling, extra["pooling_probe"] = select_pooling(encoder, ids_tr, ids_va, pad_id, tr, va, y_tr, y_va,
                                                         make_head, cfg, classes, default, scale)
        extra["pooling_probe_s"] = round(time.monotonic() - t, 1)
    torch.manual_seed(cfg.seed)
    head = make_head(pooling)

    t = time.monotonic()
    if cfg.phase1_epochs > 0:
        extra["phase1"] = phase1(encoder, head, cfg.objective, ids_tr, pad_id, tr, y_tr, cfg)
    extra["phase1_s"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    for p in encoder.parameters():
        p.requires_grad_(False)
    lora = M.lora_state_dict(encoder) if cfg.lora_rank > 0 else None
    served = served_encoder(encoder, str(enc_dir), cfg, lora)
    pooled_tr = embed(served, ids_tr, pad_id, (pooling,), progress=cfg.progress, desc="phase 2: encode train")[pooling]
    pooled_va = embed(served, ids_va, pad_id, (pooling,), progress=cfg.progress, desc="phase 2: encode val")[pooling]
    del served
    loss, epoch = train_head(head, cfg.objective, pooled_tr, tr, y_tr, pooled_va, va, y_va,
                             epochs=cfg.phase2_epochs, batch=cfg.phase2_batch, lr=cfg.phase2_lr,
                             model_dropout=cfg.model_dropout, seed=cfg.seed + 1, progress=cfg.progress,
                             desc="phase 2 (head only)")
    extra["phase2"] = {"best_epoch": epoch, "val_loss": loss}
    extra["phase2_s"] = round(time.monotonic() - t, 1)
    extra["val"] = val_scores(cfg.objective, head_outputs(head, pooled_va, va), va, classes, default, scale)
    extra["train_s"] = round(time.monotonic() - t_start, 1)
    meta = artifact.Meta(objective=cfg.objective, pooling=pooling, encoder=enc_mod.encoder_name(cfg.encoder_dir),
                         tokenizer=ds.tokenizer, tokenizer_fingerprint=fingerprint, max_length=cfg.max_length,
                         lora_rank=cfg.lora_rank, lora_targets=list(targets), models=models, classes=classes,
                         default_classes=pooled, unseen_classes=default,
                         log_mean=scale.mean, log_std=scale.std, data_hash=ds.data_hash,
                         head_hidden=head.cfg.head_hidden, model_dim=head.cfg.model_dim,
                         precision=cfg.phase2_precision, extra=extra)
    artifact.save(out_dir, meta, head.state_dict(), lora)
    logger.info("artifact %s written (%d bytes) in %.0fs", out_dir, artifact.size_bytes(out_dir), extra["train_s"])
    return meta
