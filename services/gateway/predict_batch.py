"""Predictions nothing waits for, asked several at a time (issue 15).

A request the gateway places itself on a worker with a free batch slot starts at once: its
prediction only orders a worker queue it is not in, so the request does not wait for it
(handlers.RequestRun._predict_and_place). It is still asked, for the `predicted` event, the
`completed` event's estimate and the predictor's own accuracy figures. Asked one by one, each
cost two NATS messages and a wake-up of the gateway, nats-server and the predictor (the
predictor's whole CPU per request, and about a tenth of the control plane's: docs/benchmarks/
overhead.md); gathered, a batch of them costs the same two messages. They are gathered as request events
are (`shared/batching.Cadence`): a lone prediction after a quiet spell is asked within 2 ms,
while requests keep coming once per `predict_batch_ms`.

The batch's budget is `predict_timeout_s` per 8 items (the proxy model answers a batch in
about the time of a few single predictions); an item not answered in it gets the gateway's
local estimate, as an unbatched prediction past its budget does. A predictor that does not
serve `predict_batch` yet (an older version during a rolling upgrade) is asked item by item.
"""
from __future__ import annotations

import asyncio
import logging
import math

from polyserve.proto import PredictBatch, Prediction, Predictions, PredictRequest
from polyserve.shared.batching import COALESCE_S, Cadence
from polyserve.shared.bus import BusError

logger = logging.getLogger(__name__)

MAX_BATCH = 64  # a batch this full goes at once


class PredictBatcher:
    """Gathers PredictRequests by the `Cadence` rule (or until MAX_BATCH) and asks them in one
    message; `window_s` 0 asks each at once."""

    def __init__(self, gs, window_s: float):
        self.gs = gs
        self.cadence = Cadence(window_s, min(COALESCE_S, window_s))  # holds the window
        self._items: list[tuple[PredictRequest, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.batches = 0  # batches sent (tests and the overhead benchmark read it)

    def ask(self, req: PredictRequest) -> asyncio.Future:
        """A future of the predictor's Prediction for `req`, or None when it gave none in time."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._items.append((req, fut))
        if len(self._items) >= MAX_BATCH:
            self._send_now()
        elif self._timer is None:
            self._timer = loop.call_later(self.cadence.delay(), self._send_now)
        return fut

    def _send_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._items = self._items, []
        if batch:
            self.cadence.sent()
            self.gs.spawn(self._send(batch))

    async def _send(self, batch: list[tuple[PredictRequest, asyncio.Future]]) -> None:
        gs = self.gs
        timeout = gs.settings.predict_timeout_s * max(1, math.ceil(len(batch) / 8))
        answers: dict[str, Prediction] = {}
        self.batches += 1
        try:
            reply = await gs.bus.request(gs.subjects.predict_batch, PredictBatch(items=[r for r, _ in batch]),
                                         Predictions, timeout=timeout, span_name="predict (batch)")
            answers = {p.request_id: p for p in reply.items}
        except BusError as exc:
            if exc.code == 503 and exc.description.startswith("no service is"):
                answers = await self._one_by_one([r for r, _ in batch])
            else:
                logger.debug("predictor: %s for a batch of %d; local estimates", exc.description, len(batch))
        except Exception:  # noqa: BLE001 - a bug here must not leave a request's terminal event waiting
            logger.exception("a batch of %d predictions failed; local estimates", len(batch))
        for req, fut in batch:
            if not fut.done():
                fut.set_result(answers.get(req.request_id))

    async def _one_by_one(self, reqs: list[PredictRequest]) -> dict[str, Prediction]:
        """An older predictor (no `predict_batch`): each item on `predict`."""
        gs = self.gs

        async def one(req: PredictRequest) -> Prediction | None:
            try:
                return await gs.bus.request(gs.subjects.predict, req, Prediction,
                                            timeout=gs.settings.predict_timeout_s, span_name="predict")
            except BusError:
                return None

        got = await asyncio.gather(*(one(r) for r in reqs))
        return {p.request_id: p for p in got if p is not None}
