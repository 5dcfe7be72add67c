"""`polyserve up` on a run folder that kept a deployment from an earlier `up` (Redis's
append-only file) returns only when a worker of the deployment it was asked for is ready: the
other deployment's worker may be ready first, and the first request to the asked-for model
must not get 503 "none is running" (found by hand with `scripts/up` after `scripts/up
--engine sim`)."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import msgspec
import openai

from polyserve.cli import launcher
from polyserve.proto import Keys
from polyserve.shared import infra
from polyserve.shared.state import connect_sync
from tests.system.conftest import SYSTEM_ENV


def test_up_waits_for_a_worker_of_its_own_deployment_when_another_was_kept():
    run_dir = Path(tempfile.mkdtemp(prefix="ps-up2-"))
    first = launcher.ClusterSpec(run_dir=run_dir, engine="sim", model="kept-sim", port=infra.free_port(),
                                 nats_port=0, redis_port=0, min_replicas=1, max_replicas=1,
                                 extra_env=SYSTEM_ENV, ready_timeout_s=60)
    try:
        launcher.up(first, progress=lambda m: None)
        launcher.down(run_dir, progress=lambda m: None)
        lines: list[str] = []
        # the hf engine's default model: its worker takes seconds to load, the kept sim one not
        again = dataclasses.replace(first, engine="hf", model="", port=infra.free_port())
        state = launcher.up(again, progress=lines.append)
        asked = state.model
        assert any(f"worker of {asked}" in ln for ln in lines), lines
        r = connect_sync(state.redis_url)
        keys = Keys(state.prefix)
        assert {m.decode() for m in r.smembers(keys.deployments)} >= {"kept-sim", asked}
        ids = [m.decode() for m in r.zrange(keys.workers, 0, -1)]
        deps = [msgspec.json.decode(x)["deployment"] for x in r.mget([keys.worker(i) for i in ids]) if x]
        assert asked in deps, deps  # at once: up returned with it ready
        client = openai.OpenAI(base_url=state.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=20)
        assert client.completions.create(model=asked, prompt="first", max_tokens=2).choices[0].text
    finally:
        launcher.down(run_dir, progress=lambda m: None)
        shutil.rmtree(run_dir, ignore_errors=True)
