"""Every message that crosses NATS, as frozen msgspec structs (JSON on the wire); the events
are in `events.py`, the encoder workers' in `encoder.py`, re-exported here.

Rules (DESIGN.md, Contracts): new fields get defaults; within v1 a field is
never retyped or removed. `proto/v1/*.json` holds the generated JSON Schemas and
a test fails when these classes drift from them (`python -m polyserve.proto.schema`).
"""
from __future__ import annotations

from typing import Any

import msgspec

from polyserve.proto.base import Msg, now  # noqa: F401  (re-exported)
from polyserve.proto.encoder import EmbedReply, EmbedRequest, EncoderProfile, RuntimeProfile  # (re-exported)
from polyserve.proto.events import *  # noqa: F401,F403  (events live in events.py; re-exported here)
from polyserve.proto.events import (
    AdapterInfo,
    Admitted,
    ClockDecision,
    Completed,
    Dispatched,
    EnergyReport,
    Failed,
    FirstToken,
    GpuTelemetry,
    Heartbeat,
    Predicted,
    Refused,
    RuntimePlan,
    ScaleDecision,
    ScaleSignal,
    ServiceState,
    WorkerDown,
    WorkerUp,
)


# --------------------------------------------------------------------- predictor
class PredictRequest(Msg, kw_only=True):
    request_id: str
    model: str
    prompt: str = ""
    input_tokens: int
    max_tokens: int = 0  # the request's hard cap on output tokens (0 = none known); the estimate never exceeds it


class Prediction(Msg, kw_only=True):
    request_id: str
    model: str
    length_class: int
    tokens_estimate: int
    source: str  # "prior" | "history" | "model" | "cache"
    num_classes: int = 5


class PredictBatch(Msg, kw_only=True):
    """Several PredictRequests in one message: the gateway's predictions that nothing waits
    for (a request already running on a free batch slot), gathered over `predict_batch_ms`."""
    items: list[PredictRequest]


class Predictions(Msg, kw_only=True):
    """The answers to a PredictBatch, in its order; an item the predictor refused is absent
    (the gateway answers it locally, as for a prediction past its budget)."""
    items: list[Prediction]


# --------------------------------------------------------------------- dispatcher
class DispatchRequest(Msg, kw_only=True):
    request_id: str
    deployment: str
    model: str
    input_tokens: int
    predicted_tokens: int = 0
    length_class: int = -1
    adapter: str | None = None
    priority: int = 0
    exclude: list[str] = []
    adapter_rank: int = 0  # LoRA rank of `adapter` from the registry (0 = base model or unknown)
    max_tokens: int = 0  # the request's hard cap on output tokens (0 = none known); predicted_tokens <= it
    # a hash of (tenant, prompt_cache_key), "" = none: the gateway places such requests on the key's
    # worker unless it is overloaded (gateway/routing.py); the dispatcher's policies do not read it
    affinity: str = ""
    # where the gateway would have placed the request itself (gateway/admission.py `dispatch_hint`):
    # the key's worker or those holding the longest start of the prompt, within its load bound, at
    # most 16; the dispatcher places there when its policy's choice among them meets the policy's SLO
    # (dispatcher/prefer.py), answering policy "<policy>+prefer"
    prefer: list[str] = []


class PrefixPlaced(Msg, kw_only=True):
    """Gateway -> every other gateway (core NATS, best effort): a request whose prompt starts are
    `hashes` (gateway/prefixes.py `blocks`: stable across processes) was placed on `worker_id`, so
    each gateway's picture of the workers' prefix caches includes the others' placements."""
    deployment: str
    worker_id: str
    gateway: str  # the sender's instance: it ignores its own
    hashes: list[int]


class Placement(Msg, kw_only=True):
    request_id: str
    worker_id: str
    generate_subject: str
    cancel_subject: str
    policy: str
    priority: int = 0
    runtime: str | None = None


