"""The base of every wire message and the timestamp they carry."""
from __future__ import annotations

import time

import msgspec


class Msg(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=False):
    """Base of all wire messages."""


def now() -> float:
    """Wall-clock seconds, the timestamp unit of every message."""
    return time.time()
