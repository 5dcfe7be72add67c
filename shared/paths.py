"""Where reference data lives: `$POLYSERVE_DATASETS`, else `../shared/datasets`
beside the checkout (the reference material is never copied into the repo)."""
from __future__ import annotations

import os
from pathlib import Path


def datasets_dir() -> Path:
    """The datasets folder (traces/, profiles/, text/)."""
    env = os.environ.get("POLYSERVE_DATASETS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "datasets"
