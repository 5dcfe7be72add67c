"""LoRA adapters on a worker: reading PEFT adapter directories, the registry of loaded
adapters (name -> rank, path), and a maker of random adapters for tests and demos.

An adapter directory is PEFT's format: `adapter_config.json` (rank `r`, `lora_alpha`,
`target_modules`, `base_model_name_or_path`) and `adapter_model.safetensors`.
Reading and the registry need no torch; `create_random_adapter` and the host copies
(`load_host_lora`, `copy_to_device`, used by the hf engine's cache tiers and its
CPU-assisted cold start, CaraServe §4) import it lazily.

CLI (wired as `polyserve adapter create`):
    python -m polyserve.worker.lora create --base random --rank 8 --out /tmp/a8 [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from polyserve.proto import AdapterInfo

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")
DEFAULT_TARGETS = ("q_proj", "v_proj")
RESERVED = {"__base__", "base", ""}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")


class AdapterError(ValueError):
    """An adapter directory or name that cannot be used; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterSpec:
    """What a PEFT adapter directory says about itself."""

    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str = ""
    peft_type: str = "LORA"


def check_name(name: str) -> str:
    """Adapter names travel in requests and as PEFT module keys: letters, digits, '_' and '-'."""
    if name in RESERVED or not _NAME.match(name or ""):
        raise AdapterError(f"adapter name {name!r} is not allowed (1-64 of [A-Za-z0-9_-], not {sorted(RESERVED - {''})})")
    return name


def read_adapter(path: str | Path) -> AdapterSpec:
    """Validate a PEFT LoRA adapter directory and read its rank and targets."""
    root = Path(path).expanduser()
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"{root} is not a PEFT adapter directory: no {CONFIG_FILE}", 404)
    if not any((root / w).is_file() for w in WEIGHTS_FILES):
        raise AdapterError(f"{root} has no adapter weights ({' or '.join(WEIGHTS_FILES)})", 404)
    # Messages name the file and the problem, never what the file holds (it may not be an adapter
    # config at all: a symlink to a secret must not come back in an error).
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{cfg_path}: unreadable adapter config ({type(exc).__name__})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: the adapter config is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{root}: peft_type is not LoRA (only LoRA adapters are served)")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{cfg_path}: rank 'r' must be a positive integer, got a {type(rank).__name__}")
    targets = cfg.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return AdapterSpec(path=root, rank=rank, alpha=float(cfg.get("lora_alpha", rank)), target_modules=targets,
                       base_model=str(cfg.get("base_model_name_or_path") or ""), peft_type=peft_type)


@dataclass
class AdapterRegistry:
    """Adapters loaded on one worker, by name (the heartbeat reports `infos()`)."""

    specs: dict[str, AdapterSpec] = field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def names(self) -> list[str]:
        return sorted(self.specs)

    def add(self, name: str, spec: AdapterSpec) -> AdapterInfo:
        self.specs[check_name(name)] = spec
        return AdapterInfo(name=name, rank=spec.rank)

    def remove(self, name: str) -> AdapterSpec:
        try:
            return self.specs.pop(name)
        except KeyError:
            raise AdapterError(self.unknown_message(name), 404) from None

    def rank(self, name: str) -> int:
        return self.specs[name].rank

    def infos(self) -> list[AdapterInfo]:
        return [AdapterInfo(name=n, rank=self.specs[n].rank) for n in self.names()]

    def unknown_message(self, name: str) -> str:
        loaded = ", ".join(self.names()) or "none"
        return f"adapter {name!r} is not loaded on this worker (loaded adapters: {loaded})"


# --------------------------------------------------------------------- host and device copies
PEFT_PREFIX = "base_model.model."


@dataclass
class HostLora:
    """An adapter's weights in host memory: what the CPU computes x·A·B·scaling with.

    `state` keeps PEFT's keys (``base_model.model.<module>.lora_A.weight``) for the
    device copy; `modules` maps each target module's path inside the transformers
    model to its (A [r, in], B [out, r]) tensors (the same storage). Weights are
    float32, as PEFT's default `autocast_adapter_dtype` keeps LoRA weights.
    `cpu_ok` is False for variants the CPU path does not compute (DoRA, LoRA bias,
    rank/alpha patterns, non-Linear targets): those wait for the device copy.
    """

    spec: AdapterSpec
    config: object  # peft.LoraConfig
    state: dict
    modules: dict
    scaling: float
    nbytes: int
    cpu_ok: bool = True


