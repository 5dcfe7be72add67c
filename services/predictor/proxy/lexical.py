"""The fast predictor tier (issue 17): prompt features + gradient-boosted trees, no transformer.

* **Features** (`features`): ~66 lexical/structural features of the prompt, 2 x `dims`
  principal components of its mean static token embedding (head and tail), and two stacked
  ridge scores (hashed word 1-2-grams; the raw mean static embeddings). No target-model
  feature: the target below is relative to the model (its size and family were tried in
  the design and add nothing to a within-model rank).
* **Target**: the row's *within-model percentile rank* of its output length (0..1, rank
  among the answers of the same target model on the same prompt set). A model's verbosity
  cannot be read from the prompt, so the model learns which prompts get long answers
  *relative to the model's own answers*; that carries over to models and prompt sets it
  never saw (selected on the out-of-distribution folds of `ood`, not the in-distribution split).
* **Model**: LightGBM regression (L2) on that rank; a few hundred trees, one thread.
* **Classes**: as served, by rank among the target model's recent predictions
  (`calibrate.RankCalibrator`, stored in ``extra.calibration``): a class is relative to the
  model's own p25/p50/p75/p99, so the predicted classes should split a model's traffic the same
  way; level cut points fitted for accuracy on the validation rows' (prompt set, model) groups.
  The fixed cut points on the score (``extra.thresholds``: accuracy-maximising on the validation
  rows, from the prediction quantiles) decode when calibration is off and weigh the calibrator's
  first predictions of a model. The token estimate is the class median of the model's training
  answers (`artifact.Meta.classes_for`: the unseen-model scheme for models it does not know).

Artifact (`artifacts/lexical-gbm/`): ``meta.json`` (`artifact.Meta` with ``kind:
"lexical-gbm"``, thresholds, calibration and feature names in ``extra``, the measured OOD
figures and ``ood_confusion``), ``gbm.txt`` (LightGBM's text model), ``static.safetensors``
(the static table as serving reads it: each token's projected row, vocab x dims, and its two
shares of the embedding ridge, vocab x 2; plus the bag-of-words ridge weights).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyserve.core.length_classes import UNSEEN_BOUNDS, UNSEEN_MEDIANS
from polyserve.core.model_names import canonical
from polyserve.predictor.proxy import artifact, calibrate, data, features, labels

logger = logging.getLogger(__name__)

KIND = "lexical-gbm"
GBM = "gbm.txt"
STATIC = "static.safetensors"
CLASS_SHARES = (0.25, 0.50, 0.75, 0.99)
# Smaller, more regularised trees than LightGBM's defaults (15 leaves, >= 100 prompts a leaf, half
# the features per tree, L2 10): +0.01 tau on held-out prompt sets over 31 leaves / 40 / 0.7 / 1,
# in distribution unchanged (issue 17, 2026-11-26; docs/benchmarks/predictor.md).
GBM_PARAMS = {"objective": "regression", "learning_rate": 0.03, "num_leaves": 15, "min_data_in_leaf": 100,
              "feature_fraction": 0.5, "bagging_fraction": 0.8, "bagging_freq": 1, "lambda_l2": 10.0,
              "num_threads": 1, "verbose": -1, "seed": 0, "deterministic": True}


def group_ranks(rows: list[data.Row]) -> np.ndarray:
    """Percentile rank (0..1, ties averaged) of each row's output length within its
    (prompt set, canonical target model) group."""
    from scipy.stats import rankdata

    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r.source, canonical(r.model))].append(i)
    out = np.zeros(len(rows), dtype=np.float64)
    for idx in groups.values():
        lens = np.array([rows[i].output_tokens for i in idx], dtype=np.float64)
        out[idx] = (rankdata(lens) - 0.5) / len(idx)
    return out


@dataclass
class PromptFeatures:
    """Per distinct prompt: lexical features and raw (unprojected) static-embedding means."""

    index: dict[str, int]
    lex: np.ndarray  # prompts x len(LEXICAL_NAMES)
    head: np.ndarray  # prompts x hidden: mean embedding of all tokens
    tail: np.ndarray  # prompts x hidden: mean embedding of the last TAIL_TOKENS tokens
    ids: list[list[int]]

    @classmethod
    def build(cls, prompts: list[str], tok, table: np.ndarray) -> "PromptFeatures":
        uniq = list(dict.fromkeys(prompts))
        ids = [e.ids for e in tok.encode_batch([features.clip_text(p) for p in uniq], add_special_tokens=False)]
        lex = np.stack([features.lexical(p, len(i)) for p, i in zip(uniq, ids)]) if uniq else \
            np.zeros((0, len(features.LEXICAL_NAMES)), dtype=np.float32)
        zero = np.zeros(table.shape[1], dtype=np.float32)
        head = np.stack([table[i].mean(axis=0) if i else zero for i in ids]) if uniq else np.zeros((0, len(zero)))
        tail = np.stack([table[i[-features.TAIL_TOKENS:]].mean(axis=0) if i else zero for i in ids]) \
            if uniq else np.zeros((0, len(zero)))
        return cls({p: k for k, p in enumerate(uniq)}, lex, head, tail, ids)

    def matrix(self, prompts: list[str], proj: np.ndarray) -> np.ndarray:
        """Feature matrix of `prompts` (lexical features, projected head and tail embeddings)."""
        k = np.array([self.index[p] for p in prompts], dtype=np.int64)
        return np.hstack([self.lex[k], self.head[k] @ proj, self.tail[k] @ proj]).astype(np.float32)


def feature_names(dims: int) -> list[str]:
    return list(features.LEXICAL_NAMES) + [f"emb{i}" for i in range(dims)] + [f"tail{i}" for i in range(dims)] \
        + ["bow_ridge", "emb_ridge"]


BOW_FEATURES = 2 ** 16


def bow_vectorizer():
    """Hashed word uni- and bigrams (sklearn; stateless, so nothing to store but the weights)."""
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(n_features=BOW_FEATURES, ngram_range=(1, 2), alternate_sign=False, norm="l2",
                             lowercase=True, token_pattern=r"(?u)\b\w+\b")


def ridge_oof(x, y: np.ndarray, w: np.ndarray, fold_of: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray,
                                                                                           float]:
    """Out-of-fold ridge scores of the training rows, and the ridge fitted on all of them."""
    from sklearn.linear_model import Ridge

    oof = np.zeros(len(y), dtype=np.float32)
    for k in np.unique(fold_of):
        tr, te = fold_of != k, fold_of == k
        if tr.any():
            oof[te] = Ridge(alpha=alpha).fit(x[tr], y[tr], sample_weight=w[tr]).predict(x[te])
    r = Ridge(alpha=alpha).fit(x, y, sample_weight=w)
    return oof, r.coef_.astype(np.float32), float(r.intercept_)


def prompt_targets(rows: list[data.Row]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(prompt, mean within-model rank over its answering models, number of answers) per distinct
    prompt: the mean over models is a far less noisy target than one model's answer."""
    ranks = group_ranks(rows)
    acc: dict[str, list[float]] = defaultdict(list)
    for r, q in zip(rows, ranks):
        acc[r.prompt].append(float(q))
    prompts = list(acc)
    return prompts, np.array([np.mean(acc[p]) for p in prompts]), np.array([len(acc[p]) for p in prompts], float)


