"""The engine profiles shipped with polyserve and the one way to find them.

A profile is the JSON that `polyserve profile run` or `polyserve profile fit-splitwise`
writes (`polyserve.core.profile_fit`): Aladdin's coefficients, KV capacity, the rows
they were fitted on. The shipped ones live in `polyserve/core/profiles/` and are
found through `importlib.resources`, so the lookup works from a checkout, an editable
install and a wheel alike.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_SIM = "sim-llama2-70b-h100-tp4"
"""Llama-2-70B on H100 TP4, fitted from the Splitwise rows: the sim engine's default."""
HF_CPU = "hf-tiny-llama-random-cpu"
"""The random tiny Llama of the hf engine, measured on a 2-core CPU."""
ENCODER_CPU = "encoder-minilm-l6-cpu"
"""all-MiniLM-L6-v2 encoder runtimes, measured on a 2-core CPU (Arlo)."""


def profiles_dir() -> Path:
    """The folder of the shipped profile files."""
    return Path(str(resources.files("polyserve.core") / "profiles"))


def shipped_names() -> list[str]:
    """Names of the shipped profiles (without `.json`)."""
    return sorted(p.stem for p in profiles_dir().glob("*.json"))


def profile_path(name_or_path: str | Path) -> Path:
    """A profile by shipped name (`sim-llama2-70b-h100-tp4`, with or without `.json`)
    or by path. FileNotFoundError names the shipped profiles when neither exists."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    stem = p.name[:-5] if p.name.endswith(".json") else p.name
    cand = profiles_dir() / f"{stem}.json"
    if str(p.parent) in ("", ".") and cand.is_file():
        return cand
    raise FileNotFoundError(f"no profile {str(name_or_path)!r}: not a file, and the shipped profiles are "
                            f"{', '.join(shipped_names())}")
