"""Pure parts of `polyserve bench replay`: trace selection, prompt lengths, flag errors."""
from __future__ import annotations

import math

import pytest

from polyserve import cli
from polyserve.bench import replay as br

pytestmark = pytest.mark.unit


def write_trace(path, rows) -> str:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 10:00:{s:09.6f},{i},{o}" for s, i, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_slice_rate_scale_duration_and_count(tmp_path):
    path = write_trace(tmp_path / "t.csv", [(k * 1.0, 10 + k, 2 + k) for k in range(10)])
    tr = br.load_trace(path, "2:8", rate_scale=2.0, duration_s=2.0)
    assert list(tr.arrival) == [0.0, 0.5, 1.0, 1.5, 2.0] and list(tr.input_len) == [12, 13, 14, 15, 16]
    assert len(br.load_trace(path, "", max_requests=3)) == 3
    assert br.parse_slice("5:") == (5.0, None)


@pytest.mark.parametrize("kw, match", [({"slice_": "8:2"}, "--slice"), ({"slice_": "a:b"}, "--slice"),
                                       ({"slice_": "5"}, "--slice"), ({"rate_scale": 0}, "--rate-scale"),
                                       ({"duration_s": -1}, "--duration"), ({"slice_": "100:200"}, "no requests")])
def test_bad_trace_flags_say_what_to_fix(tmp_path, kw, match):
    path = write_trace(tmp_path / "t.csv", [(0.0, 10, 2), (1.0, 10, 2)])
    with pytest.raises(br.ReplayError, match=match):
        br.load_trace(path, **kw)


def test_missing_trace_file():
    with pytest.raises(br.ReplayError, match="no such file"):
        br.load_trace("/nonexistent/trace.csv")


def test_words_tokenizer_hits_the_sim_engines_count():
    tok = br.WordsTokenizer(exact=True)
    prompts = br.make_prompts([1, 2, 3, 7, 50, 333, 1020], "synthetic", tok)
    for n, p in zip([1, 2, 3, 7, 50, 333, 1020], prompts):
        got = tok.count(p)
        assert got <= max(n, 2) and n - got <= 1, (n, got)  # ceil(1.3 w) skips some integers
        assert got == math.ceil(1.3 * len(p.split()))


def test_sharegpt_prompts_have_the_asked_lengths():
    if not br.SHAREGPT.is_file():
        pytest.skip(f"{br.SHAREGPT} absent (../shared/datasets beside the checkout)")
    tok = br.WordsTokenizer(exact=True)
    lengths = [20, 400, 3000]
    prompts = br.make_prompts(lengths, "sharegpt", tok, seed=1)
    assert all(n - 1 <= tok.count(p) <= n for n, p in zip(lengths, prompts))
    assert prompts != br.make_prompts(lengths, "sharegpt", tok, seed=2)


def test_tokenizer_flag_must_be_a_tokenizer_dir(tmp_path):
    with pytest.raises(br.ReplayError, match="--tokenizer"):
        br.resolve_tokenizer(str(tmp_path), "hf", "")
    assert isinstance(br.resolve_tokenizer("auto", "vllm", "x"), br.WordsTokenizer)


def test_cli_reports_bad_flags(tmp_path, capsys):
    path = write_trace(tmp_path / "t.csv", [(0.0, 10, 2)])
    assert cli.main(["bench", "replay", "--model", "m", "--trace", path, "--rate-scale", "-1",
                     "--out", str(tmp_path / "o")]) == 2
    assert "--rate-scale" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench", "replay", "--model", "m", "--prompts", "poems"])


def test_fidelity_calibration_recovers_a_known_step_overhead():
    import json

    from polyserve.bench import fidelity as bf
    from polyserve.simulator import simulate_requests

    raw = json.loads(bf.ENGINE_PROFILES["sim"].read_text())
    # "live" requests: the simulator's own latencies plus 3 ms per decode step and 20 ms before the first token
    live = []
    for k in range(5):
        s = simulate_requests([(0.0, 64, 32)], raw)[0]
        live.append(br.LiveRequest(k, 0.0, 0.0, 64, 32, 64, 32, ttft_ms=s.ttft_ms + 20.0, atgt_ms=s.atgt_ms + 3.0,
                                   e2e_ms=s.e2e_ms + 20.0 + 31 * 3.0))
    cal, info = bf.calibrate(live, raw, "additive")
    assert info["step_overhead_ms"] == pytest.approx(3.0) and cal["c3"] == pytest.approx(raw["c3"] + 3.0)
    assert info["overhead_ms"] == pytest.approx(20.0)
    scaled, info = bf.calibrate(live, raw, "scale")
    assert info["scale"] > 1 and scaled["k1"] == pytest.approx(raw["k1"] * info["scale"])
    sim = [simulate_requests([(0.0, 64, 32)], raw)[0] for _ in live]
    f = bf.compare(live, sim, sim, 0.0)
    assert f["paired_requests"] == 5 and f["ttft_mean"]["error_pct"] < 0 and f["atgt_mean"]["error_pct"] < 0


def test_fidelity_bad_flags_fail_before_starting_anything(capsys):
    assert cli.main(["bench", "fidelity", "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().out
    assert cli.main(["bench", "fidelity", "--profile", "/nonexistent.json"]) == 2
    assert "--profile" in capsys.readouterr().out
