"""Static checks of the Kubernetes manifests in infra/k8s (no cluster runs here).

Every document must parse, be a kind we know, use only fields that the official
`kubernetes` client's models define for that kind (walked recursively through each
model's `openapi_types`/`attribute_map`) and deserialize into that model. Then the
cross-references: kustomization lists every file, Services select pods that exist,
GPU pods request `nvidia.com/gpu`, the planner's service account may patch
deployments/scale, env names are real settings, commands run real modules.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
KINDS = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Service"): "V1Service",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
PRIMITIVES = {"str", "int", "bool", "float", "object", "datetime", "date", "bytearray"}


def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in manifests() if d["kind"] == kind]


def check_fields(value, type_name: str, where: str, client) -> list[str]:
    """Unknown fields in `value` for the client's type `type_name` (both the legacy
    'list[X]'/'dict(str, X)' and the newer 'List[X]'/'Dict[str, X]' spellings)."""
    type_name = type_name.strip()
    m = re.fullmatch(r"(?:list|List)\[(.+)\]", type_name)
    if m:
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [e for i, v in enumerate(value) for e in check_fields(v, m.group(1), f"{where}[{i}]", client)]
    m = re.fullmatch(r"(?:dict\(str, *(.+)\)|Dict\[str, *(.+)\])", type_name)
    if m:
        inner = m.group(1) or m.group(2)
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        return [e for k, v in value.items() for e in check_fields(v, inner, f"{where}.{k}", client)]
    if type_name in PRIMITIVES or not hasattr(client, type_name):
        return []
    model = getattr(client, type_name)
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping"]
    json_to_attr = {j: a for a, j in model.attribute_map.items()}
    errors = []
    for key, v in value.items():
        if key not in json_to_attr:
            errors.append(f"{where}.{key}: not a field of {type_name}")
        else:
            errors += check_fields(v, model.openapi_types[json_to_attr[key]], f"{where}.{key}", client)
    return errors


def test_every_document_parses_and_is_a_known_kind():
    docs = manifests()
    assert len(docs) >= 12
    for name, doc in docs:
        assert (doc.get("apiVersion"), doc.get("kind")) in KINDS, f"{name}: {doc.get('apiVersion')} {doc.get('kind')}"
        assert doc["metadata"]["name"], name
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "polyserve", f"{name}: {doc['metadata']['name']}"


def test_fields_match_the_kubernetes_client_models():
    kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client is needed to check field names")
    client = kubernetes.client
    api = client.ApiClient()
    for name, doc in manifests():
        model = KINDS[(doc["apiVersion"], doc["kind"])]
        assert check_fields(doc, model, f"{name}:{doc['kind']}", client) == []
        obj = api._ApiClient__deserialize(doc, model)  # the client's own validation (types, required names)
        assert obj.metadata.name == doc["metadata"]["name"]


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    assert kust["resources"][0] == "namespace.yaml"


def test_six_services_run_real_modules_and_selectors_match():
    deployments = {d["metadata"]["name"]: d for d in by_kind("Deployment")}
    modules = set()
    for dep in deployments.values():
        spec = dep["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), dep["metadata"]["name"]
        for c in spec["template"]["spec"]["containers"]:
            cmd = c.get("command", [])
            if cmd[:2] == ["python", "-m"]:
                mod = cmd[2].split(".", 1)[1]
                assert (ROOT / "services" / mod / "__main__.py").is_file(), cmd
                modules.add(mod)
    assert modules == {"gateway", "predictor", "dispatcher", "planner", "gpu_agent", "worker"}
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in deployments.values()]
    for svc in by_kind("Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= p.items() for p in pods), f"Service {svc['metadata']['name']} selects no pod"
    assert {s["metadata"]["name"] for s in by_kind("Service")} >= {"gateway", "nats", "redis"}


def test_gpu_pods_request_a_gpu_and_others_do_not():
    for dep in by_kind("Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            gpus = (c.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu")
            if c["name"] in ("gpu-agent", "worker"):
                assert str(gpus) == "1", c["name"]
            else:
                assert gpus is None, c["name"]


def test_planner_may_scale_deployments_and_nothing_more():
    [sa] = by_kind("ServiceAccount")
    [role] = by_kind("Role")
    [binding] = by_kind("RoleBinding")
    [planner] = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "planner"]
    assert planner["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    scale = [r for r in role["rules"] if "deployments/scale" in r["resources"]]
    assert scale and {"get", "patch"} <= set(scale[0]["verbs"]) and scale[0]["apiGroups"] == ["apps"]
    for rule in role["rules"]:  # no secrets, no pods/exec, no wildcard
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert set(rule["resources"]) <= {"deployments", "deployments/scale"}
    env = {e["name"]: e.get("value") for e in planner["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POLYSERVE_PLANNER_ACTUATOR"] == "kubernetes"
    from polyserve.planner.k8s import k8s_name
    template = env["POLYSERVE_PLANNER_K8S_NAME_TEMPLATE"]
    workers = [d for d in by_kind("Deployment") if d["metadata"]["name"].startswith("polyserve-worker-")]
    for w in workers:  # the planner finds each worker Deployment by its deployment id
        dep_id = next(e["value"] for e in w["spec"]["template"]["spec"]["containers"][0]["env"]
                      if e["name"] == "POLYSERVE_WORKER_DEPLOYMENT")
        assert k8s_name(template.format(deployment=dep_id)) == w["metadata"]["name"]


def test_env_names_are_real_settings_and_clock_control_stays_off():
    from polyserve.dispatcher.config import DispatcherSettings
    from polyserve.gateway.config import GatewaySettings
    from polyserve.gpu_agent.config import GpuAgentSettings
    from polyserve.planner.config import PlannerSettings
    from polyserve.predictor.config import PredictorSettings
    from polyserve.shared.settings import CommonSettings
    from polyserve.worker.config import WorkerSettings

    per_service = {"GATEWAY": GatewaySettings, "PREDICTOR": PredictorSettings, "DISPATCHER": DispatcherSettings,
                   "PLANNER": PlannerSettings, "GPU_AGENT": GpuAgentSettings, "WORKER": WorkerSettings}
    names = [k for cm in by_kind("ConfigMap") for k in cm["data"]]
    names += [e["name"] for d in by_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]
              for e in c.get("env", [])]
    for name in names:
        if not name.startswith("POLYSERVE_"):
            continue
        rest = name[len("POLYSERVE_"):]
        svc = next((s for s in per_service if rest.startswith(s + "_")), None)
        cls, field = (per_service[svc], rest[len(svc) + 1:]) if svc else (CommonSettings, rest)
        assert field.lower() in cls.__struct_fields__, f"{name} is not a setting of {cls.__name__}"
    [agent] = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "gpu-agent"]
    env = {e["name"]: e.get("value") for e in agent["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POLYSERVE_GPU_AGENT_ALLOW_CLOCK_CONTROL"] == "false"
