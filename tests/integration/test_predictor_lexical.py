"""The predictor service with its shipped default, the lexical-gbm tier, on real nats-server and redis-server.

No torch: the fast tier is prompt features + LightGBM trees (`polyserve.predictor.proxy.lexical`)."""
from __future__ import annotations

import pytest

pytest.importorskip("lightgbm")
pytest.importorskip("sklearn")
pytest.importorskip("tokenizers")

from polyserve.predictor.config import PredictorSettings  # noqa: E402
from polyserve.predictor.proxy import artifact  # noqa: E402
from polyserve.predictor.service import PredictorService  # noqa: E402
from polyserve.proto import Prediction, PredictRequest  # noqa: E402
from tests.helpers import running, wait_for  # noqa: E402

pytestmark = [pytest.mark.integration]
needs_artifact = pytest.mark.skipif(not (artifact.default_dir() / artifact.META).is_file(),
                                    reason="no shipped lexical artifact (polyserve predictor train-lexical --out ...)")
SHORT = "Answer with one word: what is the capital of France?"
LONG = "Write a detailed 1500-word essay on the causes and consequences of the French Revolution, with sections."


async def predict(bus, subjects, rid: str, prompt: str, model: str, max_tokens: int = 0) -> Prediction:
    return await bus.request(subjects.predict, PredictRequest(request_id=rid, model=model, prompt=prompt,
                                                              input_tokens=len(prompt.split()), max_tokens=max_tokens),
                             Prediction, timeout=3)


@needs_artifact
async def test_default_tier_answers_from_the_model_and_ranks_prompts(make_settings, bus, subjects):
    svc = PredictorService(make_settings(PredictorSettings, "predictor", proxy_timeout_s=5.0))
    assert svc.settings.artifact_dir == str(artifact.default_dir())
    async with running(svc):
        await wait_for(lambda: svc.runner is not None and svc.runner.ready, timeout=60, what="lexical model loaded")
        assert svc.runner.meta.kind == "lexical-gbm" and svc.handlers.cache is None  # no embedding, no cache
        for model in ("gpt-3.5-turbo", "some-unseen-model-13b"):
            short = await predict(bus, subjects, f"s-{model}", SHORT, model)
            long = await predict(bus, subjects, f"l-{model}", LONG, model)
            assert short.source == long.source == "model"
            assert short.length_class < long.length_class and short.tokens_estimate < long.tokens_estimate
            classes = svc.runner.meta.classes_for(model)
            assert long.tokens_estimate == classes.tokens(long.length_class) and long.num_classes == 5
        capped = await predict(bus, subjects, "c", LONG, "gpt-3.5-turbo", max_tokens=7)
        assert capped.tokens_estimate == 7 and capped.source == "model"
