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
                          "--concurrency", "2", "--repeats", "2", "--json", str(out)], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    for case in ("json-c2", "stream-c2"):
        cell = data["results"][case]
        assert cell["bare"]["n"] == cell["polyserve"]["n"] == 20
        # --repeats 2: two back-to-back pairs, each with its ratio; the table shows each side's median run
        assert len(cell["pairs"]) == 2 and all(p["ratio"] == p["polyserve_rps"] / p["bare_rps"] for p in cell["pairs"])
        assert cell["polyserve"]["rps"] in {p["polyserve_rps"] for p in cell["pairs"]}
        cpu = data["cpu_ms_per_request"][case]
        assert cpu["gateway"] > 0 and cpu["worker"] > 0
    assert "pairs per case" in run.stdout and "median" in run.stdout
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
    at least the generate request of each request (its events travel in batches: shared/
    batching.py), the worker at least its acceptance, a chunk and the done chunk."""
    assert overhead_probe.main(["msgs", "--requests", "30"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]
            if len(line.split()) >= 3}
    pub = {name: float(v[0]) for name, v in rows.items() if v[0].replace(".", "").isdigit()}
    assert pub["gateway"] >= 1 and pub["worker"] >= 3, rows
    assert {"predictor", "dispatcher", "planner", "gpu-agent"} <= set(pub), rows


def test_summary_names_each_sample_by_its_deepest_component(tmp_path, capsys):
    """`overhead_probe summary`: a sample goes to the deepest frame that names a component; a
    stream write counts as the NATS client's only under nats-py's flusher."""
    loop = "Runner.run (asyncio/runners.py:118)"
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        f"{loop};Client._flusher (nats/aio/client.py:2100);StreamWriter.writelines (asyncio/streams.py:346) 6",
        f"{loop};Client._read_loop (nats/aio/client.py:2200);StreamReader.read (asyncio/streams.py:700) 2",
        f"{loop};Starlette.__call__ (starlette/applications.py:96);serve (services/gateway/completions.py:80);"
        "RequestRun._start (services/gateway/handlers.py:150) 1",
        f"{loop} 1",
    ]) + "\n")
    shares = overhead_probe.summary([str(raw)])[str(raw)]
    assert shares["samples"] == 10
    assert shares["NATS client: socket writes"] == 0.6
    assert shares["nats-py (read loop, parse, publish)"] == 0.2
    assert shares["RequestRun: relay, order, credits"] == 0.1 and shares[overhead_probe.OTHER] == 0.1
    assert overhead_probe.main(["summary", str(raw)]) == 0
    assert "NATS client: socket writes" in capsys.readouterr().out


def test_bench_overhead_with_several_clients_workers_and_gateways(tmp_path):
    """--clients K splits the load over K processes (their CPU counted as the load generator's),
    --workers W starts W sim workers and waits for them, --gateways 1 2 adds the scale-out table."""
    out = tmp_path / "ov.json"
    run = subprocess.run([sys.executable, "-m", "polyserve.cli", "bench", "overhead", "--requests", "24",
                          "--concurrency", "4", "--clients", "2", "--workers", "2", "--gateways", "1", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["by_gateways"]) == {"1", "2"}
    for n, runs in data["by_gateways"].items():
        assert runs["workers"] == 2, n
        for case in ("json-c4", "stream-c4"):
            assert runs["results"][case]["polyserve"]["n"] == 24
            assert runs["cpu_ms_per_request"][case]["load generator"] > 0
    assert data["results"]["json-c4"]["bare"]["n"] == 24
    assert data["bare_cpu_ms_per_request"]["json-c4"]["load generator"] > 0
    assert "scale-out: polyserve requests/s by gateway processes" in run.stdout


def test_bench_overhead_refuses_counts_below_one():
    for flag in ("--clients", "--workers", "--gateways", "--concurrency"):
        run = subprocess.run([sys.executable, "-m", "polyserve.cli", "bench", "overhead", flag, "0"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode != 0 and "of at least 1" in run.stderr + run.stdout, (flag, run.stderr[-500:])