# --------------------------------------------------------------------- worker
class StructuredOutput(Msg, kw_only=True):
    """Constrained decoding (OpenAI `response_format`, vLLM `structured_outputs` / `guided_*`,
    forced tool calls): exactly one of these is set. The output is text that matches it."""

    json: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # a context-free grammar: Lark (llguidance) or GBNF/EBNF (`::=` rules)

    def kind(self) -> str:
        """Which constraint is set: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class SamplingParams(Msg, kw_only=True):
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = []
    n: int = 1
    # logprobs of the raw model distribution (vLLM's): None = none; k = each generated token's logprob
    # and its k most likely alternatives (k = 0: the token's own logprob only)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token (completions `echo`)
    structured: StructuredOutput | None = None  # constrain the output (JSON schema, regex, choice, grammar)
    # vLLM's meanings (hf_sampling.py writes them out): penalties, logit_bias before temperature, min_p
    # after; stop_token_ids end as EOS; truncate_prompt_tokens: 0 never, k the last k, -1 max_input_len;
    # allowed_token_ids: only these are sampled; bad_words: never these words (vLLM's token sequences)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    stop_token_ids: list[int] = []
    include_stop: bool = False
    truncate_prompt_tokens: int = 0
    allowed_token_ids: list[int] = []
    bad_words: list[str] = []
    skip_special_tokens: bool = True  # False: special tokens stay in the text (vLLM's)
    return_token_ids: bool = False  # vLLM's: the chunks carry the prompt's and the output's token ids
    # [open, close] of a thinking model (a reasoning_parser deployment): `structured` applies after
    # `close` (vLLM's reasoning_ended); past thinking_budget thinking tokens `close` is forced
    think: list[str] = []
    thinking_budget: int | None = None
    # vLLM's cache_salt as the client sent it ("" = none); a worker salts its engine's prefix cache
    # with it and the request's tenant (core/cache_salt.py)
    cache_salt: str = ""


class GenerateRequest(Msg, kw_only=True):
    request_id: str
    deployment: str
    model: str
    prompt: str
    input_tokens: int
    params: SamplingParams = SamplingParams()
    stream_to: str  # inbox the worker publishes TokenChunks to
    adapter: str | None = None
    priority: int = 0
    predicted_tokens: int = 0
    length_class: int = -1
    adapter_path: str = ""  # where the worker loads `adapter` from if it has not yet (lazy load)
    window: int = 0  # flow control: at most this many chunks beyond the last `Credit`; 0 = no window
    resume: "Resume | None" = None  # request migration: continue a stream another worker started
    # False: the client gets one body at the end, so the worker may merge a choice's chunks
    # (WorkerSettings.merge_ms); True (and from an older gateway): a chunk per engine delta.
    stream: bool = True
    # True: this gateway takes a choice's last delta (text, tokens, logprobs, finish reason) on the
    # done chunk (one chunk fewer; worker/merge.py). False (an older gateway): the done chunk has no text.
    last_on_done: bool = False
    # The tenant of the API key that sent it ("" without keys): `ssjf_refine` keeps its length
    # tables per client too (a client's requests look alike: docs/experiments/sjf.md).
    tenant: str = ""
    # A chat's messages: a worker with a chat template formats them with it (Engine.chat_prompt), any
    # other runs their transcript (`chat_transcript`), also in `prompt` unless longer than
    # INLINE_TRANSCRIPT_CHARS (then ""). None: a completion, or a chat with tools (`prompt` holds them).
    chat: "list[ChatTurn] | None" = None
    # How the chat's prompt ends (vLLM's add_generation_prompt / continue_final_message): "open" (the
    # assistant's opening), "closed" (after the last message), "continue" (inside the assistant's last).
    chat_end: str = "open"
    # The chat's tools (OpenAI's [{type: "function", function: {name, description, parameters}}]),
    # for a chat template that lists them itself; `prompt` is then always the transcript with them.
    tools: "list[dict[str, Any]] | None" = None
    # vLLM's chat_template_kwargs (e.g. enable_thinking), where a chat template renders the chat
    template_kwargs: "dict[str, Any]" = {}


INLINE_TRANSCRIPT_CHARS = 65_536
CHAT_ENDS = ("open", "closed", "continue")


class ChatTurn(Msg, kw_only=True):
    role: str
    content: str
    # An assistant's tool calls, OpenAI's shape with the arguments as an object (as chat templates
    # read them): [{id, type: "function", function: {name, arguments}}]; a tool result's call id.
    tool_calls: "list[dict[str, Any]] | None" = None
    tool_call_id: str | None = None
    name: str | None = None  # a tool result's function name (Hermes-style templates require it)

    def message(self) -> dict[str, Any]:
        """The turn as a chat template (or an engine server's chat endpoint) takes a message."""
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name:
            m["name"] = self.name
        return m


def chat_transcript(turns: "list[ChatTurn]", end: str = "open") -> str:
    """A chat as a role-prefixed transcript: one `role: text` line per message, then `assistant:`
    (the gateway's rendering for engines without a chat template); with `end` "closed" or
    "continue" (GenerateRequest.chat_end) not that opening: the last line is the one continued."""
    text = "\n".join(f"{t.role}: {t.content}" for t in turns)
    return text + "\nassistant:" if end == "open" else text


class Resume(Msg, kw_only=True):
    """What the client already has of a stream whose worker died (request migration, as in
    NVIDIA Dynamo): the new worker generates on from `prompt + text`, at most
    `max_tokens - tokens` more tokens, numbers its chunks from 0 again, and reports usage as
    if it had produced the whole output (input tokens of `prompt`, output `tokens` + its own)."""

    text: str  # the output the client already got (choice 0; started streams migrate only with n = 1)
    tokens: int  # output tokens in `text`
    migrations: int = 1  # this is the request's n-th move


class GenerateAccepted(Msg, kw_only=True):
    request_id: str
    worker_id: str
    queue_position: int = 0
    # What this worker does for the stream, so the gateway knows what it may ask for:
    replay: bool = False  # keeps the chunks it sent and answers `ReplayRequest` on its replay subject
    resumable: bool = False  # its engine continues a started stream from prompt + output (`Resume`)
    window: int = 0  # the credit window it honours (0 = none)


class RequestStats(Msg, kw_only=True):
    """Engine-side timings of one request (Aladdin §2.2 ATGT)."""

    input_tokens: int
    output_tokens: int
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    tbt_mean_ms: float = 0.0
    tbt_max_ms: float = 0.0
    atgt_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    cached_tokens: int = 0  # of input_tokens, those the engine took from its prefix cache (vllm, openai-http)


class TopLogprob(Msg, kw_only=True):
    token: str  # the token's own text (decoded alone)
    logprob: float
    token_id: int = -1


class TokenLogprob(Msg, kw_only=True):
    """One token of a choice (or of the prompt) with its log-probability and the top
    alternatives at its position, most likely first."""

    token: str
    logprob: float | None = None  # None: the first prompt token (nothing predicts it)
    token_id: int = -1
    top: list[TopLogprob] = []
    rank: int = 0  # the token's rank in its distribution (1 = the most likely); 0 = not known


WORKER_SHUTDOWN = "worker shutting down"
"""The `error` of a done chunk whose worker stopped before the stream ended (drain timeout):
the gateway moves such a stream to another worker (request migration)."""


class TokenChunk(Msg, kw_only=True):
    request_id: str
    seq: int
    index: int = 0  # choice index (n > 1)
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None  # set on the last chunk of a choice
    done: bool = False  # last chunk of the whole request
    error: str | None = None
    stats: RequestStats | None = None  # on the done chunk
    simulated: bool = False
    redirect: Placement | None = None  # the request was withdrawn before it started: send it there
    logprobs: list[TokenLogprob] | None = None  # the tokens this chunk adds (params.logprobs set)
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first chunk (params.prompt_logprobs)
    token_ids: list[int] | None = None  # the tokens this chunk adds (params.return_token_ids)
    prompt_token_ids: list[int] | None = None  # on a choice's first chunk (params.return_token_ids)


class ReplayRequest(Msg, kw_only=True):
    """Gateway -> worker (`worker.<id>.replay`): send again the chunks `from_seq`..`to_seq` (-1 =
    all buffered from `from_seq`) of a stream; asked when a `seq` gap does not fill within
    `gap_wait_s`, and when a stream has been quiet (which also proves the worker is alive: a
    killed worker's subject has no responders)."""

    request_id: str
    from_seq: int
    to_seq: int = -1


class ReplayReply(Msg, kw_only=True):
    request_id: str
    worker_id: str
    known: bool  # False: this worker has no such stream (never had it, or forgot it after it ended)
    chunks: list[TokenChunk] = []  # the buffered chunks in the range, in seq order (at most 256)
    first_seq: int = -1  # the oldest seq still buffered (-1 = none): older ones cannot be re-sent


class Credit(Msg, kw_only=True):
    """Gateway -> worker (`worker.<id>.credit`, no reply): the client has been given every
    chunk up to `acked` of a stream; the worker may send up to `acked + window` and forget
    the chunks up to `acked` (its replay buffer)."""

    request_id: str
    acked: int


class Withdraw(Msg, kw_only=True):
    """Dispatcher -> worker: give back a request that has not started (Aladdin Alg. 2 move).

    A worker that still holds `request_id` queued removes it, publishes one TokenChunk
    with `redirect` = `placement` (seq 0, not done) on the request's stream, and replies
    withdrawn=True; the gateway then sends its GenerateRequest to the new worker. A
    request already running (or unknown) is left alone: withdrawn=False with the reason."""

    request_id: str
    placement: Placement
    reason: str = "rebalance"


class WithdrawReply(Msg, kw_only=True):
    request_id: str
    worker_id: str
    withdrawn: bool
    reason: str = ""


class CancelRequest(Msg, kw_only=True):
    request_id: str
    reason: str = "client disconnected"


# --------------------------------------------------------------------- gpu-agent
class StartWorker(Msg, kw_only=True):
    deployment: str
    model: str
    engine: str
    count: int = 1
    extra_env: dict[str, str] = {}


class StopWorker(Msg, kw_only=True):
    deployment: str
    count: int = 1
    worker_id: str | None = None  # a specific worker, else the least busy


class AgentReply(Msg, kw_only=True):
    gpu_id: str
    started: list[str] = []
    stopped: list[str] = []


# --------------------------------------------------------------------- state (Redis)
class ScalerPolicy(Msg, kw_only=True):
    """Thesis §6.2: per-deployment scaler. threshold_ms is per token for `pertoken`."""

    type: str = "pertoken"  # one of polyserve.core.names.SCALERS (target_tracking: threshold_ms = P98 SLO)
    min_replicas: int = 1
    max_replicas: int = 4
    window_s: float = 30.0
    threshold_ms: float = 50.0


TTFT_SLO_MS = 1600.0
"""Aladdin Table 2 (Llama2-70B): time-to-first-token SLO, the default of a deployment."""
ATGT_SLO_MS = 75.0
"""Aladdin Table 2 (Llama2-70B): average time-per-generated-token SLO, the default of a deployment."""


class Deployment(Msg, kw_only=True):
    id: str
    model: str
    engine: str = "sim"
    policy: str = "least_outstanding"
    scaler: ScalerPolicy = ScalerPolicy()
    ttft_slo_ms: float = TTFT_SLO_MS  # the SLOs this deployment is served to (aladdin/caraserve place against them)
    atgt_slo_ms: float = ATGT_SLO_MS
    # "", "qwen3" or "deepseek_r1" (vLLM's names): chat answers' `reasoning` (gateway/reasoning.py)
    reasoning_parser: str = ""
    created: float = msgspec.field(default_factory=now)


class AdapterSpec(Msg, kw_only=True):
    """A LoRA adapter in the global registry (CaraServe): PEFT directory, rank, base deployment."""

    name: str
    path: str
    deployment: str
    rank: int
    created: float = msgspec.field(default_factory=now)


class AdapterCommand(Msg, kw_only=True):
    """Ask workers to load or unload an adapter now (`action`: "load" | "unload")."""

    action: str
    name: str
    path: str = ""
    deployment: str = ""


class AgentInfo(Msg, kw_only=True):
    gpu_id: str
    simulated: bool
    control_subject: str
    workers: dict[str, str] = {}  # worker_id -> deployment
    pid: int = 0


ALL_MESSAGES: tuple[type[msgspec.Struct], ...] = (
    PredictRequest, Prediction, PredictBatch, Predictions, DispatchRequest, PrefixPlaced, Placement, SamplingParams,
    GenerateRequest,
    GenerateAccepted, RequestStats, TokenChunk, CancelRequest, Admitted, Predicted, Dispatched,
    FirstToken, Completed, Failed, AdapterInfo, Heartbeat, WorkerUp, WorkerDown, ServiceState,
    ScaleDecision, GpuTelemetry, StartWorker, StopWorker, AgentReply, ScalerPolicy, Deployment,
    AgentInfo, AdapterSpec, AdapterCommand,
    EmbedRequest, EmbedReply, RuntimeProfile, EncoderProfile,
    Withdraw, WithdrawReply, Resume, ReplayRequest, ReplayReply, Credit, ClockDecision, ScaleSignal, EnergyReport, RuntimePlan, Refused,
)
