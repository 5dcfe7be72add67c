"""cli: the `polyserve` command (`main`), `up`/`down` (`launcher`), `status` and `events`."""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `polyserve` console script."""
    from polyserve.cli.commands import main as _main

    return _main(argv)
