"""CONTRACT: the `vllm` engine asks vLLM 0.33 for logprobs (`SamplingParams.logprobs` /
`prompt_logprobs`) and maps what comes back (per position a dict token id -> Logprob(logprob,
rank, decoded_token); DELTA outputs carry only the new positions, cumulative ones all of them,
and the prompt's come once under DELTA) into polyserve's TokenLogprob entries: one per token
of each delta, the prompt's on each choice's first delta. The fake's shapes are checked
against the release's sources here and in tests/unit/test_vllm_surface.py."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from polyserve.proto import TokenLogprob
from polyserve.worker.engine import Delta, EngineError
from polyserve.worker.engines import vllm_api
from tests.fakes import fake_vllm
from tests.unit.test_vllm_contract import ALL_FLAVORS, build, collect  # noqa: F401,F811 (the fixture)

pytestmark = pytest.mark.unit

SURFACE = json.loads((Path(vllm_api.__file__).parent / "vllm_surface.json").read_text())


def expected(token_id: int, position: int, k: int) -> TokenLogprob:
    """What the engine must make of the fake's position (fake_vllm.fake_position)."""
    own = 1 + position % 3
    text = fake_vllm.FakeTokenizer().decode([token_id])
    top = [(text, -own / 2, token_id) if r == own else (chr(1000 + r), -r / 2, 1000 + r) for r in range(1, k + 1)]
    return TokenLogprob(token=text, logprob=-own / 2, token_id=token_id, rank=own,
                        top=[vllm_api.TopLogprob(token=t, logprob=v, token_id=i) for t, v, i in top])


def deltas(res, index=0) -> list[Delta]:
    return [e for e in res.events if isinstance(e, Delta) and e.index == index]


def test_fake_logprob_is_vllms_dataclass():
    real = SURFACE["classes"]["vllm.logprobs.Logprob"]
    assert [f.name for f in dataclasses.fields(fake_vllm.Logprob)] == real["field_order"]
    for f in dataclasses.fields(fake_vllm.Logprob):
        assert (f.default is dataclasses.MISSING) == ("default" not in real["fields"][f.name]), f.name


async def test_logprobs_reach_sampling_params(build):  # noqa: F811
    engine, fake = await build("v1")
    await collect(engine, "lp", max_tokens=2, logprobs=3, prompt_logprobs=1)
    await collect(engine, "none", max_tokens=2)
    with_lp, without = (c["params"] for c in fake.engine.calls)
    assert (with_lp.logprobs, with_lp.prompt_logprobs) == (3, 1)
    assert (without.logprobs, without.prompt_logprobs) == (None, None)


@pytest.mark.parametrize("flavor", ALL_FLAVORS)
@pytest.mark.parametrize("k", [0, 2])
async def test_sampled_logprobs_one_per_token(build, flavor, k):  # noqa: F811
    """DELTA (v1) and cumulative (v0, diffed) outputs give the same entries: one per token id
    vLLM generated (EOS included), the k best by rank, the chosen token among them when ranked."""
    engine, fake = await build(flavor)
    res = await collect(engine, "lp", "hi", max_tokens=40, logprobs=k)
    entries = [lp for d in deltas(res) for lp in (d.logprobs or [])]
    assert all(len(d.logprobs or []) == d.tokens for d in deltas(res))
    script = fake_vllm.default_script([], 0, None)
    ids = [ord(c) for c in script[:40]] if len(script) >= 40 else [ord(c) for c in script] + [fake_vllm.EOS_ID]
    assert [e.token_id for e in entries] == ids[:res.tokens[0]]
    assert entries == [expected(t, j, k) for j, t in enumerate(ids[:res.tokens[0]])]
    assert all(d.prompt_logprobs is None for d in deltas(res))


@pytest.mark.parametrize("flavor", ["v1", "v0"])
async def test_prompt_logprobs_on_each_choices_first_delta(build, flavor):  # noqa: F811
    """V1 sends the prompt's logprobs once (popped) on one child's output; every choice gets them."""
    engine, _ = await build(flavor)
    res = await collect(engine, "plp", "abc", n=2, max_tokens=3, prompt_logprobs=1)
    want = [TokenLogprob(token="a", logprob=None, token_id=ord("a"))] + \
        [expected(ord(c), j, 1) for j, c in enumerate("bc", 1)]
    for i in range(2):
        ds = deltas(res, i)
        assert ds[0].prompt_logprobs == want
        assert all(d.prompt_logprobs is None for d in ds[1:])
        assert all(d.logprobs is None for d in ds)  # not asked for


async def test_logprobs_with_n_and_stop(build):  # noqa: F811
    engine, _ = await build("v1")
    res = await collect(engine, "n2", n=2, max_tokens=12, logprobs=1, stop=["d"])
    for i in range(2):
        entries = [lp for d in deltas(res, i) for lp in (d.logprobs or [])]
        assert len(entries) == res.tokens[i]
        assert "".join(e.token for e in entries).startswith(f"choice{i}:abc")


