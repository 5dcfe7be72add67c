"""CONTRACT test of the Kubernetes actuator on the wire (the signatures are checked in
tests/unit/test_k8s_contract.py): the real `kubernetes` client, pointed at a stub HTTP
server on loopback, must send GET/PATCH to the scale subresource with a JSON merge patch.
Integration: it does local socket I/O (no cluster runs here)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pytest

from polyserve.planner.k8s import MERGE_PATCH, KubernetesActuator

kubernetes = pytest.importorskip("kubernetes", reason="contract tests need the kubernetes client")
client = kubernetes.client

pytestmark = pytest.mark.integration


class _Stub(BaseHTTPRequestHandler):
    seen: ClassVar[list] = []
    replicas = 1

    def _scale(self, replicas):
        body = json.dumps({"apiVersion": "autoscaling/v1", "kind": "Scale",
                           "metadata": {"name": "polyserve-worker-d", "namespace": "ns"},
                           "spec": {"replicas": replicas}, "status": {"replicas": replicas}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.seen.append(("GET", self.path, self.headers.get("Content-Type"), None))
        self._scale(type(self).replicas)

    def do_PATCH(self):
        data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("PATCH", self.path, self.headers.get("Content-Type"), data))
        type(self).replicas = data["spec"]["replicas"]
        self._scale(type(self).replicas)

    def log_message(self, *args):  # keep test output clean
        pass


def test_real_client_sends_a_merge_patch_to_the_scale_subresource():
    server = HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{server.server_port}"
        apps = client.AppsV1Api(client.ApiClient(cfg))
        act = KubernetesActuator(apps, "ns", timeout_s=5)
        assert act.replicas("d").desired == 1
        assert act.scale("d", 4) == 4
        assert act.replicas("d").desired == 4
    finally:
        server.shutdown()
        server.server_close()
    path = "/apis/apps/v1/namespaces/ns/deployments/polyserve-worker-d/scale"
    assert [(m, p) for m, p, _, _ in _Stub.seen] == [("GET", path), ("PATCH", path), ("GET", path)]
    _, _, ctype, body = _Stub.seen[1]
    assert ctype == MERGE_PATCH and body == {"spec": {"replicas": 4}}
