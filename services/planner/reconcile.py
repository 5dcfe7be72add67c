"""Desired state and what the planner may conclude from a Redis read (issue 13).

A desired-state file (YAML, `polyserve up --config FILE`, planner setting
`desired_state_file`) declares deployments and LoRA adapters with the fields the admin
API takes (`POST /v1/deployments`, `POST /v1/adapters`) and the same rules. `up` applies
it at start; the planner applies it again whenever Redis holds no deployment (a Redis
restart without persistence, FLUSHALL, a lost volume).

`OrphanTracker` decides which workers lost their deployment for good: only those of a
deployment this planner saw and then no longer finds, while Redis kept its data (the
epoch marker, `EPOCH_KEY`, is unchanged): that is an explicit delete. A deployment it
never saw (the planner restarted after the delete) counts only after `grace_s` of
consistent absence. Data loss (marker gone) resets both, so an empty read after a Redis
restart never stops a worker.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from polyserve.core import bounds, names
from polyserve.proto import ATGT_SLO_MS, TTFT_SLO_MS, AdapterSpec, Deployment, ScalerPolicy

logger = logging.getLogger(__name__)

EPOCH_KEY = "{prefix}:planner:epoch"
"""A random token the planner keeps in Redis: gone or changed = Redis lost its data."""

ENGINES = ("sim", "hf", "vllm", "encoder", "openai-http")
_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_DEP_FIELDS = {"id", "model", "engine", "policy", "scaler", "ttft_slo_ms", "atgt_slo_ms", "reasoning_parser"}
_SCALER_FIELDS = {"type", "min_replicas", "max_replicas", "window_s", "threshold_ms"}
_ADAPTER_FIELDS = {"name", "path", "deployment"}


class ConfigError(ValueError):
    """The desired-state file is invalid; the message names each bad field and its line."""


@dataclass
class DesiredState:
    deployments: list[Deployment] = field(default_factory=list)
    adapters: list[AdapterSpec] = field(default_factory=list)


# --------------------------------------------------------------------------- loading
def _lines(node: yaml.Node, path: str, out: dict[str, int]) -> None:
    """Map each value's path (`deployments[0].scaler.type`) to its 1-based line."""
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = str(k.value)
            _lines(v, f"{path}.{key}" if path else key, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, f"{path}[{i}]", out)


class _Checker:
    """Collects errors as `FILE:LINE: path: message`."""

    def __init__(self, source: str, lines: dict[str, int]):
        self.source, self.lines, self.errors = source, lines, []

    def err(self, path: str, msg: str) -> None:
        at, line = path, self.lines.get(path)
        while line is None and at:  # a missing field: the line of its parent
            parent = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", at)
            at = parent if parent != at else ""
            line = self.lines.get(at)
        self.errors.append(f"{self.source}:{line or 1}: {path or '(top)'}: {msg}")

    def mapping(self, value: Any, path: str, allowed: set[str]) -> dict:
        if not isinstance(value, dict):
            self.err(path, f"must be a mapping with fields {', '.join(sorted(allowed))}")
            return {}
        for key in sorted(set(value) - allowed, key=str):
            self.err(f"{path}.{key}" if path else str(key), f"unknown field '{key}'; allowed: {', '.join(sorted(allowed))}")
        return value

    def number(self, d: dict, path: str, name: str, default: float, *, integer: bool = False,
               minimum: float = 0, strict: bool = True, within: tuple[float, float] | None = None) -> Any:
        value = d.get(name, default)
        kind = int if integer else (int, float)
        ok = isinstance(value, kind) and not isinstance(value, bool)
        what = "an integer" if integer else "a number"
        if not ok or (value <= minimum if strict else value < minimum):
            self.err(f"{path}.{name}", f"must be {what} {'>' if strict else '>='} {minimum:g} (got {value!r})")
            return default
        if within is not None and not within[0] <= value <= within[1]:  # core/bounds.py (issue 14)
            self.err(f"{path}.{name}", f"must be {what} within {within[0]:g}..{within[1]:g} (got {value!r})")
            return default
        return value

    def text(self, d: dict, path: str, name: str, default: str | None = None, pattern=None) -> str | None:
        value = d.get(name, default)
        if value is None:
            self.err(f"{path}.{name}", "is required")
        elif not isinstance(value, str) or not value or (pattern and not pattern.match(value)):
            rule = f" matching {pattern.pattern}" if pattern else ""
            self.err(f"{path}.{name}", f"must be a non-empty string{rule} (got {value!r})")
            return None
        return value


