"""A distilled static token table for the fast tier (issue 17; model2vec-style).

The encoder's *input* embedding rows know a token's identity but little of its meaning in
use. Passing every vocabulary token through the whole encoder once, alone (``[CLS] token
[SEP]``), and mean-pooling the output gives each token a vector in the space the sentence
encoder was trained for (Tulkens & van Dongen's model2vec distillation, without its
vocabulary or weighting steps). A prompt's mean over those rows is still one gather and one
mean at serving time, no transformer pass. 30,522 tokens take about a minute on one core,
at training time only (torch and transformers: the ``hf`` extra); the artifact stores the
table already projected (`lexical.save`), so serving needs neither.

`lexical.static_table("combined")` puts both tables side by side (the raw rows carry token
identity, the distilled ones meaning). Measured on the out-of-distribution folds it was no
better than the raw table alone once the stacked bag-of-words and embedding ridges are in
(docs/benchmarks/predictor.md, 2026-11-26), so the shipped default stays ``raw``;
``--static combined`` reproduces the comparison.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


def distilled_table(encoder_dir: str | Path, batch: int = 1024, threads: int = 1) -> np.ndarray:
    """vocab x hidden: mean-pooled encoder output of each token alone between [CLS] and [SEP]."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(max(1, threads))
    tok = AutoTokenizer.from_pretrained(str(encoder_dir))
    model = AutoModel.from_pretrained(str(encoder_dir)).eval()
    vocab = int(model.config.vocab_size)
    out = np.zeros((vocab, int(model.config.hidden_size)), dtype=np.float32)
    t0 = time.monotonic()
    with torch.inference_mode():
        for s in range(0, vocab, batch):
            ids = torch.arange(s, min(vocab, s + batch))
            x = torch.stack([torch.full_like(ids, tok.cls_token_id), ids, torch.full_like(ids, tok.sep_token_id)], 1)
            h = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
            out[s:s + len(ids)] = h.mean(dim=1).numpy()
    logger.info("distilled %d token vectors in %.0fs", vocab, time.monotonic() - t0)
    return out


def combined(raw: np.ndarray, distilled: np.ndarray) -> np.ndarray:
    """[raw | distilled], each scaled to a mean row norm of 1 so that PCA and ridge weigh them alike."""
    def unit(t: np.ndarray) -> np.ndarray:
        return t / float(np.linalg.norm(t, axis=1).mean())

    return np.hstack([unit(raw), unit(distilled)]).astype(np.float32)


def cached_combined(encoder_dir: str | Path, cache_dir: str | Path | None) -> np.ndarray:
    """`combined` for the encoder, the distilled half cached as .npy under `cache_dir` (keyed by the
    encoder's weights file size and mtime), so repeated training and evaluation runs skip the minute."""
    from polyserve.predictor.proxy.features import StaticEmbedder

    raw = StaticEmbedder.word_embeddings(encoder_dir)
    weights = Path(encoder_dir) / "model.safetensors"
    st = weights.stat()
    path = Path(cache_dir) / f"distilled-{st.st_size}-{int(st.st_mtime)}.npy" if cache_dir else None
    if path is not None and path.is_file():
        dist = np.load(path)
    else:
        dist = distilled_table(encoder_dir)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, dist)
    return combined(raw, dist)
