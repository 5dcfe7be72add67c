"""Logprobs and echo in the OpenAI formats (issue 18 item 3).

Request side: `logprobs`/`top_logprobs` (chat) and `logprobs` (completions, an int) become
`SamplingParams.logprobs` (k alternatives per token); completions `echo` with `logprobs`
asks for `prompt_logprobs` too. Engines report vLLM's default semantics: the log-softmax
of the raw model distribution (before temperature and top-k/top-p), top alternatives most
likely first. The sim engine's values are simulated.

Response side, streamed and not:
* completions: `choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`;
  `top_logprobs[t]` maps token text -> logprob; `text_offset[t]` is where token t starts in
  the choice's text (the running sum of the token strings' lengths, as vLLM counts). With
  `echo` the prompt comes first in the text and in the logprobs (its first token: null).
* chat: `choices[i].logprobs = {content: [{token, logprob, bytes, top_logprobs: [...]}],
  refusal: null}`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from polyserve.proto import SamplingParams, TokenLogprob, TopLogprob

from .policy import InvalidRequest

MAX_TOP = 20  # OpenAI's top_logprobs bound; vLLM's default max_logprobs


def _bounded(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
        raise InvalidRequest(f"'{name}' must be an integer between 0 and {MAX_TOP}, got {value!r}", name)
    return value


def apply(params: SamplingParams, body: Any, chat: bool) -> SamplingParams:
    """`params` with the logprobs the body asks for (400 for out-of-range values)."""
    params = _prompt(params, body)
    if chat:
        top = getattr(body, "top_logprobs", None)
        if top is not None:
            _bounded(top, "top_logprobs")
        if not getattr(body, "logprobs", None):
            if top:
                raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return params
        return msgspec.structs.replace(params, logprobs=top or 0)
    k = getattr(body, "logprobs", None)
    if k is None:
        return params
    k = _bounded(k, "logprobs")
    echo = k if getattr(body, "echo", False) else None
    return msgspec.structs.replace(params, logprobs=k, prompt_logprobs=echo if params.prompt_logprobs is None
                                   else params.prompt_logprobs)


def _prompt(params: SamplingParams, body: Any) -> SamplingParams:
    """vLLM's `prompt_logprobs: k` (a whole answer only; with `echo` its k wins, as vLLM's does)."""
    k = getattr(body, "prompt_logprobs", None)
    if k is None:
        return params
    _bounded(k, "prompt_logprobs")
    if getattr(body, "stream", False):  # vLLM's streamed chunks have no place for them either
        raise InvalidRequest("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    return msgspec.structs.replace(params, prompt_logprobs=k)


def whole_prompt_logprobs(answer: dict[str, Any], chat: bool, entries: list[list[TokenLogprob] | None]) -> None:
    """vLLM's `prompt_logprobs` field on a whole answer: per choice (completions: one prompt each)
    or once on the response (chat: one prompt)."""
    fields = [prompt_field(x) for x in entries]
    if chat:
        answer["prompt_logprobs"] = fields[0] if fields else None
        return
    for choice, f in zip(answer["choices"], fields):
        choice["prompt_logprobs"] = f


def prompt_field(entries: list[TokenLogprob] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token a dict token id -> {logprob, rank, decoded_token}
    holding the token itself and its top alternatives (ranks 1..k); the first token's is null."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        pos = {str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.token}
               for r, t in enumerate(e.top, start=1)}
        pos.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank or None, "decoded_token": e.token})
        out.append(pos)
    return out


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_content(entries: list[TokenLogprob], as_ids: bool = False) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`. `as_ids` (vLLM's return_tokens_as_token_ids): each token and
    alternative as "token_id:N"; the token's `bytes` stay its text's, an alternative's are the
    string's (as vLLM renders them)."""
    def name(t: TokenLogprob | TopLogprob) -> str:
        return _id(t.token_id) if as_ids else t.token

    return [{"token": name(e), "logprob": e.logprob, "bytes": _bytes(e.token),
             "top_logprobs": [{"token": name(t), "logprob": t.logprob, "bytes": _bytes(name(t))} for t in e.top]}
            for e in entries]


def _id(token_id: int) -> str:
    return f"token_id:{token_id}"


def as_token_ids(entries: list[TokenLogprob]) -> list[TokenLogprob]:
    """`entries` with every token and alternative written as "token_id:N" (completions)."""
    return [msgspec.structs.replace(e, token=_id(e.token_id), top=[msgspec.structs.replace(t, token=_id(t.token_id))
                                                                  for t in e.top]) for e in entries]


def split_at(entries: list[TokenLogprob], n: int) -> tuple[list[TokenLogprob], list[TokenLogprob]]:
    """`entries` split where their tokens' text reaches `n` characters: the tokens that lie wholly
    within the first `n`, and the rest."""
    k, length = 0, 0
    while k < len(entries) and length + len(entries[k].token) <= n:
        length += len(entries[k].token)
        k += 1
    return entries[:k], entries[k:]


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The completions `logprobs` object of `entries`, text offsets counted from `offset`."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


@dataclass
class Renderer:
    """Adds echo and logprobs to the choices of one response (state per choice index)."""

    chat: bool
    want: bool  # logprobs asked for
    echo: bool = False  # completions: the prompt leads the text
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens as "token_id:N"
    _offsets: dict[int, int] = field(default_factory=dict)
    _echoed: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, body: Any, params: SamplingParams, chat: bool) -> "Renderer":
        return cls(chat=chat, want=params.logprobs is not None, echo=not chat and bool(getattr(body, "echo", False)),
                   as_ids=bool(getattr(body, "return_tokens_as_token_ids", False)))

    @property
    def active(self) -> bool:
        return self.want or self.echo

    def choice(self, choice: dict[str, Any], index: int, prompt: str, entries: list[TokenLogprob] | None,
               prompt_entries: list[TokenLogprob] | None) -> None:
        """Fill `choice` (a streamed chunk's or a full response's) with the echo and logprobs
        of this part of choice `index`; a stream calls it once per chunk, in order."""
        first = index not in self._echoed
        self._echoed.add(index)
        if self.echo and first:
            key = "text"
            choice[key] = prompt + choice.get(key, "")
        if not self.want:
            return
        if self.chat:
            choice["logprobs"] = {"content": chat_content(entries or [], self.as_ids), "refusal": None}
            return
        lead = prompt_entries if self.echo and first and prompt_entries else []
        both = lead + (entries or [])
        rendered = completion_logprobs(as_token_ids(both) if self.as_ids else both, self._offsets.get(index, 0))
        if rendered["tokens"]:
            self._offsets[index] = rendered["text_offset"][-1] + len(rendered["tokens"][-1])
        choice["logprobs"] = rendered
