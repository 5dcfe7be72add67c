"""Who may call what on the gateway (issue 14; docs/security.md "Client API keys").

`Access`, an ASGI middleware in front of every route, reads `Authorization: Bearer <key>` before
any body is read: on the OpenAI endpoints a client key (or the admin key) when keys are on, 401
otherwise; `/metrics` and `/docs`, `/redoc`, `/openapi.json` as their settings say; health,
readiness and version stay open (probes); the admin API checks the admin key itself (admin.py).
It makes the request's `Ticket` (tenancy.py), adds the `x-ratelimit-*` headers to the answer,
and when the request has ended (streams included) settles it: the TPM reservation corrected
with the tokens used, the tokens counted per key (Redis) and per tenant (Prometheus), the fair
queue slot given back.

`client_limits`, a dependency of the OpenAI routes, runs once the JSON body is read: 403 for a
model the key may not use, then the key's RPM and TPM buckets (ratelimit.py): 429 with
Retry-After when over."""
from __future__ import annotations

import hmac
import logging

from fastapi import Request

from polyserve.shared.auth import is_loopback

from . import admission, errors, policy, tenancy
from .context import Gateway, GatewayState
from .errors import GatewayError
from .keys import ADMIN, TOKEN, KeyRecord
from .tenancy import Ticket

logger = logging.getLogger(__name__)

OPEN = frozenset({"/healthz", "/readyz", "/health", "/ping", "/version"})
DOCS = ("/docs", "/redoc", "/openapi.json")
ADMIN_PATHS = ("/v1/deployments", "/v1/adapters", "/v1/cluster", "/v1/keys")
ACCESS_MODES = ("auto", "open", "keys", "admin")


def keys_required(settings) -> bool:
    """Client keys are required when `client_keys` is on, or auto and the gateway listens beyond loopback."""
    mode = settings.client_keys
    return mode == "on" or (mode == "auto" and not is_loopback(settings.host))


def access_mode(settings, which: str) -> str:
    """open | keys | admin for `metrics` or `docs`; auto = admin when keys are required, else open."""
    mode = getattr(settings, f"{which}_access")
    if mode == "auto":
        return "admin" if keys_required(settings) else "open"
    return mode


def _kind(path: str) -> str:
    if path in OPEN:
        return "open"
    if path == "/metrics":
        return "metrics"
    if path.startswith(DOCS):
        return "docs"
    if path.startswith(ADMIN_PATHS):
        return "admin"
    return "client"  # every other path (the OpenAI endpoints, and unknown paths: deny by default)


def _bearer(scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            raw = value.decode("latin-1").strip()
            return raw[7:].strip() if raw[:7].lower() == "bearer " else ""
    return ""


def _is_admin(gs: GatewayState, token: str) -> bool:
    key = gs.settings.admin_api_key
    return bool(key) and hmac.compare_digest(token.encode(), key.encode())


async def _send_error(send, status: int, message: str, code: str) -> None:
    await errors.send_error(send, status, message, code=code, headers=((b"www-authenticate", b"Bearer"),))


class Access:
    """ASGI middleware: authentication, the request's Ticket, rate-limit headers, settlement."""

    def __init__(self, app, gs: GatewayState):
        self.app = app
        self.gs = gs

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind = _kind(scope["path"])
        if kind in ("open", "admin"):
            await self.app(scope, receive, send)
            return
        try:
            record = await self._authenticate(kind, _bearer(scope))
        except GatewayError as exc:
            self.gs.metrics.rejected.labels("auth").inc()
            await _send_error(send, exc.status, exc.message, "invalid_api_key" if exc.status == 401 else "forbidden")
            return
        if kind != "client" or record is None:  # no key, no limits: nothing to track (the hot path)
            await self.app(scope, receive, send)
            return
        ticket = Ticket(record=record)
        token = tenancy.enter(ticket)
        try:
            await self.app(scope, receive, self._sender(send, ticket))
        finally:
            tenancy.leave(token)
            self._end(ticket)

    async def _authenticate(self, kind: str, token: str) -> KeyRecord | None:
        """The client's key record (None: none needed and none given); GatewayError 401/403/503."""
        gs = self.gs
        if kind in ("metrics", "docs"):
            mode = access_mode(gs.settings, kind)
            if mode == "open" or (mode == "admin" and not gs.settings.admin_api_key):
                return None
            if _is_admin(gs, token):
                return ADMIN
            if mode == "admin":
                raise GatewayError(401, f"{kind} needs the admin API key (`Authorization: Bearer <admin key>`; "
                                        f"setting {kind}_access)")
        required = kind != "client" or keys_required(gs.settings)
        if not token or (not required and not TOKEN.match(token)):
            if required:
                raise GatewayError(401, "missing API key: send `Authorization: Bearer <key>` with a key made "
                                        "with `polyserve keys create` or POST /v1/keys")
            return None  # keys optional here: an anonymous request, no limits
        if _is_admin(gs, token):
            return ADMIN
        try:
            record = await gs.keystore.lookup(token)
        except Exception as exc:  # an unreadable key store must not let anyone in
            raise GatewayError(503, f"API keys cannot be checked now (Redis: {type(exc).__name__}); retry "
                                    "shortly") from exc
        if record is None:
            raise GatewayError(401, "invalid API key (unknown or revoked): send `Authorization: Bearer <key>` with "
                                    "a key made with `polyserve keys create` or POST /v1/keys")
        return record

    def _sender(self, send, ticket: Ticket):
        async def wrapped(message) -> None:
            if message["type"] == "http.response.start":
                ticket.status = message["status"]
                if ticket.decision is not None:
                    extra = [(k.encode(), v.encode()) for k, v in ticket.decision.headers().items()]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)
        return wrapped

    def _end(self, t: Ticket) -> None:
        """The request ended: give back its fair-queue slot (correcting its tenant's counter) now,
        settle its tokens in Redis in the background."""
        gs = self.gs
        if t.grant is not None:
            known = t.completed > 0
            t.grant.queue.release(t.grant, t.prompt_tokens if known else None,
                                  t.completion_tokens if known else None,
                                  slots=admission.fair_slots(gs, t.deployment))
        if t.record is None or t.record is ADMIN:
            return
        if t.completed:
            gs.metrics.tenant_used(t.record.tenant, t.prompt_tokens, t.completion_tokens)
        gs.spawn(_settle(gs, t))


