"""Device slots of the `hf` engine's LoRA adapters: an evicted adapter's PEFT modules are kept
for the next install of the same shape, which then only copies its weights in.

Why: PEFT's install (`add_adapter` + `set_peft_model_state_dict`, `hf_model.install_adapter`)
walks the whole model, builds a LoRA layer per targeted module and initialises it before the
weights are assigned. That took 154–182 ms per adapter on an H100 (the copy itself 7–10 ms)
and 70–250 ms on the CPU build machines, and it is what an on-demand cold start waits for.
Copying into modules that already exist took 2.1–2.2 ms there (1–2 ms on the CPU): the
on-demand cold start fell from 4.2–5.6x the cached TTFT to 1.1–1.3x (docs/benchmarks/gpu.md).

The rules, kept so that the device never holds more than the cache accounts for:

* an adapter's *shape* is its weights' names and sizes and its LoRA config apart from
  `lora_alpha` (scaling is set per install); adapters with DoRA, rank or alpha patterns,
  LoRA biases or extra trainable modules are never parked (their modules are deleted);
* `remove` parks the adapter's modules under its shape: no row names them any more
  (`peft_name` maps adapter names to the PEFT name of their slot);
* `install` takes a parked slot of its shape when there is one, and deletes every other
  parked slot first, so parked modules never outlive the next install: the device holds at
  most what it held before the eviction that parked them.

PEFT runs a mixed batch only over the adapters its rows name, so parked slots cost no compute.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from polyserve.worker.engines import hf_model
from polyserve.worker.lora import lora_scaling

# config fields that do not change the modules' shape (lora_alpha: set on install)
_FREE_FIELDS = {"lora_alpha", "base_model_name_or_path", "revision", "peft_version", "inference_mode",
                "init_lora_weights"}


def shape_key(config, state: dict[str, torch.Tensor]) -> tuple | None:
    """What must match for one adapter to reuse another's modules; None when it never may."""
    if (getattr(config, "use_dora", False) or getattr(config, "rank_pattern", None)
            or getattr(config, "alpha_pattern", None) or getattr(config, "lora_bias", False)
            or getattr(config, "modules_to_save", None) or getattr(config, "trainable_token_indices", None)):
        return None
    if any(".lora_A.weight" not in k and ".lora_B.weight" not in k for k in state):
        return None  # embeddings, magnitudes, biases: PEFT's own install and delete only
    fields = tuple(sorted((k, repr(sorted(v) if isinstance(v, set) else v))
                          for k, v in config.to_dict().items() if k not in _FREE_FIELDS))
    return fields, tuple(sorted((k, tuple(t.shape)) for k, t in state.items()))


class _Slot:
    """One PEFT adapter's modules: where each weight of the state dict goes, and its LoRA layers."""

    def __init__(self, peft_name: str, key: tuple | None, params: dict[str, torch.Tensor], layers: list):
        self.peft_name, self.key, self.params, self.layers = peft_name, key, params, layers


class AdapterSlots:
    """Adapter name -> the PEFT adapter (slot) holding its weights; parked slots by shape."""

    def __init__(self):
        self._live: dict[str, _Slot] = {}
        self._parked: list[_Slot] = []
        self._names = itertools.count()
        self.reused = 0  # installs that copied into a parked slot
        self.reuse = True  # False: every eviction deletes, every install is PEFT's (bench lora's baseline)

    def peft_name(self, name: str) -> str:
        """The PEFT adapter name a batch row of adapter `name` runs with."""
        slot = self._live.get(name)
        return slot.peft_name if slot is not None else name

    @property
    def parked(self) -> int:
        return len(self._parked)

    def install(self, batch, name: str, config, state: dict[str, torch.Tensor]) -> None:
        """Put adapter `name` on the device: into a parked slot of its shape, else through PEFT."""
        if name in self._live:
            raise ValueError(f"adapter {name!r} is installed already")
        key = shape_key(config, state)
        slot = next((s for s in self._parked if key is not None and s.key == key), None) if self.reuse else None
        for other in [s for s in self._parked if s is not slot]:  # parked modules never outlive an install
            self._parked.remove(other)
            hf_model.remove_adapter(batch, other.peft_name)
        if slot is not None:
            self._parked.remove(slot)
            try:
                with torch.no_grad():
                    for k, t in state.items():
                        slot.params[k].copy_(t)
                    scaling = lora_scaling(config)
                    for layer in slot.layers:
                        layer.scaling[slot.peft_name] = scaling
                        layer.lora_alpha[slot.peft_name] = config.lora_alpha
            except Exception:
                hf_model.remove_adapter(batch, slot.peft_name)  # never leave a half-written slot
                raise
            self._live[name] = slot
            self.reused += 1
            return
        peft_name = f"slot{next(self._names)}"
        hf_model.install_adapter(batch, peft_name, config, state)
        self._live[name] = self._describe(batch.model, peft_name, key, state)

    def remove(self, batch, name: str, park: bool = True) -> None:
        """Take adapter `name` off the device. An eviction (`park`) keeps its modules for a later
        install of the same shape; unloading it deletes them, and with the last adapter gone every
        parked slot too, so that the plain base model serves again (`hf_model.remove_adapter`)."""
        slot = self._live.pop(name)
        if park and self.reuse and slot.key is not None:
            self._parked.append(slot)
            return
        hf_model.remove_adapter(batch, slot.peft_name)
        if not park:
            self.release(batch)

    def release(self, batch) -> None:
        """With no adapter on the device any more, delete the parked slots (the base model serves)."""
        while not self._live and self._parked:
            hf_model.remove_adapter(batch, self._parked.pop().peft_name)

    @staticmethod
    def _describe(model, peft_name: str, key: tuple | None, state: dict[str, Any]) -> _Slot:
        """The parameters a later install copies into, by the state dict's own keys."""
        if key is None:
            return _Slot(peft_name, None, {}, [])
        named = dict(model.named_parameters())
        params = {}
        for k in state:
            part = ".lora_A." if ".lora_A." in k else ".lora_B."
            head, _, tail = k.rpartition(part)
            target = named.get(f"{head}{part}{peft_name}.{tail}")
            if target is None:  # a key PEFT placed elsewhere: this adapter's modules are not reused
                return _Slot(peft_name, None, {}, [])
            params[k] = target
        layers = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)
                  and peft_name in m.scaling]
        return _Slot(peft_name, key, params, layers)
