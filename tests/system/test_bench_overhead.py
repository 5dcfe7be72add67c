"""`polyserve bench overhead` and its probes (issue 15) run end to end on a tiny load: the real
CLI, a real cluster (`polyserve up` internals) and the bare endpoint, side by side."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyserve.bench import overhead_probe

pytestmark = pytest.mark.system


def test_bench_overhead_reports_both_sides_and_the_cpu_by_role(tmp_path):
    out = tmp_path / "ov.json"
    run = subprocess.run([sys.executable, "-m", "polyserve.cli", "bench", "overhead", "--requests", "20",
                          "--concurrency", "2", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    for case in ("json-c2", "stream-c2"):
        cell = data["results"][case]
        assert cell["bare"]["n"] == cell["polyserve"]["n"] == 20
        cpu = data["cpu_ms_per_request"][case]
        assert cpu["gateway"] > 0 and cpu["worker"] > 0
    # the default policy is placed in the gateway: no dispatcher hop in the per-stage medians
    assert data["stages"]["dispatch_ms"] == 0.0


def test_split_probe_accounts_for_every_segment(capsys):
    assert overhead_probe.main(["split", "--requests", "10"]) == 0
    lines = capsys.readouterr().out
    for name, _, _ in overhead_probe.SEGMENTS:
        assert name in lines
    total = float(lines.split("total")[1].split("p50")[1].split("ms")[0])
    assert 0 < total < 1000


def test_messages_probe_counts_every_service_per_request(capsys):
    """`overhead_probe msgs`: nats-server's own counters per connection; the gateway publishes
    at least the generate request and the `completed` event of each request, the worker at least
    its acceptance, a chunk and the done chunk."""
    assert overhead_probe.main(["msgs", "--requests", "30"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]
            if len(line.split()) >= 3}
    pub = {name: float(v[0]) for name, v in rows.items() if v[0].replace(".", "").isdigit()}
    assert pub["gateway"] >= 2 and pub["worker"] >= 3, rows
    assert {"predictor", "dispatcher", "planner", "gpu-agent"} <= set(pub), rows
