"""Static checks of the Kubernetes manifests in infra/k8s (no cluster runs here).

Every document must parse, be a kind we know, validate in STRICT mode against the
Kubernetes OpenAPI schemas shipped in `kubernetes-validate` (offline; unknown fields are
errors), use only fields that the official `kubernetes` client's models define for that
kind and deserialize into that model. Then the cross-references: kustomization lists every
file (but the Secret example), Services select pods that exist, GPU pods request
`nvidia.com/gpu` on GPU nodes, the planner's service account may patch deployments/scale,
env names are real settings, commands run real modules, NATS is a 3-node JetStream cluster
on volumes, Redis persists (AOF everysec) with a replica and Sentinels, secrets are
referenced not inlined, NetworkPolicies fence NATS and Redis, probes match the gateway's
/readyz and /healthz.
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
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("v1", "Secret"): "V1Secret",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
}
K8S_VERSION = "1.30.0"  # the oldest Kubernetes these manifests target (validated strictly)
SERVICES = ["gateway", "predictor", "dispatcher", "planner", "gpu-agent", "worker"]
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
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secrets.example.yaml"}
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
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in by_kind("Deployment") + by_kind("StatefulSet")]
    for svc in by_kind("Service"):
        sel = {k: v for k, v in svc["spec"]["selector"].items()
               if k != "statefulset.kubernetes.io/pod-name"}  # set by the StatefulSet controller
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


# ----------------------------------------------------------------------------- strict schemas
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    errors = []
    for name, doc in manifests():
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except (kv.ValidationError, kv.InvalidSchemaError, kv.SchemaNotFoundError) as exc:
            errors.append(f"{name}: {doc['kind']} {doc['metadata']['name']}: {getattr(exc, 'message', exc)}")
    assert errors == []


def test_strict_validation_rejects_an_unknown_field():
    kv = pytest.importorskip("kubernetes_validate")
    [nats] = [d for d in by_kind("StatefulSet") if d["metadata"]["name"] == "nats"]
    broken = yaml.safe_load(yaml.safe_dump(nats))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # misspelt
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


# ----------------------------------------------------------------------------- NATS and Redis
def _container(doc: dict, name: str) -> dict:
    return next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_nats_is_a_three_node_jetstream_cluster_on_volumes():
    [nats] = [d for d in by_kind("StatefulSet") if d["metadata"]["name"] == "nats"]
    [cfg] = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "nats-config"]
    conf = cfg["data"]["nats.conf"]
    replicas = nats["spec"]["replicas"]
    assert replicas == 3 and nats["spec"]["serviceName"] == "nats-headless"
    routes = re.findall(r"nats://(nats-\d+)\.nats-headless\.polyserve\.svc:6222", conf)
    assert routes == [f"nats-{i}" for i in range(replicas)], "one route per StatefulSet ordinal"
    store = re.search(r"store_dir:\s*(\S+)", conf).group(1)
    [claim] = nats["spec"]["volumeClaimTemplates"]
    mount = next(m for m in _container(nats, "nats")["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert store.startswith(mount["mountPath"] + "/"), "JetStream must store on the PVC"
    assert "jetstream" in conf and "cluster" in conf and "authorization" in conf
    assert "--config" in _container(nats, "nats")["args"]
    headless = next(s for s in by_kind("Service") if s["metadata"]["name"] == "nats-headless")
    assert headless["spec"]["clusterIP"] == "None" and {p["port"] for p in headless["spec"]["ports"]} >= {4222, 6222}
    pdb = next(p for p in by_kind("PodDisruptionBudget") if p["metadata"]["name"] == "nats")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_redis_persists_with_aof_everysec_a_replica_and_sentinels():
    [redis] = [d for d in by_kind("StatefulSet") if d["metadata"]["name"] == "redis"]
    [sentinel] = [d for d in by_kind("StatefulSet") if d["metadata"]["name"] == "redis-sentinel"]
    [cfg] = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "redis-config"]
    conf = cfg["data"]["redis.conf"]
    assert "appendonly yes" in conf and "appendfsync everysec" in conf and "dir /data" in conf
    assert redis["spec"]["replicas"] >= 2 and sentinel["spec"]["replicas"] == 3
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == claim["metadata"]["name"] and m["mountPath"] == "/data"
               for m in _container(redis, "redis")["volumeMounts"])
    assert "--replicaof" in cfg["data"]["start.sh"] and "--requirepass" in cfg["data"]["start.sh"]
    [scfg] = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "redis-sentinel-config"]
    assert re.search(r"sentinel monitor polyserve redis-0\.redis-headless\.polyserve\.svc 6379 2", scfg["data"]["start.sh"])
    primary = next(s for s in by_kind("Service") if s["metadata"]["name"] == "redis")
    assert primary["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "redis-0"


# ----------------------------------------------------------------------------- secrets, policies, probes
def _secret_refs() -> set[tuple[str, str]]:
    refs = set()
    for d in by_kind("Deployment") + by_kind("StatefulSet"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
    return refs


def test_credentials_come_from_secrets_that_are_documented_not_applied():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "secrets.example.yaml" not in kust["resources"]
    example = {(d["metadata"]["name"], k) for d in by_kind("Secret") for k in d["stringData"]}
    assert _secret_refs() <= example, _secret_refs() - example
    assert all("REPLACE" in v for d in by_kind("Secret") for k, v in d["stringData"].items() if k != "user")
    for d in by_kind("Deployment"):
        env = {e["name"]: e for e in _container(d, d["spec"]["template"]["spec"]["containers"][0]["name"])["env"]}
        names = list(env)
        for url, needs in (("POLYSERVE_NATS_URL", ["NATS_USER", "NATS_PASSWORD"]),
                           ("POLYSERVE_REDIS_URL", ["REDIS_PASSWORD"])):
            assert url in env, (d["metadata"]["name"], url)
            for var in needs:  # $(VAR) expands only variables defined earlier in the list
                assert f"$({var})" in env[url]["value"] and names.index(var) < names.index(url)
    for cm in by_kind("ConfigMap"):
        assert not any("PASSWORD" in k or "@" in str(v) for k, v in (cm.get("data") or {}).items()
                       if k.startswith("POLYSERVE_")), cm["metadata"]["name"]


def test_network_policies_admit_only_the_services_to_nats_and_redis():
    policies = {p["metadata"]["name"]: p for p in by_kind("NetworkPolicy")}
    for store, port in (("nats", 4222), ("redis", 6379)):
        pol = policies[store]
        assert pol["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": store}
        assert pol["spec"]["policyTypes"] == ["Ingress"]
        rule = next(r for r in pol["spec"]["ingress"] if {p["port"] for p in r["ports"]} == {port})
        allowed = set(rule["from"][0]["podSelector"]["matchExpressions"][0]["values"])
        assert set(SERVICES) <= allowed and "prometheus" not in allowed
    nats_rules = policies["nats"]["spec"]["ingress"]
    routes = next(r for r in nats_rules if r["ports"][0]["port"] == 6222)
    assert routes["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}


def test_probes_match_the_gateways_health_endpoints_and_everything_requests_resources():
    gateway = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "gateway")
    c = _container(gateway, "gateway")
    port = next(p for p in c["ports"] if p["name"] == c["readinessProbe"]["httpGet"]["port"])["containerPort"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert str(port) == env["POLYSERVE_GATEWAY_PORT"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    gateway_src = "".join(p.read_text() for p in (ROOT / "services" / "gateway").glob("*.py"))
    assert '"/readyz"' in gateway_src and '"/healthz"' in gateway_src  # the routes the gateway serves
    for other in ("predictor", "dispatcher", "planner", "gpu-agent", "worker"):  # no HTTP server: no httpGet probe
        d = next(x for x in by_kind("Deployment") if x["metadata"]["labels"]["app.kubernetes.io/name"] == other)
        assert all("httpGet" not in (cc.get(k) or {}) for cc in d["spec"]["template"]["spec"]["containers"]
                   for k in ("readinessProbe", "livenessProbe"))
    for d in by_kind("Deployment") + by_kind("StatefulSet"):
        for cc in d["spec"]["template"]["spec"]["containers"]:
            req = cc["resources"]["requests"]
            assert "cpu" in req and "memory" in req, (d["metadata"]["name"], cc["name"])
            assert "memory" in cc["resources"].get("limits", {}), (d["metadata"]["name"], cc["name"])


def test_gpu_pods_are_scheduled_on_gpu_nodes():
    for d in by_kind("Deployment"):
        spec = d["spec"]["template"]["spec"]
        gpu = any((c.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu") for c in spec["containers"])
        if gpu:
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, d["metadata"]["name"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        else:
            assert "nodeSelector" not in spec and "tolerations" not in spec, d["metadata"]["name"]
