"""Target-model names as the predictor matches them (pure; used by training, inference and the
length history, so a name means the same model everywhere).

`canonical(name)` is the key two spellings of one model share:

* lower case; a provider prefix up to the last ``/`` dropped (``meta-llama/Llama-2-70b-chat-hf``);
* split into alphanumeric tokens (punctuation, ``_``, ``.``, ``:`` and spaces are separators);
  a leading vendor token dropped when a name follows (``Meta-Llama-3-8B-Instruct``);
  trailing packaging tokens dropped (``-hf``, ``-awq``, ``-gptq``, ``-gguf``, ``-fp16``...);
* the tokens joined without separators, so ``gpt-3.5-turbo``, ``GPT-3.5-Turbo``,
  ``gpt-35-turbo`` (Azure's spelling) and ``gpt_3.5_turbo`` are all ``gpt35turbo``, and
  ``llama-2-70b-chat`` / ``Llama-2-70b-chat-hf`` are ``llama270bchat``;
* a few aliases (`ALIASES`: ``chatgpt`` is ``gpt35turbo``).

`ModelResolver(known).resolve(name)` finds the known model a name stands for, best first:
``exact`` (same canonical key), ``version`` (same key once a trailing release date such as
``-0613`` or ``-2024-04-09`` is dropped from either side: ``gpt-3.5-turbo`` ->
``gpt-3.5-turbo-0613``), ``family`` (same family: the letters that start the name, e.g.
``llama`` for ``llama-3-70b-instruct`` -> ``Meta-Llama-3-8B-Instruct``), else ``unknown``.
Among several candidates of one level, the one sharing the longest token prefix wins, then
the first by name.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

VENDORS = frozenset({"meta", "mistralai", "openai", "anthropic", "google", "microsoft", "tiiuae", "lmsys",
                     "thebloke", "huggingfaceh4", "nousresearch", "teknium"})
PACKAGING = frozenset({"hf", "awq", "gptq", "gguf", "ggml", "fp8", "fp16", "bf16", "int4", "int8", "4bit", "8bit"})
ALIASES: dict[str, str] = {"chatgpt": "gpt35turbo", "gpt35": "gpt35turbo"}
_TOKEN = re.compile(r"[a-z0-9]+")
_DATE = re.compile(r"\d{4,8}")

EXACT, VERSION, FAMILY, UNKNOWN = "exact", "version", "family", "unknown"


def tokens(name: str) -> list[str]:
    """The name's alphanumeric tokens, without provider prefix, vendor and packaging tokens."""
    toks = _TOKEN.findall(name.strip().lower().rsplit("/", 1)[-1])
    while len(toks) > 1 and toks[0] in VENDORS:
        toks = toks[1:]
    while len(toks) > 1 and toks[-1] in PACKAGING:
        toks = toks[:-1]
    return toks


@functools.lru_cache(maxsize=4096)
def canonical(name: str) -> str:
    """The key every spelling of one model shares ("" for an empty name). Cached: the gateway's
    local length estimate asks it on every request (issue 15)."""
    key = "".join(tokens(name))
    return ALIASES.get(key, key)


def undated(name: str) -> str:
    """`canonical` without a trailing release date (``-0613``, ``-20240620``, ``-2024-04-09``)."""
    toks = tokens(name)
    for i in range(len(toks) - 1, 0, -1):
        if _DATE.fullmatch(toks[i]) and all(t.isdigit() for t in toks[i:]):
            key = "".join(toks[:i])
            return ALIASES.get(key, key)
    return canonical(name)


def family(name: str) -> str:
    """The letters that start the name (``llama``, ``gpt``, ``qwen``, ``mistral``...)."""
    toks = tokens(name)
    if not toks:
        return ""
    m = re.match(r"[a-z]+", ALIASES.get(toks[0], toks[0]))
    return m.group(0) if m else ""


def _shared_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip("".join(a), "".join(b)):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class Match:
    known: str | None  # the known model's name as given to the resolver; None when unknown
    how: str  # exact | version | family | unknown


class ModelResolver:
    """Finds which of the `known` model names a requested name stands for (see module docstring)."""

    def __init__(self, known: Iterable[str], *, use_family: bool = True, max_cache: int = 4096):
        self.known = list(known)
        self.use_family = use_family
        self.max_cache = max_cache
        self._cache: dict[str, Match] = {}
        self._levels = [(EXACT, canonical), (VERSION, undated)] + ([(FAMILY, family)] if use_family else [])
        self._index = [(how, fn, self._by(fn)) for how, fn in self._levels]

    def _by(self, fn) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for k in sorted(self.known):
            key = fn(k)
            if key:
                out.setdefault(key, []).append(k)
        return out

    def resolve(self, name: str) -> Match:
        hit = self._cache.get(name)
        if hit is not None:
            return hit
        hit = Match(None, UNKNOWN)
        query = tokens(name)
        for how, fn, index in self._index:
            cands = index.get(fn(name), []) if query else []
            if cands:
                best = max(cands, key=lambda k: (_shared_prefix(query, tokens(k)), -cands.index(k)))
                hit = Match(best, how)
                break
        if len(self._cache) >= self.max_cache:
            self._cache.pop(next(iter(self._cache)))
        self._cache[name] = hit
        return hit
