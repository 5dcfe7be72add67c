"""Kubernetes actuator: the planner's replica count for a deployment becomes the
`replicas` of a Kubernetes Deployment, through the official `kubernetes` client.

One Kubernetes Deployment per polyserve deployment, named by `name_template`
(default `polyserve-worker-{deployment}`, see `infra/k8s/worker.yaml`); each pod runs
one worker with one `nvidia.com/gpu`. The actuator reads and patches the Deployment's
`scale` subresource (`AppsV1Api.read_namespaced_deployment_scale`,
`patch_namespaced_deployment_scale`), which is what `kubectl scale` does and what the
planner's Role in `infra/k8s/planner.yaml` allows (get/patch on deployments/scale).

The patch is a JSON merge patch `{"spec": {"replicas": n}}` sent with an explicit
`Content-Type: application/merge-patch+json`, so the request does not depend on which
patch type a client version picks by itself (37.0.2 sends strategic-merge-patch+json
for a dict body; its operation lists json-patch+json first, which an API server
rejects for an object). `tests/unit/test_k8s_contract.py` checks the header on the wire.

No cluster runs in this project's CI: the contract tests check this module against
the client's real method signatures and its real HTTP requests to a stub server.
The client is imported lazily, so the planner needs it only with `actuator=kubernetes`.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"


class ActuatorError(RuntimeError):
    """The Kubernetes API refused or failed; `status` is its HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


@dataclass(frozen=True)
class Replicas:
    desired: int  # spec.replicas
    current: int  # status.replicas (pods that exist)


def k8s_name(text: str) -> str:
    """A DNS-1123 label: lower case, [a-z0-9-], at most 63 characters, alphanumeric ends."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    if not name:
        raise ValueError(f"{text!r} yields no valid Kubernetes name")
    return name


class KubernetesActuator:
    """Reads and sets the replica count of the Deployment behind a polyserve deployment.

    `apps` is an `AppsV1Api` (or anything with the same two methods). The calls block:
    the planner runs them in a thread.
    """

    def __init__(self, apps: Any, namespace: str, name_template: str = "polyserve-worker-{deployment}",
                 timeout_s: float = 10.0):
        self.apps, self.namespace, self.name_template, self.timeout_s = apps, namespace, name_template, timeout_s

    @classmethod
    def from_config(cls, namespace: str, *, in_cluster: bool = True, kubeconfig: str | None = None,
                    context: str | None = None, **kw: Any) -> KubernetesActuator:
        """Build the client from the pod's service account (in cluster) or a kubeconfig."""
        from kubernetes import client, config

        if in_cluster:
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)
        return cls(client.AppsV1Api(), namespace, **kw)

    def name_of(self, deployment: str) -> str:
        return k8s_name(self.name_template.format(deployment=deployment))

    def replicas(self, deployment: str) -> Replicas:
        name = self.name_of(deployment)
        scale = self._call("read", name, lambda: self.apps.read_namespaced_deployment_scale(
            name=name, namespace=self.namespace, _request_timeout=self.timeout_s))
        spec = getattr(scale, "spec", None)
        status = getattr(scale, "status", None)
        return Replicas(int(getattr(spec, "replicas", 0) or 0), int(getattr(status, "replicas", 0) or 0))

    def scale(self, deployment: str, replicas: int) -> int:
        """Set spec.replicas; returns what the API server now holds."""
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        name = self.name_of(deployment)
        body = {"spec": {"replicas": int(replicas)}}
        scale = self._call("patch", name, lambda: self.apps.patch_namespaced_deployment_scale(
            name=name, namespace=self.namespace, body=body, _content_type=MERGE_PATCH,
            _request_timeout=self.timeout_s))
        got = int(getattr(getattr(scale, "spec", None), "replicas", replicas) or 0)
        logger.info("kubernetes: %s/%s replicas -> %d", self.namespace, name, got)
        return got

    def _call(self, what: str, name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            status = int(getattr(exc, "status", 0) or 0)
            reason = getattr(exc, "reason", None) or str(exc)
            raise ActuatorError(status, f"{what} scale of deployment {self.namespace}/{name}: {reason}") from exc
