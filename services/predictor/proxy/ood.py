"""In- and out-of-distribution evaluation of the length predictors (issue 17).

Folds over the wide corpus (`corpus`), each with train / val / test rows:

* ``in``: the in-distribution split (by prompt text; every source except the test-only
  self-instruct): train on the train split, test on the test split;
* ``source:<name>`` (leave-one-source-out): train on every *other* source, without any
  prompt that also occurs in the held-out source; test on all of the held-out source's rows;
* ``models:<k>`` (leave-target-models-out): the canonical answering models are dealt into
  `model_folds` groups (by a hash of the name); each group in turn is held out whole:
  train on the other models' train-split rows, test on the held-out models' test-split
  rows, so both the prompt and the answering model are new.

Metrics, per (prompt set, target model) group as an outsider would compute them: the true
class of a row comes from the group's *own* p25/p50/p75/p99 (on the fold's test rows);
accuracy compares it with the method's predicted class; tau is Kendall's tau-b between the
method's value and the true length within the group, row-weighted over groups (a constant
prediction, as the prior's, counts as tau 0). The confusion matrix is true x predicted class.

Methods: ``history`` (Aladdin's mean by input-length bucket per model, the service's
fallback; the prior for a model it never saw), ``minilm`` (the shipped MiniLM artifact as it
is, *not* retrained per fold: it is scored only on rows whose prompt it was not trained on,
hence its own n), and ``lexical`` (the fast tier, retrained on each fold's training rows).
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from polyserve.core.model_names import canonical
from polyserve.predictor import policy
from polyserve.predictor.proxy import corpus, data, labels

logger = logging.getLogger(__name__)
NUM_CLASSES = labels.NUM_CLASSES
DEFAULT_SOURCES = ("flask", "mt_bench", "mt_bench_pl", "lima_test", "llmzoo", "pandalm", "hh_rlhf", "gpteacher",
                   "codealpaca", "alpaca_eval", "self_instruct")


@dataclass
class Fold:
    name: str
    kind: str  # in | source | models
    train: list[data.Row]
    val: list[data.Row]
    test: list[data.Row]


def _h(text: str, seed: int) -> float:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{text}".encode()).digest()[:8], "big") / 2 ** 64


def _cap_prompts(rows: list[data.Row], max_prompts: int, seed: int) -> list[data.Row]:
    """At most `max_prompts` distinct prompts (chosen by hash), all their rows."""
    prompts = sorted({data.normalise(r.prompt) for r in rows}, key=lambda p: _h(p, seed))
    if not max_prompts or len(prompts) <= max_prompts:
        return rows
    keep = set(prompts[:max_prompts])
    return [r for r in rows if data.normalise(r.prompt) in keep]


def _cap_rows(rows: list[data.Row], max_rows: int, seed: int) -> list[data.Row]:
    if not max_rows or len(rows) <= max_rows:
        return rows
    return random.Random(seed).sample(rows, max_rows)


def folds(ds: data.Dataset, *, sources: tuple[str, ...] = DEFAULT_SOURCES, model_folds: int = 5,
          max_train_rows: int = 0, max_test_prompts: int = 0, seed: int = 0,
          kinds: tuple[str, ...] = ("in", "source", "models")) -> list[Fold]:
    trainable = [r for r in ds.rows if r.source not in corpus.TEST_ONLY]
    out: list[Fold] = []

    def add(name, kind, tr, va, te):
        out.append(Fold(name, kind, _cap_rows(tr, max_train_rows, seed), _cap_rows(va, max_train_rows // 4, seed),
                        _cap_prompts(te, max_test_prompts, seed)))

    if "in" in kinds:
        add("in", "in", [r for r in trainable if r.split == "train"], [r for r in trainable if r.split == "val"],
            [r for r in trainable if r.split == "test"])
    if "source" in kinds:
        for s in sources:
            held = {data.normalise(r.prompt) for r in ds.rows if r.source == s}
            rest = [r for r in trainable if r.source != s and data.normalise(r.prompt) not in held]
            add(f"source:{s}", "source", [r for r in rest if r.split == "train"],
                [r for r in rest if r.split == "val"], [r for r in ds.rows if r.source == s])
    if "models" in kinds and model_folds > 1:
        group = {m: int(_h(canonical(m), seed) * model_folds) for m in {r.model for r in trainable}}
        for k in range(model_folds):
            held = {m for m, g in group.items() if g == k}
            other = [r for r in trainable if r.model not in held]
            add(f"models:{k}", "models", [r for r in other if r.split == "train"],
                [r for r in other if r.split == "val"],
                [r for r in trainable if r.model in held and r.split == "test"])
    return [f for f in out if f.test and f.train]


# ------------------------------------------------------------------ metrics
def truth_classes(rows: list[data.Row]) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """True class of each row from its (prompt set, model) group's own percentiles."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r.source, canonical(r.model))].append(i)
    cls = np.zeros(len(rows), dtype=np.int64)
    for idx in groups.values():
        lens = [rows[i].output_tokens for i in idx]
        cls[idx] = labels.classes_of(lens, labels.percentile_bounds(lens))
    return cls, [(r.source, canonical(r.model)) for r in rows]


