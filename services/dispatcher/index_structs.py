"""Generic incremental structures of `dispatcher.index`: sorted orders, blocks, first-fit,
Arlo's per-runtime queues (split from index.py; see its docstring)."""
from __future__ import annotations

import abc
import math
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import fields
from operator import itemgetter

from polyserve.dispatcher import policy as P
from polyserve.dispatcher import policy_arlo as AR
from polyserve.dispatcher.views import WorkerView

_INF = math.inf
_FIELDS = [f.name for f in fields(WorkerView)]


def _make_with_load() -> Callable:
    """`_with_load`, generated from `WorkerView`'s fields: one call with every field passed
    positionally, read straight off the old view. It runs on every placement; this is 0.6 µs
    where `attrgetter` of all fields into a list, two item sets and `WorkerView(*values)`
    took 0.9 (fifth round, docs/benchmarks/dispatch.md). Generated, so it follows the fields."""
    args = ", ".join("outstanding" if n == "outstanding" else "requests" if n == "requests" else f"w.{n}"
                     for n in _FIELDS)
    code = f"def _with_load(w, outstanding, requests):\n    return WorkerView({args})\n"
    scope: dict = {"WorkerView": WorkerView}
    exec(compile(code, "<index_structs._with_load>", "exec"), scope)
    fn = scope["_with_load"]
    fn.__doc__ = "`replace(w, outstanding=..., requests=...)`, faster (on every placement)."
    return fn


_with_load = _make_with_load()


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
    `2·B` (8 -> 16) with each block's maxima of the three necessary limits, so that a
    decision skips a whole block no key of which can take the request.

    The maxima are kept exact by the update that changes them: an insert raises them; a
    delete, or a key lowered in place, that took a maximum away recomputes that one limit's
    maximum over the block (C-level `max(map(...))`, ~1 µs); a split computes both halves'.
    History (fifth round, docs/benchmarks/dispatch.md): bounds left stale-high, tightened only
    after a decision had walked a whole block in vain, put ~2 such walks into each slow
    decision (decision p99 ~18-21 µs, ~13 exact); flagging them stale and tightening them
    when a decision meets them costs the decision more still (p50 5.4 -> 7.0 µs): a placement
    lowers the chosen worker's limits, and ~3 in 4 times that worker held a maximum of its
    block. Exact maxima cost the update ~2 µs and make the decision's walk the shortest."""

    __slots__ = ("blocks", "cur", "lasts", "maxes")
    B = 8

    def __init__(self) -> None:
        self.blocks: list[list[tuple]] = []
        self.lasts: list[tuple] = []  # each block's last key (to find a key's block)
        self.maxes: list[tuple] = []  # each block's (max_in, room, max_total) maxima
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
        elif old != key:
            i = self._move(old, key)
            if i >= 0:  # it leaves its block (the search for `old` is not done twice)
                self._del(old, i)
                self._ins(key)

    def discard(self, wid: str) -> None:
        old = self.cur.pop(wid, None)
        if old is not None:
            self._del(old)

    def _move(self, old: tuple, key: tuple) -> int:
        """Replace `old` by `key` when `key` belongs in `old`'s block (a placement moves a
        worker by a little): one search of the block list instead of two. -1 when done,
        else the index of `old`'s block (for `_del`)."""
        lasts = self.lasts
        i = bisect_left(lasts, old)
        blk = self.blocks[i]
        if len(blk) == 1 or not ((i == 0 or lasts[i - 1] < key) and (key < lasts[i] or i == len(lasts) - 1)):
            return i
        del blk[bisect_left(blk, old)]
        insort(blk, key)
        lasts[i] = blk[-1]
        self._bound(i, old, key)
        return -1

    def _bound(self, i: int, gone: tuple | None, came: tuple | None) -> None:
        """Block `i`'s maxima after `gone` left it and/or `came` joined it (the block holds
        its current keys): each limit `gone` held the maximum of and `came` does not keep
        recomputed over the block, the others raised to `came`'s."""
        m0, m1, m2 = self.maxes[i]
        if came is not None:
            c0, c1, c2 = came[2], came[3], came[4]
        else:
            c0 = c1 = c2 = -_INF
        if gone is not None and ((gone[2] == m0 and c0 < m0) or (gone[3] == m1 and c1 < m1)
                                 or (gone[4] == m2 and c2 < m2)):
            blk = self.blocks[i]
            self.maxes[i] = (max(map(_G2, blk)) if gone[2] == m0 and c0 < m0 else max(m0, c0),
                             max(map(_G3, blk)) if gone[3] == m1 and c1 < m1 else max(m1, c1),
                             max(map(_G4, blk)) if gone[4] == m2 and c2 < m2 else max(m2, c2))
        elif c0 > m0 or c1 > m1 or c2 > m2:
            self.maxes[i] = (max(m0, c0), max(m1, c1), max(m2, c2))

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
        self._bound(i, None, key)
        if len(blk) > 2 * self.B:
            a, b = blk[:self.B], blk[self.B:]
            blocks[i:i + 1] = [a, b]
            lasts[i:i + 1] = [a[-1], b[-1]]
            self.maxes[i:i + 1] = [(), ()]
            self.tighten(i)
            self.tighten(i + 1)

    def _del(self, key: tuple, i: int = -1) -> None:
        """Remove `key` (`i`: its block's index, when known)."""
        lasts = self.lasts
        if i < 0:
            i = bisect_left(lasts, key)
        blk = self.blocks[i]
        del blk[bisect_left(blk, key)]
        if not blk:
            del self.blocks[i], lasts[i], self.maxes[i]
            return
        lasts[i] = blk[-1]
        self._bound(i, key, None)

    def tighten(self, i: int) -> None:
        """Compute block `i`'s maxima afresh."""
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

    LAZY = False  # whether it updates on a placement from the entry alone (`placed_from`)

    @abc.abstractmethod
    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        """`old` (None: a new worker) became `new` (None: the worker left); `added`: the one
        request `new` has more than `old` (`WorkerIndex.placed`), for structures that keep
        sums over a worker's requests incrementally."""

    def membership_changed(self) -> None:
        """A worker joined or left (after `update`)."""

    def placed_from(self, w: WorkerView, entry) -> bool | None:
        """(`LAZY` structures) `entry` was placed on the worker whose view, without it and
        any placement before it that this structure was told of, is `w`: as `update(old,
        new, entry)` with the new view, which the index has not built. (Aladdin's may
        decline: False, nothing done.) The index calls it only on structures with `LAZY`
        set, each of which defines it; any other has no way to update from the entry alone."""
        raise TypeError(f"{type(self).__name__} is not LAZY: the index must build the new view and call update")


# ------------------------------------------------------------------ simple keyed orders
class _KeyOrder(_Struct):
    def __init__(self, key: Callable[[WorkerView], tuple]):
        self.key = key
        self.sorted = _Sorted()

    def update(self, old: WorkerView | None, new: WorkerView | None, added=None) -> None:
        if new is None:
            self.sorted.discard(old.worker_id)  # type: ignore[union-attr]
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
