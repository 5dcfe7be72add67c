"""The Aladdin §3 fit behind the sim profile: it recovers known coefficients, the
shipped profile's fit explains the measured rows (R² > 0.9), and the shipped
JSON is what the fit gives today."""
from __future__ import annotations

import json

import numpy as np
import pytest

from polyserve.core import profile_fit
from polyserve.worker.engines.sim import DEFAULT_PROFILE, load_profile
from tests.conftest import DATASETS

pytestmark = pytest.mark.unit

SPLITWISE = DATASETS / "profiles" / "splitwise_llama2_70b_bloom_176b_a100_h100.csv"
needs_data = pytest.mark.skipif(
    not SPLITWISE.exists(), reason=f"reference datasets absent: {SPLITWISE} (../shared/datasets beside the checkout)")


def test_fit_recovers_known_coefficients():
    rows = []
    for p in (128, 512, 2048):
        for b in (1, 4, 16, 64):
            for t in (128, 1024):
                rows.append({"prompt_size": p, "batch_size": b, "token_size": t,
                             "prompt_time": 0.1 * p * b + 8.0 if b < 64 else 1.0,  # batch 64 left out
                             "token_time": (1e-4 * (p + t / 2) + 0.3) * b + 29.0})
    pre, dec = profile_fit.fit_prefill(rows), profile_fit.fit_decode(rows)
    assert pre.coef == pytest.approx([0.1, 8.0]) and pre.r2 == pytest.approx(1.0)
    assert dec.coef == pytest.approx([1e-4, 0.3, 29.0]) and dec.r2 == pytest.approx(1.0)
    assert pre.rows == 18 and dec.rows == 24


def test_kv_capacity_is_memory_arithmetic():
    tokens, per_token, how = profile_fit.kv_capacity("llama2-70b", "h100-80gb", 4)
    assert per_token == 2 * 80 * 8 * 128 * 2
    assert tokens == int((4 * 80 * 2**30 * 0.9 - 68.98e9 * 2) // per_token)
    assert "derived" in how


def test_shipped_profile_is_labelled_and_loads():
    raw = json.loads(DEFAULT_PROFILE.read_text())
    for key in ("k1", "c1", "k2", "c2", "c3", "h", "j", "kv_capacity_tokens", "median_output_tokens",
                "fit", "source", "simulated", "command"):
        assert key in raw, key
    assert raw["simulated"] is True and raw["median_output_tokens"] == 129
    assert raw["source"]["filter"] == {"model": "llama2-70b", "hardware": "h100-80gb", "tensor_parallel": 4}
    prof = load_profile()
    assert prof.perf.k1 == raw["k1"] and prof.kv_capacity_tokens == raw["kv_capacity_tokens"]


@needs_data
def test_fit_on_the_shipped_rows_is_good_and_matches_the_profile(tmp_path):
    out = tmp_path / "p.json"
    assert profile_fit.main(["--splitwise", str(SPLITWISE), "--model", "llama2-70b", "--hardware", "h100-80gb",
                             "--tp", "4", "--out", str(out)]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["fit"]["prefill"]["r2"] > 0.9 and fitted["fit"]["decode"]["r2"] > 0.9
    assert fitted["fit"]["prefill"]["rows"] == 100  # 105 rows less the five at batch 64
    shipped = json.loads(DEFAULT_PROFILE.read_text())
    for key in ("k1", "c1", "k2", "c2", "c3", "kv_capacity_tokens"):
        assert fitted[key] == pytest.approx(shipped[key], rel=1e-9), key
    assert shipped["source"]["sha256"] == profile_fit.sha256(SPLITWISE)
    # every coefficient of Eq. 2 and Eq. 3 comes out positive, as Aladdin §3.2 says it must
    assert min(fitted[k] for k in ("k1", "c1", "k2", "c2", "c3")) > 0


@needs_data
def test_output_lengths_from_the_azure_conversation_trace():
    trace = DATASETS / "traces" / "azure_llm_2023_conv.csv"
    if not trace.exists():
        pytest.skip(f"reference trace absent: {trace}")
    median, sigma = profile_fit.output_lengths(trace)
    assert median == 129 and 0.5 < sigma < 1.5
    assert np.isfinite(sigma)


def test_unknown_selection_is_a_clear_error(tmp_path):
    csv_path = tmp_path / "p.csv"
    csv_path.write_text("model,hardware,prompt_size,batch_size,token_size,peak_power,average_power,"
                        "prompt_time,token_time,e2e_time,tensor_parallel\n")
    assert profile_fit.main(["--splitwise", str(csv_path), "--out", str(tmp_path / "x.json")]) == 2
