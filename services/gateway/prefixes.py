"""Prefix-aware placement: requests whose prompts start alike go to the worker that served that
start before, so an engine with a prefix cache (vLLM's automatic prefix caching, SGLang's radix
cache, TGI's prefix cache) computes the shared part once. What SGLang's cache-aware router and
llm-d's prefix-cache scorer do; polyserve does it without any client hint (`prompt_cache_key` is
the explicit form: routing.py).

The gateway keeps an approximate picture of each worker's cache: chained hashes of the starts of
the prompts it placed. A prompt is cut into blocks of BLOCK_CHARS characters (the gateway does not
tokenize; 128 characters are ~32 tokens, two of vLLM's 16-token blocks), and its starts of 2, 3,
4, 6, ... 256 blocks (CHECKPOINTS) are hashed, each hash covering the whole start and the request's
tenant and `cache_salt`, as the engines' caches are salted per (tenant, salt)
(core/cache_salt.py): a prefix of another tenant does not attract a request. The table holds at
most `capacity` such hashes (least recently placed first out), so it forgets what a worker's cache
has most likely evicted too; a worker that goes down is forgotten at once.

Gateways share what they place (`PrefixPlaced` on `<p>.v1.gateway.prefixes`, best effort): with
several gateway processes or replicas a conversation's turns reach different gateways, and each must
know where the others put its earlier turns. So the hashes are stable across processes: CRC-32
(zlib, in C: 2.6 µs for a 600-character prompt, 20 µs for 31,500 on the Zen 4 EPYC of
docs/scheduling.md) run on over the start, seeded with the tenant and salt. It is no secret and may
collide (1 in 4·10⁹ per pair): a collision misplaces a request, nothing more, as the engine checks
its own cache by token.

Why by hand: no library keeps this (SGLang's router is Rust inside its own server; vLLM's block
hashes are its engine's, over token ids the gateway does not have).
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyserve.gateway.routing import LocalRouter
    from polyserve.proto import Deployment, Heartbeat

BLOCK_CHARS = 128
MAX_BLOCKS = 256  # the first 32k characters are compared; beyond them two prompts count as alike
MIN_BLOCKS = 2  # a shared start shorter than this (256 characters) does not move a request
MAX_PREFER = 16  # holders named in a dispatcher's hint (as dispatcher/prefer.py reads at most)
# The starts (in blocks) the table keeps a hash of: each about 1.4x the one before, so a long prompt
# takes 15 entries, not 256, and the table remembers 17x more prompts (on Mooncake's trace 65,536
# entries of every block held too few prompts: `polyserve bench prefix`, docs/scheduling.md); the
# longest shared start is then known to within 1.5x, enough to tell which worker has the most of it.
CHECKPOINTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# engines whose workers keep a prefix cache across requests (hf and sim keep none)
CACHING_ENGINES = frozenset({"vllm", "openai-http"})


def applies(mode: str, deployment: Deployment) -> bool:
    """Whether prefix-aware placement runs for `deployment` (setting `prefix_affinity`: auto = for the
    engines that keep a prefix cache). Under a load-only policy the gateway places by it (`choose`);
    under the others the dispatcher gets the holders as a hint (`prefer`, dispatcher/prefer.py)."""
    return mode == "on" or (mode == "auto" and deployment.engine in CACHING_ENGINES)


def blocks(tenant: str, salt: str, text: str, adapter: str = "") -> tuple[int, ...]:
    """The hashes of `text`'s starts of CHECKPOINTS[i] whole blocks (the i-th names the first
    CHECKPOINTS[i] blocks, with the tenant, salt and LoRA adapter); () when it has fewer than
    MIN_BLOCKS, so a short prompt costs nothing. Stable across processes (gateways share them:
    `PrefixPlaced`). The adapter is part of the key because an engine's prefix cache is: vLLM hashes
    a block with its request's LoRA as an extra key, so a start cached under one adapter (or the
    base model) is not reused by a request with another; a base-model prompt hashes as before."""
    n = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    if n < MIN_BLOCKS:
        return ()
    seed = f"{tenant}\0{salt}\0" + (f"lora:{adapter}\0" if adapter else "")
    h = zlib.crc32(seed.encode("utf-8", "surrogatepass"))
    out = []
    prev = 0
    for k in CHECKPOINTS:
        if k > n:
            break
        # CRC-32 runs on over the UTF-8 of each next piece: a checkpoint's value covers its whole start;
        # its start's length in the low 9 bits (a placement hint: a rare collision misplaces a request)
        h = zlib.crc32(text[prev * BLOCK_CHARS:k * BLOCK_CHARS].encode("utf-8", "surrogatepass"), h)
        out.append(h << 9 | k)
        prev = k
    return tuple(out)


class PrefixTable:
    """Block hash -> the workers this gateway placed a prompt with that start on, least recently
    placed first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: OrderedDict[int, set[str]] = OrderedDict()
        self.recorded = 0  # placements recorded (this gateway's and, via PrefixPlaced, the others')

    def __len__(self) -> int:
        return len(self._held)

    def longest(self, hashes: tuple[int, ...], among: Iterable[str]) -> tuple[set[str], int]:
        """(the workers of `among` that hold the longest start of `hashes` (`blocks`), its length in
        blocks, a checkpoint); (set(), 0) when none holds MIN_BLOCKS of it."""
        ids = among if isinstance(among, (set, frozenset)) else set(among)
        best: set[str] = set()
        n = 0
        held = self._held
        for i, h in enumerate(hashes):  # a longer start is held only by workers that held the shorter
            holders = held.get(h)
            live = holders & ids if holders else None
            if not live:
                break
            best, n = live, CHECKPOINTS[i]
        return best, n

    def record(self, hashes: tuple[int, ...], worker_id: str) -> None:
        """`worker_id` got a prompt with these blocks. The last block is touched first, so that a
        prompt's first blocks (shared by the most requests) are the last to be forgotten: the
        chain `longest` walks breaks at its first forgotten block."""
        if not hashes or self.capacity <= 0:
            return
        self.recorded += 1
        held = self._held
        for h in reversed(hashes):
            holders = held.get(h)
            if holders is None:
                held[h] = {worker_id}
            else:
                holders.add(worker_id)
                held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def holds(self, worker_id: str) -> bool:
        """Whether some prompt start names the worker."""
        return any(worker_id in holders for holders in self._held.values())

    def forget(self, worker_id: str) -> None:
        """The worker is gone (its cache with it): no block names it any more."""
        for h in [h for h, holders in self._held.items() if worker_id in holders]:
            holders = self._held[h]
            holders.discard(worker_id)
            if not holders:
                del self._held[h]


