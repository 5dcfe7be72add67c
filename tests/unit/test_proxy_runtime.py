"""The model runner: micro-batching by length bucket, budget and overload fallbacks (a fake model)."""
from __future__ import annotations

import asyncio
import threading
import time
import types

import numpy as np
import pytest

from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.proxy.artifact import default_dir
from polyserve.predictor.proxy.runtime import ModelRunner, Unavailable
from polyserve.shared.settings import SettingsError, load
from tests.helpers import wait_for

pytestmark = pytest.mark.unit


class FakePredictor:
    """Answers class = number of words % 5; records the batches it saw."""

    def __init__(self, delay_s: float = 0.0):
        self.meta = types.SimpleNamespace(max_length=512, models=["m"])
        self.delay_s = delay_s
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()
        self.dim = 4

    def token_ids(self, texts):
        return [t.split() for t in texts]

    def predict(self, prompts, models, ids=None):
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(prompts))
        time.sleep(self.delay_s)  # the fake model's compute time (on the runner's model thread), not a wait
        answers = [types.SimpleNamespace(length_class=len(p.split()) % 5, tokens=10 * len(p.split()),
                                         value=float(len(p.split()) % 5), known_model=True) for p in prompts]
        return answers, np.ones((len(prompts), 4), dtype=np.float32)


async def started(runner: ModelRunner, fake: FakePredictor) -> ModelRunner:
    runner.predictor, runner.state = fake, "ready"
    runner._task = asyncio.create_task(runner._batcher())
    return runner


async def test_not_loaded_means_fallback():
    runner = ModelRunner("/nonexistent")
    with pytest.raises(Unavailable) as err:
        await runner.predict("hi", "m", 1.0)
    assert err.value.reason == "not_loaded"
    await runner.start()  # no artifact there: failed, never raises
    assert runner.state == "failed" and runner.error
    await runner.stop()


async def test_batches_gather_and_split_by_length_bucket():
    fake = FakePredictor(delay_s=0.01)
    runner = await started(ModelRunner("x", max_batch=8, batch_wait_ms=20, bucket_step=64), fake)
    try:
        short = ["a b c"] * 5
        long = [" ".join(["w"] * 100)] * 3  # 100 tokens: bucket 128, the short ones bucket 64
        results = await asyncio.gather(*(runner.predict(p, "m", 2.0) for p in short + long))
        assert [r.tokens for r in results] == [30] * 5 + [1000] * 3
        assert sorted(len(b) for b in fake.batches) == [3, 5]  # one batch per bucket
        assert all(len(set(len(p.split()) for p in b)) == 1 for b in fake.batches)
        assert fake.threads == {t for t in fake.threads if t.startswith("predictor-model")}
        assert results[0].key is not None and results[0].batch_size == 5
    finally:
        await runner.stop()


async def test_a_lone_request_does_not_wait_for_company_but_a_crowd_still_gathers():
    """With nothing queued and the last batch alone, a request runs at once: the micro-batching wait
    (here 400 ms) is spent only when there is company (a request queued while the model ran, or a
    batch of several before)."""
    fake = FakePredictor()
    runner = await started(ModelRunner("x", max_batch=8, batch_wait_ms=400), fake)
    try:
        for i in range(3):  # one request in flight at a time
            t = time.monotonic()
            await runner.predict(f"alone {i}", "m", 5.0)
            assert time.monotonic() - t < 0.3, "a lone request waited for the batch window"
        assert [len(b) for b in fake.batches] == [1, 1, 1]
        await asyncio.gather(*(runner.predict(f"crowd {i}", "m", 5.0) for i in range(5)))
        assert [len(b) for b in fake.batches[3:]] == [5]  # queued together: one batch
    finally:
        await runner.stop()


async def test_budget_and_queue_bound_fall_back():
    fake = FakePredictor(delay_s=0.3)
    runner = await started(ModelRunner("x", max_batch=1, batch_wait_ms=0, max_queue=2), fake)
    try:
        with pytest.raises(Unavailable) as err:
            await runner.predict("slow one", "m", 0.05)
        assert err.value.reason == "timeout"
        waiting = [asyncio.ensure_future(runner.predict(f"p{i}", "m", 5.0)) for i in range(2)]
        await wait_for(runner.queue.full, 2, what="two jobs queued behind the busy model")
        with pytest.raises(Unavailable) as err:
            await runner.predict("one too many", "m", 5.0)
        assert err.value.reason == "queue_full"
        assert all(r.tokens == 10 for r in await asyncio.gather(*waiting))
    finally:
        await runner.stop()


def test_settings_of_the_model_and_cache():
    s = load(PredictorSettings, "predictor", environ={})
    assert s.artifact_dir == str(default_dir()) and s.cache_threshold == 0.8 and s.cache_keys == "tuned"
    s = load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_PROXY_ARTIFACT": "",
                                                      "POLYSERVE_PREDICTOR_CACHE_ENABLED": "false"})
    assert s.artifact_dir == "" and s.cache_enabled is False
    for bad in ({"cache_threshold": "1.5"}, {"cache_keys": "other"}, {"proxy_timeout_s": "0"},
                {"proxy_max_batch": "0"}, {"cache_max_entries": "0"}):
        with pytest.raises(SettingsError):
            load(PredictorSettings, "predictor", environ={}, **bad)
