"""The worker merges a non-streamed request's deltas (services/worker/merge.py): fewer chunks,
the same text, tokens, logprobs and finish reasons; a choice's first and last delta go at once."""
from __future__ import annotations

import time

from polyserve.proto import TokenLogprob
from polyserve.worker.engine import Delta
from polyserve.worker.merge import Merger


def lp(tok: str) -> TokenLogprob:
    return TokenLogprob(token=tok, logprob=-1.0)


def deltas(n: int, index: int = 0) -> list[Delta]:
    out = [Delta(index, f" w{i}", 1, logprobs=[lp(f"w{i}")]) for i in range(n)]
    out[0].prompt_logprobs = [lp("p")]
    out[-1].finish_reason = "length"
    return out


def run(m: Merger, ds: list[Delta]) -> list[Delta]:
    sent = [x for d in ds for x in m.add(d)]
    return sent + m.flush()


def test_merges_all_but_the_first_within_the_interval():
    sent = run(Merger(60.0), deltas(16))
    assert len(sent) == 2  # the first at once, the other 15 with the finish reason
    assert "".join(d.text for d in sent) == "".join(f" w{i}" for i in range(16))
    assert sum(d.tokens for d in sent) == 16
    assert [t.token for d in sent for t in d.logprobs] == [f"w{i}" for i in range(16)]
    assert sent[0].prompt_logprobs == [lp("p")] and sent[1].prompt_logprobs is None
    assert [d.finish_reason for d in sent] == [None, "length"]


def test_zero_interval_sends_every_delta():
    ds = deltas(5)
    assert run(Merger(0.0), ds) == ds


def test_choices_merge_separately_and_keep_their_order():
    a, b = deltas(4, 0), deltas(3, 1)
    sent = run(Merger(60.0), [a[0], b[0], a[1], b[1], a[2], b[2], a[3]])
    for i, ds in ((0, a), (1, b)):
        mine = [d for d in sent if d.index == i]
        assert "".join(d.text for d in mine) == "".join(d.text for d in ds)
        assert mine[0].text == ds[0].text  # each choice's first delta at once
        assert mine[-1].finish_reason == "length"


def test_an_elapsed_interval_sends_what_is_held():
    m = Merger(0.0001)
    ds = deltas(3)
    ds[-1].finish_reason = None
    assert m.add(ds[0]) == [ds[0]]
    time.sleep(0.001)
    assert [d.text for d in m.add(ds[1])] == [ds[1].text]  # held past the interval: sent with this one
    assert m.flush() == []


def test_hold_last_keeps_the_finishing_delta_for_the_done_chunk():
    m = Merger(60.0, hold_last=True)
    ds = deltas(16)
    sent = [x for d in ds for x in m.add(d)]
    assert [d.text for d in sent] == [" w0"]  # only the first at once
    tail = m.flush()
    assert len(tail) == 1 and tail[0].finish_reason == "length" and tail[0].tokens == 15
    one = Merger(60.0, hold_last=True)
    assert one.add(Delta(0, "x", 1, finish_reason="stop")) == []  # a one-token answer: all on the done chunk
    assert Merger(0.0, hold_last=True).add(ds[-1]) == [ds[-1]]  # no merging: nothing held


def test_merged_deltas_keep_every_token_id_in_order():
    ds = deltas(6)
    for i, d in enumerate(ds):
        d.token_ids = [100 + i]
    ds[0].prompt_token_ids = [1, 2, 3]
    sent = run(Merger(60.0), ds)
    assert [t for d in sent for t in d.token_ids] == list(range(100, 106))
    assert sent[0].prompt_token_ids == [1, 2, 3]
