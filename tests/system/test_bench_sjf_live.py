"""`polyserve bench sjf-live` runs end to end on a tiny workload: the real CLI, a live `hf`
engine per order in a process of its own, the trace's lengths forced on each request."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from polyserve.bench import sjf_live

pytestmark = [pytest.mark.system, pytest.mark.torch]


def test_workload_scales_the_trace_and_carries_predictions():
    ap = argparse.ArgumentParser()
    sjf_live.add_arguments(ap)
    wl = sjf_live.workload(ap.parse_args(["--requests", "50", "--max-tokens", "64"]))
    assert len(wl["lengths"]) == len(wl["predicted"]) == len(wl["gaps"]) == 50
    assert 1 <= min(wl["lengths"]) and max(wl["lengths"]) <= 64
    assert all(p > 0 for p in wl["predicted"]) and set(wl["classes"]) <= set(range(5))


def test_bench_sjf_live_serves_every_request_once_per_order(tmp_path):
    out = tmp_path / "sjf.json"
    run = subprocess.run([sys.executable, "-m", "polyserve.cli", "bench", "sjf-live", "--requests", "12",
                          "--max-tokens", "8", "--loads", "0.9", "--orders", "fcfs", "oracle", "ssjf_true",
                          "--repeats", "2", "--arch",
                          json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}),
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["capacity_rps"]) == 2 and min(data["capacity_rps"]) > 0
    assert [r["order"] for r in data["rows"]] == ["fcfs", "oracle", "ssjf_true"]
    assert all(r["repeats"] == 2 and 0 < r["mean_s"] <= r["p99_s"] for r in data["rows"])
    assert sorted((r["seed"], r["order"]) for r in data["runs"]) == \
        [(s, o) for s in (0, 1) for o in sorted(["fcfs", "oracle", "ssjf_true"])]
    assert "share of oracle's cut" in run.stdout
