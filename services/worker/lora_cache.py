"""Where a worker's LoRA adapters live: a pure cache policy over three tiers (no torch, no I/O).

Tiers, from slow to fast: ``disk`` (only the PEFT directory is known), ``host``
(a CPU copy, pinned on CUDA hosts) and ``device`` (installed in the model on the
accelerator). The host tier is inclusive: an adapter on the device keeps its host
copy, so demoting it (device eviction) costs nothing, and the host copy is what
CaraServe's CPU-assisted cold start computes with (§4). Promotion goes disk ->
host -> device; eviction goes device -> host -> disk.

Budgets: each tier has a slot limit and an optional byte limit (0 = none).
Adapters in use by running requests are pinned (never evicted); an adapter being
copied counts against the budget of the tier it is going to.

Eviction rule (recency and popularity in one number, LRFU-style): every request
for an adapter adds 1 to a count that decays with half-life ``half_life_s``:
``score(t) = sum_i 2 ** (-(t - t_i) / half_life_s)``. The victim is the unpinned
adapter with the lowest score (ties: least recently used). A steadily popular
adapter keeps a high score; one used once long ago decays to ~0.

Prefetch rule (rising request rate): two exponentially weighted request rates per
adapter, ``r_w(t) = sum_i exp(-(t - t_i) / w) / w`` for a short window ``w_s`` and a
long window ``w_l`` (for a steady Poisson stream both estimate its rate). An
adapter is *rising* when ``r_s >= min_rate`` and ``r_s > rise_factor * r_l``;
``prefetch(now)`` returns rising adapters that are not on the device, hottest
first, as long as the device has room or holds a colder, unpinned victim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DISK, HOST, DEVICE = "disk", "host", "device"
TIERS = (DISK, HOST, DEVICE)


class CacheError(ValueError):
    """A bad cache setting or an unknown adapter."""


@dataclass(frozen=True)
class CachePolicy:
    device_slots: int = 8  # adapters installed on the device at once
    device_bytes: int = 0  # 0 = no byte budget
    host_slots: int = 64  # host copies (including those also on the device)
    host_bytes: int = 0
    half_life_s: float = 60.0  # eviction score decay
    short_window_s: float = 5.0  # prefetch: short-window rate ...
    long_window_s: float = 60.0  # ... against the long-window rate
    rise_factor: float = 2.0
    min_rate: float = 0.5  # requests/s in the short window before an adapter counts as rising

    def __post_init__(self):
        if self.device_slots < 1 or self.host_slots < self.device_slots:
            raise CacheError(f"need device_slots >= 1 and host_slots >= device_slots "
                             f"(got {self.device_slots} and {self.host_slots})")
        if self.device_bytes < 0 or self.host_bytes < 0:
            raise CacheError("device_bytes and host_bytes must be >= 0 (0 = no byte budget)")
        if self.host_bytes and self.device_bytes > self.host_bytes:
            raise CacheError("device_bytes must not exceed host_bytes (the host tier is inclusive)")
        if min(self.half_life_s, self.short_window_s, self.long_window_s) <= 0:
            raise CacheError("half_life_s, short_window_s and long_window_s must be > 0")
        if self.short_window_s >= self.long_window_s:
            raise CacheError("short_window_s must be shorter than long_window_s")
        if self.rise_factor <= 1 or self.min_rate < 0:
            raise CacheError("rise_factor must be > 1 and min_rate >= 0")

    @classmethod
    def from_settings(cls, settings) -> "CachePolicy":
        """The policy from worker settings' `lora_*` fields (MB budgets; defaults where absent)."""
        def g(name: str, default):
            value = getattr(settings, name, None)
            return default if value is None else value
        d = cls()
        return cls(device_slots=int(g("lora_device_slots", d.device_slots)),
                   device_bytes=int(float(g("lora_device_mb", 0)) * (1 << 20)),
                   host_slots=int(g("lora_host_slots", d.host_slots)),
                   host_bytes=int(float(g("lora_host_mb", 0)) * (1 << 20)),
                   half_life_s=float(g("lora_half_life_s", d.half_life_s)),
                   short_window_s=float(g("lora_short_window_s", d.short_window_s)),
                   long_window_s=float(g("lora_long_window_s", d.long_window_s)),
                   rise_factor=float(g("lora_rise_factor", d.rise_factor)),
                   min_rate=float(g("lora_prefetch_min_rate", d.min_rate)))


