"""Engines continue a migrated stream (request migration, issue 13): a `GenerateRequest` with
`resume` makes the worker generate on from prompt + the output another worker already sent,
with what is left of max_tokens, and report usage for the whole output. The greedy hf engine
(the small random Llama) must produce exactly the tokens an uninterrupted run produces; a
request it cannot continue (n > 1) is refused with a 400 saying so. Process kills are in
tests/system/test_migration.py."""
from __future__ import annotations

import pytest

from polyserve.proto import GenerateAccepted, GenerateRequest, Resume, SamplingParams, TokenChunk
from polyserve.shared.bus import BusError, decode
from tests.integration.conftest import MODEL

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.torch]
HF = {"engine": "hf", "model": "tiny-llama-random", "deployment": MODEL}
PROMPT = "the quick brown fox jumps"


async def run(bus, subjects, worker_id: str, params: SamplingParams, resume: Resume | None = None,
              rid: str = "r") -> tuple[list[TokenChunk], GenerateAccepted]:
    chunks: list[TokenChunk] = []
    async with bus.inbox() as (inbox, queue):
        acc = await bus.request(subjects.generate(worker_id), GenerateRequest(
            request_id=rid, deployment=MODEL, model=MODEL, prompt=PROMPT, input_tokens=5, params=params,
            stream_to=inbox, resume=resume), GenerateAccepted, timeout=30)
        while not chunks or not chunks[-1].done:
            chunks.append(decode((await queue.get()).data, TokenChunk))
    return chunks, acc


async def test_hf_continues_a_stream_exactly_where_it_stopped(plane, bus, subjects):
    async with plane(worker_kw=HF) as p:
        params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
        whole, acc = await run(bus, subjects, "w-test", params, rid="whole")
        assert acc.resumable and acc.replay
        deltas = [c for c in whole if not c.done]
        assert sum(c.tokens for c in deltas) == 12
        # what a client had when its first worker died: the first 5 tokens' chunks
        k, head = 0, ""
        for c in deltas:
            if k + c.tokens > 5:
                break
            k, head = k + c.tokens, head + c.text
        rest, _ = await run(bus, subjects, "w-test", params, Resume(text=head, tokens=k), rid="rest")
        assert head + "".join(c.text for c in rest) == "".join(c.text for c in deltas)
        done = rest[-1]
        assert done.error is None and done.stats.output_tokens == 12
        assert done.stats.input_tokens == p.worker.engine.count_tokens(PROMPT)
        assert sum(c.tokens for c in rest) == 12 - k
        with pytest.raises(BusError) as err:
            await run(bus, subjects, "w-test", SamplingParams(max_tokens=8, n=2), Resume(text=head, tokens=k),
                      rid="n2")
        assert err.value.code == 400 and "n = 1" in err.value.description
