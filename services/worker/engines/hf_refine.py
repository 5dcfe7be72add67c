"""`ssjf` and `ssjf_refine` in the `hf` engine (a mixin of `hf.HfEngine`; its state lives there).

Neither is a static sort key, so the waiting queue is ordered afresh at each admission. `ssjf`:
`queue_order.speculative_sjf` (the size rule, with the overtake bound: requests overtaken by more
than it allows first, in arrival order), no pauses. `ssjf_refine`, as in the `sim` engine and
with the same `queue_order` pieces: the queue is ordered by `speculative_sjf_refine` (sizes from
the survival tables of this worker's completions, per client and class; the overtake bound), and
every `PREEMPT_QUANTUM` decode steps, with the batch full, a `Preemptor` picks running requests
whose refined key sorts far enough behind the best waiting ones: each is paused (`Batch.pause`:
its rows leave the batch with their KV, no recomputation), goes back to the queue under its
refined key and, once admitted again, rejoins the batch with that KV (`Batch.resume`, no
prefill) and decodes on exactly where it stopped (greedy output token for token the same as
without the pause).
"""
from __future__ import annotations

import asyncio
from typing import Any

from polyserve.core import queue_order


class Refine:
    """The queue order of `ssjf` and `ssjf_refine`, and ssjf_refine's pauses (`dynamic_order` None: a
    static order key; `preemptor` None: no pauses)."""

    dynamic_order: queue_order.OrderFn | None
    preemptor: queue_order.Preemptor | None
    _waiting: list[Any]
    _running: dict[str, Any]

    def _ordered(self) -> list[Any]:
        """The waiting requests in queue order (ties: arrival at this engine)."""
        by_seq = sorted(self._waiting, key=lambda a: a.seq)
        if self.dynamic_order is not None:  # on the _Active: the prompt term, a paused request's refined key
            return self.dynamic_order(by_seq)
        return sorted(by_seq, key=lambda a: self.order(a.req))

    def _could_start(self, act: Any) -> bool:
        """A waiting request that would be admitted now were a batch row free: paused (its KV is
        kept), or its adapter usable and its KV reservation within the budget."""
        return act.paused is not None or (self.loras.ready(act.req.adapter) is not None
                                          and self._kv_reserved + act.reserve <= self.kv_capacity)

    async def _pause_for_shorter(self) -> None:
        """ssjf_refine, with a full batch: pause the running requests whose key now (remaining length
        given what they generated, `queue_order.refined_ssjf_key`) sorts behind the best waiting keys
        (`queue_order.Preemptor`), as the sim engine does. A paused request keeps its KV rows (set aside
        by `Batch.pause`), its reservation and its adapter pin, and goes back to the queue under that key.
        Only waiting requests that could take the freed rows count: pausing frees rows, not KV."""
        if not self._waiting or self._rows_in_use() < self.max_batch:
            return
        running = [(a, a.generated, len(a.step_times) - a.ran_from) for a in self._running.values() if not a.done]
        heads = [w for w in self._ordered() if self._could_start(w)]
        for act in queue_order.refine_pauses(self.preemptor, running, heads):
            if act.done:  # cancelled while an earlier victim's rows were being set aside
                continue
            held = await asyncio.to_thread(self._batch.pause, act)
            if act.done:  # cancelled while its own were: _release already freed it
                continue
            del self._running[act.req.request_id]
            act.paused = held
            self._waiting.append(act)
