"""Issue 13, nats-pause: after a NATS stall a worker's chunks may reach the stream's inbox before
its GenerateAccepted (delivery.Delivery._acceptance). That must not fail a request that is being
served: the early chunks are kept and relayed in order, and when the acceptance never comes the
chunks stand for it. On the session nats-server, with a worker that sends in that order."""
from __future__ import annotations

import pytest

from polyserve.gateway.handlers import RequestRun
from polyserve.proto import GenerateAccepted, GenerateRequest, Placement, RequestStats, SamplingParams, TokenChunk
from polyserve.shared.bus import decode, encode
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration

WORDS = ["one", "two", "three", "four"]


def placement(gs, worker_id: str) -> Placement:
    return Placement(request_id="x", worker_id=worker_id, generate_subject=gs.subjects.generate(worker_id),
                     cancel_subject=gs.subjects.cancel(worker_id), policy="test")


def reordering_worker(gs, worker_id: str, accept: bool):
    """Answers a generate request with its whole stream first, then (if `accept`) the acceptance."""
    async def on_generate(m) -> None:
        req = decode(m.data, GenerateRequest)
        for seq, word in enumerate(WORDS):
            await gs.bus.nc.publish(req.stream_to, encode(TokenChunk(
                request_id=req.request_id, seq=seq, text=word + " ", tokens=1,
                finish_reason="length" if seq == len(WORDS) - 1 else None)))
        await gs.bus.nc.publish(req.stream_to, encode(TokenChunk(
            request_id=req.request_id, seq=len(WORDS), done=True,
            stats=RequestStats(input_tokens=2, output_tokens=len(WORDS)))))
        if accept:
            await gs.bus.nc.publish(m.reply, encode(GenerateAccepted(request_id=req.request_id,
                                                                     worker_id=worker_id, replay=True)))
    return on_generate


@pytest.mark.parametrize("accept", [True, False], ids=["acceptance-last", "acceptance-lost"])
async def test_chunks_before_the_acceptance_are_relayed_not_an_error(plane, accept):
    async with plane(accept_timeout_s=0.5, dispatch_retries=0) as p:
        gs = p.gateway.gs
        deployment, _ = await gs.find_deployment(MODEL)
        sub = await gs.bus.nc.subscribe(gs.subjects.generate("w-late"), cb=reordering_worker(gs, "w-late", accept))
        try:
            run = RequestRun(gs=gs, deployment=deployment, prompt="reorder me", stream=False,
                             params=SamplingParams(max_tokens=len(WORDS), min_tokens=len(WORDS)))
            await run._fresh_inbox()
            run.placement = placement(gs, "w-late")
            run._caps = await run._hand_to(run.placement, run._generate(run._inbox))
            assert run._caps.worker_id == "w-late" and run._caps.replay
            out = await run.collect()
            assert out.texts[0].split() == WORDS and out.finish == ["length"]
            assert out.completion_tokens == len(WORDS)
        finally:
            await sub.unsubscribe()
