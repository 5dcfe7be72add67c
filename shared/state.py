"""Redis cluster state: deployments, worker/agent/service registries with TTLs,
length statistics and plans. Keys are documented in proto/README.md."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote

import msgspec
import redis.asyncio as aioredis

from polyserve.proto import AdapterSpec, AgentInfo, Deployment, Heartbeat, Keys, ScaleDecision, ServiceState

logger = logging.getLogger(__name__)
T = TypeVar("T")


SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelUrl:
    """`redis+sentinel://USER:PASSWORD@HOST:PORT[,HOST:PORT...]/MASTER[/DB]`: the primary is
    whichever node the Sentinels name MASTER; USER:PASSWORD serves Sentinels and data nodes."""

    sentinels: list[tuple[str, int]]
    master: str
    db: int
    username: str | None
    password: str | None


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The parts of a Sentinel URL; None for any other URL (redis://, rediss://, unix://)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != SENTINEL_SCHEME:
        return None
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    sentinels = []
    for hp in hosts.split(","):
        host, _, port = hp.rpartition(":")
        sentinels.append((host or "127.0.0.1", int(port or 26379)))
    master, _, db = path.partition("/")
    if not master:
        raise ValueError(f"{SENTINEL_SCHEME} URL without a master name: {SENTINEL_SCHEME}://HOST:PORT/MASTER[/DB]")
    return SentinelUrl(sentinels, master, int(db or 0), unquote(user) or None, unquote(password) or None)


def _client_kw(su: SentinelUrl) -> dict:
    return {"username": su.username, "password": su.password, "db": su.db}


MASTER_CACHE_S = 0.5  # how long a client reuses the primary's address the Sentinel named


def _pool_class():
    """A Sentinel connection pool that asks the Sentinel once per MASTER_CACHE_S, not once per
    new connection: a burst of requests on a cold client opened one Sentinel query each
    (48 at once took 166 ms against 102 ms without Sentinel, past the dispatcher's 250 ms
    Redis budget under load). A failover takes longer than the cache lives."""
    from redis.asyncio.sentinel import SentinelConnectionPool

    class CachedMasterPool(SentinelConnectionPool):
        _addr: tuple[object, float] | None = None
        _lock: asyncio.Lock | None = None

        async def get_master_address(self):
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:  # one query for all the connections opened at once
                hit = self._addr
                if hit is not None and time.monotonic() - hit[1] < MASTER_CACHE_S:
                    return hit[0]
                addr = await super().get_master_address()
                self._addr = (addr, time.monotonic())
                return addr

    return CachedMasterPool


def connect(url: str) -> aioredis.Redis:
    """A Redis client with short timeouts so a Redis outage fails fast, not hangs.

    A `redis+sentinel://` URL gives a client of the current primary: each new connection
    asks the Sentinels where it is, so after a failover the next command reaches the
    promoted replica (docs/reliability.md)."""
    su = parse_sentinel_url(url)
    if su is None:
        return aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                       retry_on_timeout=False)
    from redis.asyncio.sentinel import Sentinel

    sentinel = Sentinel(su.sentinels, socket_timeout=1.0, socket_connect_timeout=1.0,
                        sentinel_kwargs={"username": su.username, "password": su.password,
                                         "socket_timeout": 1.0, "socket_connect_timeout": 1.0})
    return sentinel.master_for(su.master, connection_pool_class=_pool_class(), socket_timeout=2.0,
                               socket_connect_timeout=2.0, retry_on_timeout=False, **_client_kw(su))


def connect_sync(url: str, timeout: float = 2.0):
    """A blocking client (the CLI, health checks) for any URL `connect` takes."""
    import redis

    su = parse_sentinel_url(url)
    if su is None:
        return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    from redis.sentinel import Sentinel

    sentinel = Sentinel(su.sentinels, socket_timeout=timeout, socket_connect_timeout=timeout,
                        sentinel_kwargs={"username": su.username, "password": su.password,
                                         "socket_timeout": timeout, "socket_connect_timeout": timeout})
    return sentinel.master_for(su.master, socket_timeout=timeout, socket_connect_timeout=timeout, **_client_kw(su))


class State:
    """Typed access to the keys polyserve keeps in Redis."""

    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.r = redis
        self.keys = keys

    async def close(self) -> None:
        await self.r.aclose()

    # deployments ------------------------------------------------------------
    async def put_deployment(self, dep: Deployment) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.set(self.keys.deployment(dep.id), msgspec.json.encode(dep))
            p.sadd(self.keys.deployments, dep.id)
            await p.execute()

    async def get_deployment(self, dep_id: str) -> Deployment | None:
        raw = await self.r.get(self.keys.deployment(dep_id))
        return msgspec.json.decode(raw, type=Deployment) if raw else None

    async def list_deployments(self) -> list[Deployment]:
        ids = sorted(m.decode() for m in await self.r.smembers(self.keys.deployments))
        if not ids:
            return []
        raws = await self.r.mget([self.keys.deployment(i) for i in ids])
        return [msgspec.json.decode(x, type=Deployment) for x in raws if x]

    async def delete_deployment(self, dep_id: str) -> bool:
        async with self.r.pipeline(transaction=True) as p:
            p.delete(self.keys.deployment(dep_id))
            p.srem(self.keys.deployments, dep_id)
            removed, _ = await p.execute()
        return bool(removed)

    # LoRA adapter registry ---------------------------------------------------------
    async def put_adapter(self, spec: AdapterSpec) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.set(self.keys.adapter(spec.name), msgspec.json.encode(spec))
            p.sadd(self.keys.adapters, spec.name)
            await p.execute()

    async def list_adapters(self) -> list[AdapterSpec]:
        names = sorted(m.decode() for m in await self.r.smembers(self.keys.adapters))
        raws = await self.r.mget([self.keys.adapter(n) for n in names]) if names else []
        return [msgspec.json.decode(x, type=AdapterSpec) for x in raws if x]

    async def delete_adapter(self, name: str) -> bool:
        async with self.r.pipeline(transaction=True) as p:
            p.delete(self.keys.adapter(name))
            p.srem(self.keys.adapters, name)
            removed, _ = await p.execute()
        return bool(removed)

    # registries with TTL ---------------------------------------------------------
    async def _put_ttl(self, key: str, index: str, member: str, obj: object, ttl: float) -> None:
        async with self.r.pipeline(transaction=False) as p:
            p.set(key, msgspec.json.encode(obj), px=max(1, int(ttl * 1000)))
            p.zadd(index, {member: time.time() + ttl})
            await p.execute()

    async def _live(self, index: str, key_of, typ: type[T]) -> list[T]:
        now = time.time()
        await self.r.zremrangebyscore(index, "-inf", now)
        members = [m.decode() for m in await self.r.zrange(index, 0, -1)]
        if not members:
            return []
        raws = await self.r.mget([key_of(m) for m in members])
        return [msgspec.json.decode(x, type=typ) for x in raws if x]

    async def put_worker(self, hb: Heartbeat) -> None:
        await self._put_ttl(self.keys.worker(hb.worker_id), self.keys.workers, hb.worker_id, hb, hb.ttl_s)

    async def remove_worker(self, worker_id: str) -> None:
        await self.r.delete(self.keys.worker(worker_id))
        await self.r.zrem(self.keys.workers, worker_id)

    async def live_workers(self) -> list[Heartbeat]:
        return await self._live(self.keys.workers, self.keys.worker, Heartbeat)

    async def put_service(self, st: ServiceState, ttl: float) -> None:
        member = f"{st.service}:{st.instance}"
        await self._put_ttl(self.keys.service(st.service, st.instance), self.keys.services, member, st, ttl)

    async def remove_service(self, name: str, instance: str) -> None:
        await self.r.delete(self.keys.service(name, instance))
        await self.r.zrem(self.keys.services, f"{name}:{instance}")

    async def live_services(self) -> list[ServiceState]:
        return await self._live(self.keys.services, lambda m: self.keys.service(*m.split(":", 1)), ServiceState)

    async def put_agent(self, info: AgentInfo, ttl: float) -> None:
        await self._put_ttl(self.keys.agent(info.gpu_id), self.keys.agents, info.gpu_id, info, ttl)

    async def remove_agent(self, gpu_id: str) -> None:
        await self.r.delete(self.keys.agent(gpu_id))
        await self.r.zrem(self.keys.agents, gpu_id)

    async def live_agents(self) -> list[AgentInfo]:
        return await self._live(self.keys.agents, self.keys.agent, AgentInfo)

    # telemetry and plans -----------------------------------------------------------
    async def put_json(self, key: str, obj: object, ttl: float | None = None) -> None:
        await self.r.set(key, msgspec.json.encode(obj), px=int(ttl * 1000) if ttl else None)

    async def get_json(self, key: str, typ: type[T]) -> T | None:
        raw = await self.r.get(key)
        return msgspec.json.decode(raw, type=typ) if raw else None

    async def put_plan(self, decision: ScaleDecision) -> None:
        await self.put_json(self.keys.plan(decision.deployment), decision)
