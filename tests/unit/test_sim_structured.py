"""The sim engine's structured outputs: schema-valid (simulated) JSON, choices, and a 400 for
what it cannot generate."""
from __future__ import annotations

import json
import random

import pytest

from polyserve.proto import SamplingParams, StructuredOutput
from polyserve.worker.engine import Delta, EngineError, EngineRequest
from polyserve.worker.engines import sim_json
from polyserve.worker.engines.sim import SimEngine, load_profile

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.unit

SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 3,
                                                                                "maximum": 9}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "minItems": 1, "maxItems": 2},
                                      "when": {"type": "string", "format": "date"},
                                      "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                      "kind": {"anyOf": [{"const": "a"}, {"type": "null"}]},
                                      "child": {"$ref": "#/$defs/child"}},
     "required": ["tags", "score", "child"], "$defs": {"child": {"type": "object", "properties": {
         "ok": {"type": "boolean"}, "name": {"type": ["string", "null"], "minLength": 12}}, "required": ["ok", "name"]}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_instances_validate(schema):
    for seed in range(50):
        jsonschema.validate(sim_json.instance(schema, random.Random(seed)), schema)


def test_unsupported_schemas_are_refused():
    for schema in ({"type": "string", "pattern": "^a+$"}, {"not": {"type": "string"}}, {"type": "thing"}):
        with pytest.raises(sim_json.UnsupportedSchema):
            sim_json.instance(schema, random.Random(0))


async def collect(engine, rid, **params):
    texts, finish = {}, {}
    async for ev in engine.generate(EngineRequest(rid, "hi there", SamplingParams(**params))):
        if isinstance(ev, Delta):
            texts[ev.index] = texts.get(ev.index, "") + ev.text
            if ev.finish_reason:
                finish[ev.index] = ev.finish_reason
    return texts, finish


async def test_the_engine_streams_schema_valid_json():
    engine = SimEngine(load_profile(), time_scale=0.0)
    await engine.start()
    try:
        spec = StructuredOutput(json=json.dumps(SCHEMAS[1]))
        texts, finish = await collect(engine, "a", max_tokens=200, n=3, seed=5, structured=spec)
        for i in range(3):
            jsonschema.validate(json.loads(texts[i]), SCHEMAS[1])
            assert finish[i] == "stop"
        texts, finish = await collect(engine, "b", max_tokens=2, structured=spec)
        assert finish[0] == "length" and len(texts[0]) == 8  # cut at max_tokens, as a model is
        texts, _ = await collect(engine, "c", max_tokens=20, structured=StructuredOutput(json_object=True))
        assert json.loads(texts[0]) == {"simulated": True}
        texts, _ = await collect(engine, "d", max_tokens=20, n=4, structured=StructuredOutput(choice=["x", "yz"]))
        assert set(texts.values()) <= {"x", "yz"}
        # a thinking model's constraint after its thinking: the sim's thinking is empty, then the text
        texts, _ = await collect(engine, "t", max_tokens=20, n=2, structured=StructuredOutput(choice=["x", "yz"]),
                                 think=["<think>", "</think>"])
        assert {t.removeprefix("<think></think>") for t in texts.values()} <= {"x", "yz"}
        assert all(t.startswith("<think></think>") for t in texts.values())
        with pytest.raises(EngineError) as err:
            await collect(engine, "e", max_tokens=5, structured=StructuredOutput(regex="a+"))
        assert err.value.status == 400
    finally:
        await engine.stop()
