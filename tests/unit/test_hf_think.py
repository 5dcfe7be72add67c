"""A thinking model's tags in the hf engine (hf_think): vLLM's thinking_token_budget forces the
closing tag after that many thinking tokens, counted from the opening tag in the prompt or in the
output; a constraint waits for the close (test_hf_structured.py has the gate alone). The random
model's WordPiece vocabulary has no `<think>`, so single words stand in for the tags."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import SamplingParams, StructuredOutput  # noqa: E402
from polyserve.worker.engine import Delta, EngineRequest  # noqa: E402
from polyserve.worker.engines.hf_think import ThinkBudget, prompt_state  # noqa: E402
from tests.unit.test_hf_structured import engine  # noqa: E402,F401 (the fixture)

pytestmark = [pytest.mark.unit, pytest.mark.torch]
THINK = ["start", "done"]


async def pieces(eng, rid, prompt, **params) -> list[str]:
    out = []
    async for ev in eng.generate(EngineRequest(rid, prompt, SamplingParams(think=THINK, **params))):
        if isinstance(ev, Delta) and ev.tokens:
            out.append(ev.text.strip())
    return out


def test_the_prompts_tail_says_where_the_thinking_stands():
    from polyserve.worker.engines.hf_model import fallback_tokenizer
    tok = fallback_tokenizer()
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert prompt_state(THINK, tok, enc("tell me start")) == "open"
    assert prompt_state(THINK, tok, enc("tell me start done")) == "closed"
    assert prompt_state(THINK, tok, enc("tell me")) == "none"
    # an earlier turn's tags, more than a few tokens back, do not count
    assert prompt_state(THINK, tok, enc("start done and then a long question about many other things")) == "none"
    b = ThinkBudget(THINK, 0, tok, enc("tell me start"))
    assert b.forced == enc("done")  # a budget of 0 inside the thinking: the close comes first


async def test_the_budget_forces_the_close_after_that_many_thinking_tokens(engine):  # noqa: F811
    # the prompt opened the thinking (as DeepSeek-R1's template does): 3 tokens, then "done" forced
    got = await pieces(engine, "b3", "tell me start", max_tokens=8, min_tokens=8, seed=1, thinking_budget=3)
    assert got[3] == "done" and "done" not in got[:3], got
    got = await pieces(engine, "b0", "tell me start", max_tokens=4, min_tokens=4, seed=1, thinking_budget=0)
    assert got[0] == "done", got
    # the output opens it (as Qwen3 does): counted from the token after "start"
    start = engine._bundle.tokenizer.convert_tokens_to_ids("start")
    got = await pieces(engine, "q", "tell me", max_tokens=6, min_tokens=6, temperature=0,
                       logit_bias={start: 100.0}, thinking_budget=2)
    assert got[:4] == ["start", "start", "start", "done"], got
    # no opening tag anywhere: nothing to count, nothing forced
    got = await pieces(engine, "n", "tell me", max_tokens=6, min_tokens=6, seed=2, thinking_budget=0)
    assert "done" not in got


async def test_a_constraint_follows_the_forced_close(engine):  # noqa: F811
    got = await pieces(engine, "sc", "tell me start", max_tokens=12, seed=3, thinking_budget=2,
                       structured=StructuredOutput(choice=["yes", "no"]))
    assert got[2] == "done" and "".join(got[3:]) in ("yes", "no"), got


async def test_a_closing_tag_of_several_tokens_is_forced_whole_and_once(engine):  # noqa: F811
    out = []
    # WordPiece decodes "</think>"'s four tokens as "< / think >": the tag is never found in the text
    params = SamplingParams(think=["start", "</think>"], thinking_budget=2, max_tokens=12, min_tokens=12, seed=6)
    async for ev in engine.generate(EngineRequest("two", "tell me start", params)):
        if isinstance(ev, Delta) and ev.tokens:
            out.append(ev.text.strip())
    close = ["<", "/", "think", ">"]
    assert out[2:6] == close and out[6:10] != close, out  # forced whole, then not again

