"""The predictor clamps every answer to the request's max_tokens once, whatever the
source: here the proxy model's (a stand-in runner, no model loaded); the history and
the prior are covered in test_predictor_policy.py and the integration tests."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.handlers import SOURCE_MODEL, PredictHandlers
from polyserve.predictor.proxy.labels import ModelClasses
from polyserve.predictor.proxy.runtime import ModelResult
from polyserve.proto import PredictBatch, PredictRequest
from polyserve.shared.settings import load

pytestmark = pytest.mark.unit
CLASSES = ModelClasses(bounds=(32.0, 128.0, 256.0, 512.0), medians=(16.0, 64.0, 192.0, 384.0, 768.0))


class _Runner:
    """Answers like ModelRunner.predict: class 3, 384 tokens, for any prompt."""

    meta = SimpleNamespace(classes_for=lambda model: CLASSES)

    async def predict(self, prompt: str, model: str, timeout_s: float) -> ModelResult:
        return ModelResult(length_class=3, tokens=384, value=0.0, known_model=True, key=None, batch_size=1,
                           infer_ms=1.0)


async def test_model_answer_is_clamped_to_max_tokens_and_reclassed():
    h = PredictHandlers(load(PredictorSettings, "predictor", environ={}), stats=None, runner=_Runner())

    async def ask(max_tokens: int):
        p = await h.predict(PredictRequest(request_id="q", model="m", prompt="tell me", input_tokens=3,
                                           max_tokens=max_tokens))
        return p.source, p.tokens_estimate, p.length_class

    assert await ask(0) == (SOURCE_MODEL, 384, 3)  # 0: no cap known
    assert await ask(1000) == (SOURCE_MODEL, 384, 3)
    assert await ask(50) == (SOURCE_MODEL, 50, 1)  # the class of 50 tokens, not the model's class 3


async def test_a_batch_is_answered_in_order_and_an_invalid_item_is_left_out():
    """PredictBatch (the gateway's predictions nobody waits for): each item as `predict` answers
    it, in order; one it refuses (negative input_tokens) is absent and the rest still come."""
    h = PredictHandlers(load(PredictorSettings, "predictor", environ={}), stats=None, runner=_Runner())
    items = [PredictRequest(request_id=f"q{i}", model="m", prompt="tell me", input_tokens=3 if i != 1 else -1,
                            max_tokens=50 if i == 2 else 0) for i in range(4)]
    out = await h.predict_batch(PredictBatch(items=items))
    assert [(p.request_id, p.tokens_estimate) for p in out.items] == [("q0", 384), ("q2", 50), ("q3", 384)]