@dataclass
class _Entry:
    nbytes: int
    tier: str = DISK
    target: str | None = None  # tier a copy in flight is going to (host or device)
    pins: int = 0
    last: float = -math.inf
    score: float = 0.0  # decayed count at `last`
    r_short: float = 0.0  # rates at `last`
    r_long: float = 0.0


@dataclass
class AdapterCache:
    """Tier bookkeeping for one worker's adapters. Callers move the weights; this decides."""

    policy: CachePolicy = field(default_factory=CachePolicy)
    entries: dict[str, _Entry] = field(default_factory=dict)

    # ------------------------------------------------------------ membership
    def add(self, name: str, nbytes: int) -> None:
        if name in self.entries:
            raise CacheError(f"adapter {name!r} is already in the cache")
        if nbytes < 0:
            raise CacheError(f"adapter {name!r}: nbytes must be >= 0")
        self.entries[name] = _Entry(nbytes=int(nbytes))

    def remove(self, name: str) -> None:
        self._get(name)
        del self.entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def _get(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise CacheError(f"adapter {name!r} is not in the cache") from None

    def tier(self, name: str) -> str:
        return self._get(name).tier

    def loading(self, name: str) -> str | None:
        """The tier a copy in flight is taking `name` to, or None."""
        return self._get(name).target

    def on(self, tier: str) -> list[str]:
        """Adapters whose copy in `tier` exists (host is inclusive of device)."""
        rank = TIERS.index(tier)
        return sorted(n for n, e in self.entries.items() if TIERS.index(e.tier) >= rank)

    # ------------------------------------------------------------ demand signals
    def observe(self, name: str, now: float) -> None:
        """One request for `name` at time `now` (monotonic seconds)."""
        e = self._get(name)
        e.score, e.r_short, e.r_long = self._decayed(e, now)
        e.score += 1.0
        e.r_short += 1.0 / self.policy.short_window_s
        e.r_long += 1.0 / self.policy.long_window_s
        e.last = max(e.last, now)

    def _decayed(self, e: _Entry, now: float) -> tuple[float, float, float]:
        if e.last == -math.inf:
            return 0.0, 0.0, 0.0
        dt = max(0.0, now - e.last)
        p = self.policy
        return (e.score * 2.0 ** (-dt / p.half_life_s), e.r_short * math.exp(-dt / p.short_window_s),
                e.r_long * math.exp(-dt / p.long_window_s))

    def score(self, name: str, now: float) -> float:
        """Eviction score: the request count decayed with half-life `half_life_s`."""
        return self._decayed(self._get(name), now)[0]

    def rates(self, name: str, now: float) -> tuple[float, float]:
        """(short-window, long-window) request rates in requests/s."""
        _, short, long_ = self._decayed(self._get(name), now)
        return short, long_

    def rising(self, name: str, now: float) -> bool:
        short, long_ = self.rates(name, now)
        return short >= self.policy.min_rate and short > self.policy.rise_factor * long_

    def pin(self, name: str) -> None:
        self._get(name).pins += 1

    def unpin(self, name: str) -> None:
        e = self._get(name)
        if e.pins <= 0:
            raise CacheError(f"adapter {name!r} is not pinned")
        e.pins -= 1

    # ------------------------------------------------------------ room and victims
    def _used(self, tier: str) -> tuple[int, int]:
        """(slots, bytes) taken in `tier`, copies in flight to it included."""
        rank = TIERS.index(tier)
        held = [e for e in self.entries.values()
                if TIERS.index(e.tier) >= rank or (e.target is not None and TIERS.index(e.target) >= rank)]
        return len(held), sum(e.nbytes for e in held)

    def _limits(self, tier: str) -> tuple[int, int]:
        p = self.policy
        return (p.device_slots, p.device_bytes) if tier == DEVICE else (p.host_slots, p.host_bytes)

    def victims(self, name: str, tier: str, now: float, below: float | None = None) -> list[str] | None:
        """Adapters to evict from `tier` so that `name` fits there (lowest score first);
        [] if it fits already, None if it cannot (pinned or loading adapters fill the tier,
        or, with `below`, only adapters scoring >= `below` could make room)."""
        if tier not in (HOST, DEVICE):
            raise CacheError(f"tier must be {HOST!r} or {DEVICE!r}, got {tier!r}")
        e = self._get(name)
        slots, nbytes = self._limits(tier)
        if nbytes and e.nbytes > nbytes:
            return None
        used_slots, used_bytes = self._used(tier)
        need_slots = used_slots + 1 - slots
        need_bytes = used_bytes + e.nbytes - nbytes if nbytes else 0
        if need_slots <= 0 and need_bytes <= 0:
            return []
        # on `tier` means: the tier is the adapter's own (host: host-only copies; the device's copies are
        # demoted from the device first, so host eviction never touches them)
        cands = [(self.score(n, now), c.last, n) for n, c in self.entries.items()
                 if n != name and c.tier == tier and c.pins == 0 and c.target is None]
        cands.sort()
        out: list[str] = []
        for s, _, n in cands:
            if need_slots <= 0 and need_bytes <= 0:
                break
            if below is not None and s >= below:
                return None
            out.append(n)
            need_slots -= 1
            need_bytes -= self.entries[n].nbytes
        return out if need_slots <= 0 and need_bytes <= 0 else None

    # ------------------------------------------------------------ moves
    def start(self, name: str, tier: str) -> None:
        """A copy of `name` towards `tier` (host or device) begins; call after evicting `victims`."""
        e = self._get(name)
        if TIERS.index(tier) <= TIERS.index(e.tier):
            raise CacheError(f"adapter {name!r} is already on {e.tier}; cannot promote it to {tier}")
        if e.target is not None:
            raise CacheError(f"adapter {name!r} is already being copied to {e.target}")
        e.target = tier

    def landed(self, name: str, tier: str) -> None:
        """The copy of `name` reached `tier` (host first, then device)."""
        e = self._get(name)
        e.tier = tier
        if e.target == tier:
            e.target = None

    def failed(self, name: str) -> None:
        """A copy in flight did not land: the adapter stays where it was."""
        self._get(name).target = None

    def demote(self, name: str) -> str:
        """Evict `name` one tier down (device -> host, host -> disk); returns its new tier."""
        e = self._get(name)
        if e.tier == DISK:
            raise CacheError(f"adapter {name!r} is only on disk; nothing to evict")
        if e.pins:
            raise CacheError(f"adapter {name!r} is in use by running requests")
        e.tier = TIERS[TIERS.index(e.tier) - 1]
        return e.tier

    def prefetch(self, now: float, limit: int = 1) -> list[tuple[str, list[str]]]:
        """Up to `limit` rising adapters that are not on the device (hottest short-window rate
        first), each with the colder device victims whose eviction makes room for it."""
        cands = sorted(((self.rates(n, now)[0], n) for n, e in self.entries.items()
                        if e.tier != DEVICE and e.target is None and self.rising(n, now)), reverse=True)
        out: list[tuple[str, list[str]]] = []
        undo: list[tuple[_Entry, str, str | None]] = []  # later candidates see earlier ones as moved
        try:
            for _, n in cands:
                if len(out) >= limit:
                    break
                vics = self.victims(n, DEVICE, now, below=self.score(n, now))
                if vics is None:
                    continue
                for v in [n, *vics]:
                    e = self.entries[v]
                    undo.append((e, e.tier, e.target))
                    if v == n:
                        e.target = DEVICE
                    else:
                        e.tier = HOST
                out.append((n, vics))
        finally:
            for e, tier, target in reversed(undo):
                e.tier, e.target = tier, target
        return out

    def snapshot(self, now: float) -> dict[str, dict]:
        """Per adapter: tier, copy in flight, pins, score and rates (for logs and benchmarks)."""
        return {n: {"tier": e.tier, "loading": e.target, "pins": e.pins, "bytes": e.nbytes,
                    "score": round(self.score(n, now), 4),
                    "rate_short": round(self.rates(n, now)[0], 4), "rate_long": round(self.rates(n, now)[1], 4)}
                for n, e in sorted(self.entries.items())}
