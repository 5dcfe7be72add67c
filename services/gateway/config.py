"""Gateway settings (env POLYSERVE_GATEWAY_*, flags --field-name)."""
from __future__ import annotations

from polyserve.shared.settings import CommonSettings, SettingsError


class GatewaySettings(CommonSettings, frozen=True, kw_only=True):
    host: str = "127.0.0.1"  # loopback by default; expose deliberately
    port: int = 8000
    # SO_REUSEPORT on the listening socket: several gateway processes serve one port, the kernel
    # spreads connections over them (`polyserve up --gateways N`; Linux and the BSDs).
    reuse_port: bool = False
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
    # Admin inputs (issue 14): no deployment may ask for more replicas than this.
    max_replicas_limit: int = 1024
    # Directories adapters may be registered from (os.pathsep-separated, like PATH); "" = none:
    # POST /v1/adapters is refused until the operator sets it (`polyserve up` sets $POLYSERVE_HOME/adapters).
    adapter_roots: str = ""
    # HTTP edges (limits.py; docs/security.md): enforced before a body is parsed.
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies: 413, without reading them
    body_timeout_s: float = 60.0  # the whole body must arrive within this (else 408)
    max_messages: int = 2048  # chat messages in one request
    max_stop: int = 4  # stop strings in one request (OpenAI's limit)
    max_stop_chars: int = 1024  # characters of one stop string
    # For uvicorn (limits.uvicorn_kwargs): slow-header timeout, idle keep-alive, connection cap (503 beyond).
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 4096  # connections + running requests; 0 = no cap
    max_header_bytes: int = 64 * 1024  # request line + headers (h11_max_incomplete_event_size)

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.port < 65536:
            raise SettingsError(f"port {self.port} is not a TCP port")
        if self.max_inflight < 1 or self.max_tokens_limit < 1:
            raise SettingsError("max_inflight and max_tokens_limit must be >= 1")
        if min(self.predict_timeout_s, self.dispatch_timeout_s, self.idle_timeout_s, self.gap_wait_s) <= 0:
            raise SettingsError("predict_timeout_s, dispatch_timeout_s, idle_timeout_s and gap_wait_s must be > 0")
        self._validate_edges()
        if self.response_ttl_s <= 0:
            raise SettingsError(f"response_ttl_s must be > 0 (seconds a stored /v1/responses response is kept), "
                                f"got {self.response_ttl_s}")

    def _validate_edges(self) -> None:
        if self.max_replicas_limit < 1:
            raise SettingsError(f"max_replicas_limit must be >= 1, got {self.max_replicas_limit}")
        if min(self.max_body_bytes, self.max_messages, self.max_stop, self.max_stop_chars, self.max_header_bytes) < 1:
            raise SettingsError("max_body_bytes, max_messages, max_stop, max_stop_chars and max_header_bytes "
                                "must be >= 1")
        if min(self.body_timeout_s, self.header_timeout_s, self.keep_alive_s) <= 0 or self.max_connections < 0:
            raise SettingsError("body_timeout_s, header_timeout_s and keep_alive_s must be > 0 and "
                                "max_connections >= 0 (0 = no cap)")
