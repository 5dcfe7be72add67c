"""Structured outputs in the `hf` engine (llguidance masks in the sampling step): JSON Schema,
choice, regex and grammar constraints hold for every row of a batch, with random weights."""
from __future__ import annotations

import json
import os
import re

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from polyserve.proto import SamplingParams, StructuredOutput  # noqa: E402
from polyserve.worker.engine import Delta, EngineError, EngineRequest  # noqa: E402
from polyserve.worker.engines.hf import HfEngine  # noqa: E402
from tests.unit.test_hf_engine import settings  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}


async def run(engine, rid, **params) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    async for ev in engine.generate(EngineRequest(rid, "give me json", SamplingParams(**params))):
        if isinstance(ev, Delta):
            texts[ev.index] = texts.get(ev.index, "") + ev.text
            if ev.finish_reason:
                finish[ev.index] = ev.finish_reason
    return texts, finish


@pytest.fixture
async def engine():
    eng = HfEngine(settings(max_batch=16))
    await eng.start()
    yield eng
    await eng.stop()


@pytest.mark.parametrize("layout", ["ragged", "padded"])
async def test_json_schema_holds_for_every_row(layout):
    eng = HfEngine(settings(max_batch=16, kv_layout=layout))
    await eng.start()
    try:
        spec = StructuredOutput(json=json.dumps(SCHEMA))
        texts, finish = await run(eng, "js", max_tokens=40, temperature=1.0, n=8, seed=1, structured=spec)
        for i in range(8):
            jsonschema.validate(json.loads(texts[i]), SCHEMA)
            assert finish[i] == "stop"
    finally:
        await eng.stop()


async def test_choice_regex_and_grammar(engine):
    texts, _ = await run(engine, "c", max_tokens=10, n=4, seed=2, structured=StructuredOutput(choice=["yes", "no"]))
    assert set(texts.values()) <= {"yes", "no"}
    texts, _ = await run(engine, "r", max_tokens=10, n=4, seed=3, structured=StructuredOutput(regex="[a-c]{2,4}"))
    assert all(re.fullmatch("[a-c]{2,4}", t) for t in texts.values()), texts
    texts, _ = await run(engine, "g", max_tokens=10, seed=4,
                         structured=StructuredOutput(grammar='root ::= "a" ("b" | "c")'))
    assert texts[0] in ("ab", "ac")


async def test_unconstrained_rows_share_the_batch(engine):
    spec = StructuredOutput(choice=["yes", "no"])
    free = engine.generate(EngineRequest("free", "hello", SamplingParams(max_tokens=6, min_tokens=6)))
    first = await free.__anext__()
    texts, _ = await run(engine, "c2", max_tokens=5, n=2, structured=spec)
    rest = [ev async for ev in free]
    assert set(texts.values()) <= {"yes", "no"}
    assert sum(ev.tokens for ev in [first, *rest] if isinstance(ev, Delta)) == 6


async def test_an_invalid_constraint_is_a_400(engine):
    with pytest.raises(EngineError) as err:
        await run(engine, "bad", max_tokens=5, structured=StructuredOutput(regex="(unclosed"))
    assert err.value.status == 400


async def test_a_thinking_models_constraint_starts_after_its_thinking(engine):
    """SamplingParams.think (a reasoning_parser deployment, vLLM's reasoning_ended): no mask while
    the model thinks; from the token after the closing tag the grammar holds. Tags here are single
    words of the random model's WordPiece vocabulary ("start" ... "done"), `logit_bias` the lever."""
    spec = StructuredOutput(choice=["yes", "no"])
    think = ["start", "done"]
    done = engine._bundle.tokenizer.convert_tokens_to_ids("done")
    # thinking never ends: the text runs free (no mask), so it is not the choice
    texts, finish = await run(engine, "t1", max_tokens=6, min_tokens=6, seed=5, structured=spec, think=think)
    assert texts[0] not in ("yes", "no") and finish[0] == "length", texts
    # "done" first (biased): then the choice, exactly, and the row stops when the grammar is complete
    texts, finish = await run(engine, "t2", max_tokens=8, temperature=0, logit_bias={done: 100.0}, structured=spec,
                             think=think)
    thought, _, answer = texts[0].partition("done")
    assert not thought.strip() and answer in ("yes", "no") and finish[0] == "stop", texts
    # a prompt that already closed the thinking ("... start done"): constrained from the first token,
    # so the biased "done" is masked out like any other token outside the grammar
    closed = []
    async for ev in engine.generate(EngineRequest("t3", "give me json start done", SamplingParams(
            max_tokens=8, temperature=0, logit_bias={done: 100.0}, structured=spec, think=think))):
        closed.append(ev.text if isinstance(ev, Delta) else "")
    assert "".join(closed) in ("yes", "no"), closed
