"""The running batch of the `hf` engine: per-request prefill, batched decode over a ragged or padded KV.

Why our own loop over `past_key_values` rather than transformers' continuous-batching
manager (`generate_batch`/`ContinuousBatchingManager`): that API is young and has
changed shape between releases, it owns its own threads and scheduler (we need ours:
pluggable queue order, a KV-token budget, cancellation that frees a row between two
steps), and it does not run PEFT mixed-adapter batches. A `DynamicCache` plus an
attention mask is a stable, documented part of every causal LM's forward.

How the batch works (all of it runs in a worker thread, never on the event loop):

* Prefill runs per request, unpadded (`[1, L]`), so a prompt is computed exactly as
  when it is alone. Its KV is copied to each of its `n` choice rows.
* Decode runs all rows in one forward: one pending token per row and per-row
  `position_ids` (the row's true length, so RoPE sees the same positions as alone).
  The KV has one of two layouts:
  - "ragged" (default on CPU): each row keeps its own per-layer buffers (grown by
    doubling, so a step writes one column in place). The model's attention is routed
    (transformers' `AttentionInterface`) to a function that, for decode steps, appends
    each row's new key/value and attends over that row's own columns only: no padding,
    and a join or a leave copies nothing. Prefill still uses transformers' sdpa.
  - "padded" (default on CUDA, where one batched kernel beats a per-row loop): one
    cache, rows LEFT-padded to the longest (keys/values of zeros, attention mask 0,
    so padding gets softmax weight exactly 0). Rows that leave are dropped with
    `index_select` and the left columns no remaining row needs are trimmed, so the
    width is always the longest live row's.
  Continuous batching mixes long-running rows with just-joined short ones, so the
  padded layout attends over more cells than the rows hold (1.2x in `bench-batching`
  at 16-32 concurrent) and copies the whole cache on every join and leave; the ragged
  layout attends over exactly the real ones.
* Rows that finish or whose request is cancelled are dropped before the next step:
  the KV of a finished request is freed at once.
* Pause (`pause`/`resume`, the engine's ssjf_refine preemption): a request's rows leave
  the batch with their KV and rejoin later exactly where they stopped, with no prefill.
  Ragged: the rows' own buffers are set aside as they are (nothing copied). Padded: a
  row's real tokens are the rightmost `pos` columns of the left-padded cache (joins
  left-pad, steps append on the right), so those columns are cut out, and `resume`
  left-pads them back in like a freshly prefilled row (`_merge`). Either way the next
  step feeds the row's pending token at its true position, as if it had never left.
* Multi-LoRA: with a PEFT model every forward gets `adapter_names` (one per row,
  `"__base__"` for the base model) — PEFT's mixed-adapter batch inference, which
  applies each adapter's A/B to its own sub-batch inside every LoRA layer.
* CPU-assisted LoRA (CaraServe §4): rows whose adapter is in `cpu_lora` (its
  weights are still being copied to the device) run as base rows for PEFT, and
  forward hooks (`hf_lora.cpu_hooks`) add their delta x·A·B·scaling, computed on
  the CPU from the host copy. Once the engine installs the device copy it drops
  the adapter from `cpu_lora` and the next step uses PEFT's weights.

The engine's KV budget counts reservations (input + max_tokens per row), which
bounds either layout's memory.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from polyserve.proto import SamplingParams, TokenLogprob
from polyserve.worker.engine import Delta
from polyserve.worker.engines import hf_grammar, hf_logprobs, hf_think
from polyserve.worker.engines.hf_sampling import Restrict, Shaper, sample
from polyserve.worker.engines.hf_slots import AdapterSlots
from polyserve.worker.engines.hf_text import IncrementalDetokenizer, StopMatcher

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class Row:
    """One choice of one request: one row of the batch, with its sampling and text state."""

    def __init__(self, owner, index: int, params: SamplingParams, adapter: str | None, tokenizer,
                 prompt_ids: Sequence[int], eos_ids: set[int], max_positions: int, device: torch.device,
                 guide: hf_grammar.Guide | None = None):
        self.owner = owner  # anything with a `cancelled` attribute (the engine's request)
        self.index = index
        self.params = params
        self.adapter = adapter or BASE
        self.eos_ids = eos_ids | set(params.stop_token_ids) if params.stop_token_ids else eos_ids  # end the row
        self.max_positions = max_positions
        self.guide = guide  # structured outputs: the grammar's mask and text (hf_grammar)
        # a thinking model (hf_think): no mask until its thinking ends, the guide held here; a thinking budget
        self.gate = hf_think.ThinkGate(params.think, tokenizer, prompt_ids) if guide is not None and params.think \
            else None
        self.budget = hf_think.ThinkBudget(params.think, params.thinking_budget, tokenizer, prompt_ids) \
            if params.think and params.thinking_budget is not None else None
        self._held_guide = None
        if self.gate is not None and not self.gate.ended:
            self.guide, self._held_guide = None, guide
        self.detok = self.guide if self.guide is not None else \
            IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stop = StopMatcher(params.stop, include=params.include_stop)
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            seed = (params.seed + index) % (1 << 63) if params.seed is not None else secrets.randbits(62)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.last_token = -1  # sampled, not yet in the KV cache
        self.pos = len(prompt_ids)  # tokens in the KV cache = position id of `last_token`
        self.n_out = 0
        self.out_ids: list[int] = []
        self.finish: str | None = None
        wants = params.logprobs is not None or params.prompt_logprobs is not None
        self.texts = hf_logprobs.TokenTexts(tokenizer) if wants else None
        self.logprob: TokenLogprob | None = None  # of the token being accepted
        self.prompt_logprobs: list[TokenLogprob] | None = None  # sent with the first delta
        # Penalties and logit_bias, applied by `sample` (hf_sampling.Shaper); None: the request has none.
        self.shaper = Shaper(params, prompt_ids) if Shaper.wanted(params) else None
        self.restrict = Restrict(params, tokenizer) if Restrict.wanted(params) else None
        self._prompt_ids = list(prompt_ids) if params.return_token_ids else None  # sent with the first delta

    @property
    def gone(self) -> bool:
        return self.finish is not None or bool(getattr(self.owner, "cancelled", False))

    def accept(self, token: int) -> Delta:
        """Take the sampled token (its logprob entry set just before, if asked for); return its
        Delta (finish_reason set if this row is done)."""
        self.n_out += 1
        self.last_token = token
        self.out_ids.append(token)
        if self.shaper is not None:
            self.shaper.observe(token)
        checks = self.n_out >= self.params.min_tokens  # stop strings apply from the min_tokens-th token on
        if token in self.eos_ids:  # `sample` never picks EOS before min_tokens
            return self._end("stop", self.stop.flush())
        if self.guide is not None:
            self.guide.consume(token)
        piece = self.detok.add(token)
        if self.budget is not None:
            self.budget.accept(token, piece)
        if self._held_guide is not None and (self.gate.feed(piece) or (self.budget is not None and self.budget.done)):
            # the thinking is over (written, or forced by the budget): the grammar from the next token
            piece += self.detok.flush()
            self.guide = self.detok = self._held_guide
            self._held_guide = None
        text, stopped = self.stop.feed(piece, check=checks)
        if stopped:
            return self._end("stop", text)
        if self.guide is not None and self.guide.done:  # the grammar is complete: nothing may follow
            tail, stopped = self.stop.feed(self.detok.flush(), check=True)
            return self._end("stop", text + tail + ("" if stopped else self.stop.flush()))
        if self.n_out >= self.params.max_tokens or self.pos >= self.max_positions:
            tail, stopped = self.stop.feed(self.detok.flush(), check=True)
            return self._end("stop" if stopped else "length", text + tail + ("" if stopped else self.stop.flush()))
        return self._delta(text)

    def _end(self, reason: str, text: str) -> Delta:
        self.finish = reason
        return self._delta(text, reason)

    def _delta(self, text: str, reason: str | None = None) -> Delta:
        delta = Delta(index=self.index, text=text, tokens=1, finish_reason=reason,
                      logprobs=[self.logprob] if self.logprob is not None else None,
                      prompt_logprobs=self.prompt_logprobs)
        self.prompt_logprobs = None
        if self.params.return_token_ids:  # every accepted token, EOS and stop tokens too (as vLLM's)
            delta.token_ids, delta.prompt_token_ids, self._prompt_ids = [self.last_token], self._prompt_ids, None
        return delta


LAYOUTS = ("ragged", "padded")
_RAGGED = "polyserve_ragged"  # the attention implementation name the ragged layout registers
_GROW = 128  # columns a row's buffers grow by at least (then doubling), bounded by its last position


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Left-pad the sequence dimension (-2) of [B, H, L, D] (or -1 of a [B, L] mask)."""
    if n == 0:
        return t
    return F.pad(t, (0, 0, n, 0)) if t.dim() == 4 else F.pad(t, (n, 0))


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache
    return DynamicCache(ddp_cache_data=kv)


