"""Static checks of compose.yaml and the Dockerfile. No Docker engine runs in this
project's CI, so the stack is never started here: the file is validated against the
Compose specification's JSON Schema (compose_spec.json, shipped inside the
docker-compose 1.29.2 wheel, fetched by the test set-up) and every path it
references must exist."""
from __future__ import annotations

import json
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


def compose_schema() -> dict:
    wheels = list(WHEEL_DIR.glob("docker_compose-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(WHEEL_DIR),
                        "docker-compose==1.29.2"], check=True)
        wheels = list(WHEEL_DIR.glob("docker_compose-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        return json.loads(zf.read("compose/config/compose_spec.json"))


def test_compose_file_is_valid_against_the_compose_schema():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    jsonschema.validate(doc, compose_schema())
    services = doc["services"]
    for name in ("nats", "redis", "jaeger", "gateway", "predictor", "dispatcher", "planner", "gpu-agent", "worker"):
        assert name in services, name
    for gpu_svc in ("gpu-agent", "worker"):
        devices = services[gpu_svc]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert "cpu" in services["worker-cpu"]["profiles"]
    assert "-js" in services["nats"]["command"]


def test_every_referenced_path_exists():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, svc in doc["services"].items():
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"]).is_dir(), name
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name}: {src}"
        for arg in svc.get("command", []):
            if arg.startswith("polyserve."):
                module = arg.split(".", 1)[1]
                assert (ROOT / "services" / module / "__main__.py").is_file(), f"{name}: {arg}"


def test_dockerfile_copies_what_exists():
    for line in (ROOT / "infra" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
