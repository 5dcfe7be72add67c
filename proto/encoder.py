"""Messages of the encoder workers (/v1/embeddings, Arlo's runtimes and profiles), split from
messages.py and re-exported there."""
from __future__ import annotations

import msgspec

from polyserve.proto.base import Msg, now


class EmbedRequest(Msg, kw_only=True):
    """Embed sequences on one encoder worker (Arlo polymorphing: the worker hosts ONE runtime).

    The gateway tokenizes (it must know lengths to dispatch) and sends `input_ids`
    with the special tokens ([CLS] ... [SEP]); a sender without a tokenizer may send
    `inputs` as text instead and the worker tokenizes. An input longer than the
    runtime's max_length is refused (400) unless `truncate`."""

    request_id: str
    deployment: str
    model: str
    inputs: list[str] = []
    input_ids: list[list[int]] = []
    truncate: bool = False


class EmbedReply(Msg, kw_only=True):
    request_id: str
    worker_id: str
    embeddings: list[list[float]]  # one unit-norm vector per input, in input order
    tokens: list[int]  # tokens of each input as embedded (special tokens included, after truncation)
    max_length: int  # the runtime's static max_length; 0 = a dynamic-shape runtime (no padding)
    batch_size: int = 1  # the runtime's static batch size
    runtime: str = ""  # e.g. "static-b1-l128-compile"
    truncated: int = 0  # inputs cut to max_length
    queue_ms: float = 0.0  # waiting for a batch slot
    compute_ms: float = 0.0  # the runtime's execution of the batch(es) that held these inputs
    simulated: bool = False  # True: latency replayed from a profile, vectors are not the model's


class RuntimeProfile(Msg, kw_only=True):
    """One runtime's profile (Arlo §3.3): what the runtime allocation ILP and the simulator use."""

    name: str
    max_length: int  # 0 = dynamic shape
    batch_size: int  # the static batch size it is deployed with
    latency_ms: list[float]  # L_i: mean latency of one batch of b sequences, index b-1 (b = 1..len)
    capacity: int  # M_i: sequences one instance holds (queued + executing) within the SLO
    shape: str = "static"  # "static" | "dynamic"
    backend: str = ""


class EncoderProfile(Msg, kw_only=True):
    """`polyserve profile --encoder` output: the latency grid, the staircase and the runtimes."""

    model: str
    device: str
    backend: str  # how static runtimes were prepared: "compile" | "jit" | "eager"
    slo_ms: float
    threads: int
    lengths: list[int]  # the measured input lengths
    batches: list[int]  # the measured batch sizes
    static_ms: list[list[float]]  # [batch index][length index] latency of a static runtime of that shape
    dynamic_ms: list[list[float]] = []  # same grid, one dynamic-shape runtime (DT), unpadded input
    scan_lengths: list[int] = []  # the fine staircase scan at batch size 1 ...
    scan_static_ms: list[float] = []  # ... static runtime compiled for each length
    scan_dynamic_ms: list[float] = []  # ... the dynamic runtime at each length
    steps: list[int] = []  # lengths after which latency jumps (the staircase); [] = no clear step
    runtimes: list[RuntimeProfile] = []  # suggested runtimes (max_length spaced by the staircase)
    dynamic: RuntimeProfile | None = None  # the DT runtime at max length, for comparisons
    host: str = ""
    created: float = msgspec.field(default_factory=now)
    simulated: bool = False
    notes: str = ""