class RowKV:
    """One row's keys and values: per layer a [kv_heads, capacity, head_dim] buffer, `length` filled.

    Capacity grows by doubling (at least `_GROW` columns) up to `limit`, the row's last position,
    so a step writes one column in place instead of copying the cache."""

    __slots__ = ("layers", "length", "limit")

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], limit: int):
        length = int(kv[0][0].shape[-2])
        self.length, self.limit = length, max(limit, length + 1)
        cap = min(self.limit, length + _GROW)
        self.layers = [(_buffer(k, cap), _buffer(v, cap)) for k, v in kv]

    def reserve(self) -> None:
        """Room for one more column."""
        cap = int(self.layers[0][0].shape[1])
        if self.length < cap:
            return
        cap = min(max(self.limit, self.length + 1), max(2 * cap, cap + _GROW))
        self.layers = [(_buffer(k[:, :self.length], cap), _buffer(v[:, :self.length], cap)) for k, v in self.layers]


def _buffer(t: torch.Tensor, cap: int) -> torch.Tensor:
    """[kv_heads, cap, head_dim] holding `t` ([1, H, L, D] or [H, L, D]) in its first L columns."""
    t = t[0] if t.dim() == 4 else t
    buf = t.new_empty(t.shape[0], cap, t.shape[2])
    buf[:, :t.shape[1]] = t
    return buf


