"""µ-Serve Table 2 on the test split: trained artifacts against simple baselines.

Methods: every artifact given (its objective names the row: ``ordinal_mse``
(ours), ``ordinal_l1``, ``ce``, ``reg_log_mse``, ``reg_log_l1``), and

* ``history``: Aladdin's historical conditional mean by input-length bucket
  (`polyserve.predictor.policy.estimate`, the service's fallback) fitted on the
  training split, value = estimated tokens;
* ``majority``: the most frequent training class of the target model;
* ``random``: a uniformly random class (seeded).

Metrics per target model and overall: accuracy, macro-F1, L1 and MSE between
predicted and true class (class units), Kendall's tau-b between the predicted
value and the true output length. Overall accuracy, F1, L1 and MSE pool all
rows; overall tau is the row-weighted mean of the per-model taus (values of
different models are in their own class units, so a pooled tau would mostly
measure how lengths differ between models). ``tau_tok`` is also given: tau
between the token estimate and the true length, pooled over all rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyserve.predictor import policy
from polyserve.predictor.proxy import data, labels


@dataclass
class Predictions:
    """One method's answers for the rows of a split."""

    method: str
    classes: np.ndarray
    values: np.ndarray
    tokens: np.ndarray


@dataclass
class Truth:
    models: list[str]
    classes: np.ndarray
    lengths: np.ndarray
    input_tokens: np.ndarray


def truth_of(rows: list[data.Row], classes: dict[str, labels.ModelClasses],
             default: labels.ModelClasses) -> Truth:
    return Truth([r.model for r in rows],
                 np.array([classes.get(r.model, default).classes([r.output_tokens])[0] for r in rows]),
                 np.array([r.output_tokens for r in rows]), np.array([r.input_tokens for r in rows]))


def history_baseline(train_rows: list[data.Row], rows: list[data.Row], classes: dict[str, labels.ModelClasses],
                     default: labels.ModelClasses, min_samples: int = policy.DEFAULT_MIN_SAMPLES) -> Predictions:
    stats: dict[str, policy.ModelStats] = {}
    for r in train_rows:
        stats[r.model] = policy.observe(stats.get(r.model, policy.ModelStats()), r.input_tokens, r.output_tokens)
    tokens = np.array([policy.estimate(stats.get(r.model), r.input_tokens, min_samples=min_samples).tokens
                       for r in rows])
    cls = np.array([classes.get(r.model, default).classes([t])[0] for r, t in zip(rows, tokens)])
    return Predictions("history", cls, tokens.astype(np.float64), tokens)


def majority_baseline(train_rows: list[data.Row], rows: list[data.Row], classes: dict[str, labels.ModelClasses],
                      default: labels.ModelClasses) -> Predictions:
    counts: dict[str, np.ndarray] = {}
    for r in train_rows:
        c = counts.setdefault(r.model, np.zeros(labels.NUM_CLASSES, dtype=np.int64))
        c[classes.get(r.model, default).classes([r.output_tokens])[0]] += 1
    cls = np.array([int(np.argmax(counts[r.model])) if r.model in counts else 0 for r in rows])
    tokens = np.array([classes.get(r.model, default).tokens(c) for r, c in zip(rows, cls)])
    return Predictions("majority", cls, cls.astype(np.float64), tokens)


def random_baseline(rows: list[data.Row], classes: dict[str, labels.ModelClasses], default: labels.ModelClasses,
                    seed: int = 0) -> Predictions:
    cls = np.random.default_rng(seed).integers(0, labels.NUM_CLASSES, size=len(rows))
    tokens = np.array([classes.get(r.model, default).tokens(c) for r, c in zip(rows, cls)])
    return Predictions("random", cls, cls.astype(np.float64), tokens)


def artifact_predictions(path: str | Path, rows: list[data.Row], encoder_dir: str | None = None,
                         batch: int = 64, int8: bool = False,
                         precision: str | None = None) -> tuple[Predictions, "object"]:
    """Run an artifact over `rows` (each prompt encoded once), its encoder in `precision`
    (None: as it is served by default, `infer.resolve_precision`)."""
    from polyserve.predictor.proxy import artifact

    if artifact.read_meta(path).kind == "lexical-gbm":
        from polyserve.predictor.proxy.lexical import LexicalPredictor

        lex = LexicalPredictor.load(path, encoder_dir)
        answers, _ = lex.predict([r.prompt for r in rows], [r.model for r in rows])
        lex.meta.extra["served_precision"] = "fp32"
        return Predictions(lex.meta.objective, np.array([a.length_class for a in answers]),
                           np.array([a.value for a in answers]), np.array([a.tokens for a in answers])), lex.meta
    from polyserve.predictor.proxy.infer import ProxyPredictor

    pred = ProxyPredictor.load(path, encoder_dir, cache_keys="none", int8=int8, precision=precision)
    prompts = sorted({r.prompt for r in rows}, key=len)
    pooled = {}
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        vecs, _ = pred.encode(chunk, with_keys=False)
        pooled.update({p: v for p, v in zip(chunk, vecs)})
    import torch

    answers = pred.answer(torch.stack([pooled[r.prompt] for r in rows]), [r.model for r in rows])
    p = Predictions(pred.meta.objective, np.array([a.length_class for a in answers]),
                    np.array([a.value for a in answers]), np.array([a.tokens for a in answers]))
    pred.meta.extra["served_precision"] = pred.precision
    return p, pred.meta


def table(truth: Truth, preds: list[Predictions]) -> dict[str, dict[str, dict[str, float]]]:
    """{group (model or "overall"): {method: metrics}}."""
    models = sorted(set(truth.models))
    names = np.array(truth.models)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for m in models:
        sel = names == m
        out[m] = {p.method: labels.scores(truth.classes[sel], p.classes[sel], p.values[sel], truth.lengths[sel])
                  for p in preds}
    out["overall"] = {}
    for p in preds:
        sc = labels.scores(truth.classes, p.classes, p.values, truth.lengths)
        sc["kendall_tau"] = labels.mean_group_tau(truth.models, p.values, truth.lengths)
        sc["tau_tok"] = labels.kendall_tau(p.tokens, truth.lengths)
        out["overall"][p.method] = sc
    return out


COLUMNS = (("n", "n", "{:d}"), ("accuracy", "acc", "{:.3f}"), ("macro_f1", "F1", "{:.3f}"),
           ("l1", "L1", "{:.3f}"), ("mse", "MSE", "{:.3f}"), ("kendall_tau", "tau", "{:.3f}"))


def render(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """The table as text, one block per target model and one overall."""
    lines = []
    groups = [g for g in results if g != "overall"] + ["overall"]
    for g in groups:
        cols = COLUMNS + ((("tau_tok", "tau_tok", "{:.3f}"),) if g == "overall" else ())
        lines.append(f"== {g}")
        lines.append(f"{'method':<20}" + "".join(f"{h:>9}" for _, h, _ in cols))
        for method, sc in results[g].items():
            cells = []
            for key, _, fmt in cols:
                v = sc.get(key, math.nan)
                cells.append(f"{'-':>9}" if isinstance(v, float) and math.isnan(v) else f"{fmt.format(v):>9}")
            lines.append(f"{method:<20}" + "".join(cells))
        lines.append("")
    return "\n".join(lines)
