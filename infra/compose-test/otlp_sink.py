"""A tiny OTLP/HTTP trace receiver standing in for Jaeger in scripts/compose-test (no image
registry is reachable there). Accepts `POST /v1/traces` (protobuf, or JSON), decodes the
spans with opentelemetry-proto (installed in the polyserve image) and keeps a summary that
`GET /spans` returns as JSON: {"requests": N, "spans": [{"service", "name", "trace_id"}]}.

    python otlp_sink.py --host 127.0.0.1 --port 4318
"""
from __future__ import annotations

import argparse
import gzip
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_SPANS = 10_000
_lock = threading.Lock()
_requests = 0
_spans: list[dict] = []


def summarize(body: bytes, content_type: str) -> list[dict]:
    """The (service, span name, trace id) of every span in one OTLP export request."""
    if "json" in content_type:
        doc = json.loads(body)
        out = []
        for rs in doc.get("resourceSpans", []):
            attrs = {a["key"]: a.get("value", {}).get("stringValue") for a in rs.get("resource", {}).get("attributes", [])}
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    out.append({"service": attrs.get("service.name"), "name": sp.get("name"),
                                "trace_id": sp.get("traceId")})
        return out
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for sp in ss.spans:
                out.append({"service": attrs.get("service.name"), "name": sp.name, "trace_id": sp.trace_id.hex()})
    return out


class Handler(BaseHTTPRequestHandler):
    def _reply(self, status: int, doc: dict, raw: bytes | None = None, ctype: str = "application/json") -> None:
        data = raw if raw is not None else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        global _requests
        if self.path.rstrip("/") != "/v1/traces":
            self._reply(404, {"error": f"no route {self.path}"})
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding", "") == "gzip":
            body = gzip.decompress(body)
        ctype = self.headers.get("Content-Type", "application/x-protobuf")
        try:
            spans = summarize(body, ctype)
        except Exception as exc:  # a malformed export is answered 400, as a collector would
            self._reply(400, {"error": str(exc)})
            return
        with _lock:
            _requests += 1
            _spans.extend(spans[: max(0, MAX_SPANS - len(_spans))])
        if "json" in ctype:
            self._reply(200, {})
        else:  # an empty ExportTraceServiceResponse
            self._reply(200, {}, raw=b"", ctype="application/x-protobuf")

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/spans", ""):
            with _lock:
                self._reply(200, {"requests": _requests, "spans": list(_spans)})
        elif self.path == "/healthz":
            self._reply(200, {"ok": True})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def log_message(self, fmt: str, *args) -> None:  # quiet: one line per export would flood the log
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4318)
    args = ap.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    # PID 1 of its container: without a handler SIGTERM would be ignored until SIGKILL
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"OTLP/HTTP sink on http://{args.host}:{args.port}/v1/traces; summary at GET /spans", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