def group_tau(keys: list[tuple[str, str]], values: np.ndarray, lengths: np.ndarray) -> float:
    """Row-weighted mean over groups of Kendall's tau-b; a constant prediction counts as 0."""
    by: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        by[k].append(i)
    total = weight = 0.0
    for idx in by.values():
        if len(idx) < 2 or np.all(lengths[idx] == lengths[idx][0]):
            continue
        t = labels.kendall_tau(values[idx], lengths[idx])
        total += (0.0 if math.isnan(t) else t) * len(idx)
        weight += len(idx)
    return total / weight if weight else math.nan


@dataclass
class Scored:
    n: int
    accuracy: float
    tau: float
    confusion: np.ndarray = field(repr=False)

    def to_json(self) -> dict:
        return {"n": self.n, "accuracy": round(self.accuracy, 4), "tau": round(self.tau, 4),
                "confusion": self.confusion.astype(int).tolist()}


def score(rows: list[data.Row], values: np.ndarray, pred_cls: np.ndarray, mask: np.ndarray | None = None) -> Scored:
    true_cls, keys = truth_classes(rows)  # classes from the whole test set of the fold
    lengths = np.array([r.output_tokens for r in rows], dtype=np.float64)
    sel = np.ones(len(rows), dtype=bool) if mask is None else mask
    idx = np.flatnonzero(sel)
    conf = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
    np.add.at(conf, (true_cls[idx], np.clip(pred_cls[idx], 0, NUM_CLASSES - 1)), 1)
    acc = float(np.mean(true_cls[idx] == pred_cls[idx])) if idx.size else math.nan
    return Scored(int(idx.size), acc, group_tau([keys[i] for i in idx], values[idx], lengths[idx]), conf)


# ------------------------------------------------------------------ methods
def history_method(fold: Fold) -> tuple[np.ndarray, np.ndarray]:
    """(value, class): the service's fallback fitted on the fold's training rows."""
    from polyserve.predictor.proxy.train import fit_classes

    stats: dict[str, policy.ModelStats] = {}
    for r in fold.train:
        k = canonical(r.model)
        stats[k] = policy.observe(stats.get(k, policy.ModelStats()), r.input_tokens, r.output_tokens)
    models, classes, _ = fit_classes(fold.train)
    from polyserve.predictor.proxy.artifact import Meta

    meta = Meta("history", "none", "", "", "", 0, 0, models, classes, labels.ModelClasses.unseen(
        list(classes.values())))
    tokens = np.array([policy.estimate(stats.get(canonical(r.model)), r.input_tokens).tokens for r in fold.test])
    cls = np.array([meta.classes_for(r.model).classes([t])[0] for r, t in zip(fold.test, tokens)])
    return tokens.astype(np.float64), cls


