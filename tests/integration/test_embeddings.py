"""`POST /v1/embeddings` end to end over real HTTP (the official `openai` client): gateway ->
dispatcher (Arlo MLQ) -> encoder workers, each hosting one static runtime, on the
session nats-server and redis-server. Vectors are compared with sentence-transformers."""
from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from polyserve.proto import Completed, Deployment, ScalerPolicy  # noqa: E402
from polyserve.worker.config import WorkerSettings  # noqa: E402
from polyserve.worker.engines.encoder import EncoderConfig, EncoderEngine  # noqa: E402
from polyserve.worker.service import WorkerService  # noqa: E402
from tests.helpers import running, wait_for  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEP = "minilm"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SHORT = ["hello world", "Arlo pads each request only to its runtime's max_length."]
LONG = "word " * 60  # 62 tokens: too long for the 32-token runtime, fits the 128 one
TOL = 1e-5


@pytest.fixture(scope="module")
def st():
    import torch
    from sentence_transformers import SentenceTransformer

    from polyserve.core.encoder_text import resolve_model_dir

    torch.set_num_threads(1)
    model = SentenceTransformer(str(resolve_model_dir()), device="cpu")
    model.max_seq_length = 512
    return model


def _ref(st, texts, max_len=512) -> np.ndarray:
    st.max_seq_length = max_len
    try:
        return st.encode(texts, convert_to_numpy=True)
    finally:
        st.max_seq_length = 512


@pytest.fixture
def encoders(plane, make_settings, state, span_exporter):
    """The plane (gateway, dispatcher, predictor) plus two encoder workers: runtimes 32 and 128."""
    import contextlib

    @contextlib.asynccontextmanager
    async def start():
        await state.put_deployment(Deployment(id=DEP, model=MODEL, engine="encoder", policy="arlo_mlq",
                                              scaler=ScalerPolicy(min_replicas=2, max_replicas=2)))
        workers = []
        for wid, max_len in (("enc-32", 32), ("enc-128", 128)):
            settings = make_settings(WorkerSettings, "worker", worker_id=wid, deployment=DEP, model=MODEL,
                                     engine="sim", heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0)
            engine = EncoderEngine(EncoderConfig(model=MODEL, max_length=max_len, batch_size=2, backend="jit",
                                                 slo_ms=1000.0))
            workers.append(WorkerService(settings, engine=engine, span_exporter=span_exporter))
        async with plane(with_worker=False) as p:
            async with running(*workers, timeout=60):
                p.workers = workers
                yield p

    return start


async def test_openai_client_embeddings_equal_sentence_transformers(encoders, st, bus, subjects):
    completed: list[Completed] = []

    async def on_completed(ev: Completed) -> None:
        completed.append(ev)

    await bus.listen(subjects.event("completed"), Completed, on_completed)
    async with encoders() as p:
        texts = SHORT + [LONG]
        resp = await p.client.embeddings.create(model=DEP, input=texts)  # the client asks for base64
        got = np.array([d.embedding for d in resp.data], dtype=np.float32)
        assert got.shape == (3, 384)
        assert np.abs(got - _ref(st, texts)).max() < TOL
        tokens = [len(x) for x in st.tokenizer(texts)["input_ids"]]
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(tokens)
        assert [d.index for d in resp.data] == [0, 1, 2]

        one = await p.client.embeddings.create(model=MODEL, input=SHORT[0], encoding_format="float")
        assert np.abs(np.array(one.data[0].embedding) - _ref(st, SHORT[:1])[0]).max() < TOL

        # each input went to the runtime that fits it: short ones to 32, the long one to 128
        await wait_for(lambda: len(completed) >= 4, what="completed events")
        by_tokens = {ev.input_tokens: ev.worker_id for ev in completed}
        assert by_tokens[tokens[2]] == "enc-128"
        assert by_tokens[tokens[0]] == "enc-32"

        # raw HTTP: float format, token-array input, the runtimes header
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as http:
            ids = st.tokenizer(SHORT[1], add_special_tokens=False)["input_ids"]
            r = await http.post("/v1/embeddings", json={"model": DEP, "input": ids, "encoding_format": "float"})
            assert r.status_code == 200, r.text
            assert np.abs(np.array(r.json()["data"][0]["embedding"]) - _ref(st, SHORT[1:])[0]).max() < TOL
            assert r.headers["x-polyserve-runtimes"] == "static-b2-l32-jit"
            r = await http.post("/v1/embeddings", json={"model": DEP, "input": SHORT, "encoding_format": "base64"})
            vec = np.frombuffer(base64.b64decode(r.json()["data"][1]["embedding"]), dtype="<f4")
            assert np.abs(vec - _ref(st, SHORT[1:])[0]).max() < TOL


async def test_bad_input_gets_a_clear_400_and_nothing_else_is_disturbed(encoders, st):
    async with encoders() as p:
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as http:
            async def bad(body, status=400, match=""):
                r = await http.post("/v1/embeddings", json=body)
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert match in err["message"], err
                return err

            await bad({"model": DEP, "input": ""}, match="empty")
            await bad({"model": DEP, "input": []}, match="empty")
            await bad({"model": DEP, "input": ["ok", ""]}, match="input[1]")
            await bad({"model": DEP, "input": [[]]}, match="empty token array")
            await bad({"model": DEP, "input": [10 ** 9]}, match="outside the vocabulary")
            too_long = "word " * 200  # 202 tokens > the largest runtime (128)
            err = await bad({"model": DEP, "input": ["fine", too_long]}, match="at most 128 tokens")
            assert "truncate" in err["message"] and err["param"] == "input"
            await bad({"model": DEP, "input": ["a"] * 2049}, match="limit is 2048")
            await bad({"model": DEP, "input": "x", "encoding_format": "int8"})
            await bad({"model": DEP, "input": "x", "dimensions": 100}, match="384")
            await bad({"model": "nope", "input": "x"}, status=404, match="does not exist")
            await bad({"model": "sim-test", "input": "x"}, match="not an embedding model")

            r = await http.post("/v1/embeddings", json={"model": DEP, "input": too_long, "truncate": True,
                                                        "encoding_format": "float"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 128
            assert np.abs(np.array(r.json()["data"][0]["embedding"]) - _ref(st, [too_long], 128)[0]).max() < TOL

            # completions on an encoder deployment: a clear 400 from the worker
            r = await http.post("/v1/completions", json={"model": DEP, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 400 and "embeddings" in r.json()["error"]["message"]

        resp = await p.client.embeddings.create(model=DEP, input=SHORT)
        assert len(resp.data) == 2
        with pytest.raises(openai.BadRequestError):
            await p.client.embeddings.create(model=DEP, input="")
