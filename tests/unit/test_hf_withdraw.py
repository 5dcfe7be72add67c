"""`HfEngine.withdraw` (Aladdin Alg. 2 moves): a request still waiting is given back with no
output and its stream ends with `Withdrawn`; a running or unknown one stays (False)."""
from __future__ import annotations

import asyncio
import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineRequest, Finished, Withdrawn  # noqa: E402
from polyserve.worker.engines.hf import HfEngine  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds torch models


async def _events(eng, rid, prompt, max_tokens, started: asyncio.Event | None = None) -> list:
    out = []
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    async for ev in eng.generate(req):
        out.append(ev)
        if started is not None and isinstance(ev, Delta):
            started.set()
    return out


async def test_withdraw_gives_back_a_waiting_request_only():
    eng = HfEngine(types.SimpleNamespace(model="tiny-random", model_path="", device="cpu", dtype="float32",
                                         max_waiting=8, max_batch=1, kv_capacity_tokens=1 << 16, max_input_len=512))
    await eng.start()
    try:
        started = asyncio.Event()
        running = asyncio.create_task(_events(eng, "r", "keep going", 3000, started))
        await asyncio.wait_for(started.wait(), 20)
        waiting = asyncio.create_task(_events(eng, "w", "wait your turn", 8))
        behind = asyncio.create_task(_events(eng, "b", "behind it", 8))
        await wait_for(lambda: eng.load().waiting == 2, 5, what="two requests waiting behind the full batch")
        kv_before = eng.load().kv_used

        assert eng.withdraw("r") is False, "a running request is not withdrawn"
        assert eng.withdraw("unknown") is False
        assert eng.withdraw("w") is True
        with pytest.raises(Withdrawn) as err:
            await asyncio.wait_for(waiting, 5)
        assert "'w'" in str(err.value) and err.value.status == 409
        assert eng.withdraw("w") is False, "already withdrawn"
        load = eng.load()
        assert load.waiting == 1 and load.running == 1 and load.kv_used == kv_before

        # the id is free again (the gateway may send it back here), and the rest is served as before
        again = asyncio.create_task(_events(eng, "w", "wait your turn", 8))
        await wait_for(lambda: eng.load().waiting == 2, 5, what="the re-sent request waiting")
        assert eng.cancel("r") is True
        for task in (behind, again):
            events = await asyncio.wait_for(task, 30)
            assert isinstance(events[-1], Finished) and sum(e.tokens for e in events[:-1]) == 8
        assert (await running)[-1].stats.output_tokens < 3000
        assert eng.withdraw("b") is False, "a finished request is not withdrawn"
        assert eng.load().waiting == 0 and eng.load().running == 0 and eng.load().kv_used == 0
    finally:
        await eng.stop()