class _RaggedStep:
    """One decode forward over ragged rows: each layer's attention appends the new key/value to
    every row's buffer and attends over that row's own columns only (no padding anywhere)."""

    def __init__(self, kv: list[RowKV]):
        self.kv = kv

    def attend(self, layer: int, query, key, value, scaling):
        gqa = query.shape[1] != key.shape[1]
        outs = []
        for i, row in enumerate(self.kv):
            k, v = row.layers[layer]
            n = row.length
            k[:, n] = key[i, :, 0]
            v[:, n] = value[i, :, 0]
            outs.append(F.scaled_dot_product_attention(query[i:i + 1], k[None, :, :n + 1], v[None, :, :n + 1],
                                                       scale=scaling, enable_gqa=gqa))
        return torch.cat(outs).transpose(1, 2).contiguous()  # [B, 1, heads, head_dim] like sdpa's


def _ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The ragged layout's attention: decode steps go to their `_RaggedStep`, everything else
    (prefill) is transformers' own sdpa attention, unchanged."""
    step = kwargs.pop("ragged_step", None)
    if step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return step.attend(module.layer_idx, query, key, value, scaling), None


def use_ragged_attention(model) -> bool:
    """Route `model`'s attention through `_ragged_attention`; False if the model does not use sdpa
    or does not dispatch its attention through transformers' `AttentionInterface` (Falcon,
    StableLM: their own sdpa/eager branches would take the registered name for eager)."""
    from transformers import AttentionInterface
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", _RAGGED) or getattr(config, "sliding_window",
                                                                                         None):
        return False
    if not getattr(type(model), "_supports_attention_backend", False):
        return False
    AttentionInterface.register(_RAGGED, _ragged_attention)
    config._attn_implementation = _RAGGED
    return True


class Paused:
    """One request's rows out of the batch with their KV (`Batch.pause`): ragged, each row's
    `RowKV`; padded, per layer the rows' keys and values ([rows, kv_heads, pos, head_dim])."""

    __slots__ = ("rows", "kv")

    def __init__(self, rows: list[Row], kv: list):
        self.rows, self.kv = rows, kv


