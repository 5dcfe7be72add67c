"""Management API (per-token-latency thesis §6.2): deployments with a scaler policy
and their SLOs, LoRA adapters, and a read-only view of the cluster. Protected by the
admin API key when one is configured. Every route receives the GatewayState."""
from __future__ import annotations

import hmac
import json
import os
import re
from pathlib import Path

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from polyserve.core import names
from polyserve.proto import AdapterCommand, AdapterSpec, Deployment, ScalerPolicy

from .context import Gateway
from .errors import GatewayError
from .policy import InvalidRequest
from .schemas import AdapterBody, DeploymentBody


def require_admin(request: Request, gs: Gateway) -> None:
    """401 unless the request carries the admin API key (when one is configured)."""
    key = gs.settings.admin_api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-admin-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise GatewayError(401, "admin endpoints need `Authorization: Bearer <admin API key>`")


async def state_call(coro):
    """Await a Redis call; 503 (retry shortly) when Redis does not answer."""
    try:
        return await coro
    except Exception as exc:
        raise GatewayError(503, f"cluster state (Redis) unavailable: {exc}", retry_after=1) from exc


def _to_json(dep: Deployment) -> dict:
    return msgspec.to_builtins(dep)


def adapter_roots(setting: str) -> list[Path]:
    """The configured adapter roots (os.pathsep-separated), resolved; [] when none is configured."""
    return [Path(p).expanduser().resolve() for p in setting.split(os.pathsep) if p.strip()]


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def adapter_dir(given: str, roots: list[Path]) -> Path:
    """The adapter directory `given` names, resolved (symlinks followed), when it and the files
    the workers read lie under one of `roots`; InvalidRequest naming the problem otherwise.
    Nothing outside the roots is looked at, and no message shows a file's content or a link's target."""
    if not roots:
        raise InvalidRequest("adapter registration is off: no adapter root is configured; the operator sets "
                             "POLYSERVE_GATEWAY_ADAPTER_ROOTS to the directories adapters may be registered from "
                             f"('{os.pathsep}'-separated; `polyserve up` allows $POLYSERVE_HOME/adapters)", "path")
    allowed = ", ".join(str(r) for r in roots)
    raw = Path(given).expanduser()
    if not raw.is_absolute():
        raise InvalidRequest(f"path must be absolute, under one of the adapter roots ({allowed})", "path")
    resolved = raw.resolve()
    if not _inside(resolved, roots):
        what = "resolves (through a symlink) to a directory" if _inside(Path(os.path.normpath(raw)), roots) else "is"
        raise InvalidRequest(f"{given} {what} outside the adapter roots ({allowed})", "path")
    cfg, weights = resolved / "adapter_config.json", resolved / "adapter_model.safetensors"
    for f in (cfg, weights):
        if f.is_symlink() and not _inside(f.resolve(), roots):
            raise InvalidRequest(f"{given}/{f.name} is a symlink to a file outside the adapter roots", "path")
    if not weights.is_file() or not cfg.is_file():
        raise InvalidRequest(f"{given} is not a PEFT adapter directory (needs adapter_config.json and "
                             "adapter_model.safetensors readable by the workers)", "path")
    return resolved


