"""`polyserve bench replay` against a live gateway (real NATS/Redis, predictor, dispatcher,
sim worker): the row has the simulator's keys, sends are open-loop, errors are counted."""
from __future__ import annotations

import argparse

import pytest

from polyserve.bench import replay as br
from polyserve.core.perf import load_perf
from polyserve.simulator import report
from polyserve.simulator.cluster import SimConfig, simulate
from polyserve.simulator.trace import from_requests
from polyserve.worker.engines.sim import DEFAULT_PROFILE
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration


def write_trace(path, rows) -> str:
    """Azure LLM trace CSV of (offset seconds, input tokens, output tokens)."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 10:00:{s:09.6f},{i},{o}" for s, i, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def args(url: str, trace: str, tmp_path, **kw) -> argparse.Namespace:
    base = {"url": url, "model": MODEL, "trace": trace, "rate_scale": 1.0, "slice": "", "duration": None,
            "max_requests": 0, "prompts": "synthetic", "tokenizer": "auto", "ttft_slo_ms": 1600.0,
            "atgt_slo_ms": 75.0, "timeout": 20.0, "simulate": "", "workers": 1, "max_batch": 64, "seed": 0,
            "out": str(tmp_path / "out"), "no_plots": True, "progress": False}
    base.update(kw)
    return argparse.Namespace(**base)


async def test_replay_row_has_the_simulators_keys(plane, tmp_path):
    rows = [(0.0, 40, 6), (0.2, 25, 4), (0.4, 60, 8), (0.6, 13, 3), (0.8, 33, 5)]
    trace = write_trace(tmp_path / "t.csv", rows)
    async with plane() as p:
        res = await br.run(args(p.url, trace, tmp_path, simulate=str(DEFAULT_PROFILE)))
    live, sim = res["rows"]
    real_sim = report.metrics(simulate(from_requests([(s, i, o) for s, i, o in rows]), load_perf(DEFAULT_PROFILE)[0],
                                       SimConfig()))
    assert set(real_sim) <= set(live) and set(real_sim) <= set(sim)
    assert live["label"] == "live" and live["simulated"] is False and sim["simulated"] is True
    assert live["requests"] == live["completed"] == 5 and live["rejected"] == 0 and live["errors"] == {}
    for r, (_, i, o) in zip(res["requests"], rows):
        assert r.completion_tokens == o  # max_tokens = min_tokens = the trace's output length
        assert i - 1 <= r.prompt_tokens <= i  # the sim engine's own count of the synthesised prompt
        assert 0 < r.ttft_ms <= r.e2e_ms
    text = br.table(res["rows"], "t")
    assert "live (measured)" in text and "simulator (SIMULATED)" in text


async def test_requests_are_sent_open_loop(plane, tmp_path):
    # the first request decodes for about a second; the others must not wait for it
    rows = [(0.0, 20, 120), (0.25, 20, 2), (0.5, 20, 2), (0.75, 20, 2)]
    trace = br.load_trace(write_trace(tmp_path / "t.csv", rows))
    async with plane(worker_kw={"time_scale": 0.25}) as p:
        tok = br.WordsTokenizer(exact=True)
        reqs = await br.replay(p.url, MODEL, trace, br.make_prompts(trace.input_len, "synthetic", tok),
                               progress=False, timeout_s=20)
    assert not any(r.error for r in reqs)
    first_done = reqs[0].sent_s + reqs[0].e2e_ms / 1e3
    assert first_done > 0.9
    for r in reqs:
        assert abs(r.sent_s - r.arrival_s) < 0.1, (r.sent_s, r.arrival_s)
    assert all(r.sent_s < first_done for r in reqs[1:])


async def test_errors_are_counted_not_fatal(plane, tmp_path):
    # 5000 output tokens: over the gateway's max_tokens limit; 300 input tokens: over the worker's limit
    rows = [(0.0, 20, 3), (0.1, 20, 5000), (0.2, 300, 3), (0.3, 20, 3)]
    trace = write_trace(tmp_path / "t.csv", rows)
    async with plane(worker_kw={"max_input_len": 100}) as p:
        res = await br.run(args(p.url, trace, tmp_path))
    live = res["rows"][0]
    assert live["requests"] == 4 and live["completed"] == 2 and live["rejected"] == 2
    # the gateway refuses max_tokens 5000 (400); no worker takes a 300-token prompt (400 or 503)
    assert live["errors"].get("http 400", 0) >= 1 and sum(live["errors"].values()) == 2
    assert "max_tokens" in res["requests"][1].error and res["requests"][2].error.startswith("http ")
    assert [bool(r.error) for r in res["requests"]] == [False, True, True, False]


async def test_unknown_model_and_bad_flags(plane, tmp_path):
    trace = write_trace(tmp_path / "t.csv", [(0.0, 10, 2)])
    async with plane() as p:
        with pytest.raises(br.ReplayError, match="not served.*sim-test"):
            await br.run(args(p.url, trace, tmp_path, model="nope"))
    with pytest.raises(br.ReplayError, match="--url"):
        await br.run(args("localhost:8000", trace, tmp_path))
    with pytest.raises(br.ReplayError, match="cannot reach the gateway"):
        await br.run(args("http://127.0.0.1:9", trace, tmp_path))