class Batch:
    """The rows being decoded and their KV. Not thread-safe: one caller at a time.

    `layout`: "ragged" (each row its own KV buffers; attention per row) or "padded" (one
    left-padded cache; attention batched under a mask)."""

    def __init__(self, model, device: torch.device, suppress_ids: Sequence[int] = (), layout: str = "ragged"):
        if layout not in LAYOUTS:
            raise ValueError(f"kv layout {layout!r} is unknown; choose one of {', '.join(LAYOUTS)}")
        self.model = model
        self.lora = False  # True once the model is a PeftModel: pass adapter_names
        self.device = device
        self.suppress = torch.tensor(list(suppress_ids), device=device) if suppress_ids else None
        self.layout = "ragged" if layout == "ragged" and use_ragged_attention(model) else "padded"
        self.rows: list[Row] = []
        self.kv: list[RowKV] = []  # ragged: one per row
        self.cache = None  # padded: a DynamicCache of [B, kv_heads, L, head_dim] per layer
        self.mask: torch.Tensor | None = None  # padded: [B, L] 1 = real token, 0 = padding
        self.cpu_lora: dict = {}  # adapter name -> lora.HostLora: computed on the CPU until on the device
        self.slots = AdapterSlots()  # adapter name -> its PEFT modules; evicted ones kept for reuse
        self.cpu_steps = 0  # forwards that ran at least one row CPU-assisted
        self.cells = 0  # row x KV-column cells attended over by decode steps (padding included)

    @property
    def kv_columns(self) -> int:
        """Width of the KV: the longest row (ragged) or the padded cache's columns."""
        if self.layout == "ragged":
            return max((kv.length for kv in self.kv), default=0)
        return 0 if self.mask is None else int(self.mask.shape[1])

    def install_adapter(self, name: str, config, state: dict) -> None:
        self.slots.install(self, name, config, state)

    def remove_adapter(self, name: str, park: bool = True) -> None:
        """Evict (`park`: its modules kept for the next install of the same shape) or unload."""
        self.slots.remove(self, name, park)

    def _forward(self, input_ids, adapters: list[str], **kw):
        assisted: dict[str, list[int]] = {}
        for i, a in enumerate(adapters):
            if a in self.cpu_lora:
                assisted.setdefault(a, []).append(i)
        if self.lora:
            kw["adapter_names"] = [BASE if a in assisted or a == BASE else self.slots.peft_name(a) for a in adapters]
        kw.setdefault("use_cache", True)
        if not assisted:
            return self.model(input_ids=input_ids, **kw)
        from polyserve.worker.engines.hf_lora import cpu_hooks
        root = self.model.get_base_model() if self.lora else self.model
        handles = cpu_hooks(root, self.cpu_lora, assisted, len(adapters), self.device)
        try:
            self.cpu_steps += 1
            return self.model(input_ids=input_ids, **kw)
        finally:
            for h in handles:
                h.remove()

    @torch.inference_mode()
    def prefill(self, rows: list[Row], prompt_ids: Sequence[int]) -> list[tuple[Row, Delta]]:
        """Run one request's prompt, sample each choice's first token, merge live rows into the batch."""
        from transformers import DynamicCache
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        k_prompt = max((r.params.prompt_logprobs for r in rows if r.params.prompt_logprobs is not None), default=None)
        out = self._forward(ids, [rows[0].adapter], past_key_values=DynamicCache(),
                            logits_to_keep=0 if k_prompt is not None else 1)
        if k_prompt is not None:
            plp = hf_logprobs.prompt(out.logits[0], prompt_ids, k_prompt, rows[0].texts)
            for r in rows:
                r.prompt_logprobs = plp
        raw = out.logits[:, -1, :].expand(len(rows), -1)
        tokens = sample(raw.clone(), rows, self.suppress)
        events = self._accept(raw, tokens, rows)
        live = [r for r in rows if not r.gone]
        if live and self.layout == "ragged":
            kv = _kv(out.past_key_values)
            new = [RowKV(kv, len(prompt_ids) + r.params.max_tokens) for r in live]  # built first: all or none
            self.rows, self.kv = self.rows + live, self.kv + new
        elif live:
            kv = [(k.expand(len(live), -1, -1, -1).contiguous(), v.expand(len(live), -1, -1, -1).contiguous())
                  for k, v in _kv(out.past_key_values)]
            self._merge(live, kv, len(prompt_ids))
        return events

    def _merge(self, rows: list[Row], kv, length: int) -> None:
        mask = torch.ones(len(rows), length, dtype=torch.long, device=self.device)
        if self.cache is None or not self.rows:
            self.rows, self.cache, self.mask = list(rows), _make_cache(kv), mask
            return
        old = _kv(self.cache)
        width = max(length, self.kv_columns)
        pad_old, pad_new = width - self.kv_columns, width - length
        merged = [(torch.cat([_left_pad(ko, pad_old), _left_pad(kn, pad_new)]),
                   torch.cat([_left_pad(vo, pad_old), _left_pad(vn, pad_new)]))
                  for (ko, vo), (kn, vn) in zip(old, kv)]
        mask = torch.cat([_left_pad(self.mask, pad_old), _left_pad(mask, pad_new)])
        cache = _make_cache(merged)
        # assigned only once everything is built: a failure above leaves the batch as it was
        self.rows, self.cache, self.mask = self.rows + list(rows), cache, mask

    @torch.inference_mode()
    def reap(self) -> int:
        """Drop finished and cancelled rows (and, padded, the padding no row needs); returns rows dropped."""
        keep = [i for i, r in enumerate(self.rows) if not r.gone]
        dropped = len(self.rows) - len(keep)
        if dropped:
            self._keep(keep)
        return dropped

    def _keep(self, keep: list[int]) -> None:
        """Keep only the rows at indices `keep` (and, padded, trim the padding no kept row needs)."""
        if not keep:
            self.clear()
            return
        if self.layout == "ragged":  # a row's buffers are its own: nothing else to copy
            self.rows, self.kv = [self.rows[i] for i in keep], [self.kv[i] for i in keep]
            return
        idx = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, idx)
        lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())  # columns that are padding in every row
        self.mask = mask[:, lead:]
        self.cache = _make_cache([(k.index_select(0, idx)[:, :, lead:], v.index_select(0, idx)[:, :, lead:])
                                  for k, v in _kv(self.cache)])
        self.rows = [self.rows[i] for i in keep]

    @torch.inference_mode()
    def pause(self, owner) -> Paused:
        """Take `owner`'s live rows out of the batch with their KV (see the module docstring);
        `resume` puts them back. The rows of one request always hold the same number of tokens."""
        take = [i for i, r in enumerate(self.rows) if r.owner is owner and not r.gone]
        if not take:
            raise ValueError("pause: the request has no live rows in the batch")
        rows = [self.rows[i] for i in take]
        if self.layout == "ragged":
            held = Paused(rows, [self.kv[i] for i in take])
        else:
            length, idx = rows[0].pos, torch.tensor(take, device=self.device)
            # sliced before the select: one copy, of the real columns only
            held = Paused(rows, [(k[:, :, -length:].index_select(0, idx), v[:, :, -length:].index_select(0, idx))
                                 for k, v in _kv(self.cache)])
        self._keep([i for i, r in enumerate(self.rows) if r.owner is not owner])
        return held

    @torch.inference_mode()
    def resume(self, held: Paused) -> None:
        """Put paused rows back into the batch, KV and all: their next decode goes on where they stopped."""
        if self.layout == "ragged":
            self.rows, self.kv = self.rows + held.rows, self.kv + held.kv
        else:
            self._merge(held.rows, held.kv, held.rows[0].pos)

    @torch.inference_mode()
    def decode(self) -> list[tuple[Row, Delta]]:
        """One decode step for every live row; returns each row's Delta."""
        self.reap()
        if not self.rows:
            return []
        rows = self.rows
        ids = torch.tensor([[r.last_token] for r in rows], device=self.device)
        pos = torch.tensor([[r.pos] for r in rows], device=self.device)
        adapters = [r.adapter for r in rows]
        if self.layout == "ragged":
            for kv in self.kv:
                kv.reserve()
            self.cells += sum(kv.length + 1 for kv in self.kv)
            out = self._forward(ids, adapters, position_ids=pos, use_cache=False, ragged_step=_RaggedStep(self.kv))
            for kv in self.kv:
                kv.length += 1
        else:
            mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
            self.cells += int(mask.numel())
            out = self._forward(ids, adapters, attention_mask=mask, position_ids=pos, past_key_values=self.cache)
            self.mask, self.cache = mask, out.past_key_values
        for r in rows:
            r.pos += 1
        raw = out.logits[:, -1, :]
        wants = any(r.texts is not None for r in rows)
        tokens = sample(raw.clone() if wants else raw, rows, self.suppress)
        events = self._accept(raw, tokens, rows)
        self.reap()
        return events

    @staticmethod
    def _accept(raw: torch.Tensor, tokens: list[int], rows: Sequence[Row]) -> list[tuple[Row, Delta]]:
        """Each row takes its sampled token, with its logprob entry where it asked for logprobs
        (`raw`: the logits sampled from, unmodified)."""
        texts = next((r.texts for r in rows if r.params.logprobs is not None), None)
        lps = hf_logprobs.sampled(raw, tokens, [r.params.logprobs for r in rows], texts) if texts else None
        for i, r in enumerate(rows):
            r.logprob = lps[i] if lps else None
        return [(r, r.accept(t)) for r, t in zip(rows, tokens)]

    def clear(self) -> None:
        self.rows, self.kv, self.cache, self.mask = [], [], None, None
