"""`polyserve credentials k8s` (issue 14): the Secret manifest for infra/k8s gives each service its
own NATS user. The Secrets validate strictly as Kubernetes objects, have the keys the manifests
read (and those of secrets.example.yaml), every service's Deployment reads only its own password
key as its own user, the NATS pods mount only `auth.conf`, whose users carry exactly the
permissions `polyserve up` gives (shared/auth.nats_permissions); the file is owner-only, a re-run
keeps the passwords and --rotate changes them. tests/integration/test_k8s_nats_auth.py starts a
real nats-server with it."""
from __future__ import annotations

import json
import os
import re
import stat

import pytest
import yaml

from polyserve.cli import credentials
from polyserve.shared import auth
from tests.unit.test_k8s_manifests import K8S_VERSION, _container, by_kind

pytestmark = pytest.mark.unit
K8S_SERVICES = ("gateway", "predictor", "dispatcher", "planner", "gpu-agent", "worker")


def generated(tmp_path) -> dict[str, dict]:
    path = credentials.write_k8s_secrets(tmp_path / "secrets")
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def users_of(auth_conf: str) -> dict[str, dict]:
    body = auth_conf[auth_conf.index("authorization:") + len("authorization:"):]
    return {u["user"]: u for u in json.loads(body)["users"]}


def test_the_secrets_validate_and_have_every_key_the_manifests_read(tmp_path):
    kv = pytest.importorskip("kubernetes_validate")
    docs = generated(tmp_path)
    assert set(docs) == {"polyserve-nats", "polyserve-redis", "polyserve-admin"}
    for doc in docs.values():
        kv.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["namespace"] == "polyserve" and doc["type"] == "Opaque"
    have = {(n, k) for n, d in docs.items() for k in d["stringData"]}
    example = {(d["metadata"]["name"], k) for d in by_kind("Secret") for k in d["stringData"]}
    assert have == example  # the example shows exactly what is generated
    refs = set()
    for d in by_kind("Deployment") + by_kind("StatefulSet"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            refs |= {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                     for e in c.get("env", []) if "secretKeyRef" in (e.get("valueFrom") or {})}
        for v in d["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in v:
                refs |= {(v["secret"]["secretName"], i["key"]) for i in v["secret"]["items"]}
    assert refs <= have, refs - have


def test_each_service_connects_as_its_own_user_with_its_own_key():
    seen = set()
    for d in by_kind("Deployment"):
        name = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        c = _container(d, d["spec"]["template"]["spec"]["containers"][0]["name"])
        env = {e["name"]: e for e in c["env"]}
        assert env["NATS_USER"]["value"] == name, d["metadata"]["name"]
        assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "polyserve-nats", "key": name}
        assert "$(NATS_USER):$(NATS_PASSWORD)@" in env["POLYSERVE_NATS_URL"]["value"]
        seen.add(name)
    assert seen == set(K8S_SERVICES)


def test_nats_mounts_only_auth_conf_and_includes_it():
    [nats] = [d for d in by_kind("StatefulSet") if d["metadata"]["name"] == "nats"]
    [cfg] = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "nats-config"]
    conf = cfg["data"]["nats.conf"]
    assert "password" not in conf and "$NATS_" not in conf
    include = re.search(r"^\s*include\s+(\S+)\s*$", conf, re.M).group(1)
    mount = next(m for m in _container(nats, "nats")["volumeMounts"] if m["name"] == "auth")
    config_dir = next(m for m in _container(nats, "nats")["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert os.path.normpath(os.path.join(config_dir, include)) == f"{mount['mountPath']}/{credentials.K8S_AUTH_FILE}"
    [vol] = [v for v in nats["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert vol["secret"]["items"] == [{"key": "auth.conf", "path": "auth.conf"}]  # no service password in the pod
    assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in _container(nats, "nats").get("env", []))


def test_auth_conf_grants_each_user_exactly_the_polyserve_up_permissions(tmp_path):
    docs = generated(tmp_path)
    nats = docs["polyserve-nats"]["stringData"]
    users = users_of(nats[credentials.K8S_AUTH_FILE])
    perms = auth.nats_permissions("polyserve")
    assert set(users) == {*K8S_SERVICES, auth.OPERATOR}
    for name, u in users.items():
        assert u["permissions"] == perms[name], name
        assert u["password"] == nats[name] and len(nats[name]) >= 32
    assert len({nats[u] for u in users}) == len(users)  # no two users share a password
    assert docs["polyserve-admin"]["stringData"]["api-key"] and docs["polyserve-redis"]["stringData"]["password"]


def test_the_file_is_owner_only_kept_on_rerun_and_rotated_on_request(tmp_path, capsys):
    out = tmp_path / "secrets"
    assert credentials.main(["k8s", "--dir", str(out)]) == 0
    path = out / "k8s-secrets.yaml"
    assert "kubectl apply -f" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(out.stat().st_mode) == 0o700
    first = path.read_text()
    credentials.main(["k8s", "--dir", str(out)])
    assert path.read_text() == first  # idempotent: applying again changes nothing
    credentials.main(["k8s", "--dir", str(out), "--rotate"])
    rotated = yaml.safe_load_all(path.read_text())
    old = {d["metadata"]["name"]: d["stringData"] for d in yaml.safe_load_all(first) if d}
    for d in rotated:
        if d:
            for k, v in d["stringData"].items():
                if k != credentials.K8S_AUTH_FILE:
                    assert v != old[d["metadata"]["name"]][k], k
    credentials.main(["k8s", "--dir", str(out), "--prefix", "team1", "--namespace", "ml"])
    doc = next(yaml.safe_load_all(path.read_text()))
    assert doc["metadata"]["namespace"] == "ml"
    assert users_of(doc["stringData"]["auth.conf"])["planner"]["permissions"] == auth.nats_permissions("team1")["planner"]


def test_compose_target_still_works(tmp_path):
    assert credentials.main(["compose", "--dir", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "gateway.env").is_file() and (tmp_path / "c" / "nats.conf").is_file()
