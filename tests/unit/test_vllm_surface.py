"""The `vllm` engine and its fake, checked against vLLM's REAL API as committed in
services/worker/engines/vllm_surface.json.

That JSON is what `scripts/vllm-surface extract` read with `ast` from the sources of the
release the engine targets (downloaded from PyPI, never installed or imported). These tests
need no network: they check

1. the pins agree: JSON version == TARGET_VLLM_VERSION == the fake's VERSION == pyproject's
   `vllm` extra;
2. every vLLM name the engine uses (`vllm_api.SURFACE_USED`) exists in the JSON, and the code
   uses no vLLM name that SURFACE_USED does not list (read from the code with ast);
3. the fake of tests/fakes/fake_vllm.py (flavor "v1") has vLLM's classes, method signatures
   (parameter names, kinds, literal defaults, async or not), fields and enum members.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.machinery
import importlib.util
import inspect
import json
import re
from pathlib import Path

import pytest

from polyserve.worker.engines import vllm_api
from polyserve.worker.engines.vllm_engine import TARGET_VLLM_VERSION
from tests.fakes import fake_vllm

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "services" / "worker" / "engines"
SURFACE = json.loads((ENGINES / "vllm_surface.json").read_text())
CLASSES = SURFACE["classes"]
ASYNC_LLM = "vllm.v1.engine.async_llm.AsyncLLM"
UNRESOLVED = object()


def load_script():
    loader = importlib.machinery.SourceFileLoader("vllm_surface_script", str(ROOT / "scripts" / "vllm-surface"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- defaults
def resolve_default(text: str | None, depth: int = 0):
    """A default's source text from the JSON as a Python value, where it is a literal, a
    `field(default=...)`/`Field(default=...)`, an enum member, or `SomeConfig.field` naming a
    class in the JSON (vLLM's EngineArgs defaults point at its config classes); else UNRESOLVED."""
    if text is None or depth > 3:
        return UNRESOLVED
    node = ast.parse(text, mode="eval").body
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in ("field", "Field"):
        for kw in node.keywords:
            if kw.arg == "default":
                return resolve_default(ast.unparse(kw.value), depth + 1)
        return UNRESOLVED
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        owner = next((c for name, c in CLASSES.items() if name.rsplit(".", 1)[-1] == node.value.id), None)
        if owner is None:
            return UNRESOLVED
        if node.attr in owner.get("members", []):
            return f"{node.value.id}.{node.attr}"
        if node.attr in owner["fields"]:
            return resolve_default(owner["fields"][node.attr].get("default"), depth + 1)
    return UNRESOLVED


def as_comparable(value):
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else value


def check_default(where: str, real: str | None, fake) -> list[str]:
    value = resolve_default(real)
    if value is UNRESOLVED:
        return []
    return [] if as_comparable(fake) == value else [f"{where}: default {fake!r} in the fake, {real} in vLLM"]


# ----------------------------------------------------------------------------- signatures
KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional_only",
         inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
         inspect.Parameter.VAR_POSITIONAL: "var_positional", inspect.Parameter.KEYWORD_ONLY: "keyword_only",
         inspect.Parameter.VAR_KEYWORD: "var_keyword"}


def compare_method(where: str, fake_fn, real: dict) -> list[str]:
    """The fake method has vLLM's parameters (names, order, kinds, literal defaults) and is
    async / an async generator / plain exactly where vLLM's is."""
    errors = []
    raw = inspect.getattr_static(*fake_fn) if isinstance(fake_fn, tuple) else fake_fn
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if real["async"] and real["generator"]:
        ok = inspect.isasyncgenfunction(fn)
    elif real["async"]:
        ok = inspect.iscoroutinefunction(fn)
    else:
        ok = not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))
    if not ok:
        errors.append(f"{where}: async={real['async']} generator={real['generator']} in vLLM, not in the fake")
    if ("classmethod" in real["decorators"]) != isinstance(raw, classmethod):
        errors.append(f"{where}: classmethod in one, not the other")
    fake_params = [(p.name, KINDS[p.kind], p.default) for p in inspect.signature(fn).parameters.values()]
    real_params = [(p["name"], p["kind"], p.get("default")) for p in real["params"]]
    if [(n, k) for n, k, _ in fake_params] != [(n, k) for n, k, _ in real_params]:
        errors.append(f"{where}: parameters {[(n, k) for n, k, _ in fake_params]} in the fake, "
                      f"{[(n, k) for n, k, _ in real_params]} in vLLM")
        return errors
    for (name, _, fake_default), (_, _, real_default) in zip(fake_params, real_params):
        if (fake_default is inspect.Parameter.empty) != (real_default is None):
            errors.append(f"{where}({name}): required in one, optional in the other")
        elif real_default is not None:
            errors += check_default(f"{where}({name})", real_default, fake_default)
    return errors