def _scaler(c: _Checker, value: Any, path: str) -> ScalerPolicy:
    d = c.mapping(value, path, _SCALER_FIELDS)
    kind = d.get("type", names.DEFAULT_SCALER)
    try:
        kind = names.canonical_scaler(str(kind))
    except names.UnknownName as exc:
        c.err(f"{path}.type", str(exc))
        kind = names.DEFAULT_SCALER
    lo = c.number(d, path, "min_replicas", 1, integer=True, minimum=0, strict=False, within=(0, bounds.REPLICAS_MAX))
    hi = c.number(d, path, "max_replicas", 4, integer=True, minimum=1, strict=False, within=(1, bounds.REPLICAS_MAX))
    if lo > hi:
        c.err(f"{path}.min_replicas", f"must not exceed max_replicas ({lo} > {hi})")
    return ScalerPolicy(type=kind, min_replicas=lo, max_replicas=hi,
                        window_s=float(c.number(d, path, "window_s", 30.0, within=bounds.WINDOW_S)),
                        threshold_ms=float(c.number(d, path, "threshold_ms", 50.0, within=bounds.THRESHOLD_MS)))


def _deployment(c: _Checker, value: Any, path: str) -> Deployment | None:
    d = c.mapping(value, path, _DEP_FIELDS)
    model = c.text(d, path, "model")
    dep_id = c.text(d, path, "id", re.sub(r"[^A-Za-z0-9_\-]", "-", model or "x")[:64], _ID)
    engine = d.get("engine", "sim")
    if engine not in ENGINES:
        c.err(f"{path}.engine", f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    policy = d.get("policy", "least_outstanding")
    if policy not in names.DISPATCH_POLICIES:
        c.err(f"{path}.policy", f"unknown dispatch policy {policy!r}; choose one of "
                                f"{', '.join(sorted(names.DISPATCH_POLICIES))}")
    scaler = _scaler(c, d.get("scaler", {}), f"{path}.scaler")
    ttft = c.number(d, path, "ttft_slo_ms", TTFT_SLO_MS, within=bounds.TTFT_SLO_RANGE_MS)
    atgt = c.number(d, path, "atgt_slo_ms", ATGT_SLO_MS, within=bounds.ATGT_SLO_RANGE_MS)
    thinking = d.get("reasoning_parser", "")
    if thinking not in ("", "qwen3", "deepseek_r1"):  # gateway/reasoning.py PARSERS
        c.err(f"{path}.reasoning_parser", f"unknown reasoning parser {thinking!r}; choose qwen3 or deepseek_r1")
    if not (model and dep_id) or not d:
        return None
    return Deployment(id=dep_id, model=model, engine=str(engine), policy=str(policy), scaler=scaler,
                      ttft_slo_ms=float(ttft), atgt_slo_ms=float(atgt), reasoning_parser=str(thinking))


def adapter_rank(path: Path) -> int:
    """The LoRA rank `r` of a PEFT adapter directory (as the admin API reads it)."""
    cfg = path / "adapter_config.json"
    if not (path / "adapter_model.safetensors").is_file() or not cfg.is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory (needs adapter_config.json and "
                         "adapter_model.safetensors readable by the workers)")
    try:  # the message names the problem, never the file's content (issue 14)
        rank = json.loads(cfg.read_text()).get("r")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{cfg} is not a JSON object ({type(exc).__name__})") from None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{cfg} has no rank `r` that is a positive integer")
    return rank


def _adapter(c: _Checker, value: Any, path: str, deployments: set[str], base: Path) -> AdapterSpec | None:
    d = c.mapping(value, path, _ADAPTER_FIELDS)
    name = c.text(d, path, "name", pattern=_ID)
    where = c.text(d, path, "path")
    dep = c.text(d, path, "deployment")
    if dep and dep not in deployments:
        c.err(f"{path}.deployment", f"no deployment '{dep}' in this file (declared: {', '.join(sorted(deployments))})")
    if not (name and where and dep):
        return None
    folder = (base / where).resolve()
    try:
        rank = adapter_rank(folder)
    except ValueError as exc:
        c.err(f"{path}.path", str(exc))
        return None
    return AdapterSpec(name=name, path=str(folder), deployment=dep, rank=rank)


