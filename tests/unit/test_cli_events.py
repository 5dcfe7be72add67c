"""`polyserve events --since`: its durations and the stored messages' times as JetStream and
nats-py write them (the history itself: tests/system/test_cluster.py, as the operator's user)."""
from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from polyserve.cli.events import _stamp, duration_s

pytestmark = pytest.mark.unit


def test_durations_and_their_errors():
    assert [duration_s(x) for x in ("90", "90s", "15m", "2h", "1d", "1.5m")] == [90, 90, 900, 7200, 86400, 90]
    for bad in ("soon", "-5m", "5 minutes", ""):
        with pytest.raises(ValueError, match="15m"):
            duration_s(bad)


@pytest.mark.parametrize("raw", ["2026-11-27T20:31:03.25+00:00", "2026-11-27T20:31:03.250000123Z",
                                 datetime(2026, 11, 27, 20, 31, 3, 250000, tzinfo=timezone.utc)])
def test_message_times_in_every_form_read_alike(raw):
    want = datetime(2026, 11, 27, 20, 31, 3, 250000, tzinfo=timezone.utc).timestamp()
    assert _stamp(SimpleNamespace(time=raw)) == pytest.approx(want, abs=1e-6)