# ----------------------------------------------------------------------------- 1. pins
def test_pins_agree_on_the_verified_release():
    assert SURFACE["vllm_version"] == TARGET_VLLM_VERSION == fake_vllm.VERSION == "0.33.0"
    assert SURFACE["source"]["file"].startswith(f"vllm-{TARGET_VLLM_VERSION}")
    assert re.fullmatch(r"[0-9a-f]{64}", SURFACE["source"]["sha256"])
    assert SURFACE["missing_classes"] == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'vllm = ["vllm=={TARGET_VLLM_VERSION}"]' in pyproject
    setup = (ROOT / "setup.py").read_text()
    assert "worker/engines/*.json" in setup, "the surface JSON must ship with the package"


# ----------------------------------------------------------------------------- 2. what the engine uses
def test_every_vllm_name_the_engine_uses_exists_in_the_release():
    script = load_script()
    assert script.used_surface() == vllm_api.SURFACE_USED  # the script reads the same list with ast
    assert script.used_problems(SURFACE, vllm_api.SURFACE_USED) == []
    assert tuple(vllm_api.SURFACE_USED["constants"]["vllm.config.lora.MaxLoRARanks"]) == vllm_api.LORA_RANKS
    assert SURFACE["constants"]["vllm.config.lora.MaxLoRARanks"] == list(vllm_api.LORA_RANKS)
    assert set(vllm_api.FINISH_REASONS) | {vllm_api.ERROR_REASON} == \
        set(SURFACE["constants"]["vllm.v1.engine.FINISH_REASON_STRINGS"])


def test_used_problems_catches_a_missing_name():
    script = load_script()
    broken = json.loads(json.dumps(SURFACE))
    del broken["classes"][ASYNC_LLM]["methods"]["abort"]
    broken["classes"]["vllm.sampling_params.SamplingParams"]["fields"].pop("output_kind")
    broken["classes"]["vllm.sampling_params.SamplingParams"]["attributes"].remove("output_kind")
    broken["modules"]["vllm"].remove("SamplingParams")
    problems = script.used_problems(broken, vllm_api.SURFACE_USED)
    assert any("abort() is gone" in p for p in problems)
    assert any("SamplingParams.output_kind" in p for p in problems)
    assert any("vllm.SamplingParams is not exported" in p for p in problems)


def _code_trees():
    return {name: ast.parse((ENGINES / name).read_text()) for name in ("vllm_api.py", "vllm_engine.py")}


def _call_keywords(tree: ast.AST, func_text: str) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == func_text:
            names |= {kw.arg for kw in node.keywords if kw.arg}
    return names


def test_the_code_uses_only_names_listed_in_surface_used():
    """Read the engine's code with ast: modules/names imported, engine methods and attributes,
    constructor keywords. Each must be in SURFACE_USED (which the test above checks against vLLM)."""
    used = vllm_api.SURFACE_USED
    trees = _code_trees()
    api, engine = trees["vllm_api.py"], trees["vllm_engine.py"]
    imports = {(n.args[0].value, n.args[1].value) for n in ast.walk(api)
               if isinstance(n, ast.Call) and ast.unparse(n.func) == "_attr"}
    imports |= {("vllm", n.args[1].value) for n in ast.walk(api) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "getattr" and ast.unparse(n.args[0]) == "vllm"}
    assert imports and all(name in used["modules"].get(mod, []) for mod, name in imports), imports
    assert {n.args[0].value for n in ast.walk(api) if isinstance(n, ast.Call)
            and ast.unparse(n.func) == "importlib.import_module" and isinstance(n.args[0], ast.Constant)} == {"vllm"}

    engine_names = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and ast.unparse(n.value) in ("self._engine", "engine"):
                engine_names.add(n.attr)
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("getattr", "hasattr") \
                    and ast.unparse(n.args[0]) in ("self._engine", "engine") and isinstance(n.args[1], ast.Constant):
                engine_names.add(n.args[1].value)
    allowed = set(used["methods"][ASYNC_LLM]) | set(used["attributes"][ASYNC_LLM]) \
        | set(used["legacy_fallbacks"][ASYNC_LLM])
    assert engine_names and engine_names <= allowed, engine_names - allowed
    for legacy in used["legacy_fallbacks"][ASYNC_LLM]:  # truly fallbacks: not what 0.33 offers
        assert legacy not in CLASSES[ASYNC_LLM]["methods"] and legacy not in CLASSES[ASYNC_LLM]["attributes"]

    engine_args = {kw.arg for n in ast.walk(engine) if isinstance(n, ast.AnnAssign)
                   and ast.unparse(n.target) == "self.engine_args" for kw in n.value.keywords}
    assert engine_args == set(used["fields"]["vllm.engine.arg_utils.AsyncEngineArgs"])
    sampling = {kw.arg for n in ast.walk(api) if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "kw"
                for kw in n.value.keywords}
    sampling |= {n.slice.value for n in ast.walk(api) if isinstance(n, ast.Subscript)
                 and ast.unparse(n.value) == "kw" and isinstance(n.slice, ast.Constant)}
    assert sampling == set(used["fields"]["vllm.sampling_params.SamplingParams"])
    assert _call_keywords(engine, "self.api.LoRARequest") == set(used["fields"]["vllm.lora.request.LoRARequest"])
    prompts = [n.args[0] for n in ast.walk(engine) if isinstance(n, ast.Call)
               and ast.unparse(n.func) == "self._engine.generate"]
    if any(isinstance(a, ast.Call) and ast.unparse(a.func) == "cache_salt.tokens_prompt" for a in prompts):
        # the TokensPrompt is built by core/cache_salt.py: the keys of the dicts it returns
        salt = ast.parse((Path(vllm_api.__file__).parents[2] / "core" / "cache_salt.py").read_text())
        fn = next(f for f in ast.walk(salt) if isinstance(f, ast.FunctionDef) and f.name == "tokens_prompt")
        prompts = [d for d in ast.walk(fn) if isinstance(d, ast.Dict)]
    prompt_keys = {k.value for d in prompts if isinstance(d, ast.Dict) for k in d.keys}
    assert prompt_keys == set(used["fields"]["vllm.inputs.llm.TokensPrompt"])
    generate_kw = _call_keywords(engine, "self._engine.generate")
    assert generate_kw <= set(used["methods"][ASYNC_LLM]["generate"])
    exc_names = {e.rsplit(".", 1)[1] for e in used["exceptions"]}
    error_src = inspect.getsource(vllm_api.error_status)
    assert all(name in error_src or name in ("QueueOverflowError", "MaxQueuedTokensError") for name in exc_names)
    for name in ("QueueOverflowError", "MaxQueuedTokensError"):  # reach error_status as GracefulHTTPError
        assert "GracefulHTTPError" in SURFACE["exceptions"][f"vllm.exceptions.{name}"]["bases"]


