"""Generate the JSON Schemas of every wire message into proto/v1/.

    python -m polyserve.proto.schema            # (re)write proto/v1/*.json
    python -m polyserve.proto.schema --check    # exit 1 if the files differ from the code
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from polyserve.proto.messages import ALL_MESSAGES

SCHEMA_DIR = Path(__file__).parent / "v1"


def render() -> dict[str, str]:
    """File name -> JSON text for every message (stable, sorted keys)."""
    out = {}
    for cls in ALL_MESSAGES:
        schema = msgspec.json.schema(cls)
        out[f"{cls.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def drift() -> list[str]:
    """Names of schema files missing, stale or extra versus the code."""
    want = render()
    have = {p.name: p.read_text() for p in SCHEMA_DIR.glob("*.json")}
    return sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        bad = drift()
        if bad:
            print("schemas drifted from proto/messages.py: " + ", ".join(bad) +
                  "\nregenerate with `python -m polyserve.proto.schema`", file=sys.stderr)
            return 1
        return 0
    SCHEMA_DIR.mkdir(exist_ok=True)
    for old in SCHEMA_DIR.glob("*.json"):
        old.unlink()
    for name, text in render().items():
        (SCHEMA_DIR / name).write_text(text)
    print(f"wrote {len(ALL_MESSAGES)} schemas to {SCHEMA_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
