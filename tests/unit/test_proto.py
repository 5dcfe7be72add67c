import msgspec
import pytest

from polyserve.proto import AnyEvent, Completed, Heartbeat, Subjects
from polyserve.proto.schema import drift

pytestmark = pytest.mark.unit


def test_generated_schemas_match_the_code():
    assert drift() == [], "run `python -m polyserve.proto.schema` and commit proto/v1/"


def test_events_round_trip_with_their_tag():
    ev = Completed(request_id="r", worker_id="w", input_tokens=3, output_tokens=4, e2e_ms=1.0, ttft_ms=0.5)
    raw = msgspec.json.encode(ev)
    assert b'"event":"completed"' in raw
    assert msgspec.json.decode(raw, type=AnyEvent) == ev
    hb = msgspec.json.decode(msgspec.json.encode(Heartbeat(worker_id="w", deployment="d", model="m",
                                                           engine="sim")), type=AnyEvent)
    assert isinstance(hb, Heartbeat)


def test_subjects_are_versioned_and_prefixed():
    s = Subjects("px")
    assert s.predict == "px.v1.predict"
    assert s.event("completed") == "px.v1.events.request.completed"
    assert s.gpu_telemetry("gpu0") == "px.v1.telemetry.gpu.gpu0"
