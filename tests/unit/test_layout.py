"""The layout the architecture doc promises (docs/architecture.md, "Layout"), checked on
the source: services talk only over NATS (no service imports another service's code),
what they share is in `core/`, `shared/` or `proto/`, few loose modules, modules and
functions of a readable size, and one vocabulary of policy and scaler names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from polyserve.core import names

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SERVICES_DIR = ROOT / "services"
SERVICES = ("gateway", "predictor", "dispatcher", "planner", "gpu_agent", "worker")
TOOLS = ("core", "simulator", "profiler", "cli", "bench")
CODE_DIRS = (SERVICES_DIR, ROOT / "shared", ROOT / "proto")


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> set[str]:
    """Every `polyserve.x.y` module named by an import in `path` (top level or nested)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("polyserve.")}


def test_no_service_imports_another_service():
    offenders = []
    for service in SERVICES:
        for path in _modules(SERVICES_DIR / service):
            for mod in _imported(path):
                top = mod.split(".")[1]
                if top in SERVICES and top != service:
                    offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, "services must talk over NATS, share code through core/:\n" + "\n".join(offenders)


def test_core_is_pure_and_depends_on_nothing_above_it():
    """core/ may use proto/ and the standard/scientific libraries; no service, tool, bus or Redis."""
    for path in _modules(SERVICES_DIR / "core"):
        for mod in _imported(path):
            top = mod.split(".")[1]
            assert top in ("core", "proto"), f"{path.relative_to(ROOT)} imports {mod}"
        src = path.read_text()
        for io in ("import nats", "import redis", "import httpx", "import fastapi"):
            assert io not in src, f"{path.relative_to(ROOT)}: core does no I/O ({io})"


def test_services_folder_holds_services_and_tools_only():
    folders = {p.name for p in SERVICES_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(SERVICES) | set(TOOLS)
    loose = sorted(p.name for p in SERVICES_DIR.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 2, loose


def test_module_and_function_sizes():
    big, long_funcs = [], []
    for folder in CODE_DIRS:
        for path in _modules(folder):
            src = path.read_text()
            if src.count("\n") > 500:
                big.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 80:
                        long_funcs.append(f"{path.relative_to(ROOT)}:{node.name} ({n} lines)")
    assert not big, big
    assert len(long_funcs) <= 3, long_funcs


def test_profiles_have_one_lookup_that_works_outside_the_checkout():
    from polyserve.core import profiles

    for name in (profiles.DEFAULT_SIM, profiles.HF_CPU, profiles.ENCODER_CPU):
        assert profiles.profile_path(name).is_file()
        assert profiles.profile_path(name + ".json") == profiles.profile_path(name)
    with pytest.raises(FileNotFoundError, match=profiles.DEFAULT_SIM):
        profiles.profile_path("no-such-profile")
    for path in _modules(SERVICES_DIR):
        src = path.read_text()
        assert "Path(__file__)" not in src, f"{path}: find packaged files with importlib.resources"


def test_dispatch_policy_vocabulary_matches_the_dispatcher():
    from polyserve.dispatcher.policy import POLICIES

    assert set(POLICIES) == set(names.DISPATCH_POLICIES)
    with pytest.raises(names.UnknownName, match="least_outstanding"):
        names.check_policy("nope")


def test_scaler_vocabulary_folds_aliases():
    assert names.canonical_scaler("tracking") == "target_tracking"
    assert names.canonical_scaler("museserve") == "muserve"
    assert names.canonical_scaler(" PerToken ") == "pertoken"
    with pytest.raises(names.UnknownName, match="pertoken"):
        names.canonical_scaler("hpa2")
    assert set(names.SCALERS) == set(names.METRIC_SCALERS) | set(names.SIGNAL_SCALERS)
