"""Fewer chunks for a non-streamed request (`GenerateRequest.stream` False).

Its client gets one body at the end, so the chunks before the last serve only recovery (a
migrated request resumes from the output the gateway has) and the gateway's view of progress.
One NATS message per engine delta cost every hop per token: the worker's publish, nats-server,
and the gateway's parse, relay and bookkeeping (about 17 messages for a 16-token request;
docs/benchmarks/overhead.md). So the deltas of each choice are merged and sent at most every
`interval_s`, as vLLM's `--stream-interval` does for its own output. A choice's first delta goes
at once (the gateway's `first_token` event and TTFT stay exact), and so does its last
(`finish_reason`). No timer: what is held goes with the next delta, and all of it before the
request's final chunk, so a delta waits at most one inter-token gap beyond the interval.

With `hold_last` (a single-choice request whose gateway takes text on the done chunk:
`GenerateRequest.last_on_done`) the delta with the finish reason is held too, and the worker
sends it on the request's done chunk: one NATS message fewer per request (issue 15). Its client
gets nothing before the done chunk anyway; a worker that dies between the two loses only text
the gateway had not relayed, which a migrated request generates again.
"""
from __future__ import annotations

import time
from dataclasses import replace

from polyserve.worker.engine import Delta


def merged(parts: list[Delta]) -> Delta:
    """The deltas `parts` (one choice, in order) as one delta; built once per chunk sent, not
    once per delta held (a `dataclasses.replace` per token was ~4% of the worker's CPU)."""
    if len(parts) == 1:
        return parts[0]
    a, b = parts[0], parts[-1]
    logprobs = None
    if any(d.logprobs is not None for d in parts):
        logprobs = [lp for d in parts for lp in d.logprobs or ()]
    prompt = next((d.prompt_logprobs for d in parts if d.prompt_logprobs is not None), None)
    ids = [t for d in parts for t in d.token_ids or ()] if a.token_ids is not None else None
    return replace(a, text="".join(d.text for d in parts), tokens=sum(d.tokens for d in parts),
                   finish_reason=b.finish_reason, logprobs=logprobs, prompt_logprobs=prompt, token_ids=ids)


class Merger:
    """Deltas in, the deltas to send now out (in order per choice)."""

    def __init__(self, interval_s: float, hold_last: bool = False):
        self.interval_s = interval_s
        self.hold_last = hold_last and interval_s > 0  # the finishing delta waits for flush()
        self._held: dict[int, list[Delta]] = {}  # per choice: what has not been sent yet
        self._started: set[int] = set()  # choices whose first delta went out
        self._sent_at = time.monotonic()

    def add(self, d: Delta) -> list[Delta]:
        if self.interval_s <= 0:
            return [d]
        if d.index not in self._started:
            self._started.add(d.index)
            if d.finish_reason is None:
                self._sent_at = time.monotonic()
                return [d]
        held = self._held.get(d.index)
        if held is None:
            self._held[d.index] = [d]
        else:
            held.append(d)
        if d.finish_reason is not None:
            return [] if self.hold_last else self.flush()
        if time.monotonic() - self._sent_at >= self.interval_s:
            return self.flush()
        return []

    def flush(self) -> list[Delta]:
        """Everything held (before the request's final chunk)."""
        out = [merged(parts) for parts in self._held.values()]
        self._held.clear()
        self._sent_at = time.monotonic()
        return out
