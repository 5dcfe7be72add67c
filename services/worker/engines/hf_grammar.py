"""Structured outputs for the `hf` engine: a per-row token mask from llguidance.

Why llguidance (and not xgrammar): it is one self-contained wheel with no Python
dependencies (xgrammar pulls triton and apache-tvm-ffi into a CPU install), its
`LLMatcher` is the simple per-sequence object the batch needs (fill a bitmask, consume
the accepted token, ask whether the grammar is complete), it compiles JSON Schema, regex,
Lark (and GBNF) grammars directly, and it computes masks lazily (no per-grammar
precompilation over the vocabulary), so a new schema costs milliseconds.

How it is used (hf_batch): a `Guide` per constrained row. Before sampling, the row's
logits outside the grammar's allowed set are -inf (the row's bitmask unpacked to booleans);
after sampling, the token is consumed. EOS is allowed only where the grammar may end (the
mask says so); when the grammar is complete and nothing may follow (`is_stopped`), the row
ends with finish_reason "stop". `max_tokens` still applies: a too-short budget gives
"length" and a truncated text, as in vLLM.

Text: a constrained row's text is the bytes the grammar saw for its tokens (llguidance's
view of the vocabulary), so it is exactly what was validated. For byte-level BPE and
SentencePiece tokenizers that is the model's own decoding. The random model's WordPiece
tokenizer (BERT, uncased) has no byte decoding: every token is read as its own text
(a `##` continuation without its `##`, a word-initial token without the space BERT's
decoder would put before it: llguidance's mask goes wrong on space-led tokens of such a
vocabulary), special and `[unused]` tokens as nothing. So there the text has no spaces
between words, and an uncased vocabulary cannot spell "Red": a grammar that needs such
text dead-ends and the row ends with "stop" early.
"""
from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Sequence

import torch

from polyserve.proto import StructuredOutput
from polyserve.worker.engine import EngineError

_BITS = torch.arange(32, dtype=torch.int32)


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _wordpiece_tokens(tokenizer) -> tuple[list[bytes], list[int]]:
    """Byte view of a WordPiece vocabulary (see the module docstring) and its special ids."""
    vocab = tokenizer.get_vocab()
    tokens = [b""] * len(tokenizer)
    special = set(tokenizer.all_special_ids)
    for text, i in vocab.items():
        if i >= len(tokens):
            continue
        if text.startswith("[") and text.endswith("]"):
            special.add(i)
        else:
            tokens[i] = (text[2:] if text.startswith("##") else text).encode()
    for i in special:
        tokens[i] = b""
    return tokens, sorted(special)


class _Wrapped:
    """What llguidance's TokenizerWrapper reads: `tokens` (bytes per id), eos/bos, `__call__`."""

    def __init__(self, tokenizer, eos: int):
        self.tokens, self.special_token_ids = _wordpiece_tokens(tokenizer)
        self.eos_token_id, self.bos_token_id = eos, getattr(tokenizer, "cls_token_id", None)
        self._tok = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


def _lltokenizer(tokenizer, eos_ids: set[int], vocab: int):
    import llguidance
    import llguidance.hf
    eos = sorted(eos_ids)
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos or None)
    except ValueError:  # not a byte-level fast tokenizer (the random model's WordPiece)
        from llguidance._tokenizer import TokenizerWrapper
        return llguidance.LLTokenizer(TokenizerWrapper(_Wrapped(tokenizer, eos[0] if eos else 0)), n_vocab=vocab,
                                      eos_token=eos or None)


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar of one constraint (no validation yet: LLMatcher does that)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark
    kind = spec.kind()
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.json, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))


class Grammars:
    """The engine's llguidance tokenizer (built once, ~1 s) and its compiled-grammar cache."""

    def __init__(self, tokenizer, eos_ids: set[int], vocab: int):
        self._tok, self._eos, self.vocab = tokenizer, eos_ids, vocab
        self._ll = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._ll is None:
                self._ll = _lltokenizer(self._tok, self._eos, self.vocab)
            return self._ll

    def guide(self, spec: StructuredOutput) -> Guide:
        """A fresh matcher for one row; EngineError 400 when the constraint is invalid."""
        if not available():
            raise EngineError("structured outputs need llguidance on the worker (pip install 'polyserve[hf]')", 400)
        from llguidance import LLMatcher
        try:
            grammar = grammar_of(spec)
        except (ValueError, TypeError) as exc:
            raise EngineError(f"invalid {spec.kind()} constraint: {exc}", 400) from exc
        matcher = LLMatcher(self.lltokenizer, grammar)
        if matcher.is_error():
            raise EngineError(f"invalid {spec.kind()} constraint: {matcher.get_error()}", 400)
        return Guide(matcher, self.lltokenizer, self.vocab)

    def check(self, spec: StructuredOutput) -> None:
        """Compile `spec` once at admission so a bad schema is a 400 before any token."""
        self.guide(spec)


class Guide:
    """One row's matcher: the allowed-token mask, the accepted tokens, the row's text."""

    def __init__(self, matcher, lltokenizer, vocab: int):
        self.matcher = matcher
        self._ll = lltokenizer
        self._words = (vocab + 31) // 32
        self._vocab = vocab
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def allowed(self) -> torch.Tensor:
        """Bool [vocab]: the tokens the grammar allows next (EOS only where it may end)."""
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        return ((bits.unsqueeze(-1) >> _BITS) & 1).bool().flatten()[:self._vocab]

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (or the matcher failed)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    # the IncrementalDetokenizer interface (hf_text) over the grammar's byte view
    def add(self, token: int) -> str:
        return self._utf8.decode(self._ll.decode_bytes([token]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def mask_rows(logits: torch.Tensor, rows: Sequence) -> None:
    """-inf outside each constrained row's allowed set, in place (rows without a guide untouched)."""
    for i, row in enumerate(rows):
        guide = getattr(row, "guide", None)
        if guide is None:
            continue
        allowed = guide.allowed().to(logits.device)
        width = min(allowed.shape[0], logits.shape[-1])
        logits[i, :width].masked_fill_(~allowed[:width], float("-inf"))
        logits[i, width:] = float("-inf")
