"""The running batch of the `hf` engine: per-request prefill, batched decode over a padded KV cache.

Why our own loop over `past_key_values` rather than transformers' continuous-batching
manager (`generate_batch`/`ContinuousBatchingManager`): that API is young and has
changed shape between releases, it owns its own threads and scheduler (we need ours:
pluggable queue order, a KV-token budget, cancellation that frees a row between two
steps), and it does not run PEFT mixed-adapter batches. A `DynamicCache` plus an
attention mask is a stable, documented part of every causal LM's forward.

How the batch works (all of it runs in a worker thread, never on the event loop):

* Prefill runs per request, unpadded (`[1, L]`), so a prompt is computed exactly as
  when it is alone. Its KV is copied to its `n` choice rows and merged into the
  batch cache by LEFT-padding whichever side is shorter (keys/values of zeros,
  attention mask 0).
* Decode runs all rows in one forward: one pending token per row, the attention
  mask (0 on padding columns, so their softmax weight is exactly 0) and per-row
  `position_ids` (the row's true length, so RoPE sees the same positions as alone).
  All rows grow by one column per step, so padding stays on the left.
* Rows that finish or whose request is cancelled are dropped before the next step
  (`index_select` on the batch dimension) and padding columns that no remaining
  row needs are trimmed: the KV of a finished request is freed at once.
* Multi-LoRA: with a PEFT model every forward gets `adapter_names` (one per row,
  `"__base__"` for the base model) — PEFT's mixed-adapter batch inference, which
  applies each adapter's A/B to its own sub-batch inside every LoRA layer.
* CPU-assisted LoRA (CaraServe §4): rows whose adapter is in `cpu_lora` (its
  weights are still being copied to the device) run as base rows for PEFT, and a
  forward hook on each targeted base Linear adds their delta x·A·B·scaling,
  computed on the CPU from the host copy. The base model's x·W stays on the
  device; once the engine installs the device copy it drops the adapter from
  `cpu_lora` and the next step uses PEFT's weights.

The cache layout is a padded tensor per layer, so a batch costs
rows x longest-context of KV; the engine's KV budget counts reservations
(input + max_tokens per row), which bounds that too.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from polyserve.proto import SamplingParams

from polyserve.worker.engine import Delta
from polyserve.worker.engines.hf_text import IncrementalDetokenizer, StopMatcher

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class Row:
    """One choice of one request: one row of the batch, with its sampling and text state."""

    def __init__(self, owner, index: int, params: SamplingParams, adapter: str | None, tokenizer,
                 prompt_ids: Sequence[int], eos_ids: set[int], max_positions: int, device: torch.device):
        self.owner = owner  # anything with a `cancelled` attribute (the engine's request)
        self.index = index
        self.params = params
        self.adapter = adapter or BASE
        self.eos_ids = eos_ids
        self.max_positions = max_positions
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = StopMatcher(params.stop)
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            seed = (params.seed + index) % (1 << 63) if params.seed is not None else secrets.randbits(62)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.last_token = -1  # sampled, not yet in the KV cache
        self.pos = len(prompt_ids)  # tokens in the KV cache = position id of `last_token`
        self.n_out = 0
        self.out_ids: list[int] = []
        self.finish: str | None = None

    @property
    def gone(self) -> bool:
        return self.finish is not None or bool(getattr(self.owner, "cancelled", False))

    def accept(self, token: int) -> Delta:
        """Take the sampled token; return its Delta (finish_reason set if this row is done)."""
        self.n_out += 1
        self.last_token = token
        self.out_ids.append(token)
        checks = self.n_out >= self.params.min_tokens  # stop strings apply from the min_tokens-th token on
        if token in self.eos_ids:  # `sample` never picks EOS before min_tokens
            return self._end("stop", self.stop.flush())
        text, stopped = self.stop.feed(self.detok.add(token), check=checks)
        if stopped:
            return self._end("stop", text)
        if self.n_out >= self.params.max_tokens or self.pos >= self.max_positions:
            tail, stopped = self.stop.feed(self.detok.flush(), check=True)
            return self._end("stop" if stopped else "length", text + tail + ("" if stopped else self.stop.flush()))
        return Delta(index=self.index, text=text, tokens=1)

    def _end(self, reason: str, text: str) -> Delta:
        self.finish = reason
        return Delta(index=self.index, text=text, tokens=1, finish_reason=reason)


def sample(logits: torch.Tensor, rows: Sequence[Row], suppress: torch.Tensor | None) -> list[int]:
    """Next token per row: greedy (temperature 0) or temperature/top-k/top-p with the row's generator."""
    logits = logits.float()
    if suppress is not None:
        logits[:, suppress] = float("-inf")
    for i, row in enumerate(rows):
        if row.n_out < row.params.min_tokens and row.eos_ids:
            logits[i, list(row.eos_ids)] = float("-inf")
    out = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.generator is None]
    if greedy:
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            out[i] = tok
    for i, row in enumerate(rows):
        if row.generator is not None:
            out[i] = _sample_one(logits[i], row.params, row.generator)
    return out


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _cpu_delta(entries):
    """A forward hook: for each (rows, A, B, scaling), out[rows] += (x[rows] on the CPU)·Aᵀ·Bᵀ·scaling.

    The same operations, in the same order, as PEFT's LoRA layer (F.linear with A,
    then B, then the scaling), so on a CPU the result is the device path's."""
    def hook(module, args, out):
        x = args[0]
        for idx, a, b, scaling in entries:
            xs = x if idx is None else x.index_select(0, idx)
            delta = F.linear(F.linear(xs.to("cpu", a.dtype), a), b) * scaling
            delta = delta.to(out.device, out.dtype)
            if idx is None:
                out = out + delta
            else:
                out = out.index_add(0, idx, delta)
        return out
    return hook


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