# ----------------------------------------------------------------------------- 3. the fake vs vLLM
FAKE_METHOD_CLASSES = [
    (fake_vllm.FakeAsyncLLM, ASYNC_LLM),
    (fake_vllm.FakeTokenizer, "vllm.tokenizers.protocol.TokenizerLike"),
]


@pytest.mark.parametrize("fake_cls,real_name", FAKE_METHOD_CLASSES, ids=["AsyncLLM", "TokenizerLike"])
def test_fake_methods_have_vllms_signatures(fake_cls, real_name):
    real = CLASSES[real_name]
    public = [n for n, v in vars(fake_cls).items()
              if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, (classmethod, staticmethod)))]
    assert public
    errors = []
    for name in public:
        if name not in real["methods"]:
            errors.append(f"{fake_cls.__name__}.{name}: vLLM has no such method")
            continue
        errors += compare_method(f"{fake_cls.__name__}.{name}", (fake_cls, name), real["methods"][name])
    assert errors == []
    if fake_cls is fake_vllm.FakeAsyncLLM:
        assert set(vllm_api.SURFACE_USED["methods"][ASYNC_LLM]) <= set(public)
        fake = fake_vllm.FakeAsyncLLM(fake_vllm.AsyncEngineArgs())
        for attr in vllm_api.SURFACE_USED["attributes"][ASYNC_LLM]:
            assert hasattr(fake, attr) and attr in real["attributes"], attr


