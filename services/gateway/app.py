"""The gateway's FastAPI app: health, readiness, metrics, version and the model list here
(`/health` and `/ping`, GET and POST, answer as `/readyz`, as vLLM's server has them); the
OpenAI-compatible endpoints in completions.py, embeddings.py and responses.py, `/tokenize` and
`/detokenize` in tokens.py, the management API in admin.py and keys_api.py. Every route receives
the GatewayState the app was built with. Who may call what (client API keys, rate limits, access
to /metrics and /docs) is access.py: a middleware in front of everything, and a dependency of
the OpenAI routes."""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from importlib import metadata

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from . import access, admin, completions, embeddings, fastpath, keys_api, limits, responses, shed, tenancy, tokens
from .context import Gateway, GatewayState
from .errors import add_error_handlers


@dataclass
class Retiring:
    """A gateway with peers on its port retires its connections when it drains (service.py)."""
    since: float = 0.0  # monotonic start of the retirement (0: not draining)
    last_request: float = 0.0  # monotonic arrival of the last request since then


class Retire:
    """ASGI middleware: while the gateway drains, every response says `Connection: close`, so a
    keep-alive connection retires after the request in it instead of being closed under a client
    that is sending on it (service.GatewayService.on_drain)."""

    def __init__(self, app, gs: GatewayState, retiring: Retiring):
        self.app, self.gs, self.retiring = app, gs, retiring

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (self.retiring.since or self.gs.draining):
            return await self.app(scope, receive, send)
        self.retiring.last_request = time.monotonic()

        async def closing(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return await self.app(scope, receive, closing)


async def healthz() -> dict:
    return {"status": "ok"}


async def readyz(gs: Gateway) -> JSONResponse:
    """200 when the gateway can serve; else 503 with the reason (draining, NATS disconnected,
    Redis down with no deployment cached, no live dispatcher and no live worker)."""
    reason = await gs.not_ready()
    body = {"ready": not reason, "draining": gs.draining}
    if reason:
        body["reason"] = reason
    return JSONResponse(body, status_code=503 if reason else 200)


def polyserve_version() -> str:
    try:
        return metadata.version("polyserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


async def version() -> dict:
    return {"version": polyserve_version()}


async def metrics(gs: Gateway) -> Response:
    return Response(gs.metrics.render(), media_type="text/plain; version=0.0.4")


async def models(gs: Gateway) -> dict:
    deps = await gs.refresh_deployments()
    data = [{"id": d.id, "object": "model", "created": int(d.created), "owned_by": "polyserve",
             "root": d.model, "parent": None, "engine": d.engine, "policy": d.policy} for d in deps.values()]
    data += [{"id": a.name, "object": "model", "created": int(a.created), "owned_by": "polyserve",
              "root": a.name, "parent": a.deployment, "lora_rank": a.rank}  # a name: paths stay server-side
             for a in gs.adapters.values() if a.deployment in deps]
    t = tenancy.current()
    if t is not None and t.record is not None:  # a client key sees the models it may use
        data = [m for m in data if t.record.allows(m["id"], (m["root"],))]
    return {"object": "list", "data": data}


# FastAPI's own telemetry (FastAPI versions that have it) off: the gateway makes its request spans
# with its own tracer (Admission.begin), and FastAPI's would add a second server span per request
# once a global tracer provider is set (e.g. by opentelemetry-instrument); off, it also skips
# looking up three global providers on every request (py-spy: ~1% of the gateway; issue 15).
_NO_FASTAPI_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                         if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def build_app(gs: GatewayState) -> FastAPI:
    """The app serving `gs`: error envelopes, then every route."""
    docs = gs.settings.docs_access != "off"
    app = FastAPI(title="polyserve gateway", version=polyserve_version(), docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None,
                  **_NO_FASTAPI_TELEMETRY)
    app.state.gateway = gs
    add_error_handlers(app)
    # innermost of ours: the two hottest routes skip FastAPI's routing and dependency machinery
    app.add_middleware(fastpath.FastRoutes, gs=gs, handlers=app.exception_handlers)
    limits.install(app, gs.settings)  # body size/time limits before any parsing (HTTP edges)
    app.add_middleware(access.Access, gs=gs)  # keys are checked before a body is read
    app.add_middleware(shed.Shed, gs=gs)  # a full gateway refuses at once (issue 13, overload)
    app.state.retire = Retiring()
    app.add_middleware(Retire, gs=gs, retiring=app.state.retire)  # outermost: drain without cut connections
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/health", readyz, methods=["GET"], include_in_schema=False)  # vLLM's names for readiness
    app.add_api_route("/ping", readyz, methods=["GET", "POST"], include_in_schema=False)
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    openai = APIRouter(dependencies=[Depends(access.client_limits)])  # allowed models, RPM/TPM per key
    openai.add_api_route("/v1/models", models, methods=["GET"])
    completions.add_completion_routes(openai)
    embeddings.add_embedding_routes(openai)
    responses.add_response_routes(openai)
    tokens.add_token_routes(openai)
    app.include_router(openai)
    admin.add_admin_routes(app)
    keys_api.add_key_routes(app)
    return app