def _adapter_rank(adapter: Path) -> int:
    """The LoRA rank `r` from a PEFT adapter directory; InvalidRequest saying what is wrong
    (never what the file holds)."""
    try:
        if (adapter / "adapter_config.json").stat().st_size > 1 << 20:
            raise InvalidRequest("adapter_config.json is larger than 1 MiB; not a PEFT adapter config", "path")
        cfg = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"adapter_config.json is not readable JSON ({type(exc).__name__})", "path") from None
    rank = cfg.get("r") if isinstance(cfg, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= 65_536:
        raise InvalidRequest("adapter_config.json has no rank `r` that is a positive integer (up to 65536)",
                             "path")
    return rank


def check_scaler_bounds(body: DeploymentBody, limit: int) -> None:
    """400 naming the field: replica counts above the gateway's max_replicas_limit, min > max."""
    sc = body.scaler
    for field in ("max_replicas", "min_replicas"):
        value = getattr(sc, field)
        if value > limit:
            raise InvalidRequest(f"scaler.{field} {value} is above this gateway's limit of {limit} replicas "
                                 "(setting max_replicas_limit)", f"scaler.{field}")
    if sc.min_replicas > sc.max_replicas:
        raise InvalidRequest("scaler.min_replicas must not exceed scaler.max_replicas", "scaler.min_replicas")


async def create(body: DeploymentBody, gs: Gateway) -> JSONResponse:
    if body.policy not in names.DISPATCH_POLICIES:
        raise InvalidRequest(f"unknown dispatch policy '{body.policy}'; choose one of "
                             f"{sorted(names.DISPATCH_POLICIES)}", "policy")
    check_scaler_bounds(body, gs.settings.max_replicas_limit)
    dep_id = body.id or re.sub(r"[^A-Za-z0-9_\-]", "-", body.model)[:64]
    if await state_call(gs.state.get_deployment(dep_id)) is not None:
        raise GatewayError(409, f"deployment '{dep_id}' already exists; DELETE it first or pick another id")
    dep = Deployment(id=dep_id, model=body.model, engine=body.engine, policy=body.policy,
                     scaler=ScalerPolicy(**body.scaler.model_dump()), ttft_slo_ms=body.ttft_slo_ms,
                     atgt_slo_ms=body.atgt_slo_ms, reasoning_parser=body.reasoning_parser)
    await state_call(gs.state.put_deployment(dep))
    await gs.refresh_deployments(force=True)
    return JSONResponse(_to_json(dep), status_code=201)


async def list_all(gs: Gateway) -> dict:
    deps = await state_call(gs.state.list_deployments())
    return {"object": "list", "data": [_to_json(d) for d in deps]}


async def get_one(dep_id: str, gs: Gateway) -> dict:
    dep = await state_call(gs.state.get_deployment(dep_id))
    if dep is None:
        raise GatewayError(404, f"no deployment '{dep_id}'; GET /v1/deployments lists them")
    plan = await state_call(gs.state.r.get(gs.state.keys.plan(dep_id)))
    out = _to_json(dep)
    if plan:
        out["plan"] = json.loads(plan)
    return out


async def delete(dep_id: str, gs: Gateway) -> dict:
    if not await state_call(gs.state.delete_deployment(dep_id)):
        raise GatewayError(404, f"no deployment '{dep_id}'")
    await gs.refresh_deployments(force=True)
    return {"id": dep_id, "deleted": True}


async def register_adapter(body: AdapterBody, gs: Gateway) -> JSONResponse:
    path = adapter_dir(body.path, adapter_roots(gs.settings.adapter_roots))
    rank = _adapter_rank(path)
    if await state_call(gs.state.get_deployment(body.deployment)) is None:
        raise InvalidRequest(f"no deployment '{body.deployment}' to attach the adapter to", "deployment", 404)
    spec = AdapterSpec(name=body.name, path=str(path), deployment=body.deployment, rank=rank)
    await state_call(gs.state.put_adapter(spec))
    if body.load:
        await gs.bus.publish(gs.subjects.adapters(body.deployment),
                             AdapterCommand(action="load", name=spec.name, path=spec.path,
                                            deployment=spec.deployment))
    await gs.refresh_deployments(force=True)
    return JSONResponse(msgspec.to_builtins(spec), status_code=201)


async def list_adapters(gs: Gateway) -> dict:
    return {"object": "list", "data": msgspec.to_builtins(await state_call(gs.state.list_adapters()))}


async def delete_adapter(name: str, gs: Gateway) -> dict:
    spec = gs.adapters.get(name)
    if not await state_call(gs.state.delete_adapter(name)):
        raise GatewayError(404, f"no adapter '{name}'")
    if spec is not None:
        await gs.bus.publish(gs.subjects.adapters(spec.deployment),
                             AdapterCommand(action="unload", name=name, deployment=spec.deployment))
    await gs.refresh_deployments(force=True)
    return {"name": name, "deleted": True}


async def cluster(gs: Gateway) -> dict:
    services = await state_call(gs.state.live_services())
    workers = await state_call(gs.state.live_workers())
    agents = await state_call(gs.state.live_agents())
    return {"services": msgspec.to_builtins(services), "workers": msgspec.to_builtins(workers),
            "gpus": msgspec.to_builtins(agents)}


def add_admin_routes(app: FastAPI) -> None:
    """The management API, every route behind `require_admin`."""
    admin = [Depends(require_admin)]
    for method, path, endpoint, status in (
            ("POST", "/v1/deployments", create, 201),
            ("GET", "/v1/deployments", list_all, 200),
            ("GET", "/v1/deployments/{dep_id}", get_one, 200),
            ("DELETE", "/v1/deployments/{dep_id}", delete, 200),
            ("POST", "/v1/adapters", register_adapter, 201),
            ("GET", "/v1/adapters", list_adapters, 200),
            ("DELETE", "/v1/adapters/{name}", delete_adapter, 200),
            ("GET", "/v1/cluster", cluster, 200)):
        app.add_api_route(path, endpoint, methods=[method], status_code=status, dependencies=admin)
