"""LoRA adapters of the `openai-http` engine: vLLM's runtime endpoints on the upstream server.

`load_adapter` POSTs `/v1/load_lora_adapter` {lora_name, lora_path} (vLLM needs `--enable-lora`
and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), `unload_adapter` `/v1/unload_lora_adapter`
{lora_name}. The path is the upstream's path; when it is readable here its PEFT config gives
the rank, else the rank is reported as 0. A server without those endpoints (404/405) makes
adapter loads fail with 501. A mixin of OpenAIHttpEngine (which owns `_http`, `api_url`,
`root`, `adapters`, `_flights`, `cancel`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

from polyserve.proto import AdapterInfo
from polyserve.worker.engine import EngineError, free_adapter
from polyserve.worker.lora import AdapterError, AdapterSpec, check_name, read_adapter

logger = logging.getLogger(__name__)


class UpstreamLoRA:
    """Runtime LoRA loading through the upstream's vLLM-style endpoints."""

    _http: httpx.AsyncClient | None
    api_url: str
    root: str
    adapters: Any
    lora_supported: bool | None
    _flights: dict

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    async def _lora_call(self, endpoint: str, body: dict, what: str) -> None:
        if self._http is None:
            raise EngineError("the openai-http engine is not started", 503)
        url = f"{self.api_url}/{endpoint}"
        try:
            resp = await self._http.post(url, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{what}: upstream {url} unreachable: {exc}", 502) from exc
        if resp.status_code in (404, 405):
            self.lora_supported = False
            raise EngineError(f"{what}: the upstream at {self.root} does not serve LoRA adapters at runtime "
                              f"(POST /v1/{endpoint} answered {resp.status_code}); for vLLM start it with "
                              "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", 501)
        if resp.status_code >= 400:
            raise EngineError(f"{what}: upstream {url} answered {resp.status_code}: {resp.text[:500]}",
                              resp.status_code)
        self.lora_supported = True

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """POST /v1/load_lora_adapter {lora_name, lora_path}; the path is as the upstream sees it."""
        try:
            check_name(name)
        except AdapterError as exc:
            raise EngineError(str(exc), exc.status) from exc
        if name in self.adapters:
            raise EngineError(f"adapter {name!r} is already loaded; unload it first", 409)
        try:
            spec = read_adapter(path)
        except AdapterError:  # not readable here (the upstream's filesystem): rank unknown
            spec = AdapterSpec(path=Path(path), rank=0, alpha=0.0, target_modules=())
        await self._lora_call("load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                              f"load adapter {name!r}")
        logger.info("upstream %s loaded adapter %s from %s", self.root, name, path)
        return self.adapters.add(name, spec)

    async def unload_adapter(self, name: str, force: bool = False) -> None:
        """POST /v1/unload_lora_adapter {lora_name}; 409 while requests use it unless `force`."""
        free_adapter(name, self.adapters, list(self._flights.values()), force, self.cancel)
        await self._lora_call("unload_lora_adapter", {"lora_name": name}, f"unload adapter {name!r}")
        self.adapters.remove(name)
        logger.info("upstream %s unloaded adapter %s", self.root, name)
