"""Static checks of compose.yaml, the compose test's override and the Dockerfile. The
files are validated against the Compose specification's JSON Schema (compose_spec.json,
shipped inside the docker-compose 1.29.2 wheel, fetched by the test set-up) and every path
they reference must exist. The stack itself is started by scripts/compose-test
(tests/system/test_compose_e2e.py) where Docker can run."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / "build" / "schemas"
OVERRIDE = ROOT / "infra" / "compose-test" / "compose.test.yaml"
POLYSERVE_SERVICES = ("gateway", "predictor", "dispatcher", "planner", "gpu-agent", "gpu-agent-cpu")


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: `!reset` (drop the value of the files before) and
    `!override` (replace instead of merge), kept as markers for the checks below."""


class Reset:
    def __init__(self, value):
        self.value = value


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset(
    loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else None))
ComposeLoader.add_constructor("!override", lambda loader, node: (
    loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else loader.construct_mapping(node)))


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def plain(doc):
    """The document as the schema sees it once merged: a `!reset` value is its empty value."""
    if isinstance(doc, Reset):
        return doc.value
    if isinstance(doc, dict):
        return {k: plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [plain(v) for v in doc]
    return doc


def compose_schema() -> dict:
    wheels = list(WHEEL_DIR.glob("docker_compose-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(WHEEL_DIR),
                        "docker-compose==1.29.2"], check=True)
        wheels = list(WHEEL_DIR.glob("docker_compose-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        return json.loads(zf.read("compose/config/compose_spec.json"))


def test_compose_file_is_valid_against_the_compose_schema():
    doc = load(ROOT / "compose.yaml")
    jsonschema.validate(plain(doc), compose_schema())
    services = doc["services"]
    for name in ("nats", "redis", "jaeger", *POLYSERVE_SERVICES):
        assert name in services, name
    devices = services["gpu-agent"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "cpu" in services["gpu-agent-cpu"]["profiles"] and "gpu" in services["gpu-agent"]["profiles"]
    assert "-js" in services["nats"]["command"]
    # the public images stay for users; the compose test swaps them in its override
    assert services["nats"]["image"].startswith("nats:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["jaeger"]["image"].startswith("jaegertracing/")


def test_workers_have_one_owner_the_gpu_agent():
    """Workers are child processes of the gpu-agent (the planner asks agents for them); no
    compose service runs a worker itself (docs/deployment.md)."""
    services = load(ROOT / "compose.yaml")["services"]
    for name, svc in services.items():
        assert "polyserve.worker" not in svc.get("command", []), f"{name} runs a worker outside the gpu-agent"
    assert not {"worker", "worker-cpu"} & set(services)


def test_every_service_restarts_and_has_a_healthcheck():
    services = load(ROOT / "compose.yaml")["services"]
    for name in ("nats", "redis", *POLYSERVE_SERVICES):
        assert services[name].get("restart") == "unless-stopped", name
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in POLYSERVE_SERVICES:
        assert services[name]["healthcheck"]["test"] == ["CMD", "polyserve", "health"], name
        deps = services[name]["depends_on"]
        assert deps["nats"]["condition"] == deps["redis"]["condition"] == "service_healthy", name


def test_redis_persists_with_aof_everysec():
    redis = load(ROOT / "compose.yaml")["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "everysec"
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_compose_test_override_is_valid_local_and_on_loopback():
    base = load(ROOT / "compose.yaml")["services"]
    doc = load(OVERRIDE)
    jsonschema.validate(plain(doc), compose_schema())
    for name, svc in doc["services"].items():
        assert name in base, f"the override names {name}, which compose.yaml lacks"
        assert svc.get("network_mode") == "host", name
        image = svc.get("image") or base[name].get("image", "")
        assert image.startswith("${POLYSERVE_IMAGE"), f"{name} would pull {image} from a registry"
        if base[name].get("ports"):
            assert isinstance(svc.get("ports"), Reset), f"{name}: reset the published ports under host networking"
    started = {n for n, s in base.items() if not ({"gpu", "observability"} & set(s.get("profiles", [])))}
    assert started <= set(doc["services"]), f"not overridden: {started - set(doc['services'])}"
    env = doc["x-test-env"]
    assert env["POLYSERVE_OTLP_ENDPOINT"].startswith("http://127.0.0.1:")
    assert all(v.startswith(("nats://127.0.0.1:", "redis://127.0.0.1:"))
               for k, v in env.items() if k in ("POLYSERVE_NATS_URL", "POLYSERVE_REDIS_URL"))
    redis = doc["services"]["redis"]["command"]
    assert redis[redis.index("--appendfsync") + 1] == "everysec"
    assert "otlp_sink.py" in " ".join(doc["services"]["jaeger"]["command"])


def test_every_referenced_path_exists():
    for path in (ROOT / "compose.yaml", OVERRIDE):
        doc = plain(load(path))
        for name, svc in doc["services"].items():
            build = svc.get("build")
            if build:
                assert (ROOT / build["context"]).is_dir(), name
                assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name
            for vol in svc.get("volumes") or []:
                src = vol.split(":")[0]
                if src.startswith((".", "/")):
                    assert (ROOT / src).exists(), f"{name}: {src}"
            command = svc.get("command") or []
            for i, arg in enumerate(command):
                if arg.startswith("polyserve."):
                    module = arg.split(".", 1)[1]
                    assert (ROOT / "services" / module / "__main__.py").is_file(), f"{name}: {arg}"
                if arg.startswith("/sink/"):
                    assert (ROOT / "infra" / "compose-test" / arg[len("/sink/"):]).is_file(), f"{name}: {arg}"


def test_dockerfile_installs_properly_as_a_non_root_user():
    text = (ROOT / "infra" / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    body = "\n".join(lines)
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            for src in [a for a in line.split()[1:-1] if not a.startswith("--")]:
                assert (ROOT / src).exists(), src
    assert "|| true" not in body, "a failed install must fail the build"
    assert re.search(r"^ARG EXTRAS=hf\b", body, re.MULTILINE), "the predictor and the encoder need the hf extra"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", body, re.MULTILINE)
    assert "--no-index --find-links" in body, "the offline install (scripts/compose-test)"
    user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("root", "0"), "the services run as a non-root user"
    assert re.search(r"^HEALTHCHECK .*polyserve.*health", body, re.MULTILINE)


def test_dockerignore_keeps_what_the_install_reads():
    allowed = {ln[1:] for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")}
    assert {"pyproject.toml", "setup.py", "README.md", "services", "shared", "proto"} <= allowed
