"""The single vocabularies of names that cross service boundaries: dispatch policies
(a deployment's `policy`) and scalers (a deployment's `scaler.type`). The gateway
validates against these, the dispatcher and planner map them to code, the simulator
and the tools accept the same names.
"""
from __future__ import annotations

DISPATCH_POLICIES: tuple[str, ...] = (
    "round_robin", "least_outstanding", "power_of_two", "random", "least_loaded", "first_fit",
    "aladdin", "caraserve", "arlo_mlq", "arlo_ilb", "arlo_ig",
)
"""Every dispatch policy (`polyserve.dispatcher.policy.POLICIES` maps exactly these)."""
DEFAULT_POLICY = "least_outstanding"
MODEL_POLICIES = frozenset({"aladdin", "caraserve"})
"""Policies that reason with performance models and keep per-request bookkeeping."""
PREFERRED = "+prefer"
"""Suffix of a `Placement.policy` where the dispatcher followed `DispatchRequest.prefer`
(dispatcher/prefer.py); the gateway names it `+affinity` or `+prefix` as it names its own."""

METRIC_SCALERS: tuple[str, ...] = ("pertoken", "request", "target_tracking")
"""Scalers driven by a latency metric each poll (thesis §5 HPA; target tracking)."""
SIGNAL_SCALERS: tuple[str, ...] = ("aladdin", "caraserve", "muserve", "signal")
"""Scalers driven by `ScaleSignal`s (Aladdin/CaraServe no-fit, µ-Serve MIAD)."""
SCALERS: tuple[str, ...] = METRIC_SCALERS + SIGNAL_SCALERS
DEFAULT_SCALER = "pertoken"
SCALER_ALIASES = {"tracking": "target_tracking", "museserve": "muserve", "mu-serve": "muserve"}
"""Older spellings still accepted on input; never written."""


class UnknownName(ValueError):
    """A policy or scaler name outside the vocabulary; the message lists the known ones."""


def canonical_scaler(name: str) -> str:
    """The one spelling of a scaler name (aliases folded); UnknownName otherwise."""
    n = SCALER_ALIASES.get(name.strip().lower(), name.strip().lower())
    if n not in SCALERS:
        raise UnknownName(f"unknown scaler {name!r}; choose one of {', '.join(SCALERS)}")
    return n


def check_policy(name: str) -> str:
    """`name` if it is a dispatch policy; UnknownName otherwise."""
    if name not in DISPATCH_POLICIES:
        raise UnknownName(f"unknown dispatch policy {name!r}; choose one of {', '.join(sorted(DISPATCH_POLICIES))}")
    return name
