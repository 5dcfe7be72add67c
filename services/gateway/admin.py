"""Management API (per-token-latency thesis §6.2): deployments with a scaler
policy, and a read-only view of the cluster. Protected by the admin API key
when one is configured."""
from __future__ import annotations

import hmac
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from polyserve.core import names
from polyserve.proto import AdapterCommand, AdapterSpec, Deployment, ScalerPolicy

from .handlers import GatewayError
from .policy import InvalidRequest
from .schemas import AdapterBody, DeploymentBody

if TYPE_CHECKING:
    from .service import GatewayService


def _to_json(dep: Deployment) -> dict:
    return msgspec.to_builtins(dep)


def _adapter_rank(path: str) -> int:
    """The LoRA rank `r` from a PEFT adapter directory; InvalidRequest saying what is missing."""
    cfg = Path(path) / "adapter_config.json"
    if not (Path(path) / "adapter_model.safetensors").is_file() or not cfg.is_file():
        raise InvalidRequest(f"{path} is not a PEFT adapter directory (needs adapter_config.json and "
                             "adapter_model.safetensors readable by the workers)", "path")
    try:
        return int(json.loads(cfg.read_text())["r"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"{cfg} has no integer rank `r`: {exc}", "path") from exc


def add_admin_routes(app: FastAPI, gw: "GatewayService") -> None:
    def require_admin(request: Request) -> None:
        key = gw.settings.admin_api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-admin-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise GatewayError(401, "admin endpoints need `Authorization: Bearer <admin API key>`")

    admin = [Depends(require_admin)]

    async def state_call(coro):
        try:
            return await coro
        except Exception as exc:
            raise GatewayError(503, f"cluster state (Redis) unavailable: {exc}", retry_after=1) from exc

    @app.post("/v1/deployments", status_code=201, dependencies=admin)
    async def create(body: DeploymentBody) -> JSONResponse:
        if body.policy not in names.DISPATCH_POLICIES:
            raise InvalidRequest(f"unknown dispatch policy '{body.policy}'; choose one of "
                                 f"{sorted(names.DISPATCH_POLICIES)}", "policy")
        if body.scaler.min_replicas > body.scaler.max_replicas:
            raise InvalidRequest("scaler.min_replicas must not exceed scaler.max_replicas", "scaler.min_replicas")
        dep_id = body.id or re.sub(r"[^A-Za-z0-9_\-]", "-", body.model)[:64]
        if await state_call(gw.state.get_deployment(dep_id)) is not None:
            raise GatewayError(409, f"deployment '{dep_id}' already exists; DELETE it first or pick another id")
        dep = Deployment(id=dep_id, model=body.model, engine=body.engine, policy=body.policy,
                         scaler=ScalerPolicy(**body.scaler.model_dump()))
        await state_call(gw.state.put_deployment(dep))
        await gw.refresh_deployments(force=True)
        return JSONResponse(_to_json(dep), status_code=201)

    @app.get("/v1/deployments", dependencies=admin)
    async def list_all() -> dict:
        deps = await state_call(gw.state.list_deployments())
        return {"object": "list", "data": [_to_json(d) for d in deps]}

    @app.get("/v1/deployments/{dep_id}", dependencies=admin)
    async def get_one(dep_id: str) -> dict:
        dep = await state_call(gw.state.get_deployment(dep_id))
        if dep is None:
            raise GatewayError(404, f"no deployment '{dep_id}'; GET /v1/deployments lists them")
        plan = await state_call(gw.state.r.get(gw.keys.plan(dep_id)))
        out = _to_json(dep)
        if plan:
            out["plan"] = json.loads(plan)
        return out

    @app.delete("/v1/deployments/{dep_id}", dependencies=admin)
    async def delete(dep_id: str) -> dict:
        if not await state_call(gw.state.delete_deployment(dep_id)):
            raise GatewayError(404, f"no deployment '{dep_id}'")
        await gw.refresh_deployments(force=True)
        return {"id": dep_id, "deleted": True}

    @app.post("/v1/adapters", status_code=201, dependencies=admin)
    async def register_adapter(body: AdapterBody) -> JSONResponse:
        rank = _adapter_rank(body.path)
        if await state_call(gw.state.get_deployment(body.deployment)) is None:
            raise InvalidRequest(f"no deployment '{body.deployment}' to attach the adapter to", "deployment", 404)
        spec = AdapterSpec(name=body.name, path=str(Path(body.path).resolve()), deployment=body.deployment,
                           rank=rank)
        await state_call(gw.state.put_adapter(spec))
        if body.load:
            await gw.bus.publish(gw.subjects.adapters(body.deployment),
                                 AdapterCommand(action="load", name=spec.name, path=spec.path,
                                                deployment=spec.deployment))
        await gw.refresh_deployments(force=True)
        return JSONResponse(msgspec.to_builtins(spec), status_code=201)

    @app.get("/v1/adapters", dependencies=admin)
    async def list_adapters() -> dict:
        return {"object": "list", "data": msgspec.to_builtins(await state_call(gw.state.list_adapters()))}

    @app.delete("/v1/adapters/{name}", dependencies=admin)
    async def delete_adapter(name: str) -> dict:
        spec = gw.adapters.get(name)
        if not await state_call(gw.state.delete_adapter(name)):
            raise GatewayError(404, f"no adapter '{name}'")
        if spec is not None:
            await gw.bus.publish(gw.subjects.adapters(spec.deployment),
                                 AdapterCommand(action="unload", name=name, deployment=spec.deployment))
        await gw.refresh_deployments(force=True)
        return {"name": name, "deleted": True}

    @app.get("/v1/cluster", dependencies=admin)
    async def cluster() -> dict:
        services = await state_call(gw.state.live_services())
        workers = await state_call(gw.state.live_workers())
        agents = await state_call(gw.state.live_agents())
        return {"services": msgspec.to_builtins(services), "workers": msgspec.to_builtins(workers),
                "gpus": msgspec.to_builtins(agents)}
