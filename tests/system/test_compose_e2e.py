"""The compose deployment end to end: scripts/compose-test builds the image offline, starts
compose.yaml (+ infra/compose-test/compose.test.yaml) with Docker, drives it with the openai
client, checks NATS events and a trace, and takes it down leaving nothing (see the script).

Bounded: the script gets COMPOSE_TEST_TIMEOUT_S (default 900 s; on the project's 2-core
machine about 2.5 min with the base image cached and no polyserve image (the image build, with
uv, ~100 s of it), about 1 min more where the base image must be debootstrapped). Skipped,
with the script's reason, only where Docker cannot run here (the script prints SKIPPED and
exits 0), or when POLYSERVE_COMPOSE_TEST=0 (a developer's quick run; CI leaves it on).
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose-test"
TIMEOUT_S = float(os.environ.get("COMPOSE_TEST_TIMEOUT_S", "900"))


def test_compose_stack_builds_offline_serves_the_openai_client_and_goes_down_clean(tmp_path):
    if os.environ.get("POLYSERVE_COMPOSE_TEST", "1") == "0":
        pytest.skip("POLYSERVE_COMPOSE_TEST=0: the compose end-to-end test is switched off")
    log = tmp_path / "compose-test.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(SCRIPT)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the script's trap takes the stack down
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    text = log.read_text(errors="replace")
    tail = "\n".join(text.splitlines()[-40:])
    print(text)  # shown by pytest on failure (-ra) and with -s
    if rc is None:
        pytest.fail(f"scripts/compose-test did not finish within {TIMEOUT_S:.0f}s:\n{tail}")
    skipped = [ln for ln in text.splitlines() if "SKIPPED:" in ln]
    if rc == 0 and skipped:
        pytest.skip(skipped[-1].split("SKIPPED:", 1)[1].strip())
    assert rc == 0, f"scripts/compose-test failed (exit {rc}):\n{tail}"
    assert "PASSED:" in text, tail
