"""A thinking model's tags in the `hf` engine (SamplingParams.think, set by the gateway for a
deployment with a `reasoning_parser`: gateway/reasoning.py):

* `ThinkGate`: a constraint (structured outputs, a forced tool call) starts after the thinking, as
  vLLM's structured outputs with a reasoning parser (`reasoning_ended`) do: the row's grammar is
  held until the row has written the closing tag;
* `ThinkBudget`: vLLM's `thinking_token_budget`: once the row has thought that many tokens (counted
  from the opening tag, in the prompt or the output) without closing, the closing tag's tokens are
  forced, one a step (`hf_sampling.sample`), and the answer follows.

Both read the prompt's last few tokens: a prompt that already closed the thinking (Qwen3's
`enable_thinking: false` ends it with `<think></think>`) needs neither; one that opened it
(DeepSeek-R1's template ends with `<think>`) thinks from the first token. Only the tail is read,
so an earlier turn's tags do not count. Tags are matched in the row's text, so they may span
tokens (a model whose vocabulary has them as single tokens writes them as one).
"""
from __future__ import annotations

from collections.abc import Sequence

PROMPT_TAIL = 8  # tokens: the generation prompt's own tags are its last few


def prompt_state(think: Sequence[str], tokenizer, prompt_ids: Sequence[int]) -> str:
    """"closed", "open" (the prompt is inside the thinking) or "none", from the prompt's tail."""
    open_tag, close = think
    tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL:]), skip_special_tokens=False) if prompt_ids else ""
    at_open, at_close = tail.rfind(open_tag), tail.rfind(close)
    if at_close > at_open:
        return "closed"
    return "open" if at_open >= 0 else "none"


class _Tail:
    """The row's recent text, long enough to find a tag that spans pieces."""

    def __init__(self, longest: int):
        self.keep, self.text = longest, ""

    def add(self, piece: str) -> str:
        self.text = (self.text + piece)[-(self.keep + len(piece)):]
        return self.text


class ThinkGate:
    """Whether a row's thinking has ended (`ended`); `feed` each piece of its text."""

    def __init__(self, think: Sequence[str], tokenizer, prompt_ids: Sequence[int]):
        self.close = think[1]
        self.ended = prompt_state(think, tokenizer, prompt_ids) == "closed"
        self._tail = _Tail(len(self.close))

    def feed(self, piece: str) -> bool:
        """Whether the thinking has ended, with `piece` (the row's next text) written."""
        if not self.ended:
            self.ended = self.close in self._tail.add(piece)
        return self.ended


class ThinkBudget:
    """vLLM's thinking_token_budget for one row: `accept` each token and its text; `forced` holds the
    closing tag's tokens still to be forced (the next one first)."""

    def __init__(self, think: Sequence[str], budget: int, tokenizer, prompt_ids: Sequence[int]):
        self.open_tag, self.close = think
        self.budget = budget
        state = prompt_state(think, tokenizer, prompt_ids)
        self.inside, self.done = state == "open", state == "closed"
        self.count = 0  # thinking tokens so far (after the opening tag)
        self.close_ids = list(tokenizer.encode(self.close, add_special_tokens=False))
        self.forced: list[int] = []
        self._tail = _Tail(max(len(self.open_tag), len(self.close)))
        self._over()

    def _over(self) -> None:
        if self.inside and not self.done and not self.forced and self.count >= self.budget:
            self.forced = list(self.close_ids)

    def accept(self, token: int, piece: str) -> None:
        if self.done:
            return
        if self.forced:  # `sample` chose it: once the whole tag is written the thinking is over, however
            self.forced.pop(0)  # the tokenizer spaces its pieces when it decodes them
            self.done = not self.forced
            return
        text = self._tail.add(piece)
        if not self.inside:
            at = text.rfind(self.open_tag)
            if at >= 0:  # the output opened the thinking (Qwen3): count from the next token
                self.inside, self._tail.text = True, text[at + len(self.open_tag):]
                self._over()
            return
        if self.close in text:
            self.done = True
            return
        self.count += 1
        self._over()
