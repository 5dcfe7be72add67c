"""Log-probabilities for the `hf` engine (OpenAI `logprobs`/`top_logprobs`, completions `echo`).

Semantics are vLLM's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the
model's raw logits at each position, in float32, before temperature, top-k/top-p and the
engine's own suppression of special tokens. The sampled token is reported with its logprob
under that distribution whatever the sampler did, plus the k most likely tokens (most
likely first). A token's text is the token decoded alone (special tokens kept).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from polyserve.proto import TokenLogprob, TopLogprob


class TokenTexts:
    """token id -> its text, decoded once per id."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _entries(lp: torch.Tensor, chosen: Sequence[int], ks: Sequence[int], texts: TokenTexts) -> list[TokenLogprob]:
    """One TokenLogprob per row of `lp` ([rows, vocab] log-probabilities) for token `chosen[i]`
    with its `ks[i]` best alternatives."""
    k_max = max(ks, default=0)
    top_v = top_i = None
    if k_max > 0:
        top = torch.topk(lp, min(k_max, lp.shape[-1]), dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    idx = torch.tensor(list(chosen), device=lp.device).unsqueeze(-1)
    own_t = lp.gather(-1, idx)
    own = own_t.squeeze(-1).tolist()
    ranks = ((lp > own_t).sum(-1) + 1).tolist()  # vLLM's rank: 1 + the tokens more likely than it
    out = []
    for i, (tok, k) in enumerate(zip(chosen, ks)):
        alts = [TopLogprob(token=texts(t), logprob=v, token_id=t) for t, v in zip(top_i[i][:k], top_v[i][:k])] \
            if k > 0 else []
        out.append(TokenLogprob(token=texts(tok), logprob=own[i], token_id=tok, top=alts, rank=ranks[i]))
    return out


def sampled(logits: torch.Tensor, tokens: Sequence[int], ks: Sequence[int | None],
            texts: TokenTexts) -> list[TokenLogprob | None]:
    """Per row: the sampled token's entry if that row asked for logprobs (k not None), else None.
    `logits` are the raw [rows, vocab] logits the tokens were sampled from (not modified)."""
    want = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(tokens)
    if not want:
        return out
    lp = torch.log_softmax(logits[want].float(), dim=-1)
    for i, entry in zip(want, _entries(lp, [tokens[i] for i in want], [ks[i] for i in want], texts)):
        out[i] = entry
    return out


def prompt(logits: torch.Tensor, ids: Sequence[int], k: int, texts: TokenTexts) -> list[TokenLogprob]:
    """The prompt's tokens with their logprobs: `logits` [L, vocab] from the prefill of `ids`
    (position i predicts token i + 1); the first token has none."""
    first = [TokenLogprob(token=texts(ids[0]), logprob=None, token_id=ids[0])] if ids else []
    if len(ids) < 2:
        return first
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return first + _entries(lp, list(ids[1:]), [k] * (len(ids) - 1), texts)
