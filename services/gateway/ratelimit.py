"""Per-key rate limits (issue 14): requests per minute (RPM) and tokens per minute (TPM) as
token buckets in Redis, shared by every gateway replica.

Each bucket holds up to its limit and refills at limit/60 per second (a key may burst its whole
minute at once, then proceeds at the steady rate, as OpenAI's limits behave). One Lua script
(`register_script`: EVALSHA) refills and checks both buckets and takes from both, or from
neither, atomically inside Redis, with Redis's own clock: concurrent requests on any number of
gateways cannot overdraw a bucket, and gateways need no synchronised clocks.

Tokens are reserved at admission (the estimate: prompt + max_tokens × n) and settled when the
request ends with the usage the worker reported: the difference goes back to (or is taken
from) the bucket. A bucket may go into debt by at most its limit, so a key that used more than
it reserved waits the overrun out. Buckets expire when idle (a missing bucket is full)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis

_REFILL = """
local function bucket(key, limit, now_ms)
  local raw = redis.call('HMGET', key, 't', 'ts')
  local tokens, ts = tonumber(raw[1]), tonumber(raw[2])
  if tokens == nil or ts == nil then return limit end
  return math.min(limit, tokens + math.max(0, now_ms - ts) * limit / 60000.0)
end
local function store(key, tokens, limit, now_ms)
  redis.call('HSET', key, 't', tostring(tokens), 'ts', tostring(now_ms))
  -- full again after (limit - tokens) / (limit / 60 s); a missing bucket reads as full
  redis.call('PEXPIRE', key, math.ceil((limit - tokens) * 60000.0 / limit) + 1000)
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: rpm bucket, tpm bucket. ARGV: rpm limit, tpm limit (0 = none), tokens to reserve.
# Returns {allowed, rpm_left, rpm_reset_ms, tpm_left, tpm_reset_ms, retry_ms}; retry_ms -1 = never fits.
TAKE = _REFILL + """
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r = rpm > 0 and bucket(KEYS[1], rpm, now_ms) or 0
local k = tpm > 0 and bucket(KEYS[2], tpm, now_ms) or 0
local retry = 0
if rpm > 0 and r < 1 then retry = math.ceil((1 - r) * 60000.0 / rpm) end
if tpm > 0 and cost > tpm then retry = -1
elseif tpm > 0 and k < cost then retry = math.max(retry, math.ceil((cost - k) * 60000.0 / tpm)) end
local ok = retry == 0
if ok then
  if rpm > 0 then r = r - 1; store(KEYS[1], r, rpm, now_ms) end
  if tpm > 0 then k = k - cost; store(KEYS[2], k, tpm, now_ms) end
end
local function reset(left, limit) if limit <= 0 then return 0 end
  return math.ceil((limit - left) * 60000.0 / limit) end
return {ok and 1 or 0, math.floor(r), reset(r, rpm), math.floor(k), reset(k, tpm), retry}
"""

# KEYS: tpm bucket. ARGV: tpm limit, delta (tokens used beyond the reservation; < 0 gives back).
SETTLE = _REFILL + """
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
local k = math.max(-tpm, math.min(tpm, bucket(KEYS[1], tpm, now_ms) - delta))
store(KEYS[1], k, tpm, now_ms)
return math.floor(k)
"""


def duration(ms: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{int(ms)}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.3g}s"
    return f"{int(s // 60)}m{int(s % 60)}s"


@dataclass
class Decision:
    """The outcome of one `take`: allowed or not, and what the x-ratelimit headers say."""

    allowed: bool
    rpm: int
    tpm: int
    rpm_left: int = 0
    rpm_reset_ms: int = 0
    tpm_left: int = 0
    tpm_reset_ms: int = 0
    retry_ms: int = 0  # -1: the request alone needs more tokens than the key's TPM

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.retry_ms / 1000))

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits the key has."""
        out: dict[str, str] = {}
        for kind, limit, left, reset in (("requests", self.rpm, self.rpm_left, self.rpm_reset_ms),
                                         ("tokens", self.tpm, self.tpm_left, self.tpm_reset_ms)):
            if limit > 0:
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, left))
                out[f"x-ratelimit-reset-{kind}"] = duration(reset)
        return out


class Limiter:
    """The two Lua scripts, registered on the gateway's Redis client."""

    def __init__(self, redis: aioredis.Redis, prefix: str):
        self.prefix = prefix
        self._take = redis.register_script(TAKE)
        self._settle = redis.register_script(SETTLE)

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self.prefix}:ratelimit:{key_id}:rpm", f"{self.prefix}:ratelimit:{key_id}:tpm"]

    async def take(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision:
        """One request and `tokens` tokens from the key's buckets, both or neither."""
        if rpm <= 0 and tpm <= 0:
            return Decision(True, 0, 0)
        ok, r, r_ms, k, k_ms, retry = await self._take(keys=self._keys(key_id), args=[rpm, tpm, tokens])
        return Decision(bool(ok), rpm, tpm, int(r), int(r_ms), int(k), int(k_ms), int(retry))

    async def settle(self, key_id: str, tpm: int, delta: int) -> int:
        """Correct the key's TPM bucket by `delta` tokens (actual − reserved); the tokens left."""
        if tpm <= 0 or delta == 0:
            return 0
        return int(await self._settle(keys=self._keys(key_id)[1:], args=[tpm, delta]))