def parse_desired_state(text: str, source: str = "<config>", base: Path | None = None) -> DesiredState:
    """Validate a desired-state document; ConfigError lists every problem with its line."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    lines: dict[str, int] = {}
    if node is not None:
        _lines(node, "", lines)
    c = _Checker(source, lines)
    top = c.mapping(data if data is not None else {}, "", {"deployments", "adapters"})
    out = DesiredState()
    for key in ("deployments", "adapters"):
        if not isinstance(top.get(key, []), list):
            c.err(key, "must be a list")
            top = {**top, key: []}
    for i, item in enumerate(top.get("deployments") or []):
        dep = _deployment(c, item, f"deployments[{i}]")
        if dep and any(d.id == dep.id for d in out.deployments):
            c.err(f"deployments[{i}].id", f"deployment id '{dep.id}' is declared twice")
        elif dep:
            out.deployments.append(dep)
    ids = {d.id for d in out.deployments}
    for i, item in enumerate(top.get("adapters") or []):
        spec = _adapter(c, item, f"adapters[{i}]", ids, base or Path.cwd())
        if spec and any(a.name == spec.name for a in out.adapters):
            c.err(f"adapters[{i}].name", f"adapter '{spec.name}' is declared twice")
        elif spec:
            out.adapters.append(spec)
    if c.errors:
        raise ConfigError("invalid desired-state file:\n  " + "\n  ".join(c.errors))
    return out


def load_desired_state(path: str | Path) -> DesiredState:
    """Read and validate the file at `path` (relative adapter paths are relative to it)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read desired-state file {p}: {exc}") from exc
    return parse_desired_state(text, str(p), p.resolve().parent)


async def apply_desired_state(state, desired: DesiredState) -> None:
    """Write every declared deployment and adapter (`shared.state.State`), replacing
    same-id entries: the file is the declared truth."""
    for dep in desired.deployments:
        await state.put_deployment(dep)
    for spec in desired.adapters:
        await state.put_adapter(spec)


# --------------------------------------------------------------------------- orphans
@dataclass
class OrphanTracker:
    """Which deployments' workers to stop (module docstring); time is passed in."""

    grace_s: float = 600.0  # 0: never stop workers of a deployment this planner never saw
    seen: set[str] = field(default_factory=set)
    absent_since: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        """Redis lost its data: nothing seen before counts as deleted."""
        self.seen.clear()
        self.absent_since.clear()

    def observe(self, known: set[str], hosted: set[str], now: float) -> set[str]:
        """`known`: the deployments Redis lists now; `hosted`: those that have workers.
        Returns the deployments whose workers are orphans."""
        orphans = set()
        for dep in hosted - known:
            if dep in self.seen:
                orphans.add(dep)  # seen, then gone while Redis kept its data: deleted
                continue
            since = self.absent_since.setdefault(dep, now)
            if self.grace_s > 0 and now - since >= self.grace_s:
                orphans.add(dep)
        self.seen = (self.seen | known) & (known | hosted)
        self.absent_since = {d: t for d, t in self.absent_since.items() if d in hosted and d not in known}
        return orphans


# --------------------------------------------------------------------------- Redis I/O
async def check_epoch(r, key: str, known: str | None) -> tuple[str, bool]:
    """The epoch token in Redis (written when missing) and whether it differs from
    `known`, i.e. Redis lost its data since the last check."""
    raw = await r.get(key)
    if raw is not None:
        token = raw.decode()
        return token, known is not None and token != known
    await r.set(key, uuid.uuid4().hex, nx=True)
    raw = await r.get(key)
    return (raw.decode() if raw else ""), known is not None


class DesiredStateKeeper:
    """Applies the desired-state file when Redis holds no deployment; an invalid edit of
    the file is logged and the last valid version used."""

    def __init__(self, path: str, state):
        self.path, self.state = path, state
        self.last_good: DesiredState | None = None
        self._last_error = ""

    def load(self) -> DesiredState | None:
        try:
            self.last_good = load_desired_state(self.path)
            self._last_error = ""
        except ConfigError as exc:
            if str(exc) != self._last_error:
                logger.error("%s\n(using the last valid version: %s)", exc, "yes" if self.last_good else "none")
            self._last_error = str(exc)
        return self.last_good

    async def ensure(self) -> int:
        """The number of deployments applied (0: Redis had some, or nothing is declared)."""
        if await self.state.r.scard(self.state.keys.deployments):
            return 0
        desired = self.load()
        if desired is None or not desired.deployments:
            return 0
        await apply_desired_state(self.state, desired)
        logger.warning("Redis held no deployment: applied %d deployment(s) and %d adapter(s) from %s",
                       len(desired.deployments), len(desired.adapters), self.path)
        return len(desired.deployments)
