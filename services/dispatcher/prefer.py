"""Placement hints under the dispatcher's policies: `DispatchRequest.prefer` names the workers the
gateway would have placed the request on itself (gateway/admission.py `dispatch_hint`): a
`prompt_cache_key`'s worker, or those holding the longest start of the prompt (the gateway's picture
of the engines' prefix caches, gateway/prefixes.py), each within the gateway's load bound
(`affinity_load_factor` x the mean + 4). The gateway places by them itself under the load-only
policies; under aladdin and caraserve (and for a LoRA request, or with `local_dispatch` off, or while
it does not hear the fleet as usual) the dispatcher places, and follows the hint when its policy
agrees:

* the deployment's own policy chooses among the preferred workers that may take the request (live,
  of the deployment, not excluded, a long enough input limit, under `max_outstanding`; for a LoRA
  request, holding its adapter or with a free adapter slot), with the
  state and request view of the choice it made over every worker;
* that choice is kept unless the policy flags it (aladdin: none of them meets the TTFT and ATGT
  constraints; caraserve: it would break the ATGT SLO: `Decision.scale_out`) while its own pick over
  every worker is not flagged: a hint never buys a cache hit with an SLO miss the policy could have
  avoided. Where the policy flags its own pick too (no worker meets the SLO), the hint stands (the
  least harmful of the preferred, by the policy's own fallback), flagged for scale-out as well
  (`follows`).

The load bound is the gateway's (it has the loads it bounds by locally); the SLO is the policy's
(the gateway has no model of it). A followed hint answers the policy name with `names.PREFERRED`
appended (the gateway names it `+affinity` or `+prefix`). The cost is one policy evaluation over at
most MAX_PREFER workers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from polyserve.core.names import MODEL_POLICIES
from polyserve.dispatcher import index_hints, policy

if TYPE_CHECKING:
    from collections.abc import Sequence

    from polyserve.dispatcher.index import WorkerIndex
    from polyserve.dispatcher.liveview import Choice, LiveView
    from polyserve.dispatcher.policy import Decision, PolicyState, RequestView, WorkerView
    from polyserve.proto import Deployment, DispatchRequest

MAX_PREFER = 16  # preferred workers read from one request (the gateway sends at most this many)
AMONG = {"aladdin": index_hints.aladdin_among, "caraserve": index_hints.caraserve_among}


def _swaps(hb, adapter: str | None) -> bool:
    """Whether a LoRA request on this worker would first evict another adapter: it does not hold
    `adapter` and its slots are full. Not worth a hint: the cold start costs more than the cached
    start saves, and the engine's prefix cache is per adapter anyway (gateway/prefixes.py)."""
    return adapter is not None and 0 < hb.max_adapters <= len(hb.adapters) \
        and all(a.name != adapter for a in hb.adapters)


def pick_among(policy_name: str, views: Sequence[WorkerView], request: RequestView, state: PolicyState,
               rng) -> Decision:
    """The policy's pick among the preferred workers' `views` (`keep` without an index; `polyserve
    bench prefix`, SIMULATED, places by it too)."""
    return policy.get_policy(policy_name)(views, request, state, rng)


def follows(own: Decision, pick: Decision) -> bool:
    """Whether the pick among the preferred workers stands against the policy's own pick over every
    worker: not where it breaks the SLO (`scale_out`) and the own pick does not. Where the own pick
    breaks it too (no worker meets it: the policy asks for one more), the cache hit costs nothing
    the policy could have saved, and the hint stands, flagged as well. (Refusing it there left
    Aladdin's placements on Mooncake's trace with 6% of prompt tokens from cache instead of 20%:
    half of its own picks were flagged; `polyserve bench prefix`, SIMULATED,
    docs/experiments/prefix.md.)"""
    return own.scale_out or not pick.scale_out


def keep(view: LiveView, dep: Deployment, req: DispatchRequest, choice: Choice, state: PolicyState,
         index: WorkerIndex | None = None) -> Choice:
    """`choice` (the policy's pick over every worker) or the policy's pick among `req.prefer` (module
    docstring), marked `prefixed`. `index`: the deployment's worker index when its fast twin made
    `choice`; aladdin and caraserve then decide from the index's structures (index_hints.py: their
    pure policies over the views took 20-60 µs), and the other policies read the same views the
    twin did (building one costs ~2-3 µs): `polyserve bench dispatch --live --prefer K`,
    docs/benchmarks/dispatch.md."""
    if choice.worker.worker_id in req.prefer:
        return choice._replace(prefixed=True)
    excluded = set(req.exclude)
    cap = view.settings.max_outstanding
    beats = {}
    for wid in req.prefer[:MAX_PREFER]:
        hb = view.registry.live_one(wid, dep.id)
        if hb is None or wid in excluded or (0 < hb.max_input_len < req.input_tokens) \
                or (cap > 0 and view.outstanding.count(wid) >= cap) or _swaps(hb, req.adapter):
            continue
        beats[wid] = hb
    if not beats:
        return choice
    pick = None
    among = AMONG.get(dep.policy) if index is not None else None
    if among is not None:  # from the index's structures (index_hints.py)
        pick = among(index, choice.request, state, list(beats), choice.decision.scale_out)
    if pick is None:
        views = [index.get(wid) for wid in beats] if index is not None else []
        if not views or None in views:
            views = view.views(beats.values(), dep.policy in MODEL_POLICIES)
        pick = pick_among(dep.policy, views, choice.request, state, view.rng)
    if not follows(choice.decision, pick):
        return choice
    return choice._replace(decision=pick, worker=beats[pick.worker_id], candidates=len(beats),
                           indexed=False, prefixed=True)
