"""Session fixtures: a real nats-server and a real redis-server (started with the
same code as `polyserve up`), a fresh subject/key prefix per test, and helpers to
run services in-process or as processes.

The tiers are enforced here (tests/tiers.py): each test gets its folder's tier marker,
and a unit test that requests one of the server fixtures below fails before they start."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from polyserve.proto import Keys, Subjects
from polyserve.shared import infra
from polyserve.shared import settings as settings_mod
from polyserve.shared.bus import Bus
from polyserve.shared.state import State, connect
from polyserve.shared.telemetry import make_tracer
from tests.tiers import pytest_collection_modifyitems, pytest_configure, pytest_runtest_setup  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"


@dataclass
class Infra:
    nats_url: str
    redis_url: str
    run_dir: Path
    nats_pid: int
    redis_pid: int


@pytest.fixture(scope="session")
def infra_servers() -> Infra:
    """One nats-server (JetStream) and one redis-server (unix socket) for the session."""
    run_dir = Path(tempfile.mkdtemp(prefix="ps-", dir="/tmp"))
    nats_proc, nats_url, _ = infra.start_nats(run_dir / "nats")
    redis_proc, redis_url = infra.start_redis(run_dir / "redis", unix_socket=str(run_dir / "r.sock"))
    yield Infra(nats_url, redis_url, run_dir, nats_proc.pid, redis_proc.pid)
    for proc in (redis_proc, nats_proc):
        proc.terminate()
        with contextlib.suppress(Exception):
            proc.wait(10)
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def prefix() -> str:
    """A subject/key prefix of this test's own."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def make_settings(infra_servers: Infra, prefix: str):
    """Build a service's settings pointed at the session servers and this test's prefix."""

    def build(cls: type[settings_mod.CommonSettings], service: str, **overrides):
        base = dict(nats_url=infra_servers.nats_url, redis_url=infra_servers.redis_url, prefix=prefix,
                    drain_timeout_s=3.0, service_ttl_s=3.0)
        base.update(overrides)
        return settings_mod.load(cls, service, environ={}, **base)

    return build


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def bus(infra_servers: Infra) -> AsyncIterator[Bus]:
    tracer, _ = make_tracer("test")
    b = await Bus.connect(infra_servers.nats_url, tracer, "test")
    yield b
    await b.close()


@pytest.fixture
async def state(infra_servers: Infra, prefix: str) -> AsyncIterator[State]:
    s = State(connect(infra_servers.redis_url), Keys(prefix))
    yield s
    await s.close()


@pytest.fixture
def subjects(prefix: str) -> Subjects:
    return Subjects(prefix)


