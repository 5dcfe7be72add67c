"""`polyserve up` whose worker cannot start as configured (here a checkpoint directory that does
not exist) fails at once with the worker's own error and its log, and leaves nothing running;
before, it waited out its whole ready timeout (120 s) and said only "not ready: a worker". The
failed worker's log then does not fail the next `up` in the same run folder."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from polyserve.cli import launcher
from polyserve.shared import infra
from tests.system.conftest import SYSTEM_ENV


def test_up_fails_fast_with_the_workers_error_then_starts_cleanly():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-upfail-"))
    bad = launcher.ClusterSpec(run_dir=run_dir, engine="hf", model_path=str(run_dir / "no-such-checkpoint"),
                               port=infra.free_port(), nats_port=0, redis_port=0, min_replicas=1, max_replicas=1,
                               extra_env=SYSTEM_ENV, ready_timeout_s=120)
    try:
        lines: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(launcher.LaunchError) as err:
            launcher.up(bad, progress=lines.append)
        took = time.monotonic() - t0
        assert "could not start" in str(err.value) and "no-such-checkpoint" in str(err.value), err.value
        assert "is not a Hugging Face checkpoint directory" in str(err.value)
        assert str(run_dir / "logs" / "workers") in str(err.value)  # its log
        assert any("a worker stopped:" in ln for ln in lines), lines
        assert took < 90, f"took {took:.0f}s: waited for the ready timeout"
        assert launcher.ClusterState.load(run_dir) is None  # torn down
        good = dataclasses.replace(bad, engine="sim", model="ok-sim", model_path="", port=infra.free_port())
        state = launcher.up(good, progress=lambda m: None)  # the old failed log is not this run's
        assert state.model == "ok-sim"
    finally:
        launcher.down(run_dir, progress=lambda m: None)
        shutil.rmtree(run_dir, ignore_errors=True)
