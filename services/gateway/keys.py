"""Client API keys (issue 14): each key has a tenant, the models it may use, RPM and TPM
limits and a priority class. The secret is shown once, when the key is created; Redis keeps
only its SHA-256 (the secret is 192 random bits, so a plain hash is as strong as a slow one:
there is nothing to brute-force) and the gateway compares hashes in constant time.

A token reads `psk_<id>_<secret>`: the id (12 hex digits) finds the record with one Redis GET,
the secret is checked against the stored hash. Lookups are cached in the gateway for
`key_cache_s` (default 2 s), so a request costs no Redis round trip for its key, and a revoked
key stops working on every gateway within that time (at once on the gateway that revoked it).

Redis keys (all under the cluster prefix, so the gateway's ACL user reaches them):
`<prefix>:apikey:<id>` the record (JSON), `<prefix>:apikeys` the set of ids,
`<prefix>:apikey:<id>:usage` a hash of tokens and requests counted for the key."""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict

import msgspec
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

TOKEN = re.compile(r"^psk_([0-9a-f]{12})_([0-9a-f]{48})$")
PRIORITY_CLASSES = ("high", "normal", "low")  # served in this order under contention (fairness.py)
CACHE_ENTRIES = 10_000  # cached lookups (hits and misses) at most: random tokens cannot grow memory


class KeyRecord(msgspec.Struct, kw_only=True):
    """A client key as stored (without its secret)."""

    id: str
    tenant: str
    name: str = ""
    models: list[str] = []  # [] = every model
    rpm: int = 0  # requests per minute; 0 = no limit
    tpm: int = 0  # tokens (prompt + completion) per minute; 0 = no limit
    priority: str = "normal"  # one of PRIORITY_CLASSES
    created: float = 0.0
    hash: str = ""  # sha256 hex of the whole token

    def public(self) -> dict:
        """The record as the admin API shows it: never the hash."""
        out = msgspec.to_builtins(self)
        out.pop("hash", None)
        out["object"] = "api_key"
        return out

    def allows(self, model: str, resolved: tuple[str, ...] = ()) -> bool:
        """Whether the key may use `model` (or what it resolves to: deployment id, model name)."""
        return not self.models or "*" in self.models or any(m in self.models for m in (model, *resolved))


ADMIN = KeyRecord(id="admin", tenant="admin", priority="high")  # the admin key used as a client key


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """(id, token) of a fresh key."""
    key_id = secrets.token_hex(6)
    return key_id, f"psk_{key_id}_{secrets.token_hex(24)}"


class KeyStore:
    """Client keys in Redis, with a short lookup cache (hits and misses)."""

    def __init__(self, redis: aioredis.Redis, prefix: str, cache_s: float = 2.0):
        self.r = redis
        self.prefix = prefix
        self.cache_s = cache_s
        self._cache: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()

    def record_key(self, key_id: str) -> str:
        return f"{self.prefix}:apikey:{key_id}"

    def usage_key(self, key_id: str) -> str:
        return f"{self.prefix}:apikey:{key_id}:usage"

    @property
    def index(self) -> str:
        return f"{self.prefix}:apikeys"

    async def create(self, tenant: str, *, name: str = "", models: list[str] | None = None, rpm: int = 0,
                     tpm: int = 0, priority: str = "normal") -> tuple[KeyRecord, str]:
        """Store a new key; (record, token). The token is not kept anywhere."""
        key_id, token = new_token()
        rec = KeyRecord(id=key_id, tenant=tenant, name=name, models=list(models or []), rpm=rpm, tpm=tpm,
                        priority=priority, created=time.time(), hash=digest(token))
        async with self.r.pipeline(transaction=True) as p:
            p.set(self.record_key(key_id), msgspec.json.encode(rec))
            p.sadd(self.index, key_id)
            await p.execute()
        self._cache.pop(key_id, None)
        return rec, token

    async def list(self) -> list[KeyRecord]:
        ids = sorted(m.decode() for m in await self.r.smembers(self.index))
        raws = await self.r.mget([self.record_key(i) for i in ids]) if ids else []
        return [msgspec.json.decode(x, type=KeyRecord) for x in raws if x]

    async def get(self, key_id: str) -> KeyRecord | None:
        raw = await self.r.get(self.record_key(key_id))
        return msgspec.json.decode(raw, type=KeyRecord) if raw else None

    async def delete(self, key_id: str) -> bool:
        """Revoke a key (its usage counters stay for the record); False when there was none."""
        async with self.r.pipeline(transaction=True) as p:
            p.delete(self.record_key(key_id))
            p.srem(self.index, key_id)
            removed, _ = await p.execute()
        self._cache[key_id] = (time.monotonic(), None)  # this gateway forgets it at once
        return bool(removed)

    async def usage(self, key_id: str) -> dict[str, int]:
        raw = await self.r.hgetall(self.usage_key(key_id))
        return {k.decode(): int(v) for k, v in raw.items()}

    async def lookup(self, token: str) -> KeyRecord | None:
        """The key `token` is, or None (malformed, unknown, revoked or wrong secret). Redis errors
        propagate (the caller answers 503: an unreadable key store must not let anyone in)."""
        m = TOKEN.match(token)
        if m is None:
            return None
        key_id = m.group(1)
        hit = self._cache.get(key_id)
        if hit is not None and time.monotonic() - hit[0] < self.cache_s:
            rec = hit[1]
        else:
            rec = await self.get(key_id)
            self._remember(key_id, rec)
        if rec is None or not hmac.compare_digest(digest(token), rec.hash):
            return None
        return rec

    def _remember(self, key_id: str, rec: KeyRecord | None) -> None:
        self._cache[key_id] = (time.monotonic(), rec)
        self._cache.move_to_end(key_id)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    async def count(self, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Add a finished request's tokens to the key's usage counters in Redis."""
        async with self.r.pipeline(transaction=False) as p:
            p.hincrby(self.usage_key(key_id), "requests", 1)
            p.hincrby(self.usage_key(key_id), "prompt_tokens", prompt_tokens)
            p.hincrby(self.usage_key(key_id), "completion_tokens", completion_tokens)
            p.hincrby(self.usage_key(key_id), "total_tokens", prompt_tokens + completion_tokens)
            await p.execute()
