"""The worker's side of a stream's delivery guarantees (issue 13): a bounded replay buffer of
the chunks it sent, and the credit window that holds a stream whose client reads slowly.

One `Outbox` per stream. Every chunk the worker publishes goes into it first; the gateway's
`Credit` (the highest `seq` it handed to the client) frees what it covers and opens the
window again; a `ReplayRequest` (a `seq` gap the gateway could not fill) is answered from
what is still buffered. The buffer is bounded: by the window when the gateway uses one
(nothing beyond `acked + window` is ever sent), else by `capacity` (oldest dropped first;
a replay that needs them then fails explicitly at the gateway). After the stream's last
chunk the outbox lingers until that chunk is acknowledged or `linger_s` passes.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

from polyserve.proto import TokenChunk

MAX_REPLAY = 256  # chunks in one ReplayReply (well under NATS's 1 MB payload even with logprobs)


class Outbox:
    def __init__(self, window: int, capacity: int):
        self.window = max(0, window)  # 0 = no flow control
        self.capacity = max(capacity, self.window + 1)
        self.chunks: deque[TokenChunk] = deque()  # consecutive seqs, oldest first
        self.acked = -1  # highest seq the gateway relayed to its client
        self.last_seq = -1  # the done chunk's seq once the stream has ended
        self.ended_at = 0.0  # monotonic time the done chunk was sent (0 = still streaming)
        self._credit = asyncio.Event()

    def add(self, chunk: TokenChunk) -> None:
        """Remember a chunk about to be published (the oldest goes when the buffer is full)."""
        self.chunks.append(chunk)
        while len(self.chunks) > self.capacity:
            self.chunks.popleft()
        if chunk.done or chunk.redirect is not None:
            self.last_seq, self.ended_at = chunk.seq, time.monotonic()

    def ack(self, seq: int) -> None:
        """The gateway has relayed every chunk up to `seq`: forget them, open the window."""
        if seq <= self.acked:
            return
        self.acked = seq
        while self.chunks and self.chunks[0].seq <= seq:
            self.chunks.popleft()
        self._credit.set()

    @property
    def finished(self) -> bool:
        """The last chunk was sent and the gateway has acknowledged it."""
        return self.ended_at > 0 and self.acked >= self.last_seq

    async def wait_credit(self, seq: int, timeout: float) -> bool:
        """Wait until chunk `seq` fits in the window; False when no credit came within `timeout`."""
        if not self.window:
            return True
        deadline = time.monotonic() + timeout
        while seq - self.acked > self.window:
            self._credit.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._credit.wait(), timeout=left)
            except asyncio.TimeoutError:
                return seq - self.acked <= self.window
        return True

    def replay(self, from_seq: int, to_seq: int = -1) -> list[TokenChunk]:
        """The buffered chunks from `from_seq` to `to_seq` (-1 = the newest), at most MAX_REPLAY."""
        out = [c for c in self.chunks if c.seq >= from_seq and (to_seq < 0 or c.seq <= to_seq)]
        return out[:MAX_REPLAY]

    @property
    def first_seq(self) -> int:
        return self.chunks[0].seq if self.chunks else -1
