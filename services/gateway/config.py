"""Gateway settings (env POLYSERVE_GATEWAY_*, flags --field-name)."""
from __future__ import annotations

from polyserve.shared.settings import CommonSettings, SettingsError


class GatewaySettings(CommonSettings, frozen=True, kw_only=True):
    host: str = "127.0.0.1"  # loopback by default; expose deliberately
    port: int = 8000
    admin_api_key: str = ""  # when set, admin endpoints need `Authorization: Bearer <key>`
    max_inflight: int = 512  # beyond this: 429 with Retry-After
    # The prediction is a hint: past this budget the gateway answers it locally (history, else the
    # 129-token prior; Predicted.source "local-history" / "local-prior"); it never fails a request.
    predict_timeout_s: float = 0.05
    # Per try: a timeout is retried once (the queue group may pick another dispatcher replica),
    # then the gateway places locally (least outstanding from the heartbeats; policy "local-fallback").
    dispatch_timeout_s: float = 0.5
    accept_timeout_s: float = 2.0  # worker must acknowledge a generate request within this
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 10.0  # no chunk from the worker for this long once it streams -> explicit error (504)
    gap_wait_s: float = 1.0  # a chunk after a missing `seq` waits this long for it, then the stream fails (502)
    max_tokens_limit: int = 4096
    default_max_tokens: int = 16
    max_n: int = 8
    max_prompts: int = 64  # prompts in one /v1/completions request (each runs as a request of its own)
    max_embedding_inputs: int = 2048
    max_prompt_chars: int = 200_000
    deployment_cache_s: float = 5.0
    dispatch_retries: int = 2  # re-dispatch when the chosen worker vanished before accepting
    response_ttl_s: float = 3600.0  # how long a stored /v1/responses response (and its conversation) is kept

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.port < 65536:
            raise SettingsError(f"port {self.port} is not a TCP port")
        if self.max_inflight < 1 or self.max_tokens_limit < 1:
            raise SettingsError("max_inflight and max_tokens_limit must be >= 1")
        if min(self.predict_timeout_s, self.dispatch_timeout_s, self.idle_timeout_s, self.gap_wait_s) <= 0:
            raise SettingsError("predict_timeout_s, dispatch_timeout_s, idle_timeout_s and gap_wait_s must be > 0")
        if self.response_ttl_s <= 0:
            raise SettingsError(f"response_ttl_s must be > 0 (seconds a stored /v1/responses response is kept), "
                                f"got {self.response_ttl_s}")
