"""The sim engine's simulated logprobs: one entry per token, plausible, deterministic, and
asking for them changes nothing else."""
from __future__ import annotations

import pytest

from polyserve.worker.engine import Delta
from tests.unit.test_sim_engine import engine, profile, req

pytestmark = pytest.mark.unit


async def run(e, r):
    texts: dict[int, str] = {}
    entries: dict[int, list] = {}
    prompts: dict[int, list] = {}
    async for ev in e.generate(r):
        if isinstance(ev, Delta):
            texts[ev.index] = texts.get(ev.index, "") + ev.text
            if ev.prompt_logprobs is not None:
                assert ev.index not in prompts
                prompts[ev.index] = ev.prompt_logprobs
            if r.params.logprobs is not None:
                assert len(ev.logprobs or []) == ev.tokens
                entries.setdefault(ev.index, []).extend(ev.logprobs or [])
            else:
                assert ev.logprobs is None
    return texts, entries, prompts


async def test_sim_logprobs_are_plausible_deterministic_and_leave_the_text_alone():
    async with engine(profile(median=12)) as e:
        plain, _, _ = await run(e, req("a", seed=5, max_tokens=10, n=2))
        texts, entries, prompts = await run(e, req("b", seed=5, max_tokens=10, n=2, logprobs=3, prompt_logprobs=1))
        again, entries2, _ = await run(e, req("c", seed=5, max_tokens=10, n=2, logprobs=3))
    assert texts == plain == again and entries == entries2
    for index, lps in entries.items():
        assert "".join(e.token for e in lps).startswith(texts[index])
        for e in lps:
            assert e.logprob <= 0 and len(e.top) == 3
            values = [t.logprob for t in e.top]
            assert values == sorted(values, reverse=True)
            if e.token in [t.token for t in e.top]:
                assert e.logprob == next(t.logprob for t in e.top if t.token == e.token)
            else:
                assert e.logprob < values[-1]
        words = prompts[index]
        assert "".join(w.token for w in words) == "one two three four five six seven eight nine ten"
        assert words[0].logprob is None and all(w.logprob <= 0 and len(w.top) == 1 for w in words[1:])
