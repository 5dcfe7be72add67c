"""Load shedding at the door (issue 13, overload): a request to a model endpoint that arrives
while the gateway is at `max_inflight` is answered 429 with Retry-After by the outermost
middleware, before any other runs: no key check, no body read, no routing, no validation.

Why here: under a 40x burst the refusals are most of the work. Refused at admission
(admission.admit) each one first goes through every middleware, the router, the body read
and the body model; py-spy put about 60% of the gateway's loop in that stack during a burst
of 500 requests/s, and the loop, busy refusing, slowed the streams it had admitted. The test
is the same as admission's early one (`inflight >= max_inflight`); admission still takes the
slot atomically (`Admission.begin`), so nothing admits more than before. A client whose key
would be refused (401) also gets the 429 while the gateway is full: it learns nothing from it.
"""
from __future__ import annotations

from . import admission, errors
from .context import GatewayState

# The endpoints whose requests take an in-flight slot (Admission.begin).
MODEL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"})


class Shed:
    """ASGI middleware: 429 + Retry-After for model requests while the gateway is full."""

    def __init__(self, app, gs: GatewayState):
        self.app = app
        self.gs = gs

    async def __call__(self, scope, receive, send) -> None:
        gs = self.gs
        if (scope["type"] == "http" and gs.inflight >= gs.settings.max_inflight
                and scope.get("method") == "POST" and scope.get("path") in MODEL_PATHS):
            exc = admission.overloaded(gs)  # counted as admission counts it
            retry = str(int(max(1, exc.retry_after or 1))).encode()
            await errors.send_error(send, exc.status, exc.message, headers=((b"retry-after", retry),))
            return
        await self.app(scope, receive, send)

