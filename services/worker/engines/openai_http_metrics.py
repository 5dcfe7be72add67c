"""Load of an OpenAI-compatible engine server from its Prometheus `/metrics` (vLLM, SGLang
and TGI gauge names), for the `openai-http` engine's heartbeats. vLLM's names are checked
against `vllm_surface.json`; SGLang's and TGI's come from their documentation. Also the
engine's token counts (`exact_tokenizer`, `words_estimate`), which its load and usage use."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

# Prometheus gauges, first match wins (names as exported; labels may include model_name).
RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size")
WAITING_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size")
KV_FRACTION_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
KV_USED_METRICS = ("sglang:num_used_tokens",)
KV_INFO_METRIC = "vllm:cache_config_info"  # labels num_gpu_blocks, block_size
STALE_POLLS = 3  # metrics older than this many intervals are not used


def server_root(url: str) -> str:
    """`http://host:port[/prefix]` from an upstream URL given with or without `/v1`."""
    return url.strip().rstrip("/").removesuffix("/v1")


def words_estimate(text: str) -> int:
    return math.ceil(len(text.split()) * 1.3)


def exact_tokenizer(tokenizer_path: str) -> Any:
    """The `tokenizers` Tokenizer of a tokenizer.json (or its directory), or None: count by estimate."""
    if not tokenizer_path:
        return None
    path = Path(tokenizer_path).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(path))
        tok.no_padding()  # a saved tokenizer.json may pad or truncate to a fixed length
        tok.no_truncation()
        return tok
    except Exception as exc:  # noqa: BLE001 - fall back to the estimate
        logger.warning("cannot read tokenizer %s (%s); counting tokens as 1.3 x words", path, exc)
        return None


@dataclass
class UpstreamLoad:
    """What one /metrics scrape said (None = that metric was not exported)."""

    running: float | None = None
    waiting: float | None = None
    kv_fraction: float | None = None
    kv_used: float | None = None
    kv_capacity: int | None = None
    at: float = 0.0


def parse_metrics(text: str, models: set[str] | None = None) -> UpstreamLoad:
    """Read running/waiting/KV gauges from Prometheus text (vLLM, SGLang, TGI names).

    Values with a `model_name` label are summed over the `models` given (all when None)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    kv_capacity = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model_name")
            if models and model is not None and model not in models:
                continue
            if sample.name == KV_INFO_METRIC or family.name == KV_INFO_METRIC:
                try:
                    blocks = int(float(sample.labels.get("num_gpu_blocks", "") or 0))
                    block = int(float(sample.labels.get("block_size", "") or 0))
                except ValueError:
                    continue
                if blocks and block:
                    kv_capacity = blocks * block
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)

    def first(names: tuple[str, ...]) -> float | None:
        return next((values[n] for n in names if n in values), None)

    return UpstreamLoad(running=first(RUNNING_METRICS), waiting=first(WAITING_METRICS),
                        kv_fraction=first(KV_FRACTION_METRICS), kv_used=first(KV_USED_METRICS),
                        kv_capacity=kv_capacity, at=time.monotonic())


class MetricsPoller:
    """Scrapes `url` every `interval` s; `fresh()` is the last usable scrape, else None
    (the engine then counts its own in-flight requests). `state`: ok | absent | failing |
    unknown. A server without usable metrics (404/405, not Prometheus text, none of the
    known gauges) is not asked again."""

    def __init__(self, http: httpx.AsyncClient, url: str, interval: float, models: Callable[[], set[str]]):
        self.http, self.url, self.interval, self.models = http, url, interval, models
        self.state = "unknown"
        self.last: UpstreamLoad | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._loop(), name="openai-http-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
            self._task = None

    async def poll_once(self) -> None:
        try:
            resp = await self.http.get(self.url, timeout=max(0.5, min(5.0, 2 * self.interval)))
        except httpx.HTTPError as exc:
            if self.state != "failing":
                logger.warning("cannot read %s (%s); load from the in-flight count until it answers", self.url, exc)
            self.state = "failing"
            return
        if resp.status_code in (404, 405):
            logger.info("%s answered %d: no Prometheus metrics; load from the in-flight count",
                        self.url, resp.status_code)
            self.state = "absent"
            return
        if resp.status_code != 200:
            self.state = "failing"
            return
        try:
            parsed = parse_metrics(resp.text, self.models())
        except Exception as exc:  # noqa: BLE001 - not Prometheus text
            logger.warning("%s is not Prometheus text (%s); load from the in-flight count", self.url, exc)
            self.state = "absent"
            return
        if parsed.running is None and parsed.waiting is None:
            if self.state != "absent":
                logger.info("%s exports none of %s; load from the in-flight count", self.url,
                            ", ".join(RUNNING_METRICS))
            self.state = "absent"
            return
        self.last = parsed
        self.state = "ok"

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self.state == "absent":
                return  # the server has no usable /metrics: do not keep asking
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - keep polling
                logger.exception("metrics poll of %s failed", self.url)

    def fresh(self) -> UpstreamLoad | None:
        m = self.last
        if self.state != "ok" or m is None:
            return None
        if time.monotonic() - m.at > STALE_POLLS * self.interval + 1.0:
            return None
        return m
