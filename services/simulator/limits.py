"""What a profile is good for: the model's context window and the prompt lengths its
prefill model was measured on (the simulator flags work beyond either; SIMULATED runs
that extrapolate say so).

* Context window: the profile's ``context_tokens`` (or ``max_model_len``) key, else the
  model's published window by name (`KNOWN_CONTEXT`), else none (0).
* Profiled prompt range: the profile's ``profiled_max_prompt_tokens`` key, else, for a
  profile fitted from the Splitwise rows (``source.file`` + ``source.filter``), the longest
  ``prompt_size`` among the rows of its filter, read from the datasets folder; else
  unknown (0).
"""
from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path

from polyserve.shared.paths import datasets_dir

KNOWN_CONTEXT = {"llama2-70b": 4096, "llama2-13b": 4096, "llama2-7b": 4096, "llama-2-70b": 4096,
                 "bloom-176b": 2048, "opt-13b": 2048, "opt-66b": 2048, "opt-175b": 2048}
"""Published context windows (tokens) of the models the shipped profiles are fitted for."""


def context_limit(raw: Mapping) -> tuple[int, str]:
    """(tokens, where from) of the profile's model context window; (0, why) when unknown."""
    for key in ("context_tokens", "max_model_len"):
        if int(raw.get(key, 0) or 0) > 0:
            return int(raw[key]), f"profile key {key}"
    model = str(raw.get("model", "")).lower()
    if model in KNOWN_CONTEXT:
        return KNOWN_CONTEXT[model], f"{model}'s published context window"
    return 0, "unknown (profile names no context window)"


def profiled_prompt_tokens(raw: Mapping, profiles_dir: Path | None = None) -> tuple[int, str]:
    """(tokens, where from) of the longest prompt the profile's prefill model was measured on."""
    if int(raw.get("profiled_max_prompt_tokens", 0) or 0) > 0:
        return int(raw["profiled_max_prompt_tokens"]), "profile key profiled_max_prompt_tokens"
    src = raw.get("source") or {}
    name, filt = src.get("file"), src.get("filter") or {}
    path = (profiles_dir or datasets_dir() / "profiles") / name if name else None
    if not path or not path.exists() or not filt:
        return 0, "unknown (no profiled range in the profile, source rows not found)"
    longest = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if all(str(row.get(k, "")) == str(v) for k, v in filt.items()):
                longest = max(longest, int(float(row.get("prompt_size", 0) or 0)))
    return (longest, f"longest prompt_size of the {name} rows it was fitted on") if longest else \
        (0, "unknown (no matching source rows)")
