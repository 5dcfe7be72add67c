"""Frozen per-service settings read once from env (POLYSERVE_<SVC>_*) and flags.

Each service declares a `msgspec.Struct` subclass of `CommonSettings`. Values
come, lowest priority first, from field defaults, common env
(`POLYSERVE_<FIELD>`), service env (`POLYSERVE_<SVC>_<FIELD>`), then command-line
flags (`--field-name value`). msgspec converts and validates the strings.
"""
from __future__ import annotations

import argparse
import os
import uuid
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound="CommonSettings")


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message says which and why."""


class CommonSettings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "polyserve"
    instance: str = ""
    drain_timeout_s: float = 10.0
    request_timeout_s: float = 2.0
    otlp_endpoint: str = ""  # empty = no trace export
    log_level: str = "INFO"
    service_ttl_s: float = 5.0

    def validate(self) -> None:
        """Raise SettingsError on values no service can run with."""
        if self.drain_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise SettingsError("drain_timeout_s and request_timeout_s must be > 0")
        if not self.prefix or any(c in self.prefix for c in " .*>:"):
            raise SettingsError(f"prefix {self.prefix!r} must be non-empty without spaces, '.', '*', '>' or ':'")


def _env_values(cls: type[msgspec.Struct], service: str, environ: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in cls.__struct_fields__:
        for key in (f"POLYSERVE_{name.upper()}", f"POLYSERVE_{service.upper().replace('-', '_')}_{name.upper()}"):
            if key in environ:
                values[name] = environ[key]
    return values


def add_flags(parser: argparse.ArgumentParser, cls: type[msgspec.Struct]) -> None:
    """One `--field-name` flag per settings field (strings, converted later); a
    boolean field may be given bare (`--allow-clock-control` means true)."""
    for f in msgspec.structs.fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type is bool:
            parser.add_argument(flag, dest=f.name, default=None, nargs="?", const="true")
        else:
            parser.add_argument(flag, dest=f.name, default=None)


def load(cls: type[T], service: str, argv: list[str] | None = None,
         environ: dict[str, str] | None = None, **overrides: Any) -> T:
    """Build and validate the settings of `service` from env, flags and overrides."""
    environ = dict(os.environ if environ is None else environ)
    values = _env_values(cls, service, environ)
    if argv is not None:
        parser = argparse.ArgumentParser(prog=f"polyserve-{service}")
        add_flags(parser, cls)
        ns = parser.parse_args(argv)
        values.update({k: v for k, v in vars(ns).items() if v is not None})
    values.update(overrides)
    values.setdefault("instance", f"{service}-{uuid.uuid4().hex[:6]}")
    if not values["instance"]:
        values["instance"] = f"{service}-{uuid.uuid4().hex[:6]}"
    try:
        settings = msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"{service} settings: {exc}") from exc
    settings.validate()
    return settings