class Batch:
    """The rows being decoded and their padded KV cache. Not thread-safe: one caller at a time."""

    def __init__(self, model, device: torch.device, suppress_ids: Sequence[int] = ()):
        self.model = model
        self.lora = False  # True once the model is a PeftModel: pass adapter_names
        self.device = device
        self.suppress = torch.tensor(list(suppress_ids), device=device) if suppress_ids else None
        self.rows: list[Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = padding
        self.cpu_lora: dict = {}  # adapter name -> lora.HostLora: computed on the CPU until on the device
        self.cpu_steps = 0  # forwards that ran at least one row CPU-assisted

    @property
    def kv_columns(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def install_adapter(self, name: str, config, state: dict) -> None:
        """Put adapter `name` (a peft LoraConfig and its PEFT state dict, already on the device) into
        the model: PEFT's modules are created on the meta device, then the tensors are assigned."""
        import copy
        import warnings

        from peft import PeftModel
        from peft.auto import MODEL_TYPE_TO_PEFT_MODEL_MAPPING
        from peft.utils import set_peft_model_state_dict
        config = copy.deepcopy(config)
        model = self.model
        with warnings.catch_warnings():  # deprecation chatter between peft and transformers releases
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            if isinstance(model, PeftModel):
                model.add_adapter(name, config, low_cpu_mem_usage=True)
            else:
                cls = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
                model = cls(model, config, adapter_name=name, low_cpu_mem_usage=True)
            self.model, self.lora = model, True
            try:  # the new adapter's weights are on the meta device until assigned here
                result = set_peft_model_state_dict(model, state, adapter_name=name, low_cpu_mem_usage=True)
                missing = [k for k in result.missing_keys if name in k and "lora_" in k]
                if missing:
                    raise ValueError(f"adapter {name!r} is missing weights for {missing[:3]}")
            except Exception:
                self.remove_adapter(name)  # never leave a half-installed adapter in the model
                raise
        model.eval()

    def remove_adapter(self, name: str) -> None:
        """Delete adapter `name` from the PEFT model; the last one gone restores the plain base model."""
        import warnings
        model = self.model
        with warnings.catch_warnings():  # PEFT warns that another adapter becomes "active": we never use that
            warnings.simplefilter("ignore", UserWarning)
            model.delete_adapter(name)
        if not list(model.peft_config):
            self.model, self.lora = model.unload(), False

    def _forward(self, input_ids, adapters: list[str], **kw):
        assisted: dict[str, list[int]] = {}
        for i, a in enumerate(adapters):
            if a in self.cpu_lora:
                assisted.setdefault(a, []).append(i)
        if self.lora:
            kw["adapter_names"] = [BASE if a in assisted else a for a in adapters]
        if not assisted:
            return self.model(input_ids=input_ids, use_cache=True, **kw)
        handles = self._cpu_hooks(assisted, len(adapters))
        try:
            self.cpu_steps += 1
            return self.model(input_ids=input_ids, use_cache=True, **kw)
        finally:
            for h in handles:
                h.remove()

    def _cpu_hooks(self, assisted: dict[str, list[int]], n_rows: int) -> list:
        """Forward hooks adding x·A·B·scaling (on the CPU) to the base Linear outputs of `assisted` rows."""
        root = self.model.get_base_model() if self.lora else self.model
        per_module: dict[str, list] = {}
        for name, rows in assisted.items():
            host = self.cpu_lora[name]
            idx = None if len(rows) == n_rows else torch.tensor(rows, device=self.device)
            for path, (a, b) in host.modules.items():
                per_module.setdefault(path, []).append((idx, a, b, host.scaling))
        handles = []
        for path, entries in per_module.items():
            mod = root.get_submodule(path)
            handles.append(getattr(mod, "base_layer", mod).register_forward_hook(_cpu_delta(entries)))
        return handles

    @torch.inference_mode()
    def prefill(self, rows: list[Row], prompt_ids: Sequence[int]) -> list[tuple[Row, Delta]]:
        """Run one request's prompt, sample each choice's first token, merge live rows into the batch."""
        from transformers import DynamicCache
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        out = self._forward(ids, [rows[0].adapter], past_key_values=DynamicCache(), logits_to_keep=1)
        logits = out.logits[:, -1, :].expand(len(rows), -1).clone()
        events = [(r, r.accept(t)) for r, t in zip(rows, sample(logits, rows, self.suppress))]
        live = [r for r in rows if not r.gone]
        if live:
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
        """Drop finished and cancelled rows and the padding no row needs; returns rows dropped."""
        keep = [i for i, r in enumerate(self.rows) if not r.gone]
        dropped = len(self.rows) - len(keep)
        if not dropped:
            return 0
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return dropped
        idx = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, idx)
        lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())  # columns that are padding in every row
        self.mask = mask[:, lead:]
        self.cache = _make_cache([(k.index_select(0, idx)[:, :, lead:], v.index_select(0, idx)[:, :, lead:])
                                  for k, v in _kv(self.cache)])
        self.rows = [self.rows[i] for i in keep]
        return dropped

    @torch.inference_mode()
    def decode(self) -> list[tuple[Row, Delta]]:
        """One decode step for every live row; returns each row's Delta."""
        self.reap()
        if not self.rows:
            return []
        rows = self.rows
        ids = torch.tensor([[r.last_token] for r in rows], device=self.device)
        pos = torch.tensor([[r.pos] for r in rows], device=self.device)
        mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        out = self._forward(ids, [r.adapter for r in rows], attention_mask=mask, position_ids=pos,
                            past_key_values=self.cache)
        self.mask, self.cache = mask, out.past_key_values
        for r in rows:
            r.pos += 1
        tokens = sample(out.logits[:, -1, :], rows, self.suppress)
        events = [(r, r.accept(t)) for r, t in zip(rows, tokens)]
        self.reap()
        return events

    def clear(self) -> None:
        self.rows, self.cache, self.mask = [], None, None