@dataclass
class Fitted:
    booster: object  # lightgbm.Booster
    proj: np.ndarray
    thresholds: tuple[float, ...]
    best_iteration: int
    bow_coef: np.ndarray
    bow_bias: float
    emb_coef: np.ndarray  # 2 x hidden: ridge on the raw head and tail mean embeddings
    emb_bias: float
    calibration: dict | None = None  # `calibrate.RankCalibrator.to_json()`: per-target class decoding

    def matrix(self, pf: "PromptFeatures", prompts: list[str]) -> np.ndarray:
        bow = bow_vectorizer().transform([features.clip_text(p) for p in prompts]) @ self.bow_coef + self.bow_bias
        k = np.array([pf.index[p] for p in prompts], dtype=np.int64)
        emb = np.hstack([pf.head[k], pf.tail[k]]) @ self.emb_coef + self.emb_bias
        return np.hstack([pf.matrix(prompts, self.proj), np.asarray(bow, np.float32)[:, None],
                          np.asarray(emb, np.float32)[:, None]])

    def values(self, pf: "PromptFeatures", rows: list[data.Row]) -> np.ndarray:
        prompts = list(dict.fromkeys(r.prompt for r in rows))
        v = dict(zip(prompts, self.booster.predict(self.matrix(pf, prompts), num_threads=1)))
        return np.array([v[r.prompt] for r in rows])

    def classes(self, values: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.thresholds), values, side="right").astype(np.int64)


