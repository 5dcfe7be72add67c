"""What the gateway knows about the client of the request it is serving (issue 14): its key,
the rate-limit decision, the tokens reserved and used, its fair-queue slot. One `Ticket` per
HTTP request, made by the access middleware (access.py) and kept in a context variable, so the
code on the request's path (admission's fair queue, the usage hook in `GatewayState.event`)
reads it without threading it through every call; tasks the request starts inherit it."""
from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass
from typing import Any

from .fairness import Grant
from .keys import KeyRecord
from .ratelimit import Decision


@dataclass
class Ticket:
    record: KeyRecord | None = None  # None: no client key (keys off, none given)
    decision: Decision | None = None
    reserved: int = 0  # TPM tokens reserved at admission
    est_in: int = 0
    est_out: int = 0
    prompt_tokens: int = 0  # actual usage, from the request's `completed` events
    completion_tokens: int = 0
    completed: int = 0
    grant: Grant | None = None
    deployment: str = ""  # of the fair-queue slot
    status: int = 0  # the HTTP status answered

    def used(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens += max(0, prompt_tokens)
        self.completion_tokens += max(0, completion_tokens)
        self.completed += 1


_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("polyserve_ticket", default=None)


def current() -> Ticket | None:
    """The ticket of the request being served (None outside one)."""
    return _TICKET.get()


def current_tenant() -> str:
    """The tenant of the request being served, "" without an API key."""
    t = _TICKET.get()
    return t.record.tenant if t is not None and t.record is not None else ""


def enter(ticket: Ticket) -> contextvars.Token:
    return _TICKET.set(ticket)


def leave(token: contextvars.Token) -> None:
    _TICKET.reset(token)


def _text_tokens(value: Any, depth: int = 0) -> int:
    """A cheap token estimate of a prompt-like JSON value: ~4 characters per token for text, one
    per integer (token-id prompts); nested lists and message dicts are walked (bounded depth)."""
    if isinstance(value, str):
        return math.ceil(len(value) / 4)
    if isinstance(value, bool) or depth > 6:
        return 0
    if isinstance(value, int):
        return 1
    if isinstance(value, list):
        return sum(_text_tokens(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_text_tokens(v, depth + 1) for k, v in value.items() if k in ("content", "text", "input"))
    return 0


def _int(value: Any, default: int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return max(low, min(high, value))


def estimate(body: Any, *, embedding: bool, default_max_tokens: int, max_tokens_limit: int,
             max_n: int) -> tuple[int, int]:
    """(input, output) tokens a request body may use, before it is validated: the TPM reservation
    and the fair queue's charge. Output: max_tokens (or max_completion_tokens, max_output_tokens)
    × n × prompts; 0 for embeddings."""
    if not isinstance(body, dict):
        return 0, 0
    source = next((body[k] for k in ("prompt", "messages", "input") if k in body), None)
    est_in = _text_tokens(source)
    if embedding:
        return est_in, 0
    prompts = len(source) if isinstance(source, list) and source and all(
        isinstance(p, (str, list)) for p in source) and "prompt" in body else 1
    given = next((body[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                  if body.get(k) is not None), None)
    max_out = _int(given, default_max_tokens, 1, max_tokens_limit)
    return est_in, max_out * _int(body.get("n"), 1, 1, max_n) * prompts
