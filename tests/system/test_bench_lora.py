"""`polyserve bench lora` runs end to end on the CPU: the real CLI, the hf engine with random
adapters, every cold-start state measured, the install into kept modules counted."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyserve.bench import lora

pytestmark = [pytest.mark.system, pytest.mark.torch]


def test_bench_lora_measures_every_state_and_reuses_the_evicted_modules(tmp_path):
    out = tmp_path / "lora.json"
    arch = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4}
    run = subprocess.run([sys.executable, "-m", "polyserve.cli", "bench", "lora", "--device", "cpu", "--ranks", "4,8",
                          "--trials", "2", "--prompt-tokens", "16", "--arch", json.dumps(arch), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["device"].startswith("cpu: ")
    for rank in ("4", "8"):
        row = data["ranks"][rank]
        assert all(len(row[s]["samples_ms"]) == 2 and row[s]["median_ms"] > 0 for s in lora.STATES)
        assert row["install_ms"] > 0 and row["install_peft_ms"] > 0 and row["copy_ms"] >= 0
    # the cold states but PEFT's own park the adapter's modules and the install copies into them
    assert data["lora_stats"]["slot_reuses"] >= 2 * 2 * 2
    assert "PEFT/cached" in run.stdout
