"""`polyserve up --config FILE` refuses out-of-range numbers (issue 14), naming the field, its line
and the range, with the same bounds as POST /v1/deployments (core/bounds.py)."""
from __future__ import annotations

import pytest

from polyserve.core import bounds
from polyserve.planner.reconcile import ConfigError, parse_desired_state

GOOD = """deployments:
  - model: m
    scaler: {min_replicas: 0, max_replicas: 1024, window_s: 1, threshold_ms: 600000}
    ttft_slo_ms: 0.1
    atgt_slo_ms: 60000
"""


def test_values_at_the_bounds_are_accepted():
    dep = parse_desired_state(GOOD, "d.yaml").deployments[0]
    assert dep.scaler.max_replicas == bounds.REPLICAS_MAX and dep.atgt_slo_ms == 60000


@pytest.mark.parametrize("field,line,value,message", [
    ("scaler", 3, "{min_replicas: 1000000000, max_replicas: 1000000000}",
     "deployments[0].scaler.max_replicas: must be an integer within 1..1024 (got 1000000000)"),
    ("scaler", 3, "{max_replicas: 1025}", "deployments[0].scaler.max_replicas: must be an integer within 1..1024"),
    ("scaler", 3, "{window_s: 0.5}", "deployments[0].scaler.window_s: must be a number within 1..86400 (got 0.5)"),
    ("scaler", 3, "{threshold_ms: 600001}", "deployments[0].scaler.threshold_ms: must be a number within 0.1..600000"),
    ("ttft_slo_ms", 3, "700000.0", "deployments[0].ttft_slo_ms: must be a number within 0.1..600000"),
    ("atgt_slo_ms", 3, "0.001", "deployments[0].atgt_slo_ms: must be a number within 0.01..60000 (got 0.001)"),
])
def test_out_of_range_values_are_refused_naming_field_and_range(field, line, value, message):
    with pytest.raises(ConfigError) as err:
        parse_desired_state(f"deployments:\n  - model: m\n    {field}: {value}\n", "d.yaml")
    assert f"d.yaml:{line}: {message}" in str(err.value)
