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
    # A request placed on a free batch slot starts at once and does not wait for its prediction;
    # those predictions are asked in one message (PredictBatch: two NATS messages per batch instead
    # of per request): a lone one within 2 ms, while requests keep coming once per this window
    # (as request events, shared/batching.py). 10 -> 50 ms halved the predictor's CPU per json c8
    # request on the EPYC (docs/benchmarks/overhead.md, twelfth session). 0 = each asked at once.
    predict_batch_ms: float = 50.0
    # Per try: a timeout is retried once (the queue group may pick another dispatcher replica),
    # then the gateway places locally (least outstanding from the heartbeats; policy "local-fallback").
    dispatch_timeout_s: float = 0.5
    # Place requests of the load-only policies (round_robin, least_outstanding, power_of_two,
    # random; no LoRA adapter) in the gateway, from heartbeats and its own requests in flight,
    # without a dispatcher round trip (routing.py); false = ask the dispatcher for every request.
    local_dispatch: bool = True
    # requests with one prompt_cache_key (per tenant) go to one worker while its load stays within
    # this factor of the mean (consistent hashing with bounded loads; routing.py); >= 1
    affinity_load_factor: float = 1.25
    # Prefix-aware placement (prefixes.py): a request whose prompt starts as one placed before (256+
    # characters alike, same tenant and cache_salt) goes to that worker, within the same load bound.
    # auto = for engines that keep a prefix cache (vllm, openai-http); on; off.
    prefix_affinity: str = "auto"
    prefix_table_blocks: int = 65536  # prompt starts remembered (15 per long prompt, prefixes.py); ~23 MB when full
    accept_timeout_s: float = 2.0  # worker must acknowledge a generate request within this
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 10.0  # no chunk from the worker for this long once it streams -> explicit error (504)
    # A chunk after a missing `seq` waits this long for it; then the worker is asked to re-send it
    # (its replay buffer), and only if that fails does the stream end with an explicit error (502).
    gap_wait_s: float = 1.0
    # A stream quiet this long asks its worker to re-send what follows (a lost tail comes back, and
    # a worker whose subject has no responders is dead: the request migrates at once).
    liveness_probe_s: float = 1.0
    # Request migration: times one request may move to another worker after its worker died (a
    # started stream continues there from prompt + output when the engine can resume); 0 = never.
    max_migrations: int = 3
    # Slow readers: chunks a worker may send beyond those handed to the client (credit window);
    # the gateway's inbox per stream holds 4x this (+64). 0 = no flow control.
    stream_window: int = 256
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
    # Client API keys (keys.py, access.py; docs/security.md): "auto" = required when the gateway
    # listens beyond loopback; "on" = required; "off" = optional (a `psk_` key given still counts).
    client_keys: str = "auto"
    key_cache_s: float = 2.0  # key lookups cached this long: a revoked key works at most this much longer
    metrics_access: str = "auto"  # /metrics: open | keys | admin; auto = admin when keys are required
    docs_access: str = "auto"  # /docs, /redoc, /openapi.json: open | keys | admin | off; auto as above
    # Fair sharing (fairness.py, VTC): requests with a client key wait in a per-deployment queue once
    # `fair_slots` of this gateway's requests run (0 = the batch slots of the live workers).
    fair_share: bool = True
    fair_slots: int = 0
    fair_headroom: float = 0.5  # with fair_slots 0 and one tenant active: slots = batch slots × (1 + this)
    fair_reserve: float = 0.125  # with 2+ tenants active: this share of the slots only for tenants under their share

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.port < 65536:
            raise SettingsError(f"port {self.port} is not a TCP port")
        if self.affinity_load_factor < 1.0:
            raise SettingsError(f"affinity_load_factor {self.affinity_load_factor} must be >= 1 (1 = no worker above "
                                "the mean load)")
        if self.prefix_affinity not in ("auto", "on", "off") or self.prefix_table_blocks < 0:
            raise SettingsError(f"prefix_affinity must be auto, on or off (got {self.prefix_affinity!r}) and "
                                f"prefix_table_blocks >= 0 (got {self.prefix_table_blocks})")
        if self.max_inflight < 1 or self.max_tokens_limit < 1:
            raise SettingsError("max_inflight and max_tokens_limit must be >= 1")
        if min(self.predict_timeout_s, self.dispatch_timeout_s, self.idle_timeout_s, self.gap_wait_s) <= 0:
            raise SettingsError("predict_timeout_s, dispatch_timeout_s, idle_timeout_s and gap_wait_s must be > 0")
        if not 0 <= self.predict_batch_ms <= 1000:
            raise SettingsError(f"predict_batch_ms must be within 0..1000 (milliseconds the gateway gathers "
                                f"predictions nothing waits for; 0 = none), got {self.predict_batch_ms}")
        if self.liveness_probe_s <= 0 or self.max_migrations < 0 or self.stream_window < 0:
            raise SettingsError("liveness_probe_s must be > 0, max_migrations and stream_window >= 0")
        self._validate_edges()
        self._validate_access()
        if self.response_ttl_s <= 0:
            raise SettingsError(f"response_ttl_s must be > 0 (seconds a stored /v1/responses response is kept), "
                                f"got {self.response_ttl_s}")

    def _validate_access(self) -> None:
        if self.client_keys not in ("auto", "on", "off"):
            raise SettingsError(f"client_keys must be auto, on or off, got {self.client_keys!r}")
        for name, allowed in (("metrics_access", ("auto", "open", "keys", "admin")),
                              ("docs_access", ("auto", "open", "keys", "admin", "off"))):
            if getattr(self, name) not in allowed:
                raise SettingsError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0 <= self.key_cache_s <= 60:
            raise SettingsError(f"key_cache_s must be within 0..60 s (how long a revoked key may still work), "
                                f"got {self.key_cache_s}")
        if not 0 <= self.fair_headroom <= 4:
            raise SettingsError(f"fair_headroom must be within 0..4 (× the workers' batch slots), got {self.fair_headroom}")
        if not 0 <= self.fair_reserve < 1:
            raise SettingsError(f"fair_reserve must be within 0..1 (share of the slots), got {self.fair_reserve}")
        if self.fair_slots < 0:
            raise SettingsError(f"fair_slots must be >= 0 (0 = the workers' batch slots), got {self.fair_slots}")

    def _validate_edges(self) -> None:
        if self.max_replicas_limit < 1:
            raise SettingsError(f"max_replicas_limit must be >= 1, got {self.max_replicas_limit}")
        if min(self.max_body_bytes, self.max_messages, self.max_stop, self.max_stop_chars, self.max_header_bytes) < 1:
            raise SettingsError("max_body_bytes, max_messages, max_stop, max_stop_chars and max_header_bytes "
                                "must be >= 1")
        if min(self.body_timeout_s, self.header_timeout_s, self.keep_alive_s) <= 0 or self.max_connections < 0:
            raise SettingsError("body_timeout_s, header_timeout_s and keep_alive_s must be > 0 and "
                                "max_connections >= 0 (0 = no cap)")
