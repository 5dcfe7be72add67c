"""Events of one subject sent together as one message (shared/batching.py, issue 15)."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from polyserve.gateway.predict_batch import PredictBatcher
from polyserve.proto import PredictRequest
from polyserve.shared import batching, durable

pytestmark = pytest.mark.unit


def _ev(kind: str, i: int) -> bytes:
    return msgspec.json.encode({"event": kind, "request_id": f"r{i}"})


def test_one_event_stays_an_object_and_several_become_an_array():
    one, two = _ev("completed", 1), _ev("completed", 2)
    assert batching.join([one]) == one and not batching.is_batch(one)
    both = batching.join([one, two])
    assert batching.is_batch(both)
    assert [e["request_id"] for e in batching.event_dicts(both)] == ["r1", "r2"]
    assert batching.event_dicts(one) == [{"event": "completed", "request_id": "r1"}]
    assert batching.event_dicts(b"not json") == [] and batching.event_dicts(b"3") == []


def test_pending_groups_by_subject_and_sends_terminal_events_last():
    p = batching.Pending(0.01)
    done, pred = "x.v1.events.request.completed", "x.v1.events.request.predicted"
    p.add(done, _ev("completed", 0))  # a terminal event first ...
    p.add(pred, _ev("predicted", 1))
    p.add(pred, _ev("predicted", 0))
    p.add(done, _ev("completed", 1))
    out = p.take(durable.prefix_of)
    assert [s for s, _ in out] == [pred, done], "... still leaves after every other event of the send"
    assert [[e["request_id"] for e in batching.event_dicts(d)] for _, d in out] == [["r1", "r0"], ["r0", "r1"]]
    assert not p


def test_without_a_window_every_event_is_its_own_message():
    p = batching.Pending(0.0)
    for i in range(3):
        p.add("s", _ev("admitted", i))
    out = p.take(durable.prefix_of)
    assert [s for s, _ in out] == ["s", "s", "s"] and not any(batching.is_batch(d) for _, d in out)


def test_a_payload_that_is_not_an_object_is_never_joined():
    p = batching.Pending(0.01)
    p.add("s", b"[1,2]")
    p.add("s", _ev("admitted", 0))
    p.add("s", b"[3]")
    assert [d for _, d in p.take(durable.prefix_of)] == [b"[1,2]", _ev("admitted", 0), b"[3]"]


def test_a_lone_event_waits_the_short_window_and_a_busy_flow_the_batch_window():
    p = batching.Pending(0.05)
    assert p.delay() == batching.COALESCE_S, "quiet: at most 2 ms"
    p.add("s", _ev("admitted", 0))
    p.take(durable.prefix_of)
    assert 0.04 < p.delay() <= 0.05, "right after a send: until one window after it"


def test_the_window_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("POLYSERVE_EVENT_BATCH_MS", "0")
    assert batching.batch_window_s() == 0.0
    monkeypatch.setenv("POLYSERVE_EVENT_BATCH_MS", "25")
    assert batching.batch_window_s() == 0.025
    monkeypatch.setenv("POLYSERVE_EVENT_BATCH_MS", "ten")
    assert batching.batch_window_s() == batching.BATCH_S
    monkeypatch.delenv("POLYSERVE_EVENT_BATCH_MS")
    assert batching.batch_window_s() == batching.BATCH_S


def test_a_large_burst_is_cut_into_messages_below_the_size_cap(monkeypatch):
    monkeypatch.setattr(batching, "MAX_BYTES", 100)
    p = batching.Pending(0.01)
    for i in range(10):
        p.add("s", _ev("failed", i))  # ~40 bytes each
    out = p.take(durable.prefix_of)
    assert len(out) > 1 and all(len(d) <= 100 for _, d in out)
    ids = [e["request_id"] for _, d in out for e in batching.event_dicts(d)]
    assert ids == [f"r{i}" for i in range(10)], "every event once, in order"


async def test_prediction_batches_follow_the_same_cadence(monkeypatch):
    """gateway/predict_batch.py: a lone prediction after a quiet spell is asked within the short
    delay, not a whole window later; while requests keep coming the next batch waits until one
    window after the previous; window 0 asks at once."""
    sent: list[tuple[float, int]] = []

    class Gs:
        def spawn(self, coro):
            coro.close()  # the batch's own send is tested with a real predictor elsewhere

    def record(self, batch):
        sent.append((time.monotonic(), len(batch)))
        return original(self, batch)

    original = PredictBatcher._send
    monkeypatch.setattr(PredictBatcher, "_send", record)
    b = PredictBatcher(Gs(), window_s=0.3)
    t0 = time.monotonic()
    b.ask(PredictRequest(request_id="a", model="m", input_tokens=1))
    await asyncio.sleep(0.1)
    assert len(sent) == 1 and sent[0][0] - t0 < 0.08, "a lone prediction waits the short delay only"
    b.ask(PredictRequest(request_id="b", model="m", input_tokens=1))
    b.ask(PredictRequest(request_id="c", model="m", input_tokens=1))
    await asyncio.sleep(0.1)
    assert len(sent) == 1, "busy: the next batch waits for the window"
    await asyncio.sleep(0.3)
    assert len(sent) == 2 and sent[1][1] == 2 and sent[1][0] - sent[0][0] >= 0.29
    now = PredictBatcher(Gs(), window_s=0.0)
    now.ask(PredictRequest(request_id="d", model="m", input_tokens=1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(sent) == 3, "window 0: asked at once"


def test_a_send_keeps_each_requests_events_in_lifecycle_order():
    """One send may hold an earlier request's first_token before this request's admitted: the
    subjects go by the request's lifecycle, not first-seen, so r1's first_token cannot overtake
    its admitted; terminal events still last, other subjects between."""
    p = batching.Pending(0.05)
    ev = "x.v1.events.request."
    p.add(ev + "first_token", _ev("first_token", 0))
    p.add(ev + "completed", _ev("completed", 0))
    p.add(ev + "admitted", _ev("admitted", 1))
    p.add("x.v1.events.other", _ev("other", 1))
    p.add(ev + "dispatched", _ev("dispatched", 1))
    p.add(ev + "first_token", _ev("first_token", 1))
    p.add(ev + "predicted", _ev("predicted", 1))
    sent = [(e["event"], e["request_id"]) for _, d in p.take(durable.prefix_of) for e in batching.event_dicts(d)]
    r1 = [k for k, r in sent if r == "r1"]
    assert r1 == ["admitted", "predicted", "dispatched", "first_token", "other"], sent
    assert sent[-1] == ("completed", "r0")
