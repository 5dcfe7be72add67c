"""CONTRACT tests of the Kubernetes actuator against the official `kubernetes` client's
API shape. No cluster runs here, so these check the two seams the actuator depends on:

1. signatures (here): a fake AppsV1Api whose methods have the real client's parameter
   names; every call the actuator makes must bind to the REAL method's signature, and the
   fake answers with the client's real `V1Scale` model;
2. the wire (tests/integration/test_k8s_wire.py, it does local socket I/O): the real
   client, pointed at a stub HTTP server on loopback, must send GET/PATCH to the scale
   subresource with a JSON merge patch.
"""
from __future__ import annotations

import inspect

import pytest

from polyserve.planner.k8s import MERGE_PATCH, ActuatorError, KubernetesActuator, k8s_name

kubernetes = pytest.importorskip("kubernetes", reason="contract tests need the kubernetes client")
client = kubernetes.client

pytestmark = pytest.mark.unit


class FakeAppsV1Api:
    """Same parameter names as AppsV1Api's two scale methods; records calls."""

    def __init__(self, replicas: int = 2, fail: Exception | None = None):
        self.replicas, self.fail, self.calls = replicas, fail, []

    def read_namespaced_deployment_scale(self, name, namespace, **kwargs):
        self.calls.append(("read_namespaced_deployment_scale", (), dict(name=name, namespace=namespace, **kwargs)))
        if self.fail:
            raise self.fail
        return client.V1Scale(api_version="autoscaling/v1", kind="Scale",
                              metadata=client.V1ObjectMeta(name=name, namespace=namespace),
                              spec=client.V1ScaleSpec(replicas=self.replicas),
                              status=client.V1ScaleStatus(replicas=self.replicas - 1))

    def patch_namespaced_deployment_scale(self, name, namespace, body, **kwargs):
        self.calls.append(("patch_namespaced_deployment_scale", (),
                           dict(name=name, namespace=namespace, body=body, **kwargs)))
        if self.fail:
            raise self.fail
        self.replicas = body["spec"]["replicas"]
        return client.V1Scale(spec=client.V1ScaleSpec(replicas=self.replicas))


def test_fake_has_the_real_methods_and_parameter_names():
    for name in ("read_namespaced_deployment_scale", "patch_namespaced_deployment_scale"):
        real = inspect.signature(getattr(client.AppsV1Api, name))
        fake = inspect.signature(getattr(FakeAppsV1Api, name))
        explicit = [p for p in fake.parameters if fake.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD]
        assert explicit == [p for p in real.parameters][:len(explicit)], name
        for p in explicit[1:]:
            assert real.parameters[p].default is inspect.Parameter.empty, f"{name}.{p} is required in the client"


def test_every_call_binds_to_the_real_signature_and_uses_real_models():
    fake = FakeAppsV1Api(replicas=3)
    act = KubernetesActuator(fake, "polyserve")
    r = act.replicas("Llama_2.70B")
    assert (r.desired, r.current) == (3, 2)
    assert act.scale("Llama_2.70B", 5) == 5
    for method, args, kwargs in fake.calls:
        inspect.signature(getattr(client.AppsV1Api, method)).bind(object(), *args, **kwargs)  # raises if not
        assert kwargs["name"] == "polyserve-worker-llama-2-70b" and kwargs["namespace"] == "polyserve"
    patch = fake.calls[-1][2]
    assert patch["body"] == {"spec": {"replicas": 5}} and patch["_content_type"] == MERGE_PATCH
    # the patch body is a valid Scale for the client's own model
    client.ApiClient()._ApiClient__deserialize({"apiVersion": "autoscaling/v1", "kind": "Scale", **patch["body"]},
                                               "V1Scale")


def test_api_errors_become_actuator_errors_with_status():
    act = KubernetesActuator(FakeAppsV1Api(fail=client.ApiException(status=403, reason="Forbidden")), "ns")
    with pytest.raises(ActuatorError) as err:
        act.scale("d", 2)
    assert err.value.status == 403 and "Forbidden" in str(err.value) and "ns/polyserve-worker-d" in str(err.value)
    with pytest.raises(ValueError):
        act.scale("d", -1)


def test_names_are_dns_labels():
    assert k8s_name("polyserve-worker-My Model.v1") == "polyserve-worker-my-model-v1"
    assert len(k8s_name("x" * 100)) == 63
    with pytest.raises(ValueError):
        k8s_name("***")
