"""Simulator honesty and the SJF experiment's parts: the context window (reject / truncate,
counted), prefill beyond the profiled range (flagged), --search-gpus saying "target not
reached", the predictor model (the artifact's measured OOD confusion or a named fallback;
a trace's own predictions), the new traces (Mooncake, ServeGen, µ-Serve's predictions)
and the SSJF rules in the simulator."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyserve.core.perf import PerfModel, WorkerPerf
from polyserve.simulator import cluster, report, sjf_experiment
from polyserve.simulator.cli import _search
from polyserve.simulator.cli import main as cli_main
from polyserve.simulator.engine import WorkerConfig
from polyserve.simulator.limits import context_limit, profiled_prompt_tokens
from polyserve.simulator.predictor import META_ENV, LengthPredictor, resolve_confusion
from polyserve.simulator.trace import Trace, from_requests, load_trace, window

pytestmark = pytest.mark.unit

PERF = WorkerPerf(base=PerfModel(k1=1.0, c1=10.0, k2=0.0, c2=2.0, c3=5.0))


def _run(reqs, **cfg):
    c = cluster.SimConfig(workers=1, worker=WorkerConfig(max_batch=4, kv_capacity=1_000_000), **cfg)
    return cluster.simulate(from_requests(reqs), PERF, c)


def test_context_limit_rejects_or_truncates_and_counts_each():
    reqs = [(0.0, 100, 10), (0.1, 5000, 10), (0.2, 4000, 500)]
    res = _run(reqs, context_limit=4096)
    rej = [r for r in res.requests if r.rejected]
    assert len(rej) == 1 and "context limit 4096" in rej[0].rejected and rej[0].input_len == 5000
    assert res.counters["over_context_rejected"] == 1 and res.counters["rejected"] == 1
    capped = next(r for r in res.requests if r.idx == 2)
    assert capped.output_len == 96 and res.counters["output_capped"] == 1 and capped.finish > 0
    res = _run(reqs, context_limit=4096, over_context="truncate")
    assert not any(r.rejected for r in res.requests) and res.counters["prompt_truncated"] == 1
    assert max(r.input_len + r.output_len for r in res.requests) <= 4096
    assert "over_context_rejected" not in _run(reqs).counters  # 0 = no limit
    with pytest.raises(ValueError, match="over_context"):
        _run(reqs, over_context="drop")


def test_prefill_beyond_the_profiled_range_is_counted_and_reported(tmp_path: Path):
    res = _run([(0.0, 100, 5), (0.1, 9000, 5), (0.2, 20000, 5)], profiled_prefill_tokens=8192)
    assert res.counters["prefill_extrapolated"] == 2
    src = tmp_path / "rows.csv"
    src.write_text("model,hardware,tensor_parallel,prompt_size\nm,h,4,128\nm,h,4,8192\nm,h,8,16384\n")
    raw = {"model": "llama2-70b", "source": {"file": "rows.csv", "filter": {"model": "m", "tensor_parallel": 4}}}
    assert profiled_prompt_tokens(raw, tmp_path)[0] == 8192
    assert context_limit(raw) == (4096, "llama2-70b's published context window")
    assert context_limit({"model": "x", "context_tokens": 32768})[0] == 32768
    assert context_limit({"model": "x"})[0] == 0


def test_search_gpus_says_target_not_reached(tmp_path: Path):
    trace = from_requests([(k * 0.01, 200, 50) for k in range(200)])
    cfg = cluster.SimConfig(workers=1, ttft_slo_ms=50.0, atgt_slo_ms=1.0,
                            worker=WorkerConfig(max_batch=2, kv_capacity=100_000))
    res, m, n = _search(trace, PERF, cfg, 0.99, 2)
    assert m["target_reached"] is False and n == 2
    m.update(label="x", workers=n)
    assert "NOT REACHED" in report.table([m])
    easy = from_requests([(k * 1.0, 20, 5) for k in range(20)])
    ok = _search(easy, PERF, cluster.SimConfig(workers=1, worker=WorkerConfig(max_batch=64, kv_capacity=10**6)),
                 0.5, 8)[1]
    assert ok["target_reached"] is True and "NOT REACHED" not in report.table([{**ok, "label": "y"}])


def test_predictor_model_is_the_artifacts_ood_confusion_or_a_named_fallback(tmp_path: Path, monkeypatch):
    meta = tmp_path / "meta.json"
    ood = [[0.5, 0.3, 0.2, 0.0], [0.2, 0.5, 0.2, 0.1], [0.1, 0.2, 0.5, 0.2], [0.0, 0.2, 0.3, 0.5]]
    meta.write_text(json.dumps({"format": 1, "ood_confusion": ood}))
    monkeypatch.setenv(META_ENV, str(meta))
    m, name = resolve_confusion(None)
    assert m.shape == (4, 4) and np.allclose(m.sum(axis=1), 1) and "measured OOD confusion" in name
    out = np.arange(1, 1001)
    pred = LengthPredictor("confusion", out, confusion=m)
    assert len(pred.bounds) == 3  # 4 classes: p25/p50/p75
    meta.write_text(json.dumps({"format": 1}))
    m, name = resolve_confusion(None)
    assert m.shape == (5, 5) and name.startswith("FALLBACK") and "no 'ood_confusion'" in name
    with pytest.raises(ValueError, match="ood_confusion"):
        resolve_confusion(meta)  # named explicitly: must have the key
    meta.write_text(json.dumps({"format": 1, "ood_confusion": None}))  # being re-recorded: not "measured"
    m, name = resolve_confusion(None)
    assert m.shape == (5, 5) and name.startswith("FALLBACK") and "measured" not in name
    with pytest.raises(ValueError, match="ood_confusion"):
        resolve_confusion(meta)
    # posterior tokens: E[true | predicted class], between the class means
    p = LengthPredictor("confusion", out, estimate="posterior", seed=3)
    tok, cls = p.precompute(out)
    assert all(tok[cls == c].min() == tok[cls == c].max() for c in set(cls.tolist()))
    assert tok[cls == 0][0] > p.class_tokens[0] and tok[cls == 4][0] < p.class_tokens[4]


def _muserve_csv(tmp_path: Path, n: int = 200) -> Path:
    rng = np.random.default_rng(0)
    rows = [",output_token_length,predicted_length,latency,model"]
    for k in range(n):
        out = int(rng.integers(1, 511))
        rows.append(f"{k},{out},{min(4, int(np.searchsorted([59, 148, 281, 500], out, side='right')))},0.01,v")
    p = tmp_path / "pred.csv"
    p.write_text("\n".join(rows) + "\n")
    return p


def test_real_predictor_uses_the_traces_own_predictions(tmp_path: Path):
    lengths = tmp_path / "az.csv"
    lengths.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,100,10\n"
                       "2023-11-16 18:00:01.0,300,20\n")
    tr = load_trace(f"muserve:{_muserve_csv(tmp_path)}:4", lengths)
    assert tr.predicted_class is not None and tr.class_bounds == (59, 148, 281, 500)
    assert set(tr.input_len.tolist()) <= {100, 300} and 2.5 < tr.rate < 6
    pred = LengthPredictor("real", tr.output_len, bounds=tr.class_bounds, given_classes=tr.predicted_class)
    tok, cls = pred.precompute(tr.output_len)
    assert (cls == tr.predicted_class).all()
    with pytest.raises(ValueError, match="carries predictions"):
        LengthPredictor("real", tr.output_len)
    out = tmp_path / "o"
    assert cli_main(["--trace", f"muserve:{_muserve_csv(tmp_path)}:4", "--synthetic-lengths", str(lengths),
                     "--predictor", "real", "--order", "ssjf", "--no-plots", "--out", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["predictor_model"][0].startswith("real: the trace's own predictions")
    assert "predictor model: real" in (out / "results.txt").read_text()
    assert cli_main(["--trace", str(lengths), "--predictor", "real", "--no-plots", "--out", str(out)]) == 2


def test_mooncake_and_servegen_traces(tmp_path: Path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"timestamp": 1000 * k, "input_length": 10 + k, "output_length": 5,
                                      "hash_ids": [k]}) + "\n" for k in range(20)))
    t = load_trace(mc)
    assert len(t) == 20 and t.arrival[-1] == 19.0 and t.input_len[3] == 13
    sg = tmp_path / "sg"
    sg.mkdir()
    (sg / "chunk-0-trace.csv").write_text("0,2.0,3.0,Gamma,0.111,4.5\n600,0,0,,0,0\n1200,1.0,1.5,Weibull,0.7,1.0\n")
    (sg / "chunk-0-dataset.json").write_text(json.dumps({"0": {"input_tokens": "{100: 0.5, 200: 0.5}",
                                                               "output_tokens": "{7: 1.0}"}}))
    t = load_trace(f"servegen:{sg}:0:1800")
    n_first = int((t.arrival < 600).sum())
    assert 900 < n_first < 1500 and (t.arrival[(t.arrival >= 600) & (t.arrival < 1200)].size == 0)
    assert set(t.input_len.tolist()) <= {100, 200} and set(t.output_len.tolist()) == {7}
    assert t.client is not None and set(t.client.tolist()) == {0}  # the sending client travels with it
    assert window(t, rate_scale=2.0).client.size == len(t)
    with pytest.raises(ValueError, match="no arrivals"):
        load_trace(f"servegen:{sg}:600:500")



def test_a_multimodal_servegen_prompt_is_its_text_and_image_tokens(tmp_path: Path):
    """ServeGen's mm-image windows have text/image/audio/video token PMFs, no input_tokens: each
    prompt is one draw of each summed (it was a KeyError: 'input_tokens'); a window with neither
    is refused with the fields it has."""
    sg = tmp_path / "mm"
    sg.mkdir()
    (sg / "chunk-0-trace.csv").write_text("0,2.0,1.0,Gamma,1.0,0.5\n")
    (sg / "chunk-0-dataset.json").write_text(json.dumps({"0": {
        "text_tokens": "{10: 0.5, 20: 0.5}", "image_tokens": "{1000: 1.0}", "audio_tokens": "{0: 1.0}",
        "video_tokens": "{0: 1.0}", "image_count": "{1: 1.0}", "output_tokens": "{30: 1.0}"}}))
    t = load_trace(f"servegen:{sg}:0:600")
    assert len(t) > 100 and set(t.input_len.tolist()) == {1010, 1020} and set(t.output_len.tolist()) == {30}
    (sg / "chunk-0-dataset.json").write_text(json.dumps({"0": {"prompt": "{5: 1.0}", "output_tokens": "{3: 1.0}"}}))
    with pytest.raises(ValueError, match="neither input_tokens.*it has: output_tokens, prompt"):
        load_trace(f"servegen:{sg}:0:600")

def test_ssjf_in_the_simulator_beats_fcfs_on_long_prompts_and_old_rule_is_kept():
    """One busy worker, a burst of long-prompt jobs with short ones behind: the size rule (prompt
    counted) serves the short ones first; FCFS does not; oracle (output only) ranks prompts as equal."""
    warm = [(10.0 * k, 3000 if k % 2 else 50, 5) for k in range(20)]  # the rule learns what is long
    burst = [(300 + 0.001 * k, 3000, 5) for k in range(6)] + [(300.01 + 0.001 * k, 50, 5) for k in range(6)]
    tr = from_requests(warm + burst)
    pred = LengthPredictor("oracle", tr.output_len)
    mean = {}
    for order in ("fcfs", "ssjf", "ssjf_class", "sjf_oracle"):
        cfg = cluster.SimConfig(workers=1, order=order, worker=WorkerConfig(max_batch=1, kv_capacity=10**6))
        res = cluster.simulate(tr, PERF, cfg, predictor=pred)
        mean[order] = np.mean([r.finish - r.arrival for r in res.requests if r.arrival >= 300])
    assert mean["ssjf"] < 0.8 * mean["fcfs"] and mean["ssjf"] < mean["sjf_oracle"]


def test_sjf_experiment_table(tmp_path: Path):
    rng = np.random.default_rng(1)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for k in range(300):
        rows.append(f"2023-11-16 18:{k // 60:02d}:{k % 60:02d}.000000,{rng.integers(50, 3000)},"
                    f"{rng.integers(2, 300)}")
    p = tmp_path / "t.csv"
    p.write_text("\n".join(rows) + "\n")
    assert sjf_experiment.main(["--trace", str(p), "--loads", "0.9,1.2", "--requests", "300",
                                "--out", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o" / "results.txt").read_text()
    assert text.count("| t |") == 2 and "predictor model:" in text and "saturation" in text
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    # no client ids in a CSV trace: the by-client variant is left out (its runs would be + refine's)
    assert {r["order"] for r in data["rows"]} == {"fcfs", "ssjf", "ssjf_refine", "sjf_oracle", "srpt_oracle"}
    assert "% of oracle SRPT's cut" in text and "% of oracle SJF's cut" in text
    with pytest.raises(SystemExit):
        sjf_experiment.main(["--trace", str(p), "--orders", "ssjf,sjf_oracle", "--out", str(tmp_path / "x")])



def test_sjf_experiment_takes_the_batch_size_the_prompt_weight_and_an_unguarded_ssjf(tmp_path: Path):
    rng = np.random.default_rng(2)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for k in range(200):
        rows.append(f"2023-11-16 18:{k // 60:02d}:{k % 60:02d}.000000,{rng.integers(50, 3000)},{rng.integers(2, 300)}")
    p = tmp_path / "t.csv"
    p.write_text("\n".join(rows) + "\n")
    means = {}
    for batch in (2, 64):
        out = tmp_path / f"b{batch}"
        assert sjf_experiment.main(["--trace", str(p), "--loads", "1.0", "--requests", "200", "--orders",
                                    "fcfs,ssjf,ssjf_guard,ssjf_noguard,sjf_oracle", "--max-batch", str(batch),
                                    "--input-weight", "0", "--out", str(out)]) == 0
        text = (out / "results.txt").read_text()
        assert f"max batch {batch};" in text and "input weight 0;" in text
        assert "overtake bound 0.15 of the completions of the last P99 JCT, tail guard off" in text
        data = json.loads((out / "results.json").read_text())
        # ssjf_guard, the earlier name of plain ssjf with the guard, runs ssjf
        assert {r["order"] for r in data["rows"]} == {"fcfs", "ssjf", "ssjf_noguard", "sjf_oracle"}
        assert "SSJF without guards" in text
        assert next(r for r in data["rows"] if r["order"] == "ssjf_noguard")["counters"]["overdue_promoted"] == 0
        means[batch] = next(r for r in data["rows"] if r["order"] == "fcfs")["saturation_rps"]
    assert means[2] < means[64]  # two slots saturate at a lower rate than 64



def test_the_first_burst_of_a_fresh_worker_is_not_held_for_the_cold_window():
    """A fresh worker (max batch 1) gets a burst with one long request behind a short one, then a
    stream of short ones that keeps its queue full. Keyed under the cold W (120 s), the long one
    sorted behind every later arrival until the stream ended (94.7 s before the fix); re-keyed
    with the first warm W, it runs within a few seconds."""
    reqs = [(0.0, 10, 20), (0.001, 10, 300)] + [(0.002 + 0.001 * k, 10, 20) for k in range(4)]
    reqs += [(0.2 + 0.15 * k, 10, 20) for k in range(600)]  # ~0.16 s of work every 0.15 s
    tr = from_requests(reqs)
    cfg = cluster.SimConfig(workers=1, order="ssjf", worker=WorkerConfig(max_batch=1, kv_capacity=10**6))
    res = cluster.simulate(tr, PERF, cfg, predictor=LengthPredictor("oracle", tr.output_len))
    long = next(r for r in res.requests if r.idx == 1)
    assert long.finish < 10.0 and max(r.finish for r in res.requests) > 85.0


def _pause_run(order: str, **worker):
    """max batch 1: a 400-token job (prompt 3,000) runs; a 5-token job arrives behind it."""
    tr = from_requests([(0.0, 3000, 400), (1.0, 10, 5)])
    cfg = cluster.SimConfig(workers=1, order=order, worker=WorkerConfig(max_batch=1, kv_capacity=10**6, **worker))
    res = cluster.simulate(tr, PERF, cfg, predictor=LengthPredictor("oracle", tr.output_len))
    return {r.idx: r for r in res.requests}, res


def test_preemptive_srpt_pauses_the_long_job_and_resumes_it_without_a_prefill():
    plain, _ = _pause_run("sjf_oracle")
    paused, res = _pause_run("sjf_oracle", refine_preempt=True, preempt_quantum=4)
    again, res_rc = _pause_run("sjf_oracle", refine_preempt=True, preempt_quantum=4, pause_kv=False)
    assert plain[1].finish > plain[0].finish  # non-preemptive: the short job waits for all 400 tokens
    # it waits only for the long job's 3 s prefill and one quantum, not its 400 tokens
    assert paused[1].finish < paused[0].finish and paused[1].finish < 0.6 * plain[1].finish
    assert paused[0].pauses == 1 and res.counters["refine_preemptions"] == 1
    assert paused[0].finish > 0 and paused[0].first_token == plain[0].first_token
    # kept KV: the long job's 3,000-token prompt is not prefilled again (k1 = 1 ms per token);
    # recompute (pause_kv=False) pays prompt + generated once more
    assert abs(paused[0].finish - plain[0].finish - (plain[1].finish - plain[0].finish)) < 0.5
    assert again[0].finish - paused[0].finish > 3.0


def test_paused_kv_is_freed_for_the_queue_and_every_request_finishes():
    """KV for about two sequences: paused requests give their KV back to the queue's head and
    re-prefill later; nothing is lost or double-counted."""
    reqs = [(0.0, 500, 300), (0.0, 500, 300)] + [(2.0 + 0.01 * k, 400, 4) for k in range(6)]
    tr = from_requests(reqs)
    cfg = cluster.SimConfig(workers=1, order="sjf_oracle",
                            worker=WorkerConfig(max_batch=2, kv_capacity=1700, refine_preempt=True, preempt_quantum=2))
    c = cluster.Cluster(tr, PERF, cfg, predictor=LengthPredictor("oracle", tr.output_len))
    res = c.run()
    assert all(r.finish > 0 for r in res.requests)
    assert res.counters["refine_preemptions"] >= 2 and res.counters["paused_kv_dropped"] >= 1
    w = next(iter(c.workers.values()))  # the books balance once everything is done
    assert not w.paused and w.kv_paused == 0 and w.S == 0 and w.b == 0 and not w.waiting and w.kv_used() == 0
    shorts = [r.finish - r.arrival for r in res.requests if r.output_len == 4]
    longs = [r.finish for r in res.requests if r.output_len == 300]
    assert max(shorts) < min(longs)


def test_refine_needs_a_size_order_and_client_ids_reach_the_estimator():
    tr = from_requests([(0.0, 10, 5)])
    with pytest.raises(ValueError, match="refine_preempt"):
        cluster.simulate(tr, PERF, cluster.SimConfig(workers=1, order="fcfs",
                                                     worker=WorkerConfig(refine_preempt=True)))
    n = 200
    rng = np.random.default_rng(0)
    client = rng.integers(0, 2, size=n)
    out = np.where(client == 0, 20, 800).astype(np.int64)
    tr = Trace("c", np.arange(n) * 0.05, np.full(n, 50, dtype=np.int64), out, client=client)
    cfg = cluster.SimConfig(workers=1, order="ssjf", worker=WorkerConfig(
        max_batch=4, kv_capacity=10**6, refine_preempt=True, refine_by_client=True))
    c = cluster.Cluster(tr, PERF, cfg, predictor=LengthPredictor("confusion", out, confusion=np.ones((5, 5)) / 5))
    res = c.run()
    est = next(iter(c.workers.values())).rule.estimator
    assert {r.client for r in res.requests} == {0, 1} and est.by_client
    assert est.remaining(-1, 0, 0, client=0) < 100 < 600 < est.remaining(-1, 0, 0, client=1)


def test_tail_guard_serves_a_request_waiting_past_the_jct_quantile_first():
    """Batch of 1 kept busy by short jobs that keep arriving: the long-prompt job sorts last under
    ssjf until its window runs out; with the tail guard it goes as soon as it has waited longer
    than the P90 of recent JCTs (the overtake bound, on by default, off here: this is the guard alone)."""
    warm = [(1.0 * k, 50, 5) for k in range(80)]  # 80 completions of ~0.1 s teach the guard
    late = [(80.0, 3000, 5)] + [(79.99 + 0.08 * k, 50, 5) for k in range(400)]  # more than it can serve
    tr = from_requests(warm + late)
    out = {}
    for guard in (0.0, 0.9):
        cfg = cluster.SimConfig(workers=1, order="ssjf", ssjf_window_factor=1000.0, worker=WorkerConfig(
            max_batch=1, kv_capacity=10**6, refine_preempt=True, tail_guard=guard, overtake_bound=0.0))
        res = cluster.simulate(tr, PERF, cfg, predictor=LengthPredictor("oracle", tr.output_len))
        big = next(r for r in res.requests if r.input_len == 3000)
        out[guard] = (big.finish - big.arrival, res.counters["overdue_promoted"])
    assert out[0.0][1] == 0 and out[0.9][1] >= 1
    assert out[0.9][0] < 0.5 * out[0.0][0]


def test_the_simulators_ssjf_carries_the_live_overtake_bound_unless_turned_off():
    """Plain ssjf in the simulator models the live worker's: the overtake bound (ε = OVERTAKE_BOUND)
    is on by default and the tail guard off (WorkerConfig, `polyserve simulate --overtake-bound /
    --tail-guard`); 0 turns the bound off. Batch of 1 kept busy by short jobs: the long-prompt job
    sorts last under the size rule; with the bound it goes once more than ⌈ε × the completions of
    the last P99 JCT⌉ later requests have overtaken it, and only then."""
    from polyserve.core import queue_order as qo
    from polyserve.simulator.cli import _base_config, build_parser

    assert WorkerConfig().overtake_bound == qo.DEFAULT_RULE.overtake_bound == qo.OVERTAKE_BOUND == 0.15
    assert WorkerConfig().tail_guard == qo.DEFAULT_RULE.tail_guard == qo.TAIL_GUARD == 0.0
    def parsed(*argv: str) -> WorkerConfig:
        return _base_config(build_parser().parse_args(list(argv)), {"model": "x"}, 1, 0.6).worker
    assert parsed().overtake_bound == qo.OVERTAKE_BOUND and parsed("--overtake-bound", "0").overtake_bound == 0
    warm = [(1.0 * k, 50, 5) for k in range(80)]
    late = [(80.0, 3000, 5)] + [(79.99 + 0.08 * k, 50, 5) for k in range(400)]
    tr = from_requests(warm + late)
    out = {}
    for name, worker in (("default", {}), ("off", {"overtake_bound": 0.0})):
        cfg = cluster.SimConfig(workers=1, order="ssjf", ssjf_window_factor=1000.0,
                                worker=WorkerConfig(max_batch=1, kv_capacity=10**6, **worker))
        res = cluster.simulate(tr, PERF, cfg, predictor=LengthPredictor("oracle", tr.output_len))
        big = next(r for r in res.requests if r.input_len == 3000)
        overtook = sum(1 for r in res.requests if r.arrival > big.arrival and r.admitted < big.admitted)
        out[name] = (big.finish - big.arrival, res.counters["overdue_promoted"], overtook)
    assert out["off"][1] == 0 and out["default"][1] >= 1
    assert out["default"][0] < 0.5 * out["off"][0]
    # the bound: the later arrivals that went first number about M (here a few: ~10 completions
    # a second, the P99 JCT a few seconds, ε = 0.15), far fewer than without it
    assert 1 <= out["default"][2] <= 20 < out["off"][2]
