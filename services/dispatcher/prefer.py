"""Placement hints under the dispatcher's policies: `DispatchRequest.prefer` names the workers the
gateway would have placed the request on itself (gateway/admission.py `dispatch_hint`): a
`prompt_cache_key`'s worker, or those holding the longest start of the prompt (the gateway's picture
of the engines' prefix caches, gateway/prefixes.py), each within the gateway's load bound
(`affinity_load_factor` x the mean + 4). The gateway places by them itself under the load-only
policies; under aladdin and caraserve (and for a LoRA request, or with `local_dispatch` off, or while
it does not hear the fleet as usual) the dispatcher places, and follows the hint when its policy
agrees:

* the deployment's own policy chooses among the preferred workers that may take the request (live,
  of the deployment, not excluded, a long enough input limit, under `max_outstanding`), with the
  state and request view of the choice it made over every worker;
* that choice is kept when the policy does not flag it (aladdin: none of them meets the TTFT and
  ATGT constraints; caraserve: it would break the ATGT SLO: `Decision.scale_out`), so a hint never
  buys a cache hit with an SLO miss; otherwise the policy's own pick stands.

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
    from polyserve.dispatcher.index import WorkerIndex
    from polyserve.dispatcher.liveview import Choice, LiveView
    from polyserve.dispatcher.policy import PolicyState
    from polyserve.proto import Deployment, DispatchRequest

MAX_PREFER = 16  # preferred workers read from one request (the gateway sends at most this many)
AMONG = {"aladdin": index_hints.aladdin_among, "caraserve": index_hints.caraserve_among}


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
                or (cap > 0 and view.outstanding.count(wid) >= cap):
            continue
        beats[wid] = hb
    if not beats:
        return choice
    pick = None
    among = AMONG.get(dep.policy) if index is not None else None
    if among is not None:  # from the index's structures (index_hints.py)
        pick = among(index, choice.request, state, list(beats))
    if pick is None:
        views = [index.get(wid) for wid in beats] if index is not None else []
        if not views or None in views:
            views = view.views(beats.values(), dep.policy in MODEL_POLICIES)
        pick = policy.get_policy(dep.policy)(views, choice.request, state, view.rng)
    if pick.scale_out:
        return choice
    return choice._replace(decision=pick, worker=beats[pick.worker_id], candidates=len(beats),
                           indexed=False, prefixed=True)
