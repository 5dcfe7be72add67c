"""The predictor service with µ-Serve's proxy model and semantic cache, on real nats-server and redis-server.

Uses the artifact shipped in `services/predictor/artifacts/` (skips without it or
without the `hf` extra and faiss)."""
from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("faiss")

from polyserve.core.model_names import canonical  # noqa: E402
from polyserve.predictor.config import PredictorSettings  # noqa: E402
from polyserve.predictor.proxy import artifact  # noqa: E402
from polyserve.predictor.service import PredictorService  # noqa: E402
from polyserve.proto import Completed, Prediction, PredictRequest  # noqa: E402
from tests.helpers import running, wait_for  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]  # torch: builds torch models
needs_artifact = pytest.mark.skipif(not (artifact.default_dir("minilm") / artifact.META).is_file(),
                                    reason="no shipped predictor artifact (polyserve predictor train --out ...)")

MODEL = "Qwen1.5-7B-Chat"  # one of the artifact's target models
PROMPT = "What are the names of some famous actors that started their careers on Broadway?"
PARAPHRASE = "Which famous actors began their careers on Broadway?"
UNRELATED = "Write a Python function that reverses a singly linked list in place."
LOAD_TIMEOUT = 90.0  # the model loads in a thread; a busy 2-core machine is slow


async def predict(bus, subjects, rid: str, prompt: str, model: str = MODEL) -> Prediction:
    return await bus.request(subjects.predict, PredictRequest(request_id=rid, model=model, prompt=prompt,
                                                              input_tokens=len(prompt.split())),
                             Prediction, timeout=3)


def completed(rid: str, out: int, model: str = MODEL, finish: str = "stop") -> Completed:
    return Completed(request_id=rid, model=model, worker_id="w", input_tokens=12, output_tokens=out,
                     e2e_ms=10.0, ttft_ms=1.0, finish_reason=finish)


@needs_artifact
async def test_model_answers_and_cache_learns_true_lengths_across_restart(make_settings, bus, subjects, state,
                                                                          prefix):
    svc = PredictorService(make_settings(PredictorSettings, "predictor", proxy_artifact="minilm", cache_sync_s=0.2,
                                         proxy_timeout_s=10.0))
    async with running(svc):
        first = await predict(bus, subjects, "r0", PROMPT)  # answered at once, model loading or not
        assert first.source in ("prior", "model")
        await wait_for(lambda: svc.handlers.cache is not None, timeout=LOAD_TIMEOUT, what="model and cache loaded")
        meta = svc.runner.meta
        p = await predict(bus, subjects, "r1", PROMPT)
        assert p.source == "model" and 0 <= p.length_class < 5 and p.num_classes == 5
        assert p.tokens_estimate == meta.classes_for(MODEL).tokens(p.length_class)

        await bus.publish(subjects.event("completed"), completed("r1", 777))
        await wait_for(lambda: svc.handlers.cache.learned == 1, what="the true length in the cache")
        again = await predict(bus, subjects, "r2", PROMPT)
        assert (again.source, again.tokens_estimate) == ("cache", 777)
        assert again.length_class == meta.classes_for(MODEL).classes([777])[0]
        para = await predict(bus, subjects, "r3", PARAPHRASE)
        assert (para.source, para.tokens_estimate) == ("cache", 777)
        assert (await predict(bus, subjects, "r4", UNRELATED)).source == "model"
        assert (await predict(bus, subjects, "r5", PROMPT, model="vicuna-7b-v1.5")).source == "model"
        # a request cut by max_tokens does not teach the cache
        await bus.publish(subjects.event("completed"), completed("r4", 16, finish="length"))
        await wait_for(lambda: svc.handlers.cache.cache.misses >= 2 and not svc.handlers.cache.pending.get("r4"),
                       what="the cut request handled")
        assert (await predict(bus, subjects, "r6", UNRELATED)).source == "model"
        space = svc.runner.predictor.key_space
        assert space.startswith("lora-")  # keys of the artifact's tuned encoder
        assert await state.r.hlen(f"{prefix}:predcache:{space}:m:{canonical(MODEL)}")  # the normalised name (issue 17) == 1
        assert await state.r.zcard(f"{prefix}:predcache:{space}:index") == 1

        # past its budget the model is skipped and the history answers
        svc.handlers.settings = msgspec.structs.replace(svc.settings, proxy_timeout_s=1e-6)
        late = await predict(bus, subjects, "r7", UNRELATED)
        assert late.source in ("prior", "history") and svc.handlers.fallbacks.get("timeout", 0) >= 1

    svc2 = PredictorService(make_settings(PredictorSettings, "predictor", proxy_artifact="minilm",
                                          proxy_timeout_s=10.0))
    async with running(svc2):
        await wait_for(lambda: svc2.handlers.cache is not None and len(svc2.handlers.cache.cache) == 1,
                       timeout=LOAD_TIMEOUT, what="model loaded and the cache restored from Redis")
        p = await predict(bus, subjects, "r8", PARAPHRASE)
        assert (p.source, p.tokens_estimate) == ("cache", 777)


async def test_without_an_artifact_the_history_answers(make_settings, bus, subjects, tmp_path):
    cfg = make_settings(PredictorSettings, "predictor", proxy_artifact=str(tmp_path / "absent"), refresh_s=0.2)
    svc = PredictorService(cfg)
    async with running(svc):
        await wait_for(lambda: svc.runner.state == "failed", what="the load to fail")
        assert "absent" in svc.runner.error
        p = await predict(bus, subjects, "r1", PROMPT)
        assert (p.source, p.tokens_estimate) == ("prior", 129)
        for i in range(5):
            await bus.publish(subjects.event("completed"), completed(f"h{i}", 60))
        await wait_for(lambda: svc.handlers.learned == 5, what="5 observations")
        p = await predict(bus, subjects, "r2", PROMPT)
        assert (p.source, p.tokens_estimate) == ("history", 60)


async def test_model_off_by_setting(make_settings, bus, subjects):
    svc = PredictorService(make_settings(PredictorSettings, "predictor", proxy_artifact=""))
    async with running(svc):
        assert svc.runner is None
        assert (await predict(bus, subjects, "r1", PROMPT)).source == "prior"