def fit(pf: PromptFeatures, table: np.ndarray, train_rows: list[data.Row], val_rows: list[data.Row], *,
        dims: int = 24, rounds: int = 600, seed: int = 0, params: dict | None = None, folds: int = 5,
        cut: str = "accuracy") -> Fitted:
    """Train on `train_rows`, early-stop and cut classes on `val_rows` (both with prompts in `pf`).

    Two ridge scores enter the trees as features (stacking): on hashed word 1-2-grams and on the
    raw mean static embeddings. On the training prompts they are out-of-fold scores (`folds`
    folds), so the trees do not learn to trust an overfit score."""
    import lightgbm as lgb

    p_tr, y_tr, w_tr = prompt_targets(train_rows)
    p_va, y_va, w_va = prompt_targets(val_rows)
    proj = features.fit_projection(table, [pf.ids[pf.index[p]] for p in p_tr], dims, seed)
    fold_of = np.array([int(_hash01(p, seed) * folds) for p in p_tr])
    x_bow = bow_vectorizer().transform([features.clip_text(p) for p in p_tr])
    oof_bow, bow_coef, bow_bias = ridge_oof(x_bow, y_tr, w_tr, fold_of, alpha=3.0)
    k = np.array([pf.index[p] for p in p_tr], dtype=np.int64)
    oof_emb, emb_coef, emb_bias = ridge_oof(np.hstack([pf.head[k], pf.tail[k]]), y_tr, w_tr, fold_of, alpha=1.0)
    fitted = Fitted(None, proj, (), 0, bow_coef, bow_bias, emb_coef, emb_bias)
    x_tr = np.hstack([pf.matrix(p_tr, proj), oof_bow[:, None], oof_emb[:, None]])
    x_va = fitted.matrix(pf, p_va)
    prm = dict(GBM_PARAMS, seed=seed, **(params or {}))
    # a leaf holds >= 100 prompts on the corpus, fewer on a small training set (else no split at all)
    prm["min_data_in_leaf"] = min(prm["min_data_in_leaf"], max(5, len(p_tr) // 50))
    dtr = lgb.Dataset(x_tr, y_tr, weight=w_tr, feature_name=feature_names(dims), free_raw_data=True)
    dva = lgb.Dataset(x_va, y_va, weight=w_va, reference=dtr)
    fitted.booster = lgb.train(prm, dtr, num_boost_round=rounds, valid_sets=[dva],
                               callbacks=[lgb.early_stopping(50, verbose=False)])
    fitted.best_iteration = int(fitted.booster.best_iteration or rounds)
    row_pred = fitted.values(pf, val_rows)
    fitted.thresholds = tuple(float(t) for t in np.quantile(row_pred, CLASS_SHARES))
    from polyserve.predictor.proxy.ood import truth_classes

    truth, keys = truth_classes(val_rows)
    if cut == "accuracy":
        fitted.thresholds = accuracy_cuts(row_pred, truth, fitted.thresholds)
    fitted.calibration = calibrate.RankCalibrator(calibrate.fit_level_cuts(keys, row_pred, truth),
                                                  calibrate.reference_sample(row_pred)).to_json()
    return fitted


def accuracy_cuts(values: np.ndarray, truth: np.ndarray, start: tuple[float, ...], passes: int = 3) -> tuple[float, ...]:
    """Class cut points that maximise accuracy on (values, true class), by coordinate ascent from `start`
    over a grid of the values' quantiles, each cut kept between its neighbours."""
    grid = np.unique(np.quantile(values, np.linspace(0.0, 1.0, 201)))
    cuts = list(start)

    def acc(c) -> float:
        return float(np.mean(np.searchsorted(np.asarray(c), values, side="right") == truth))

    best = acc(cuts)
    for _ in range(passes):
        for k in range(len(cuts)):
            lo = cuts[k - 1] if k else -np.inf
            hi = cuts[k + 1] if k + 1 < len(cuts) else np.inf
            for g in grid[(grid > lo) & (grid < hi)]:
                trial = cuts[:k] + [float(g)] + cuts[k + 1:]
                a = acc(trial)
                if a > best:
                    best, cuts = a, trial
    return tuple(cuts)


def _hash01(text: str, seed: int) -> float:
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}\0{text}".encode()).digest()[:8], "big") / 2 ** 64


STATIC_TABLES = ("raw", "combined")
DEFAULT_STATIC = "raw"  # "combined" was no better out of distribution (docs/benchmarks/predictor.md)


def static_table(enc_dir, static: str = DEFAULT_STATIC, cache_dir: str | Path | None = None) -> np.ndarray:
    """The static token table (vocab x width) the embedding features average: ``raw`` = the encoder's
    input embeddings; ``combined`` = raw and distilled rows side by side (`distill`, needs torch
    once, then cached under `cache_dir`)."""
    if static == "raw":
        return features.StaticEmbedder.word_embeddings(enc_dir)
    if static == "combined":
        from polyserve.predictor.proxy import distill

        return distill.cached_combined(enc_dir, cache_dir)
    raise ValueError(f"static table {static!r}: use one of {', '.join(STATIC_TABLES)}")


def train(ds: data.Dataset, out_dir: str | Path, *, encoder_dir: str | None = None, dims: int = 24,
          rounds: int = 600, seed: int = 0, exclude_sources: frozenset[str] = frozenset(),
          extra: dict | None = None, cut: str = "accuracy", static: str = DEFAULT_STATIC,
          cache_dir: str | Path | None = None) -> artifact.Meta:
    """Fit on the train split (sources in `exclude_sources` left out) and write the artifact."""
    from polyserve.predictor.proxy import encoder as enc_mod
    from polyserve.predictor.proxy import train as proxy_train

    t0 = time.monotonic()
    enc_dir = enc_mod.resolve_encoder_dir(encoder_dir)
    tok = fast_tokenizer(enc_dir)
    table = static_table(enc_dir, static, cache_dir)
    rows = [r for r in ds.rows if r.source not in exclude_sources]
    tr, va = [r for r in rows if r.split == "train"], [r for r in rows if r.split == "val"]
    pf = PromptFeatures.build([r.prompt for r in tr + va], tok, table)
    fitted = fit(pf, table, tr, va, dims=dims, rounds=rounds, seed=seed, cut=cut)
    models, classes, pooled = proxy_train.fit_classes(tr)
    derived = labels.ModelClasses.unseen(list(classes.values()))
    # Unknown models are decoded with the project-wide unseen-model scheme (`core.length_classes`),
    # so a class of an unknown model means the same at the gateway's local fallback, in the
    # predictor's history and in the scheduler; the scheme derived from this corpus's 100+ models
    # is kept in `extra` for reference.
    unseen = labels.ModelClasses(tuple(float(b) for b in UNSEEN_BOUNDS), tuple(float(m) for m in UNSEEN_MEDIANS),
                                 derived.count)
    meta = artifact.Meta(objective="rank_gbm", pooling="none", encoder=enc_mod.encoder_name(encoder_dir),
                         tokenizer=ds.tokenizer, tokenizer_fingerprint=enc_mod.tokenizer_fingerprint(enc_dir),
                         max_length=512, lora_rank=0, models=models, classes=classes, default_classes=pooled,
                         unseen_classes=unseen, data_hash=ds.data_hash, lora_targets=[], kind=KIND,
                         extra={"thresholds": list(fitted.thresholds), "static_dims": dims,
                                "features": feature_names(dims), "best_iteration": fitted.best_iteration,
                                "gbm_params": dict(GBM_PARAMS, seed=seed), "train_rows": len(tr),
                                "val_rows": len(va), "excluded_sources": sorted(exclude_sources), "cut": cut,
                                "static": static, "calibration": fitted.calibration,
                                "unseen_classes_derived": derived.to_json(),
                                "train_s": round(time.monotonic() - t0, 1), **(extra or {})})
    save(out_dir, meta, fitted, table)
    return meta


def save(out_dir: str | Path, meta: artifact.Meta, fitted: Fitted, table: np.ndarray) -> Path:
    """Write gbm.txt, static.safetensors and meta.json. The static table is stored already reduced
    to what serving reads: each token's projected row (vocab x dims) and its two shares of
    the embedding ridge (vocab x 2), so serving needs neither the distilled table nor torch."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fitted.booster.save_model(str(out / GBM), num_iteration=fitted.best_iteration)
    hidden = table.shape[1]
    scores = np.stack([table @ fitted.emb_coef[:hidden], table @ fitted.emb_coef[hidden:]], axis=1)
    save_file({"table_proj": np.ascontiguousarray(table @ fitted.proj, dtype=np.float32),
               "token_scores": np.ascontiguousarray(scores, dtype=np.float32),
               "bow_coef": np.ascontiguousarray(fitted.bow_coef, dtype=np.float16)}, str(out / STATIC))
    meta.extra["bow_bias"] = fitted.bow_bias
    meta.extra["emb_bias"] = fitted.emb_bias
    artifact.write_meta(out, meta)
    for f in (GBM, STATIC, artifact.META):
        (out / f).chmod(0o644)  # safetensors writes 0600; the service may run as another user
    return out


def fast_tokenizer(enc_dir):
    """The encoder's tokenizer as a `tokenizers.Tokenizer` (no transformers import, no truncation)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(enc_dir) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


@dataclass(frozen=True, slots=True)
class Answer:
    length_class: int
    tokens: int
    value: float
    known_model: bool


class _TokWrapper:
    """`tok(text, add_special_tokens=False)["input_ids"]`, as the benchmark calls a tokenizer."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, add_special_tokens: bool = False, **_):
        if isinstance(text, str):
            return {"input_ids": self.tok.encode(text, add_special_tokens=add_special_tokens).ids}
        return {"input_ids": [e.ids for e in self.tok.encode_batch(list(text), add_special_tokens=add_special_tokens)]}


class LexicalPredictor:
    """A loaded lexical-gbm artifact: prompts (+ target models) -> class, tokens, value.

    The same interface as `infer.ProxyPredictor` where the service and the benchmark use it;
    no encoder pass, so no semantic-cache keys (``dim`` 0) and no length buckets."""

    dim = 0
    key_space = "none"
    cache_keys = "none"
    precision = "lexical"
    bucketed = False

    def __init__(self, meta: artifact.Meta, booster, table: np.ndarray, bow_coef: np.ndarray,
                 token_scores: np.ndarray, tok):
        self.meta = meta
        self.booster = booster
        self.embed = features.StaticEmbedder(table)
        # the embedding ridge is linear in the mean embedding: precompute each token's share of it
        self.head_score, self.tail_score = token_scores[:, 0].copy(), token_scores[:, 1].copy()
        self.emb_bias = float(meta.extra.get("emb_bias", 0.0))
        self.bow_coef = bow_coef.astype(np.float32)
        self.bow_bias = float(meta.extra.get("bow_bias", 0.0))
        self.thresholds = np.asarray(meta.extra["thresholds"], dtype=np.float64)
        self.calibrator: calibrate.RankCalibrator | None = None
        self.vec = bow_vectorizer()
        self._tok = tok
        self.tok = _TokWrapper(tok)

    @classmethod
    def load(cls, path: str | Path, encoder_dir: str | None = None, *,
             calibrate_classes: bool = True) -> "LexicalPredictor":
        """`calibrate_classes`: decode classes by rank among each target model's recent predictions
        (`calibrate.RankCalibrator`, stored in the artifact) instead of the fixed cut points."""
        import lightgbm as lgb
        from safetensors.numpy import load_file

        from polyserve.predictor.proxy import encoder as enc_mod

        path = Path(path)
        meta = artifact.read_meta(path)
        if meta.kind != KIND:
            raise artifact.ArtifactError(f"{path} is a {meta.kind!r} artifact, not {KIND}")
        for f in (GBM, STATIC):
            if not (path / f).is_file():
                raise artifact.ArtifactError(f"predictor artifact {path} has no {f}")
        enc_dir = enc_mod.resolve_encoder_dir(encoder_dir)
        fp = enc_mod.tokenizer_fingerprint(enc_dir)
        if fp != meta.tokenizer_fingerprint:
            raise artifact.ArtifactError(f"artifact {path} was trained with tokenizer {meta.tokenizer} "
                                         f"({meta.tokenizer_fingerprint}), the encoder at {enc_dir} has {fp}")
        names = meta.extra.get("features")
        if names is not None and names != feature_names(int(meta.extra.get("static_dims", 24))):
            raise artifact.ArtifactError(f"artifact {path} was trained on other features than this code computes "
                                         "(retrain it: polyserve predictor train-lexical)")
        arrays = load_file(str(path / STATIC))
        if "table_proj" not in arrays:
            raise artifact.ArtifactError(f"artifact {path} has no projected static table (an older format)")
        booster = lgb.Booster(model_file=str(path / GBM))
        pred = cls(meta, booster, arrays["table_proj"].astype(np.float32), arrays["bow_coef"],
                   arrays["token_scores"].astype(np.float32), fast_tokenizer(enc_dir))
        if calibrate_classes and meta.extra.get("calibration"):
            pred.calibrator = calibrate.RankCalibrator.from_json(meta.extra["calibration"])
        return pred

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch([features.clip_text(p) for p in prompts],
                                                       add_special_tokens=False)]

    def matrix(self, prompts: list[str], ids: list[list[int]] | None = None) -> np.ndarray:
        ids = ids if ids is not None else self.token_ids(prompts)
        lex = np.stack([features.lexical(p, len(i)) for p, i in zip(prompts, ids)])
        emb = np.stack([self.embed(i) for i in ids])
        bow = self.vec.transform([features.clip_text(p) for p in prompts]) @ self.bow_coef + self.bow_bias
        ridge = [(float(self.head_score[i].mean()) + float(self.tail_score[i[-features.TAIL_TOKENS:]].mean())
                  if i else 0.0) + self.emb_bias for i in ids]
        return np.hstack([lex, emb, np.asarray(bow, dtype=np.float32)[:, None],
                          np.asarray(ridge, dtype=np.float32)[:, None]])

    def predict(self, prompts: list[str], models: list[str], *, with_keys: bool = True, pad_to_max: bool = False,
                ids: list[list[int]] | None = None) -> tuple[list[Answer], None]:
        """Answers for (prompt, target model) pairs; no cache keys (None)."""
        if len(prompts) != len(models):
            raise ValueError("one target model per prompt")
        if not prompts:
            return [], None
        values = self.booster.predict(self.matrix(prompts, ids), num_threads=1)
        if self.calibrator is not None:
            cls = [self.calibrator.classify(m, float(v)) for m, v in zip(models, values)]
        else:
            cls = np.searchsorted(self.thresholds, values, side="right")
        out = []
        for m, v, c in zip(models, values, cls):
            out.append(Answer(int(c), self.meta.classes_for(m).tokens(int(c)), float(v),
                              self.meta.model_index(m) > 0))
        return out, None
