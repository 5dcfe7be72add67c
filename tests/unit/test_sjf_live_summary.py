"""`polyserve bench sjf-live`'s summary over repeats (sjf_live.summarise): means of the repeats'
means, the oracle's share from those means with the per-repeat range, P99 of the pooled requests."""
from __future__ import annotations

import pytest

from polyserve.bench.sjf_live import summarise


def _run(repeat, order, jct):
    return {"repeat": repeat, "load": 1.0, "order": order, "mean_s": sum(jct) / len(jct), "jct": jct}


def test_share_is_taken_from_the_means_over_repeats_with_the_per_repeat_range():
    runs = [_run(0, "fcfs", [2.0] * 10), _run(0, "oracle", [1.0] * 10), _run(0, "ssjf", [1.5] * 10),
            _run(1, "fcfs", [4.0] * 10), _run(1, "oracle", [2.0] * 10), _run(1, "ssjf", [2.2] * 10)]
    rows = {r["order"]: r for r in summarise(runs, [1.0], ["fcfs", "ssjf", "oracle"])}
    assert rows["fcfs"]["mean_s"] == pytest.approx(3.0) and rows["oracle"]["mean_s"] == pytest.approx(1.5)
    # means 3.0 / 1.85 / 1.5: (3.0 - 1.85) / (3.0 - 1.5); per repeat 0.5 and 0.9
    assert rows["ssjf"]["share"] == pytest.approx(1.15 / 1.5)
    assert (rows["ssjf"]["share_min"], rows["ssjf"]["share_max"]) == (pytest.approx(0.5), pytest.approx(0.9))
    assert rows["ssjf"]["vs_fcfs"] == pytest.approx(1.85 / 3.0 - 1)
    assert rows["fcfs"]["p99_vs_fcfs"] == pytest.approx(1.0) and rows["oracle"]["share"] == pytest.approx(1.0)


def test_pooled_p99_sees_a_tail_that_one_repeat_alone_hides():
    runs = [_run(0, "fcfs", [1.0] * 99 + [1.0]), _run(1, "fcfs", [1.0] * 90 + [9.0] * 10),
            _run(0, "oracle", [0.5] * 100), _run(1, "oracle", [0.5] * 100)]
    rows = {r["order"]: r for r in summarise(runs, [1.0], ["fcfs", "oracle"])}
    assert rows["fcfs"]["p99_s"] == pytest.approx(9.0)
    assert rows["oracle"]["p99_vs_fcfs"] == pytest.approx(0.5 / 9.0)


def test_no_share_without_an_oracle_cut():
    runs = [_run(0, "fcfs", [1.0] * 10), _run(0, "oracle", [1.2] * 10)]
    rows = summarise(runs, [1.0], ["fcfs", "oracle"])
    assert all(r["share"] is None for r in rows)
