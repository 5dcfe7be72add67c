"""Text side of generation for the `hf` engine: incremental detokenisation and stop strings.

Pure Python over a tokenizer's `decode`; no torch, so it is cheap to test.
"""
from __future__ import annotations

from collections.abc import Sequence

from polyserve.core.queue_order import stop_span

# Tokens of prompt context kept in the decode window so that the first generated
# token gets the spacing it has after the prompt (SentencePiece "▁", WordPiece "##").
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that join into the decoded whole.

    The offsets scheme of vLLM/TGI: decode a short window before and after the new
    token and emit the difference, holding text back while it ends in an incomplete
    UTF-8 sequence (U+FFFD). Cost per token is O(window), not O(output).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token and return the new text it completes ('' while incomplete)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            return piece
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete sequence that will not complete)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class StopMatcher:
    """Holds back text that may be the start of a stop string; finds the first stop.

    `feed(piece)` returns (text safe to emit, stopped). When stopped, the emitted
    text ends exactly before the stop string, which itself is emitted only with `include`
    (vLLM's include_stop_str_in_output).
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str, check: bool = True) -> tuple[str, bool]:
        """Add decoded text; `check=False` (before min_tokens) emits it all without matching."""
        self.text += piece
        if not self.stops or not check:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out, False
        # Held-back text is never emitted, so a stop can only start at or after `emitted`.
        cut, end = stop_span(self.text, self.stops, self.emitted)
        if cut >= 0:
            cut = end if self.include else cut
            out = self.text[self.emitted:cut] if cut > self.emitted else ""
            self.text = self.text[:cut]
            self.emitted = cut
            return out, True
        keep = self._held_back()
        end = len(self.text) - keep
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, False

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        pending = len(self.text) - self.emitted
        for k in range(min(self._longest - 1, pending), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """Release the held-back text (generation ended for another reason)."""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out
