"""Generic incremental structures of `dispatcher.index`: sorted orders, blocks, first-fit,
Arlo's per-runtime queues (split from index.py; see its docstring)."""
from __future__ import annotations

import abc
import math
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter, itemgetter

from polyserve.dispatcher import policy as P
from polyserve.dispatcher import policy_arlo as AR
from polyserve.dispatcher.views import WorkerView

_INF = math.inf
_FIELDS = [f.name for f in fields(WorkerView)]
_GET_ALL = attrgetter(*_FIELDS)
_I_OUT, _I_REQS = _FIELDS.index("outstanding"), _FIELDS.index("requests")


def _with_load(w: WorkerView, outstanding: int, requests: tuple) -> WorkerView:
    """`replace(w, outstanding=..., requests=...)`, twice as fast (on every placement)."""
    values = list(_GET_ALL(w))
    values[_I_OUT], values[_I_REQS] = outstanding, requests
    return WorkerView(*values)


class _Sorted:
    """Keys kept sorted in a list, one per worker id; each key holds its id, so keys are unique."""

    __slots__ = ("cur", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.cur: dict[str, tuple] = {}

    def set(self, wid: str, key: tuple) -> None:
        old = self.cur.get(wid)
        if old is not None:
            if old == key:
                return
            del self.keys[bisect_left(self.keys, old)]
        insort(self.keys, key)
        self.cur[wid] = key

    def discard(self, wid: str) -> None:
        old = self.cur.pop(wid, None)
        if old is not None:
            del self.keys[bisect_left(self.keys, old)]

    def __len__(self) -> int:
        return len(self.keys)


_G2, _G3, _G4 = itemgetter(2), itemgetter(3), itemgetter(4)


class _Blocked:
    """Aladdin's live keys (−cn, id, max_in, room, max_total, ...) sorted, in blocks of at most
    `2·B` (8 -> 16) with an upper bound of each block's three necessary limits, so that a
    decision skips a whole block no key of which can take the request.

    The bounds may be stale (too high), never too low: an insert raises them, a delete
    leaves them, a split gives both halves the old block's. Recomputing them exactly after
    each delete that removed a maximum (as before) cost ~2 recomputations of 3 × 16 keys per
    decision (docs/benchmarks/dispatch.md, fourth round); a stale bound only makes a
    decision walk a block it could have skipped, and
    `tighten` (called by the walk when no key of a block qualified) makes it exact again."""

    __slots__ = ("blocks", "cur", "lasts", "maxes")
    B = 8

    def __init__(self) -> None:
        self.blocks: list[list[tuple]] = []
        self.lasts: list[tuple] = []  # each block's last key (to find a key's block)
        self.maxes: list[tuple] = []  # each block's (max_in, room, max_total) bound
        self.cur: dict[str, tuple] = {}

    @property
    def keys(self) -> list[tuple]:
        return [k for blk in self.blocks for k in blk]

    def __len__(self) -> int:
        return len(self.cur)

    def set(self, wid: str, key: tuple) -> None:
        old = self.cur.get(wid)
        self.cur[wid] = key
        if old is None:
            self._ins(key)
        elif old != key and not self._move(old, key):
            self._del(old)
            self._ins(key)

    def discard(self, wid: str) -> None:
        old = self.cur.pop(wid, None)
        if old is not None:
            self._del(old)

    def _move(self, old: tuple, key: tuple) -> bool:
        """Replace `old` by `key` when `key` belongs in `old`'s block (a placement moves a
        worker by a little): one search of the block list instead of two."""
        lasts = self.lasts
        i = bisect_left(lasts, old)
        blk = self.blocks[i]
        if len(blk) == 1 or not ((i == 0 or lasts[i - 1] < key) and (key < lasts[i] or i == len(lasts) - 1)):
            return False
        del blk[bisect_left(blk, old)]
        insort(blk, key)
        lasts[i] = blk[-1]
        mx = self.maxes[i]
        if key[2] > mx[0] or key[3] > mx[1] or key[4] > mx[2]:
            self.maxes[i] = (max(mx[0], key[2]), max(mx[1], key[3]), max(mx[2], key[4]))
        return True

    def _ins(self, key: tuple) -> None:
        blocks, lasts = self.blocks, self.lasts
        if not blocks:
            blocks.append([key])
            lasts.append(key)
            self.maxes.append((key[2], key[3], key[4]))
            return
        i = bisect_left(lasts, key)
        if i == len(blocks):
            i -= 1
        blk = blocks[i]
        insort(blk, key)
        lasts[i] = blk[-1]
        mx = self.maxes[i]
        if key[2] > mx[0] or key[3] > mx[1] or key[4] > mx[2]:
            mx = self.maxes[i] = (max(mx[0], key[2]), max(mx[1], key[3]), max(mx[2], key[4]))
        if len(blk) > 2 * self.B:
            a, b = blk[:self.B], blk[self.B:]
            blocks[i:i + 1] = [a, b]
            lasts[i:i + 1] = [a[-1], b[-1]]
            self.maxes[i:i + 1] = [mx, mx]

    def _del(self, key: tuple) -> None:
        lasts = self.lasts
        i = bisect_left(lasts, key)
        blk = self.blocks[i]
        del blk[bisect_left(blk, key)]
        if not blk:
            del self.blocks[i], lasts[i], self.maxes[i]
            return
        lasts[i] = blk[-1]

    def tighten(self, i: int) -> None:
        """Make block `i`'s bound exact (its maxima)."""
        blk = self.blocks[i]
        self.maxes[i] = (max(map(_G2, blk)), max(map(_G3, blk)), max(map(_G4, blk)))

    def first(self, need_in: float, need_w: float, need_t: float):
        """The keys, in order, of the blocks where some key may take the request."""
        for i, blk in enumerate(self.blocks):
            mx = self.maxes[i]
            if need_in > mx[0] or need_w > mx[1] or need_t > mx[2]:
                continue
            yield from blk


class _Struct(abc.ABC):
    """One policy's structure: told of every change of one worker's view."""

    @abc.abstractmethod
    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        """`old` (None: a new worker) became `new` (None: the worker left); `added`: the one
        request `new` has more than `old` (`WorkerIndex.placed`), for structures that keep
        sums over a worker's requests incrementally."""

    def membership_changed(self) -> None:
        """A worker joined or left (after `update`)."""


# ------------------------------------------------------------------ simple keyed orders
class _KeyOrder(_Struct):
    def __init__(self, key: Callable[[WorkerView], tuple]):
        self.key = key
        self.sorted = _Sorted()

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if new is None:
            self.sorted.discard(old.worker_id)
        else:
            self.sorted.set(new.worker_id, self.key(new))


def _tokens_key(w: WorkerView) -> tuple:
    return (P._token_load(w), P._in_flight(w), w.worker_id)


# ------------------------------------------------------------------ first fit
def _free_kv(w: WorkerView) -> float:
    """first_fit leaf: free KV tokens when a batch slot is free, else −inf."""
    if P._in_flight(w) >= (w.max_batch or P.FIRST_FIT_DEFAULT_BATCH):
        return -_INF
    if w.kv_capacity <= 0:
        return _INF
    return float(w.kv_capacity - w.kv_used)


class _FirstFit(_Struct):
    """Max segment tree over `_free_kv` of the workers in worker_id order: `ids` and `views`
    are the index's own sorted id list and id -> view dict (kept up to date by the index)."""

    def __init__(self, ids: list[str], views: dict[str, WorkerView]):
        self.ids, self.views = ids, views
        self.dirty = True
        self.size = 1
        self.tree: list[float] = []

    def membership_changed(self) -> None:
        self.dirty = True

    def _rebuild(self) -> None:
        ids, views = self.ids, self.views
        size = 1
        while size < max(1, len(ids)):
            size *= 2
        t = [-_INF] * (2 * size)
        for i, wid in enumerate(ids):
            t[size + i] = _free_kv(views[wid])
        for i in range(size - 1, 0, -1):
            t[i] = max(t[2 * i], t[2 * i + 1])
        self.size, self.tree, self.dirty = size, t, False

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if self.dirty or old is None or new is None:
            self.dirty = True  # a worker joined or left: positions move
            return
        i = bisect_left(self.ids, new.worker_id) + self.size
        t = self.tree
        v = _free_kv(new)
        if t[i] == v:
            return
        t[i] = v
        i //= 2
        while i:
            m = max(t[2 * i], t[2 * i + 1])
            if t[i] == m:
                break
            t[i] = m
            i //= 2

    def leftmost(self, need: float) -> str | None:
        if self.dirty:
            self._rebuild()
        t = self.tree
        if not t or t[1] < need:
            return None
        i, size = 1, self.size
        while i < size:
            i = 2 * i if t[2 * i] >= need else 2 * i + 1
        return self.ids[i - size]



# ------------------------------------------------------------------ arlo
def _ilb_key(w: WorkerView) -> tuple:
    return (w.outstanding, AR.congestion(w), w.worker_id)


class _Arlo(_Struct):
    """Per runtime length: instances by Alg. 1's head key and by ILB's key."""

    def __init__(self) -> None:
        self.lengths: list[float] = []
        self.head: dict[float, _Sorted] = {}
        self.ilb: dict[float, _Sorted] = {}
        self.where: dict[str, float] = {}

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if old is not None:
            n = self.where.pop(old.worker_id)
            if new is None or AR.runtime_length(new) != n:
                self.head[n].discard(old.worker_id)
                self.ilb[n].discard(old.worker_id)
                if not self.head[n]:
                    del self.head[n], self.ilb[n]
                    del self.lengths[bisect_left(self.lengths, n)]
        if new is not None:
            n = AR.runtime_length(new)
            if n not in self.head:
                self.head[n], self.ilb[n] = _Sorted(), _Sorted()
                insort(self.lengths, n)
            self.head[n].set(new.worker_id, AR._head_key(new))
            self.ilb[n].set(new.worker_id, _ilb_key(new))
            self.where[new.worker_id] = n

    def candidate_levels(self, input_tokens: int) -> list[float]:
        lens = self.lengths
        i = bisect_left(lens, input_tokens)
        return lens[i:] if i < len(lens) else lens[-1:]
