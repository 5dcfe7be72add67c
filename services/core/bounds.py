"""Ranges of the deployment numbers an operator or client gives (issue 14): checked by the gateway
on `POST /v1/deployments` (gateway/schemas.py, admin.py) and by `polyserve up --config`
(planner/reconcile.py), so that no service runs a loop proportional to an unchecked number."""
from __future__ import annotations

REPLICAS_MAX = 1024  # the default of the gateway's and the planner's `max_replicas_limit`
WINDOW_S = (1.0, 86_400.0)  # a scaler's sample window: 1 s .. 1 day
THRESHOLD_MS = (0.1, 600_000.0)  # a scaler's latency threshold: 0.1 ms .. 10 min
TTFT_SLO_RANGE_MS = (0.1, 600_000.0)  # time to first token: 0.1 ms .. 10 min
ATGT_SLO_RANGE_MS = (0.01, 60_000.0)  # per generated token: 0.01 ms .. 1 min