async def test_negative_logprobs_are_a_400(build):  # noqa: F811
    engine, fake = await build("v1")
    with pytest.raises(EngineError) as err:
        await collect(engine, "bad", logprobs=-2)
    assert err.value.status == 400 and not fake.engine.calls


def test_position_mapping_details():
    decode = {5: "five", 6: "six", 7: "seven"}.__getitem__
    Lp = fake_vllm.Logprob
    # the chosen token (rank 9) below the top 2; a missing decoded_token falls back to decode()
    pos = {6: Lp(-0.1, 1, None), 7: Lp(-0.2, 2, "SEVEN"), 5: Lp(-3.0, 9, "FIVE")}
    e = vllm_api.token_logprob(pos, 5, 2, decode)
    assert (e.token, e.logprob, e.token_id, e.rank) == ("FIVE", -3.0, 5, 9)  # vLLM's rank kept
    assert [(t.token, t.logprob, t.token_id) for t in e.top] == [("six", -0.1, 6), ("SEVEN", -0.2, 7)]
    assert vllm_api.token_logprob(pos, 5, 0, decode).top == []
    assert vllm_api.token_logprob(None, 6, 2, decode) == TokenLogprob(token="six", logprob=None, token_id=6)
    # fewer positions than tokens (never from vLLM): entries without a logprob, not an error
    assert [x.logprob for x in vllm_api.token_logprobs([pos], [5, 6], 1, decode)] == [-3.0, None]


async def test_penalties_bias_and_min_p_reach_sampling_params_only_when_asked(build):  # noqa: F811
    """Sent as vLLM's own SamplingParams fields (names checked against its sources in
    test_vllm_surface); left out at their off values, so every release keeps its defaults; a value
    vLLM refuses is the request's 400."""
    engine, fake = await build("v1")
    await collect(engine, "pen", max_tokens=2, frequency_penalty=0.5, presence_penalty=-0.5,
                  repetition_penalty=1.2, min_p=0.1, logit_bias={7: -100.0}, stop_token_ids=[3], include_stop=True,
                  allowed_token_ids=[4, 5], bad_words=["no"], skip_special_tokens=False)
    await collect(engine, "off", max_tokens=2)
    pen, off = (c["params"] for c in fake.engine.calls)
    names = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias", "stop_token_ids",
             "include_stop_str_in_output", "allowed_token_ids", "bad_words", "skip_special_tokens")
    assert [getattr(pen, n) for n in names] == [0.5, -0.5, 1.2, 0.1, {7: -100.0}, [3], True, [4, 5], ["no"], False]
    assert [getattr(off, n) for n in names] == [0.0, 0.0, 1.0, 0.0, None, None, False, None, None, True]  # defaults
    with pytest.raises(EngineError) as err:
        await collect(engine, "bad", max_tokens=2, repetition_penalty=-1.0)
    assert err.value.status == 400 and "repetition_penalty" in str(err.value)


async def test_truncate_prompt_tokens_cuts_the_ids_vllm_gets(build):  # noqa: F811
    """vLLM 0.33 truncates in its tokenizing front end, not in SamplingParams: the engine, which
    hands vLLM token ids, keeps the prompt's last k itself (-1: its max_input_len)."""
    engine, fake = await build("v1")
    await collect(engine, "whole", "abcdefgh", max_tokens=2)
    await collect(engine, "cut", "abcdefgh", max_tokens=2, truncate_prompt_tokens=3)
    whole, cut = (c["prompt"]["prompt_token_ids"] for c in fake.engine.calls)
    assert cut == whole[-3:] and len(whole) > 3


async def test_return_token_ids_come_from_vllms_outputs(build):  # noqa: F811
    """CONTRACT: each delta's token_ids are vLLM's CompletionOutput.token_ids (delta mode) and the
    first delta of each choice carries the prompt ids the engine handed vLLM."""
    from polyserve.worker.engine import Delta
    engine, fake = await build("v1")
    res = await collect(engine, "ids", max_tokens=4, n=2, return_token_ids=True)
    for i in (0, 1):
        deltas = [e for e in res.events if isinstance(e, Delta) and e.index == i]
        ids = [t for d in deltas for t in d.token_ids or ()]
        assert len(ids) == res.tokens[i] and engine._tokenizer.decode(ids) == res.text[i]
        assert deltas[0].prompt_token_ids == list(engine._tokenizer.encode("hello"))
        assert all(d.prompt_token_ids is None for d in deltas[1:])
    plain = await collect(engine, "plain", max_tokens=2)
    assert all(e.token_ids is None for e in plain.events if isinstance(e, Delta))
