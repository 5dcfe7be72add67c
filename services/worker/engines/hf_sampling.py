"""Choosing the next token of each row of the hf engine's batch (`sample`): logit_bias and
penalties (`Shaper`), the engine's suppressed ids, grammar masks, min_tokens; then greedy, or
temperature, min-p, top-k and top-p with the row's own generator (`hf_batch.Row`)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from polyserve.proto import SamplingParams
from polyserve.worker.engines import hf_grammar


class Shaper:
    """One row's logit_bias and repetition / frequency / presence penalties (vLLM's rules and
    order), applied to its logits before temperature, so greedy decoding sees them too. Its
    tensors are built at the first step, on the logits' device and at their width."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]):
        self.params = params
        self._prompt_ids = list(prompt_ids) if params.repetition_penalty != 1.0 else None
        self._out: list[int] = []  # tokens accepted before the first step's tensors exist
        self._counts: torch.Tensor | None = None  # output token counts (frequency / presence)
        self._seen: torch.Tensor | None = None  # tokens of the prompt or the output (repetition)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        """Whether a request asks for a bias or a penalty (the rest of its rows' sampling needs none)."""
        return bool(params.logit_bias or params.frequency_penalty or params.presence_penalty
                    or params.repetition_penalty != 1.0)

    def observe(self, token: int) -> None:
        """A token the row accepted."""
        if self._bias is None:
            self._out.append(token)
            return
        if self._counts is not None and token < len(self._counts):
            self._counts[token] += 1
        if self._seen is not None and token < len(self._seen):
            self._seen[token] = True

    def _build(self, logits: torch.Tensor) -> None:
        p, width, dev = self.params, logits.shape[-1], logits.device
        items = [(t, b) for t, b in p.logit_bias.items() if t < width]  # ids are checked at admission
        self._bias = (torch.tensor([t for t, _ in items], dtype=torch.long, device=dev),
                      torch.tensor([b for _, b in items], dtype=logits.dtype, device=dev))
        if p.frequency_penalty or p.presence_penalty:
            self._counts = torch.zeros(width, dtype=logits.dtype, device=dev)
        if self._prompt_ids is not None:
            self._seen = torch.zeros(width, dtype=torch.bool, device=dev)
            self._seen[[t for t in self._prompt_ids if t < width]] = True
        for t in self._out:
            self.observe(t)
        self._out = []

    def apply(self, logits: torch.Tensor) -> None:
        """Bias, then repetition, frequency and presence penalties, on one row's logits in place."""
        if self._bias is None:
            self._build(logits)
        p = self.params
        ids, bias = self._bias
        if len(ids):
            logits[ids] += bias
        if self._seen is not None:
            r = p.repetition_penalty
            logits.copy_(torch.where(self._seen, torch.where(logits > 0, logits / r, logits * r), logits))
        if self._counts is not None:
            if p.frequency_penalty:
                logits.sub_(p.frequency_penalty * self._counts)
            if p.presence_penalty:
                logits.sub_(p.presence_penalty * (self._counts > 0).to(logits.dtype))


def bad_word_ids(words: Sequence[str], tokenizer) -> list[list[int]]:
    """vLLM's token sequences of `bad_words` (SamplingParams.update_from_tokenizer): each word as it
    encodes, and with a leading space where that is another word token of the same length."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class Restrict:
    """One row's allowed_token_ids and bad_words (vLLM's rules): outside the allowed set, and the
    last token of a bad word whose other tokens the row has just written, are -inf."""

    def __init__(self, params: SamplingParams, tokenizer):
        self.allowed = list(params.allowed_token_ids)
        self.bad = bad_word_ids(params.bad_words, tokenizer)
        self._barred: torch.Tensor | None = None  # True outside the allowed set, at the logits' width

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        return bool(params.allowed_token_ids or params.bad_words)

    def apply(self, logits: torch.Tensor, out_ids: list[int]) -> None:
        if self.allowed:
            if self._barred is None:
                self._barred = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
                self._barred[[t for t in self.allowed if t < logits.shape[-1]]] = False
            logits.masked_fill_(self._barred, float("-inf"))
        for ids in self.bad:
            prefix = len(ids) - 1
            if prefix <= len(out_ids) and (prefix == 0 or out_ids[-prefix:] == ids[:-1]) and ids[-1] < logits.shape[-1]:
                logits[ids[-1]] = float("-inf")


def sample(logits: torch.Tensor, rows: Sequence, suppress: torch.Tensor | None) -> list[int]:
    """Next token per row (`_choose`); a row over its thinking budget gets its forced token (hf_think)."""
    out = _choose(logits, rows, suppress)
    for i, row in enumerate(rows):
        if row.budget is not None and row.budget.forced:
            out[i] = row.budget.forced[0]
    return out


def _choose(logits: torch.Tensor, rows: Sequence, suppress: torch.Tensor | None) -> list[int]:
    """Next token per row: greedy (temperature 0) or temperature/top-k/top-p with the row's generator."""
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.shaper is not None:  # logit_bias and penalties, before any mask: a bias cannot lift a masked token
            row.shaper.apply(logits[i])
        if row.restrict is not None:  # allowed_token_ids, bad_words
            row.restrict.apply(logits[i], row.out_ids)
    if suppress is not None:
        logits[:, suppress] = float("-inf")
    if any(r.guide is not None for r in rows):
        hf_grammar.mask_rows(logits, rows)
    held = [(i, eos) for i, row in enumerate(rows) if row.n_out < row.params.min_tokens for eos in row.eos_ids]
    if held:  # one indexed write for every row still under min_tokens (a write per row cost ~10 us each)
        logits[[i for i, _ in held], [eos for _, eos in held]] = float("-inf")
    greedy = [i for i, r in enumerate(rows) if r.generator is None]
    if len(greedy) == len(rows):  # all greedy: no copy of the [rows, vocab] logits
        return logits.argmax(dim=-1).tolist()
    out = [0] * len(rows)
    if greedy:
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            out[i] = tok
    for i, row in enumerate(rows):
        if row.generator is not None:
            out[i] = _sample_one(logits[i], row.params, row.generator)
    return out


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    logits = logits / p.temperature
    if p.min_p > 0.0:  # after temperature, as vLLM: drop what is below min_p x the top probability
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