def test_fake_sampling_params_fields_and_defaults():
    real = CLASSES["vllm.sampling_params.SamplingParams"]
    params = inspect.signature(fake_vllm.SamplingParams.__init__).parameters
    named = [p for p in params.values() if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    errors = []
    for p in named:
        if p.name not in real["fields"]:
            errors.append(f"SamplingParams.{p.name}: not a vLLM field")
        else:
            errors += check_default(f"SamplingParams.{p.name}", real["fields"][p.name].get("default"), p.default)
    assert errors == []
    source = inspect.getsource(fake_vllm.SamplingParams.__init__)
    extra = set(re.findall(r'"([a-z_]+)"', source.split("unknown = set(other) - {", 1)[1].split("}", 1)[0]))
    assert extra and extra <= set(real["fields"]), extra - set(real["fields"])
    assert set(vllm_api.SURFACE_USED["fields"]["vllm.sampling_params.SamplingParams"]) <= {p.name for p in named}


def test_fake_lora_request_matches_vllms_struct():
    real = CLASSES["vllm.lora.request.LoRARequest"]
    params = [p for p in inspect.signature(fake_vllm.LoRARequest.__init__).parameters.values() if p.name != "self"]
    assert [p.name for p in params] == real["field_order"]
    for p in params:
        real_default = real["fields"][p.name].get("default")
        assert (p.default is inspect.Parameter.empty) == (real_default is None), p.name
        if real_default is not None:
            assert check_default(p.name, real_default, p.default) == []
    with pytest.raises(AssertionError):  # vLLM: "lora_path cannot be empty"
        fake_vllm.LoRARequest("a", 1)


def test_fake_engine_args_are_vllm_fields_with_vllms_defaults():
    real = CLASSES["vllm.engine.arg_utils.AsyncEngineArgs"]
    errors = []
    for f in dataclasses.fields(fake_vllm.AsyncEngineArgs):
        if f.name not in real["fields"]:
            errors.append(f"AsyncEngineArgs.{f.name}: not a vLLM field")
            continue
        errors += check_default(f"AsyncEngineArgs.{f.name}", real["fields"][f.name].get("default"), f.default)
    assert errors == []
    assert set(vllm_api.SURFACE_USED["fields"]["vllm.engine.arg_utils.AsyncEngineArgs"]) <= \
        set(fake_vllm.field_names(fake_vllm.AsyncEngineArgs))
    assert resolve_default(real["fields"]["max_lora_rank"]["default"]) == 16  # via LoRAConfig: resolution works
    assert resolve_default(real["fields"]["scheduling_policy"]["default"]) == "fcfs"
    assert resolve_default(real["fields"]["gpu_memory_utilization"]["default"]) == 0.92  # via Field(default=)


def test_fake_outputs_match_vllms_outputs():
    real = CLASSES["vllm.outputs.CompletionOutput"]
    fake_fields = dataclasses.fields(fake_vllm.CompletionOutput)
    assert [f.name for f in fake_fields] == real["field_order"][:len(fake_fields)]
    for f in fake_fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        assert required == ("default" not in real["fields"][f.name]), f.name
    assert {"finished"} <= set(real["methods"]) and callable(fake_vllm.CompletionOutput.finished)

    real_init = CLASSES["vllm.outputs.RequestOutput"]["methods"]["__init__"]["params"]
    fake_init = list(inspect.signature(fake_vllm.RequestOutput.__init__).parameters.values())
    named = [p.name for p in fake_init if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert named == [p["name"] for p in real_init][:len(named)]
    assert fake_init[-1].kind is inspect.Parameter.VAR_KEYWORD and real_init[-1]["kind"] == "var_keyword"

    kind = CLASSES["vllm.sampling_params.RequestOutputKind"]
    assert [m.name for m in fake_vllm.RequestOutputKind] == kind["members"]


def test_fake_exceptions_and_modules_mirror_vllm(monkeypatch):
    fake = fake_vllm.install(monkeypatch, "v1")
    for module_name in ("vllm.exceptions", "vllm.v1.engine.exceptions"):
        for name, obj in vars(fake.modules[module_name]).items():
            if isinstance(obj, type) and issubclass(obj, BaseException):
                real = SURFACE["exceptions"].get(f"{module_name}.{name}")
                assert real is not None, f"{module_name}.{name} is not in vLLM"
                assert [b.__name__ for b in obj.__bases__] == [b.rsplit(".", 1)[-1] for b in real["bases"]], name
    for module_name, module in fake.modules.items():
        exported = SURFACE["modules"].get(module_name)
        if exported is None:
            continue
        public = {n for n in vars(module) if not n.startswith("_") or n == "__version__"}
        assert public <= set(exported), (module_name, public - set(exported))
    assert fake.modules["vllm.v1.engine.async_llm"].AsyncLLM is fake_vllm.FakeAsyncLLM
    assert tuple(SURFACE["constants"]["vllm.config.lora.MaxLoRARanks"]) == fake_vllm.MAX_LORA_RANKS


def test_surface_records_the_http_side_for_external_engines():
    """Recorded for engines that front `vllm serve` over HTTP: its metrics and LoRA routes."""
    for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric in SURFACE["metrics"]
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                  "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "GET /metrics"):
        if route == "GET /metrics":  # mounted by prometheus instrumentation, not a decorated route
            continue
        assert route in SURFACE["http_routes"], route
    load = CLASSES["vllm.entrypoints.serve.lora.protocol.LoadLoRAAdapterRequest"]
    assert {"lora_name", "lora_path"} <= set(load["fields"])


def test_check_reports_drift_and_breaking_changes(tmp_path):
    """`check` against an edited copy of the committed JSON: a removed used method is BREAKING."""
    script = load_script()
    old = json.loads(json.dumps(SURFACE))
    old["classes"][ASYNC_LLM]["methods"]["old_method"] = old["classes"][ASYNC_LLM]["methods"]["abort"]
    changes = script.diff(old, SURFACE)
    assert any(path.endswith("methods.old_method") and new == "<removed>" for path, _, new in changes)
    assert script.diff(SURFACE, SURFACE) == []
