"""Prefix-aware placement under the dispatcher's policies: `DispatchRequest.prefer` names the workers
that hold the longest start of the request's prompt (the gateway's picture of the engines' prefix
caches: gateway/prefixes.py). The gateway places prefix-aware itself under the load-only policies;
under aladdin and caraserve (and for a LoRA request, or with `local_dispatch` off) it asks the
dispatcher with that hint, and the dispatcher honours it when the policy agrees:

* the deployment's own policy chooses among the preferred workers that may take the request (live,
  not excluded, long enough an input limit, under `max_outstanding`), with the state and request
  view of the choice it made over every worker;
* that choice is kept when the policy does not flag it (aladdin: no worker of them meets the TTFT
  and ATGT constraints; caraserve: it would break the ATGT SLO: `Decision.scale_out`), and its
  outstanding count is within `prefix_load_factor` x that of the policy's own pick + 4, the bound
  the gateway's `affinity_load_factor` sets on load-only policies (a hint never piles a
  conversation's turns onto an overloaded worker);
* otherwise the policy's own pick stands.

A preferred placement answers with the policy name `<policy>+prefix` (the gateway counts it as a
hit, the `dispatched` event shows it). The cost is O(preferred workers), at most MAX_PREFER.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from polyserve.core.names import MODEL_POLICIES
from polyserve.dispatcher import policy

if TYPE_CHECKING:
    from polyserve.dispatcher.liveview import Choice, LiveView
    from polyserve.dispatcher.policy import PolicyState
    from polyserve.proto import Deployment, DispatchRequest

MAX_PREFER = 16  # preferred workers read from one request (the gateway sends at most this many)
SLACK = 4  # requests a preferred worker may carry beyond the factor (as gateway/routing.py's bound)


def keep(view: LiveView, dep: Deployment, req: DispatchRequest, choice: Choice, state: PolicyState) -> Choice:
    """`choice` (the policy's pick over every worker) or the policy's pick among `req.prefer` (module
    docstring), marked `prefixed`."""
    mine = choice.worker.worker_id
    if mine in req.prefer:
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
    views = view.views(beats.values(), dep.policy in MODEL_POLICIES)
    pick = policy.get_policy(dep.policy)(views, choice.request, state, view.rng)
    bound = view.settings.prefix_load_factor * view.outstanding.count(mine) + SLACK
    if pick.scale_out or view.outstanding.count(pick.worker_id) > bound:
        return choice
    return choice._replace(decision=pick, worker=beats[pick.worker_id], candidates=len(views),
                           indexed=False, prefixed=True)