def lora_config(spec: AdapterSpec):
    """The adapter's peft.LoraConfig, read from its directory (inference mode)."""
    from peft import LoraConfig
    try:
        config = LoraConfig.from_pretrained(str(spec.path))
    except Exception as exc:  # bad or incompatible config; the type only: messages may quote the file
        raise AdapterError(f"{spec.path}: cannot read its LoRA config ({type(exc).__name__})") from exc
    config.inference_mode = True
    return config


def weight_bytes(spec: AdapterSpec) -> int:
    """Bytes of the adapter's float32 host copy, from the safetensors header (file size for .bin)."""
    st = spec.path / WEIGHTS_FILES[0]
    if st.is_file():
        from safetensors import safe_open
        total = 0
        with safe_open(str(st), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                total += 4 * math.prod(f.get_slice(key).get_shape())
        return total
    return (spec.path / WEIGHTS_FILES[1]).stat().st_size


def lora_scaling(config, rank: int = 8, alpha: float = 8.0) -> float:
    """PEFT's LoRA scaling of `config` (alpha / r, or alpha / sqrt(r) with rsLoRA); `rank` and `alpha`
    when the config does not say."""
    r = int(getattr(config, "r", rank))
    a = float(getattr(config, "lora_alpha", alpha))
    return a / math.sqrt(r) if getattr(config, "use_rslora", False) else a / r


def load_host_lora(spec: AdapterSpec, pin: bool = False, config=None) -> HostLora:
    """Read an adapter from disk into host memory (pinned when `pin`, for async copies to CUDA)."""
    import torch
    config = config or lora_config(spec)
    st = spec.path / WEIGHTS_FILES[0]
    if st.is_file():
        from safetensors.torch import load_file
        raw = load_file(str(st))
    else:
        raw = torch.load(str(spec.path / WEIGHTS_FILES[1]), map_location="cpu", weights_only=True)
    state = {}
    for key, t in raw.items():
        t = t.detach().to(torch.float32).contiguous()
        state[key] = t.pin_memory() if pin else t
    pairs: dict[str, dict[str, object]] = {}
    cpu_ok = not (getattr(config, "use_dora", False) or getattr(config, "rank_pattern", None)
                  or getattr(config, "alpha_pattern", None) or getattr(config, "lora_bias", False))
    for key, t in state.items():
        body = key.removeprefix(PEFT_PREFIX)
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if body.endswith(suffix):
                pairs.setdefault(body[:-len(suffix)], {})[part] = t
                break
        else:
            cpu_ok = False  # embeddings, magnitudes, biases: not the x·A·B of a Linear
    modules = {m: (p["A"], p["B"]) for m, p in pairs.items() if "A" in p and "B" in p}
    if not modules:
        raise AdapterError(f"{spec.path}: no lora_A/lora_B weight pairs in the adapter")
    scaling = lora_scaling(config, spec.rank, spec.alpha)
    return HostLora(spec=spec, config=config, state=state, modules=modules, scaling=scaling,
                    nbytes=sum(t.numel() * t.element_size() for t in state.values()), cpu_ok=cpu_ok)


def linear_features(mod) -> tuple[int, int] | None:
    """(in, out) features of a layer LoRA can target: an nn.Linear, or transformers' `Conv1D` (GPT-2
    and its kin: a linear layer whose weight is stored (in, out), so it has no `in_features`);
    None for anything else."""
    if hasattr(mod, "in_features") and hasattr(mod, "out_features"):
        return int(mod.in_features), int(mod.out_features)
    weight = getattr(mod, "weight", None)
    if type(mod).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def check_fits(host: HostLora, model) -> None:
    """Raise AdapterError unless every target module exists in `model` with matching shapes."""
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    for path, (a, b) in host.modules.items():
        try:
            mod = root.get_submodule(path)
        except AttributeError:
            raise AdapterError(f"the model has no module {path!r} that the adapter targets") from None
        fan_in, fan_out = linear_features(getattr(mod, "base_layer", mod)) or (None, None)
        if (a.shape[1], b.shape[0]) != (fan_in, fan_out) or a.shape[0] != b.shape[1]:
            raise AdapterError(f"module {path}: adapter A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                               f"in_features={fan_in}, out_features={fan_out}")


def copy_to_device(state: dict, device) -> dict:
    """The device copy of a host state dict. On CUDA: an async copy from pinned memory on a
    side stream, waited for in this (background) thread only; elsewhere a clone."""
    import torch
    device = torch.device(device)
    with torch.no_grad():
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                out = {k: t.to(device, non_blocking=True) for k, t in state.items()}
            stream.synchronize()
            for t in out.values():  # later used (and freed) on the default stream
                t.record_stream(torch.cuda.default_stream(device))
            return out
        return {k: t.to(device).clone() for k, t in state.items()}


# --------------------------------------------------------------------- random adapters
def _base_structure(base):
    """(model on the meta device or as given, name, weight std) for a base given as module, path or 'random[:seed]'."""
    import torch
    if isinstance(base, torch.nn.Module):
        if hasattr(base, "get_base_model"):  # a PeftModel: key names are relative to the base model
            base = base.get_base_model()
        name = getattr(getattr(base, "config", None), "_name_or_path", "") or type(base).__name__
        return base, name, None
    base = str(base or "random")
    if base == "random" or base.startswith("random:"):
        from transformers import LlamaForCausalLM

        from polyserve.worker.engines.hf_model import RANDOM_ARCH, random_config
        with torch.device("meta"):
            model = LlamaForCausalLM(random_config())
        return model, "random-llama", RANDOM_ARCH["initializer_range"]
    from transformers import AutoConfig, AutoModelForCausalLM
    root = Path(base).expanduser()
    if not (root / "config.json").is_file():
        raise AdapterError(f"base {base!r} is neither 'random' nor a checkpoint directory with config.json")
    config = AutoConfig.from_pretrained(str(root))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, str(root), float(getattr(config, "initializer_range", 0.02) or 0.02)


def create_random_adapter(base, rank: int, out_dir: str | Path, seed: int = 0,
                          targets: tuple[str, ...] = DEFAULT_TARGETS, alpha: float | None = None,
                          strength: float = 0.5) -> Path:
    """Write a random PEFT LoRA adapter of `rank` for `base` into `out_dir`; returns the directory.

    `base` is a model, a checkpoint directory, or "random" (the engine's random Llama).
    A and B are both non-zero (seeded), scaled so the adapter's contribution to each
    target's output is about `strength` times the base projection's, whatever the rank:
    it visibly changes generations, as a fine-tuned adapter would.
    """
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    if rank <= 0:
        raise AdapterError(f"rank must be > 0, got {rank}")
    model, base_name, init_std = _base_structure(base)
    alpha = float(alpha if alpha is not None else rank)
    scaling = alpha / rank
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    conv1d = False
    for mod_name, module in model.named_modules():
        # nn.Linear or Conv1D, or a PEFT LoRA layer wrapping one (it exposes the same weight)
        features = linear_features(getattr(module, "base_layer", module))
        if mod_name.split(".")[-1] not in targets or features is None:
            continue
        fan_in, fan_out = features
        conv1d = conv1d or type(getattr(module, "base_layer", module)).__name__ == "Conv1D"
        w_std = init_std if module.weight.is_meta else float(module.weight.detach().float().std())
        a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)  # A x has the scale of x
        b_std = strength * w_std * math.sqrt(fan_in) / (math.sqrt(rank) * scaling)
        b = torch.randn(fan_out, rank, generator=gen) * b_std
        key = f"base_model.model.{mod_name}"
        tensors[f"{key}.lora_A.weight"] = a.contiguous()
        tensors[f"{key}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise AdapterError(f"no Linear or Conv1D modules named {list(targets)} in base {base_name!r}")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", base_model_name_or_path=base_name, fan_in_fan_out=conv1d)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / WEIGHTS_FILES[0]), metadata={"format": "pt", "polyserve": f"random seed={seed}"})
    return out


def main(argv: list[str] | None = None) -> int:
    """`polyserve adapter create --base random --rank 8 --out DIR [--seed N] [--targets q_proj,v_proj]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "create":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="polyserve adapter create",
                                     description="Create a random PEFT LoRA adapter (for tests and demos).")
    parser.add_argument("--base", default="random", help="checkpoint directory, or 'random' (the built-in model)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--out", required=True, help="directory to write the adapter into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank)")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated module names")
    args = parser.parse_args(argv)
    try:
        out = create_random_adapter(args.base, args.rank, args.out, seed=args.seed, alpha=args.alpha,
                                    targets=tuple(t for t in args.targets.split(",") if t))
    except AdapterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"path": str(out), "rank": args.rank, "base": str(args.base), "seed": args.seed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
