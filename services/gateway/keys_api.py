"""`/v1/keys`: the admin API for client API keys (keys.py). Every route needs the admin key.
The secret is in the answer to POST only; GET shows the records and their usage, never a secret
or its hash; DELETE revokes (every gateway stops accepting it within `key_cache_s`)."""
from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from .admin import require_admin, state_call
from .context import Gateway
from .errors import GatewayError
from .schemas import KeyBody


async def create_key(body: KeyBody, gs: Gateway) -> JSONResponse:
    rec, token = await state_call(gs.keystore.create(body.tenant, name=body.name, models=body.models,
                                                     rpm=body.rpm, tpm=body.tpm, priority=body.priority))
    out = rec.public()
    out["key"] = token  # shown once: only its hash is stored
    return JSONResponse(out, status_code=201)


async def list_keys(gs: Gateway) -> dict:
    recs = await state_call(gs.keystore.list())
    return {"object": "list", "data": [r.public() for r in recs]}


async def get_key(key_id: str, gs: Gateway) -> dict:
    rec = await state_call(gs.keystore.get(key_id)) if key_id.isalnum() and len(key_id) <= 64 else None
    if rec is None:
        raise GatewayError(404, f"no API key '{key_id}'; GET /v1/keys lists them")
    return {**rec.public(), "usage": await state_call(gs.keystore.usage(key_id))}


async def delete_key(key_id: str, gs: Gateway) -> dict:
    if not (key_id.isalnum() and len(key_id) <= 64) or not await state_call(gs.keystore.delete(key_id)):
        raise GatewayError(404, f"no API key '{key_id}'")
    return {"id": key_id, "object": "api_key", "deleted": True}


def add_key_routes(app: FastAPI) -> None:
    admin = [Depends(require_admin)]
    for method, path, endpoint, status in (
            ("POST", "/v1/keys", create_key, 201),
            ("GET", "/v1/keys", list_keys, 200),
            ("GET", "/v1/keys/{key_id}", get_key, 200),
            ("DELETE", "/v1/keys/{key_id}", delete_key, 200)):
        app.add_api_route(path, endpoint, methods=[method], status_code=status, dependencies=admin)
