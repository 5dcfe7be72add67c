"""Simulated log-probabilities for the sim engine (clearly simulated, like all its output).

Each generated word gets a plausible logprob and k alternatives drawn from the sim's
vocabulary, most likely first, the sampled word among them at a random rank (or below
them all). Values come from their own generator seeded by the choice and position, so
asking for logprobs never changes the text, and the same seed gives the same numbers.
The prompt's "tokens" are its whitespace-led words (first: no logprob)."""
from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence

from polyserve.proto import TokenLogprob, TopLogprob

_WORD = re.compile(r"\s*\S+")


def _entry(token: str, k: int, rng: random.Random, vocab: Sequence[str]) -> TokenLogprob:
    space = " " if token.startswith(" ") else ""
    values = sorted((-rng.expovariate(0.6) for _ in range(max(k, 1) + 1)), reverse=True)
    rank = rng.randrange(k + 1) if k else 0  # k: below every alternative
    own = values[rank]
    others = [space + w for w in rng.sample(list(vocab), min(len(vocab), k + 1)) if space + w != token]
    top = []
    for i in range(k):
        text = token if i == rank else others.pop()
        top.append(TopLogprob(token=text, logprob=values[i], token_id=-1))
    return TokenLogprob(token=token, logprob=own, token_id=-1, top=top)


def generated(seed: str, position: int, token: str, k: int, vocab: Sequence[str]) -> TokenLogprob:
    """The entry of the `position`-th generated token of the choice seeded by `seed`."""
    return _entry(token, k, random.Random(f"{seed}:lp:{position}"), vocab)


def prompt(text: str, k: int, vocab: Sequence[str]) -> list[TokenLogprob]:
    """The prompt's words with simulated logprobs; the first has none."""
    words = _WORD.findall(text)
    rng = random.Random(zlib.crc32(text.encode()))
    return [TokenLogprob(token=w, logprob=None) if i == 0 else _entry(w, k, rng, vocab) for i, w in enumerate(words)]