async def _settle(gs: GatewayState, t: Ticket) -> None:
    """TPM bucket corrected to the tokens used (an error answer gives the reservation back; a
    request cut off before its usage was known keeps it), usage counted per key."""
    rec = t.record
    used = t.prompt_tokens + t.completion_tokens if t.completed else (t.reserved if t.status == 200 else 0)
    try:
        if t.decision is not None and t.decision.allowed:
            await gs.limiter.settle(rec.id, rec.tpm, used - t.reserved)
        if t.completed:
            await gs.keystore.count(rec.id, t.prompt_tokens, t.completion_tokens)
    except Exception as exc:  # noqa: BLE001 - accounting is best effort; the answer is already sent
        logger.warning("could not settle the usage of key %s: %s", rec.id, exc)


async def client_limits(request: Request, gs: Gateway) -> None:
    """Route dependency of the OpenAI endpoints: the key's allowed models (403) and its RPM and
    TPM limits (429), once the body is read. Nothing to do for a request without a key."""
    t = tenancy.current()
    if t is None or t.record is None or t.record is ADMIN:
        return
    rec, s = t.record, gs.settings
    body = await request.json() if request.method == "POST" and await request.body() else {}
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and not rec.allows(model):
        dep, spec = await gs.find_deployment(model)
        resolved = tuple(x for x in (dep and dep.id, dep and dep.model, spec and spec.name) if x)
        if not rec.allows(model, resolved):
            gs.metrics.rejected.labels("model_not_allowed").inc()
            raise policy.InvalidRequest(f"this API key (tenant '{rec.tenant}') may not use the model '{model}'; "
                                        f"it may use: {', '.join(rec.models)}", "model", 403, "model_not_allowed")
    t.est_in, t.est_out = tenancy.estimate(body, embedding=request.url.path.endswith("/embeddings"),
                                           default_max_tokens=s.default_max_tokens,
                                           max_tokens_limit=s.max_tokens_limit, max_n=s.max_n)
    cost = t.est_in + t.est_out
    try:
        t.decision = await gs.limiter.take(rec.id, rec.rpm, rec.tpm, cost)
    except Exception as exc:
        raise GatewayError(503, f"rate limits cannot be checked now (Redis: {type(exc).__name__}); retry "
                                "shortly", retry_after=1) from exc
    if t.decision.allowed:
        t.reserved = cost if rec.tpm > 0 else 0
        return
    gs.metrics.rejected.labels("rate_limit").inc()
    if t.decision.retry_ms < 0:
        raise GatewayError(429, f"this request may use up to {cost} tokens (prompt ≈ {t.est_in} + max_tokens × n "
                                f"= {t.est_out}), more than the key's limit of {rec.tpm} tokens per minute; "
                                "lower max_tokens or n")
    which = "requests" if t.decision.rpm and t.decision.rpm_left < 1 else "tokens"
    limit = rec.rpm if which == "requests" else rec.tpm
    raise GatewayError(429, f"rate limit reached for tenant '{rec.tenant}': {limit} {which} per minute; "
                            f"retry after {t.decision.retry_after_s} s", retry_after=t.decision.retry_after_s)
