"""vLLM's return_token_ids in the hf engine: every accepted token's id on its delta (EOS too), the
prompt's ids (after truncation) on a choice's first delta."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineRequest  # noqa: E402
from tests.unit.test_hf_structured import engine  # noqa: E402,F401 (the fixture)

pytestmark = [pytest.mark.unit, pytest.mark.torch]


async def test_return_token_ids_are_the_rows_tokens(engine):  # noqa: F811
    tok = engine._bundle.tokenizer
    for n, params in ((1, {}), (2, {"truncate_prompt_tokens": 2})):
        deltas = [ev async for ev in engine.generate(EngineRequest(f"ids{n}", "tell me more", SamplingParams(
            max_tokens=6, seed=9, n=n, return_token_ids=True, **params))) if isinstance(ev, Delta)]
        for i in range(n):
            mine = [d for d in deltas if d.index == i]
            ids = [t for d in mine for t in d.token_ids or ()]
            assert len(ids) == sum(d.tokens for d in mine)
            assert tok.decode(ids, skip_special_tokens=True).split() == "".join(d.text for d in mine).split()
            prompt = engine._bundle.encode("tell me more")
            assert mine[0].prompt_token_ids == (prompt[-2:] if params else prompt)
            assert all(d.prompt_token_ids is None for d in mine[1:])