def lexical_method(fold: Fold, pf, table, *, dims: int = 24, rounds: int = 600,
                   seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fast tier retrained on the fold: ``lexical`` decodes classes as served (`calibrate`: rank
    among the target's earlier predictions; each (prompt set, model) group of the test rows is one
    traffic stream, rows in a fixed hash order), ``lexical_fixed`` with the fixed cut points."""
    from polyserve.predictor.proxy import calibrate, lexical

    fitted = lexical.fit(pf, table, fold.train, fold.val or fold.train[: len(fold.train) // 10], dims=dims,
                         rounds=rounds, seed=seed)
    v = fitted.values(pf, fold.test)
    keys = [(r.source, canonical(r.model)) for r in fold.test]
    order = sorted(range(len(fold.test)), key=lambda i: _h(f"{fold.test[i].prompt}\0{fold.test[i].model}", seed))
    streamed = calibrate.stream_classes(keys, [r.model for r in fold.test], v, fitted.calibration, order)
    return {"lexical": (v, streamed), "lexical_fixed": (v, fitted.classes(v))}


class MiniLM:
    """The shipped MiniLM artifact, pooled vectors of each prompt computed once."""

    def __init__(self, path: str, precision: str | None = None):
        from polyserve.predictor.proxy.infer import ProxyPredictor

        self.pred = ProxyPredictor.load(path, cache_keys="none", precision=precision)
        self.pooled: dict[str, object] = {}

    def encode(self, prompts: list[str], batch: int = 32, progress: bool = True) -> None:
        todo = sorted({p for p in prompts if p not in self.pooled}, key=len)
        t0 = time.monotonic()
        for i in range(0, len(todo), batch):
            chunk = todo[i:i + batch]
            vecs, _ = self.pred.encode(chunk, with_keys=False)
            self.pooled.update(zip(chunk, vecs))
            if progress and (i // batch) % 20 == 0:
                logger.info("minilm: encoded %d/%d prompts (%.0fs)", i + len(chunk), len(todo),
                            time.monotonic() - t0)

    def method(self, fold: Fold) -> tuple[np.ndarray, np.ndarray]:
        import torch

        self.encode([r.prompt for r in fold.test])
        answers = self.pred.answer(torch.stack([self.pooled[r.prompt] for r in fold.test]),
                                   [r.model for r in fold.test])
        return np.array([a.value for a in answers]), np.array([a.length_class for a in answers])


def minilm_seen(ds: data.Dataset) -> set[str]:
    """Normalised prompts the shipped MiniLM artifact was trained or validated on."""
    return {data.normalise(r.prompt) for r in ds.rows
            if r.source in ("alpaca_eval", "gpteacher", "codealpaca") and r.split in ("train", "val")}


def summarise(results: dict[str, dict[str, Scored]]) -> dict[str, dict[str, Scored]]:
    """Pooled rows per fold kind: ``in``, ``OOD sources``, ``OOD models``, ``OOD all``."""
    out: dict[str, dict[str, Scored]] = {}
    for label, pick in (("OOD sources (macro)", "source:"), ("OOD models (macro)", "models:"),
                        ("OOD all (macro)", "")):
        names = [f for f in results if f != "in" and f.startswith(pick)]
        methods = {m for f in names for m in results[f]}
        out[label] = {}
        for m in sorted(methods):
            sc = [results[f][m] for f in names if m in results[f] and results[f][m].n]
            if sc:
                out[label][m] = Scored(sum(s.n for s in sc), float(np.mean([s.accuracy for s in sc])),
                                       float(np.nanmean([s.tau for s in sc])),
                                       sum(s.confusion for s in sc))
    return out


def row_normalised(conf: np.ndarray) -> list[list[float]]:
    c = np.asarray(conf, dtype=np.float64)
    s = c.sum(axis=1, keepdims=True)
    return np.round(np.divide(c, s, out=np.full_like(c, 1.0 / c.shape[1]), where=s > 0), 4).tolist()


def render(results: dict[str, dict[str, Scored]], summary: dict[str, dict[str, Scored]]) -> str:
    methods = sorted({m for r in list(results.values()) + list(summary.values()) for m in r})
    head = f"{'fold':<26}" + "".join(f"{m + ' n':>12}{'acc':>7}{'tau':>7}" for m in methods)
    lines = [head]
    for name, res in list(results.items()) + list(summary.items()):
        cells = []
        for m in methods:
            s = res.get(m)
            cells.append(f"{'-':>12}{'-':>7}{'-':>7}" if s is None else
                         f"{s.n:>12d}{s.accuracy:>7.3f}{s.tau:>7.3f}")
        lines.append(f"{name:<26}" + "".join(cells))
    return "\n".join(lines)


def run(ds: data.Dataset, *, encoder_dir: str | None = None, minilm: str | None = None,
        minilm_precision: str | None = None, max_train_rows: int = 0, max_test_prompts: int = 400,
        model_folds: int = 5, sources: tuple[str, ...] = DEFAULT_SOURCES, seed: int = 0,
        kinds: tuple[str, ...] = ("in", "source", "models"), progress: bool = True, static: str | None = None,
        cache_dir: str | None = None) -> dict:
    """Every fold, every method; returns {"folds": {fold: {method: Scored}}, "summary": ...}."""
    from polyserve.predictor.proxy import encoder as enc_mod
    from polyserve.predictor.proxy import lexical

    def say(msg: str) -> None:
        if progress:
            logger.info("%s", msg)

    t0 = time.monotonic()
    enc_dir = enc_mod.resolve_encoder_dir(encoder_dir)
    table = lexical.static_table(enc_dir, static or lexical.DEFAULT_STATIC, cache_dir)
    pf = lexical.PromptFeatures.build([r.prompt for r in ds.rows], lexical.fast_tokenizer(enc_dir), table)
    say(f"ood: features of {len(pf.index)} prompts in {time.monotonic() - t0:.0f}s")
    mini = MiniLM(minilm, minilm_precision) if minilm else None
    seen = minilm_seen(ds) if mini else set()
    results: dict[str, dict[str, Scored]] = {}
    for f in folds(ds, sources=sources, model_folds=model_folds, max_train_rows=max_train_rows,
                   max_test_prompts=max_test_prompts, seed=seed, kinds=kinds):
        t = time.monotonic()
        res = {"history": score(f.test, *history_method(f))}
        for name, (v, c) in lexical_method(f, pf, table, seed=seed).items():
            res[name] = score(f.test, v, c)
        if mini is not None:
            mask = np.array([data.normalise(r.prompt) not in seen for r in f.test])
            if mask.any():
                res["minilm"] = score(f.test, *mini.method(f), mask=mask)
        results[f.name] = res
        say(f"ood: {f.name}: train {len(f.train)} rows, test {len(f.test)} rows; " + ", ".join(
            f"{m} acc {s.accuracy:.3f} tau {s.tau:.3f} (n {s.n})" for m, s in res.items())
            + f" [{time.monotonic() - t:.0f}s]")
    return {"folds": results, "summary": summarise(results), "seconds": round(time.monotonic() - t0, 1),
            "settings": {"static": static or lexical.DEFAULT_STATIC,
                         "max_train_rows": max_train_rows, "max_test_prompts": max_test_prompts,
                         "model_folds": model_folds, "sources": list(sources), "seed": seed,
                         "data_hash": ds.data_hash, "rows": len(ds.rows)}}


def consensus_tau(ds: data.Dataset) -> dict[str, float]:
    """Per prompt set with >= 3 answering models: Kendall's tau of each model's lengths against the
    mean within-model rank of the *other* models on the same prompts, row-weighted over models. It
    shows roughly how well any prompt-only predictor can do on a set. Printed by `eval --ood`."""
    from polyserve.predictor.proxy.lexical import group_ranks

    ranks = group_ranks(ds.rows)
    by: dict[str, dict[str, dict[str, tuple[float, int]]]] = defaultdict(lambda: defaultdict(dict))
    for r, q in zip(ds.rows, ranks):
        by[r.source][canonical(r.model)][r.prompt] = (float(q), r.output_tokens)
    out: dict[str, float] = {}
    for src, models in sorted(by.items()):
        if len(models) < 3:
            continue
        total = weight = 0.0
        for m, rows in models.items():
            others = [(np.mean([models[o][p][0] for o in models if o != m and p in models[o]]), n)
                      for p, (_, n) in rows.items() if any(o != m and p in models[o] for o in models)]
            if len(others) < 2:
                continue
            t = labels.kendall_tau(np.array([o[0] for o in others]), np.array([o[1] for o in others], float))
            if not math.isnan(t):
                total += t * len(others)
                weight += len(others)
        if weight:
            out[src] = round(total / weight, 4)
    return out


def to_json(out: dict) -> dict:
    return {"folds": {f: {m: s.to_json() for m, s in r.items()} for f, r in out["folds"].items()},
            "summary": {f: {m: s.to_json() for m, s in r.items()} for f, r in out["summary"].items()},
            "seconds": out["seconds"], "settings": out["settings"]}


def confusion_of(out: dict, method: str = "lexical", label: str = "OOD all (macro)") -> list[list[float]]:
    """The row-normalised OOD confusion (true x predicted class) of `method`, pooled over OOD folds."""
    return row_normalised(out["summary"][label][method].confusion)
