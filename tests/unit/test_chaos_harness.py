"""The chaos suite's judgement of what clients saw (services/bench/chaos_*.py), on made-up
inputs: a stream that ends with [DONE] after fewer tokens than asked is `short`, not ok; an
error event or a cut is an explicit error; recovery is counted to the first good probe after
the last bad one; a row lists every target it misses."""
from __future__ import annotations

import json

import pytest

from polyserve.bench import chaos_burst
from polyserve.bench.chaos_load import Probes
from polyserve.bench.chaos_run import misses

pytestmark = pytest.mark.unit


def sse(*texts: str, finish: str | None = "length", done: bool = True, error: str = "") -> bytes:
    lines = [f"data: {json.dumps({'id': 'cmpl-1', 'choices': [{'text': t, 'finish_reason': None}]})}"
             for t in texts]
    if finish:
        lines.append(f"data: {json.dumps({'id': 'cmpl-1', 'choices': [{'text': '', 'finish_reason': finish}]})}")
    if error:
        lines.append(f"data: {json.dumps({'error': {'message': error}})}")
    if done:
        lines.append("data: [DONE]")
    return "\n\n".join(lines).encode()


@pytest.mark.parametrize("body, kind", [
    (sse("a", " b", " c"), "ok"),
    (sse("a", " b"), "short"),  # [DONE] after 2 of 3 tokens: the silent loss
    (sse("a", " b", " c", finish=None), "short"),  # no finish_reason before [DONE]
    (sse("a", error="worker died", done=False), "error"),
    (sse("a", " b", " c", finish=None, done=False), "error"),  # cut: no [DONE]
])
def test_a_stream_is_judged_by_its_tokens_and_its_end(body, kind):
    res: dict = {"kind": "error"}
    chaos_burst._judge(res, body, 3)
    assert res["kind"] == kind
    assert res["rid"] == "cmpl-1"  # the request id the events carry


def test_recovery_is_the_first_good_probe_after_the_last_bad_one():
    p = Probes("http://x", "m", since=100.0)
    assert p.recovery_s() == 0.0  # nothing disrupted
    p.log = [(100.0, 100.1, True), (100.2, 105.2, False), (105.3, 105.4, False), (105.5, 106.0, True),
             (106.2, 106.3, True)]
    assert p.recovery_s() == 6.0 and p.disrupted() == 2
    p.log.append((106.5, 111.5, False))
    assert p.recovery_s() is None  # still down at the end
    assert p._good_run() == 0.0


def _row(**kw) -> dict:
    row = {"short": 0, "hung": 0, "no_terminal": [], "recovery_s": 0.0, "ok_rate_others": 1.0}
    row.update(kw)
    return row


def test_a_row_lists_every_target_it_misses():
    assert misses(_row()) == []
    got = misses(_row(short=2, hung=1, no_terminal=["r1"], recovery_s=12.5, ok_rate_others=0.95))
    assert got == ["2 short", "1 hung", "1 without a terminal event", "recovery 12.5s > 10s", "ok 95.0% < 99%"]
    assert misses(_row(recovery_s=None)) == ["recovery never > 10s"]
    ov = {"admitted_over_budget": 3, "budget_s": 10.0, "429_without_retry_after": 1, "other_errors": 2}
    assert misses(_row(overload=ov)) == ["3 admitted past 10s or failed", "1 429 without Retry-After",
                                         "2 errors other than 429"]