def prefer(table: PrefixTable, hashes: tuple[int, ...], among: Iterable[str]) -> list[str]:
    """The workers of `among` that hold the longest start of `hashes`, sorted, at most MAX_PREFER:
    `DispatchRequest.prefer`, the dispatcher's hint (dispatcher/prefer.py); [] when none holds
    MIN_BLOCKS of it."""
    holders, _ = table.longest(hashes, among) if hashes else (set(), 0)
    return sorted(holders)[:MAX_PREFER]


def hint(router: LocalRouter, table: PrefixTable, hashes: tuple[int, ...], fits: Sequence[Heartbeat],
         factor: float) -> tuple[list[str], bool]:
    """(`DispatchRequest.prefer` for a prompt of block hashes `hashes`: the workers of `fits` holding
    its longest start (`prefer`) that take one more request within the bound of `LocalRouter.affine`,
    sorted; whether some worker holds a start of it): `choose`'s rule, for where the dispatcher places
    (admission.dispatch_hint; `polyserve bench prefix` replays it)."""
    holders = set(prefer(table, hashes, {hb.worker_id for hb in fits}))
    return sorted(hb.worker_id for hb in fits if hb.worker_id in holders and router.within(hb, fits, factor)), \
        bool(holders)


def choose(router: LocalRouter, table: PrefixTable, hashes: tuple[int, ...], policy: str, deployment: str,
           fits: Sequence[Heartbeat], factor: float) -> tuple[Heartbeat, str]:
    """(the worker for a prompt of block hashes `hashes` among `fits`, the outcome): the least loaded
    of the workers holding its longest start when it takes one more request within the bound of
    `LocalRouter.affine` ("hit"); else `policy`'s choice ("spilled": they were overloaded; "miss":
    none holds MIN_BLOCKS of it). The caller records the placement (`PrefixTable.record`)."""
    holders, _ = table.longest(hashes, {hb.worker_id for hb in fits})
    if holders:
        home = router.least([hb for hb in fits if hb.worker_id in holders])
        if router.within(home, fits, factor):
            return home, "hit"
    return router.choose(policy, deployment, fits), "spilled" if holders else "miss"
