"""The index's fast twins over a few given workers: what a placement hint (`DispatchRequest.prefer`,
dispatcher/prefer.py) needs, each the pure policy's decision over those workers' views, read from
the structures the index keeps (no view built, no pure policy run: through the pure policies a hint
cost aladdin ~30 µs and caraserve 20-60 µs at one to four workers; docs/benchmarks/dispatch.md).
Pure Python over the compiled structures (`scripts/build-dispatcher-native`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from polyserve.dispatcher import policy_aladdin as AL
from polyserve.dispatcher import policy_caraserve as CS
from polyserve.dispatcher.views import Decision, PolicyState, RequestView

if TYPE_CHECKING:
    from polyserve.dispatcher.index import WorkerIndex


def caraserve_among(index: WorkerIndex, request: RequestView, state: PolicyState,
                    worker_ids: list[str], fallback: bool = False) -> Decision | None:
    """`policy.POLICIES["caraserve"]` over the views of `worker_ids` (`_Cara.best_among`); None when
    none of them is indexed. (`fallback`: as `aladdin_among`'s; caraserve's pick is its fallback.)"""
    index._require()
    s = index._struct("caraserve")
    best = s.best_among(request, CS.config_for(request), request.input_tokens + request.predicted_tokens, worker_ids)
    return None if best is None else Decision(best[2], state, scale_out=best[3])


def aladdin_among(index: WorkerIndex, request: RequestView, state: PolicyState,
                  worker_ids: list[str], fallback: bool = False) -> Decision | None:
    """`policy.POLICIES["aladdin"]` over the views of `worker_ids` where one of them fits: Alg. 1's
    best fit, walked as `index.fast_aladdin` walks every worker (in (-capacity_norm, id) order, the
    keys' limits deciding where they can, `check` where they cannot). Where none fits, a decision
    with `scale_out`: with `fallback` (the policy's own pick was flagged too, so the hint stands:
    prefer.follows) the pure policy's fallback among them, else the first of them (the hint is not
    followed, so the fallback is not computed). None where the index keeps no structure for the
    request's SLOs."""
    index._require()
    cfg = AL.config_for(request)
    s = index._aladdin_for(cfg)
    if s is None:
        return None
    need_in, out = request.input_tokens, AL.new_output(request)
    need_w, need_t = need_in + cfg.gamma * out, need_in + out
    cur = s.live.cur  # worker -> its key; a worker not there fits no request
    for key in sorted(k for k in (cur.get(w) for w in worker_ids) if k is not None):
        if need_in > key[2] or need_w > key[3] or need_t > key[4]:
            continue
        if (need_in <= key[5] and need_w <= key[6] and need_t <= key[7]) \
                or not AL.check(index.get(key[1]), request, cfg):
            return Decision(key[1], state)
    if fallback:
        views = [v for v in (index.get(w) for w in worker_ids) if v is not None]
        if views:
            return Decision(AL.fallback(views, request, cfg), state, scale_out=True)
    return Decision(worker_ids[0], state, scale_out=True)
