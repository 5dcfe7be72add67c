"""CONTRACT: the `vllm` engine hands polyserve's StructuredOutput to vLLM 0.33 as
`SamplingParams(structured_outputs=StructuredOutputsParams(...))` (the fake mirrors the
release's class: tests/unit/test_vllm_surface.py), one constraint field set."""
from __future__ import annotations

import json

import pytest

from polyserve.proto import StructuredOutput
from polyserve.worker.engine import EngineError
from tests.fakes import fake_vllm
from tests.unit.test_vllm_contract import build, collect  # noqa: F401,F811 (the fixture)

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("spec,field,value", [
    (StructuredOutput(json=json.dumps(SCHEMA)), "json", json.dumps(SCHEMA)),
    (StructuredOutput(json_object=True), "json_object", True),
    (StructuredOutput(regex="[a-z]+"), "regex", "[a-z]+"),
    (StructuredOutput(choice=["yes", "no"]), "choice", ["yes", "no"]),
    (StructuredOutput(grammar='root ::= "a"'), "grammar", 'root ::= "a"'),
])
async def test_structured_outputs_reach_vllm(build, spec, field, value):  # noqa: F811
    engine, fake = await build("v1")
    await collect(engine, "so", max_tokens=4, structured=spec)
    so = fake.engine.calls[-1]["params"].structured_outputs
    assert isinstance(so, fake_vllm.StructuredOutputsParams)
    assert getattr(so, field) == value
    others = {"json", "regex", "choice", "grammar", "json_object"} - {field}
    assert all(getattr(so, f) is None for f in others)


async def test_unconstrained_requests_send_none(build):  # noqa: F811
    engine, fake = await build("v1")
    await collect(engine, "free", max_tokens=4)
    assert fake.engine.calls[-1]["params"].structured_outputs is None


async def test_a_vllm_without_structured_outputs_is_a_400(build, monkeypatch):  # noqa: F811
    engine, fake = await build("v1")
    monkeypatch.setattr(engine.api, "StructuredOutputsParams", None)
    with pytest.raises(EngineError) as err:
        await collect(engine, "old", max_tokens=4, structured=StructuredOutput(regex="a"))
    assert err.value.status == 400


async def test_a_thinking_models_constraint_needs_vllms_reasoning_parser(build):  # noqa: F811
    """SamplingParams.think (gateway/reasoning.py `gate`): with vLLM's own `reasoning_parser` (the
    engine arg `polyserve up --reasoning-parser` adds) vLLM constrains after the thinking and the text
    is vLLM's; without it vLLM constrains from the first token, so each choice's text starts with an
    empty `<think></think>` and the gateway reads the constrained text as the content."""
    spec, think = StructuredOutput(choice=["yes", "no"]), ["<think>", "</think>"]
    engine, fake = await build("v1")
    plain = await collect(engine, "bare", max_tokens=4, n=2, structured=spec, think=think)
    assert all(plain.text[i].startswith("<think></think>") for i in (0, 1)), plain.text
    assert fake.engine.calls[-1]["params"].structured_outputs.choice == ["yes", "no"]
    engine, fake = await build("v1", vllm_engine_args={"reasoning_parser": "qwen3"})
    assert fake.engine.engine_args.reasoning_parser == "qwen3"
    parsed = await collect(engine, "parsed", max_tokens=4, structured=spec, think=think)
    assert not parsed.text[0].startswith("<think>"), parsed.text


async def test_a_thinking_budget_reaches_vllm_only_where_its_reasoning_config_enforces_it(build):  # noqa: F811
    """CONTRACT: SamplingParams(thinking_token_budget=...) (vLLM 0.33), enforced by vLLM only with the
    engine's `reasoning_config`; without one the worker refuses the field rather than ignore it."""
    think = ["<think>", "</think>"]
    engine, fake = await build("v1")
    with pytest.raises(EngineError) as err:
        await collect(engine, "nb", max_tokens=4, think=think, thinking_budget=8)
    assert err.value.status == 400 and "reasoning_config" in str(err.value)
    config = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
    engine, fake = await build("v1", vllm_engine_args={"reasoning_config": config})
    await collect(engine, "b", max_tokens=4, think=think, thinking_budget=8)
    assert fake.engine.calls[-1]["params"].thinking_token_budget == 8
    await collect(engine, "free", max_tokens=4)
    assert fake.engine.calls[-1]["params"].thinking_token_budget is None
