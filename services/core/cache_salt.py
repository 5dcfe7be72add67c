"""Prefix-cache salts (vLLM's `cache_salt`): which requests may share cached prompt prefixes.

vLLM (V1) keeps the KV blocks of prompt prefixes and lets a later request with the same prefix
reuse them, so its first token comes sooner. Between tenants that is a side channel: from its own
time to first token one tenant can tell whether another sent a given prompt prefix. vLLM salts
the block hashes with a request's `cache_salt`: requests share a prefix only when their salts are
equal.

The salt a worker hands its engine is a hash of (the request's tenant, the client's own
`cache_salt`): requests of one tenant with the same (or no) client salt share prefixes, no two
tenants ever do, and no client can pick another tenant's salt, since its own tenant is always in
the hash (so the hash needs no secret). Requests without an API key (tenant "") and without a
client salt stay unsalted, as in vLLM. Whether the tenant enters the salt is the worker setting
`cache_salt_tenants`: `auto` = yes on the vllm engine (its prefix cache is on by default), and on
openai-http only where the client sent a salt (the upstream may not take the field: set `on` for a
vLLM upstream); `on`; `off` = only a client's own salt. The hf and sim engines keep no KV cache
across requests: nothing to salt.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

MODES = ("auto", "on", "off")
MAX_CHARS = 256  # a client's cache_salt (vLLM sets no bound; it suggests 43 base64 characters)


def mode(value: str) -> str:
    """`cache_salt_tenants`, checked."""
    if value not in MODES:
        raise ValueError(f"cache_salt_tenants {value!r}: use one of {', '.join(MODES)}")
    return value


def salt(tenant: str, client_salt: str) -> str:
    """sha256 of [tenant, client salt] as JSON ("" when both are empty: no salt)."""
    if not tenant and not client_salt:
        return ""
    return hashlib.sha256(json.dumps([tenant, client_salt]).encode()).hexdigest()


def engine_salt(tenant: str, client_salt: str, salt_mode: str, engine: str) -> str:
    """The salt a worker of `engine` hands its engine under `cache_salt_tenants` = `salt_mode`."""
    if salt_mode == "off":
        return salt("", client_salt)
    if salt_mode == "auto" and engine != "vllm" and not client_salt:
        return ""  # openai-http: the upstream may not take the field unless the client sent it
    return salt(tenant, client_salt)


def tokens_prompt(ids: list[int], req: Any, salt_mode: str) -> dict[str, Any]:
    """vLLM's TokensPrompt for an EngineRequest: its token ids and, where it has one, its salt."""
    s = engine_salt(req.tenant, req.params.cache_salt, salt_mode, "vllm")
    return {"prompt_token_ids": ids, "cache_salt": s} if s else {"prompt_token_ids": ids}


def upstream(req: Any, salt_mode: str) -> dict[str, str]:
    """openai-http: vLLM's `cache_salt` field for an EngineRequest's upstream body ({} = none)."""
    s = engine_salt(req.tenant, req.params.cache_salt, salt_mode, "openai-http")
    return {"cache_salt": s} if s else {}
