"""The `openai-http` engine against a real engine server that is not polyserve's:
`transformers serve` (the installed transformers) serving a checkpoint directory saved
from the small random Llama, started once for this module on a free loopback port.

Engine level: streamed and non-streamed answers with the upstream's token counts,
sampling parameters passed through, cancellation that the upstream sees (its generation
thread is sequential, so a short request right after a cancelled long one finishes only
if the long one stopped), upstream errors as EngineErrors with the upstream's status,
load from the in-flight count when /metrics is absent (transformers serve has none) and
from vLLM-named gauges when a /metrics endpoint exports them, LoRA refused with 501
where the server has no runtime adapter endpoints.

End to end: the official `openai` client -> gateway -> dispatcher -> worker(openai-http)
-> transformers serve, completions and chat, streamed and not.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from polyserve.dispatcher.config import DispatcherSettings
from polyserve.dispatcher.service import DispatcherService
from polyserve.gateway.config import GatewaySettings
from polyserve.gateway.service import GatewayService
from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.service import PredictorService
from polyserve.proto import Deployment, SamplingParams, ScalerPolicy
from polyserve.shared import infra
from polyserve.shared.settings import SettingsError
from polyserve.worker.config import WorkerSettings
from polyserve.worker.engine import Delta, EngineError, EngineRequest, Finished
from polyserve.worker.engines import make_engine
from polyserve.worker.engines.openai_http import OpenAIHttpEngine
from polyserve.worker.engines.openai_http_metrics import parse_metrics, server_root
from polyserve.worker.service import WorkerService
from tests.helpers import LoopbackHTTP, running, wait_for
from tests.integration.conftest import placements

pytestmark = [pytest.mark.integration, pytest.mark.torch]  # torch: saves a model; the upstream runs one

TRANSFORMERS_CLI = Path(sys.executable).with_name("transformers")
PROMPT = "the quick brown fox jumps over the lazy dog"
READY_TIMEOUT_S = 180.0


class Upstream:
    def __init__(self, url: str, model: str, log: Path, proc: subprocess.Popen):
        self.url, self.model, self.log, self.proc = url, model, log, proc

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""


def _save_checkpoint(out: Path) -> Path:
    from polyserve.worker.engines.hf_model import save_random_checkpoint

    save_random_checkpoint(out, seed=0)
    # The fallback tokenizer is BERT's WordPiece, which also returns token_type_ids; Llama's
    # generate() rejects those ("model_kwargs are not used by the model"), so the saved
    # tokenizer names only the inputs a causal LM takes.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Upstream:
    """`transformers serve <checkpoint>` on a free 127.0.0.1 port, ready; its process group killed after."""
    if not TRANSFORMERS_CLI.exists():
        pytest.skip(f"no transformers CLI at {TRANSFORMERS_CLI}")
    root = tmp_path_factory.mktemp("openai-http")
    ckpt = _save_checkpoint(root / "tiny-llama")
    port = infra.free_port()
    log = root / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(TRANSFORMERS_CLI), "serve", str(ckpt), "--host", "127.0.0.1", "--port",
                                 str(port), "--device", "cpu", "--log-level", "info"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    up = Upstream(f"http://127.0.0.1:{port}", str(ckpt), log, proc)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{up.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{up.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve not ready within {READY_TIMEOUT_S:.0f}s:\n{up.log_tail()}")
            time.sleep(0.25)
        yield up
    finally:
        _stop_group(proc)


def _settings(up: Upstream, **kw) -> WorkerSettings:
    base = dict(engine="openai-http", model="tiny-upstream", upstream_url=up.url + "/v1", upstream_model=up.model,
                model_path=up.model, upstream_start_timeout_s=30.0, upstream_timeout_s=120.0,
                upstream_metrics_interval_s=0.2)
    base.update(kw)
    return WorkerSettings(**base)


@contextlib.asynccontextmanager
async def _engine(up: Upstream, **kw):
    engine = make_engine(_settings(up, **kw))
    assert isinstance(engine, OpenAIHttpEngine)
    await asyncio.wait_for(engine.start(), 60)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.stop(), 30)


async def _collect(engine, req: EngineRequest, timeout: float = 120.0) -> tuple[list[Delta], Finished]:
    async def run():
        deltas, fin = [], None
        async for ev in engine.generate(req):
            if isinstance(ev, Delta):
                deltas.append(ev)
            else:
                fin = ev
        return deltas, fin

    deltas, fin = await asyncio.wait_for(run(), timeout)
    assert isinstance(fin, Finished)
    return deltas, fin


def _greedy(rid: str, max_tokens: int = 8, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt=PROMPT,
                         params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


# ------------------------------------------------------------------ engine level
async def test_streamed_and_non_streamed_answers_agree(upstream):
    async with _engine(upstream) as eng:
        card = eng.model_card()
        assert card["engine"] == "openai-http" and card["upstream_models"] == [upstream.model]
        assert card["tokenizer"] == "exact"  # model_path's tokenizer.json
        deltas, fin = await _collect(eng, _greedy("s1"))
        text = "".join(d.text for d in deltas)
        assert text.strip() and len([d for d in deltas if d.text]) >= 2  # arrived in pieces
        assert deltas[-1].finish_reason == "length" and all(d.index == 0 for d in deltas)
        assert fin.stats.output_tokens == 8  # the upstream's usage
        assert fin.stats.input_tokens == eng.count_tokens(PROMPT)  # its prompt count = our tokenizer's
        assert fin.stats.ttft_ms > 0 and fin.stats.decode_ms > 0
    async with _engine(upstream, upstream_stream=False) as eng:
        deltas2, fin2 = await _collect(eng, _greedy("s2"))
        assert len(deltas2) == 1 and deltas2[0].finish_reason == "length" and deltas2[0].tokens == 8
        assert deltas2[0].text == text  # greedy: the same answer either way
        assert fin2.stats.output_tokens == 8 and fin2.stats.input_tokens == fin.stats.input_tokens


async def test_sampling_parameters_reach_the_upstream(upstream):
    async with _engine(upstream) as eng:
        pieces = [d.text for d in (await _collect(eng, _greedy("p0", max_tokens=12)))[0] if d.text]
        short, _ = await _collect(eng, _greedy("p1", max_tokens=3))
        assert "".join(d.text for d in short) == "".join(pieces[:3])  # max_tokens
        # stop: cut at a word the greedy answer contains
        stop_word = pieces[4].strip()
        assert stop_word
        deltas, fin = await _collect(eng, _greedy("p2", max_tokens=12, stop=[stop_word]))
        assert deltas[-1].finish_reason == "stop" and fin.stats.output_tokens < 12
        # seed (with temperature 1): the same seed draws the same text
        def seeded(rid, seed):
            return EngineRequest(request_id=rid, prompt=PROMPT,
                                 params=SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=seed))

        a = "".join(d.text for d in (await _collect(eng, seeded("p3", 7)))[0])
        b = "".join(d.text for d in (await _collect(eng, seeded("p4", 7)))[0])
        assert a == b
        body, extra = eng.request_body(EngineRequest("x", PROMPT, SamplingParams(max_tokens=5, top_k=4, n=2,
                                                                                  min_tokens=2, seed=1)))
        assert body["n"] == 2 and body["seed"] == 1 and extra == {"top_k": 4, "min_tokens": 2}
        body, extra = eng.request_body(EngineRequest("y", PROMPT, SamplingParams(
            frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.1, min_p=0.05, logit_bias={9: -100.0},
            stop_token_ids=[2], include_stop=True, truncate_prompt_tokens=64, think=["<think>", "</think>"],
            thinking_budget=32, allowed_token_ids=[5, 9], bad_words=["no"], skip_special_tokens=False,
            return_token_ids=True)))
        assert (body["frequency_penalty"], body["presence_penalty"], body["logit_bias"]) == (0.5, 0.25, {"9": -100.0})
        assert extra == {"repetition_penalty": 1.1, "min_p": 0.05, "stop_token_ids": [2],
                         "include_stop_str_in_output": True, "truncate_prompt_tokens": 64,
                         "thinking_token_budget": 32, "allowed_token_ids": [5, 9],
                         "bad_words": ["no"], "skip_special_tokens": False,
                         "return_token_ids": True}  # vLLM's, as extra body
        penalised = "".join(d.text for d in (await _collect(eng, EngineRequest("p5", PROMPT, SamplingParams(
            max_tokens=6, temperature=0.0, frequency_penalty=0.5))))[0])
        assert penalised  # transformers serve takes frequency_penalty (as its repetition penalty)


async def test_cancel_closes_the_upstream_stream(upstream):
    """transformers serve generates one request at a time on one thread: a short request sent
    after the cancel finishes quickly only if the upstream saw the disconnect and stopped."""
    async with _engine(upstream) as eng:
        req = EngineRequest(request_id="long", prompt=PROMPT, params=SamplingParams(max_tokens=3500, temperature=0.0))
        stream = eng.generate(req)
        events = []
        t0 = time.monotonic()
        async with contextlib.aclosing(stream):
            while len([e for e in events if isinstance(e, Delta) and e.text]) < 5:
                events.append(await asyncio.wait_for(stream.__anext__(), 60))
            per_token = (time.monotonic() - t0) / 5
            load = eng.load()
            assert (load.running, load.waiting) == (1, 0)  # in-flight fallback: it has output
            assert eng.cancel("long") is True and eng.cancel("long") is False
            rest = [e async for e in stream]
        assert isinstance(rest[-1], Finished) and rest[-2].finish_reason == "cancelled"
        assert eng.load().running == 0 and eng.load().waiting == 0
        t1 = time.monotonic()
        _, fin = await _collect(eng, _greedy("after", max_tokens=4), timeout=60)
        elapsed = time.monotonic() - t1
        assert fin.stats.output_tokens == 4
        # Measured here: all 3500 tokens take ~120 s, and a request sent meanwhile waits for them.
        assert elapsed < 20, (f"the next request took {elapsed:.1f}s (the cancelled one ran at "
                              f"{per_token * 1e3:.0f} ms/token so far): did the upstream keep generating?")


async def test_consumer_going_away_cancels(upstream):
    async with _engine(upstream) as eng:
        stream = eng.generate(EngineRequest("gone", PROMPT, SamplingParams(max_tokens=3000, temperature=0.0)))
        await asyncio.wait_for(stream.__anext__(), 60)
        await stream.aclose()  # e.g. the worker's stream task cancelled
        await wait_for(lambda: not eng._tasks, 10, what="the upstream request task to end")
        _, fin = await _collect(eng, _greedy("next", max_tokens=3), timeout=30)
        assert fin.stats.output_tokens == 3


async def test_upstream_errors_are_engine_errors(upstream):
    async with _engine(upstream) as eng:
        with pytest.raises(EngineError) as err:  # transformers serve takes no top_k: 422
            await _collect(eng, EngineRequest("k", PROMPT, SamplingParams(max_tokens=4, top_k=5)))
        assert err.value.status == 422 and "top_k" in str(err.value) and "answered 422" in str(err.value)
        assert eng.load().running == 0 and eng.load().waiting == 0
    async with _engine(upstream, upstream_model="not-the-model") as eng:  # the server is pinned to one model
        with pytest.raises(EngineError) as err:
            await _collect(eng, _greedy("m"))
        assert err.value.status == 400 and "not-the-model" in str(err.value)
    port = infra.free_port()  # nothing listens there
    eng = make_engine(WorkerSettings(engine="openai-http", upstream_url=f"http://127.0.0.1:{port}",
                                     upstream_start_timeout_s=1.0, upstream_connect_timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        await asyncio.wait_for(eng.start(), 20)
    assert err.value.status == 503 and f"127.0.0.1:{port}" in str(err.value) and time.monotonic() - t0 < 10
    with pytest.raises(SettingsError, match="upstream_url"):
        WorkerSettings(engine="openai-http").validate()
    with pytest.raises(EngineError, match="upstream_url"):
        make_engine(WorkerSettings(engine="openai-http"))


async def test_logprobs_and_structured_outputs_transformers_serve_lacks_are_explicit_errors(upstream):
    """`transformers serve` ignores `logprobs`/`echo` (a logged warning) and rejects `response_format` /
    `structured_outputs` on /v1/completions (422): neither is silently dropped; nor is vLLM's
    `return_token_ids`."""
    from polyserve.proto import StructuredOutput

    async with _engine(upstream) as eng:
        for params in (dict(logprobs=1), dict(prompt_logprobs=1)):
            with pytest.raises(EngineError) as err:
                await _collect(eng, _greedy("lp", max_tokens=2, **params))
            assert err.value.status == 502 and "answered without" in str(err.value), err.value
        for spec in (StructuredOutput(json_object=True), StructuredOutput(regex="[a-z]+")):
            with pytest.raises(EngineError) as err:
                await _collect(eng, _greedy("so", max_tokens=2, structured=spec))
            assert err.value.status == 422 and "Unexpected fields" in str(err.value), err.value
        with pytest.raises(EngineError) as err:  # vLLM's return_token_ids: refused or left out, never dropped
            await _collect(eng, _greedy("ids", max_tokens=2, return_token_ids=True))
        assert err.value.status in (422, 502) and ("token_ids" in str(err.value) or "Unexpected" in str(err.value))


async def test_upstream_dying_mid_stream_fails_the_request(upstream, tmp_path):
    """A server that closes the connection mid-answer: the stream ends with an EngineError."""
    srv = _LocalServer(models=["m"], truncate_stream=True)
    with srv:
        async with _engine(upstream, upstream_url=srv.url, upstream_model="m", upstream_metrics_url="off") as eng:
            with pytest.raises(EngineError) as err:
                await _collect(eng, _greedy("cut"), timeout=20)
            assert err.value.status == 502


async def test_metrics_absent_falls_back_to_in_flight_count(upstream):
    async with _engine(upstream) as eng:
        assert eng.metrics_state == "absent"  # transformers serve has no /metrics (404)
        assert eng.model_card()["metrics_state"] == "absent"
        stream = eng.generate(EngineRequest("m1", PROMPT, SamplingParams(max_tokens=3000, temperature=0.0)))
        async with contextlib.aclosing(stream):
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            assert eng.load().waiting == 1 and eng.load().running == 0  # sent, no token yet
            await asyncio.wait_for(first, 60)
            assert eng.load().running == 1 and eng.load().waiting == 0
            eng.cancel("m1")
        assert eng.load().running == 0


class _LocalServer(LoopbackHTTP):
    """A loopback HTTP server for what transformers serve lacks: Prometheus /metrics with vLLM's
    gauge names, and (optionally) a /v1 that lists models and cuts a stream short."""

    def __init__(self, metrics: str = "", models: list[str] | None = None, truncate_stream: bool = False,
                 lora: bool = False):
        super().__init__()
        self.metrics, self.models, self.truncate_stream, self.lora = metrics, models, truncate_stream, lora

    def answer(self, method: str, path: str, body: dict) -> tuple:
        if method == "GET" and path == "/metrics" and self.metrics:
            return 200, self.metrics.encode(), "text/plain; version=0.0.4"
        if method == "GET" and path == "/v1/models" and self.models is not None:
            return 200, json.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
                                   ).encode(), "application/json"
        if method == "POST" and self.lora and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            ok = body.get("lora_name") != "broken"
            return (200, b"Success", "text/plain") if ok else \
                (400, b'{"error": {"message": "cannot read adapter", "code": 400}}', "application/json")
        if method == "POST" and path == "/v1/completions" and self.truncate_stream:
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
            return 200, f"data: {json.dumps(chunk)}\n\n".encode(), "text/event-stream", True
        return 404, b"not found", "text/plain"


def _vllm_metrics(model: str, running: int, waiting: int, usage: float) -> str:
    return (f"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            f"# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}\n'
            f'vllm:num_requests_running{{engine="0",model_name="other-model"}} 40\n'
            f"# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}\n'
            f"# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} {usage}\n'
            f"# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="1000"}} 1.0\n'
            f"# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{engine="0",model_name="{model}"}} 123.0\n')


def test_metric_names_are_vllms_and_parse():
    surface = json.loads((Path(__file__).resolve().parents[2] / "services" / "worker" / "engines" /
                          "vllm_surface.json").read_text())
    from polyserve.worker.engines import openai_http_metrics as om

    for name in (om.RUNNING_METRICS[0], om.WAITING_METRICS[0], om.KV_FRACTION_METRICS[0], om.KV_INFO_METRIC):
        assert name in surface["metrics"], f"{name} is not a metric of vLLM {surface['vllm_version']}"
    m = parse_metrics(_vllm_metrics("m", 3, 2, 0.25), {"m"})
    assert (m.running, m.waiting, m.kv_fraction, m.kv_capacity) == (3, 2, 0.25, 16000)
    assert parse_metrics(_vllm_metrics("m", 3, 2, 0.25)).running == 43  # no model filter: all summed
    sg = parse_metrics('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 5\n'
                       '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 1\n')
    assert (sg.running, sg.waiting) == (5, 1)
    assert server_root("http://h:8000/v1/") == "http://h:8000" and server_root("http://h:8000") == "http://h:8000"


async def test_load_from_vllm_metrics(upstream):
    """Generation from transformers serve, load from a /metrics endpoint with vLLM's gauges."""
    srv = _LocalServer(_vllm_metrics(upstream.model, 3, 2, 0.25))
    with srv:
        async with _engine(upstream, upstream_metrics_url=srv.url + "/metrics") as eng:
            assert eng.metrics_state == "ok"
            load = eng.load()
            assert (load.running, load.waiting, load.kv_capacity, load.kv_used) == (3, 2, 16000, 4000)
            srv.metrics = _vllm_metrics(upstream.model, 1, 0, 0.5)
            await wait_for(lambda: eng.load().running == 1, 5, what="the next metrics poll")
            assert eng.load().kv_used == 8000
            srv.metrics = ""  # now 404: the server lost its metrics -> in-flight count
            await wait_for(lambda: eng.metrics_state == "absent", 5, what="metrics to be marked absent")
            assert (eng.load().running, eng.load().waiting, eng.load().kv_used) == (0, 0, 0)


async def test_lora_unsupported_upstream_says_so(upstream, tmp_path):
    async with _engine(upstream) as eng:
        with pytest.raises(EngineError) as err:
            await eng.load_adapter("ad1", str(tmp_path / "nowhere"))
        assert err.value.status == 501 and "load_lora_adapter" in str(err.value)
        assert "does not serve LoRA adapters" in str(err.value)
        assert not eng.has_adapter("ad1") and eng.model_card()["lora"] == "unsupported by the upstream"
        with pytest.raises(EngineError) as err:  # a request naming an unknown adapter
            await _collect(eng, EngineRequest("a", PROMPT, SamplingParams(max_tokens=2), adapter="ad1"))
        assert err.value.status == 404


async def test_lora_through_vllms_runtime_endpoints(upstream, tmp_path):
    """The request shapes of vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (a loopback
    stand-in answers as vLLM does: 200 "Success"; vLLM itself cannot run here)."""
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                              "target_modules": ["q_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    srv = _LocalServer(models=["base"], lora=True)
    with srv:
        async with _engine(upstream, upstream_url=srv.url, upstream_model="base", upstream_metrics_url="off") as eng:
            info = await eng.load_adapter("sql", str(adapter))
            assert (info.name, info.rank) == ("sql", 8) and eng.has_adapter("sql") and eng.lora_supported
            remote = await eng.load_adapter("remote", "/models/on/the/server/lora")  # not readable here
            assert remote.rank == 0
            assert [a.name for a in eng.load().adapters] == ["remote", "sql"]
            with pytest.raises(EngineError) as err:
                await eng.load_adapter("broken", str(adapter))
            assert err.value.status == 400 and "cannot read adapter" in str(err.value)
            assert not eng.has_adapter("broken")
            await eng.unload_adapter("sql")
            assert not eng.has_adapter("sql")
            assert srv.posts == [
                ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapter)}),
                ("/v1/load_lora_adapter", {"lora_name": "remote", "lora_path": "/models/on/the/server/lora"}),
                ("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(adapter)}),
                ("/v1/unload_lora_adapter", {"lora_name": "sql"})]
            kw, _ = eng.request_body(EngineRequest("r", PROMPT, SamplingParams(), adapter="remote"))
            assert kw["model"] == "remote"


# ------------------------------------------------------------------ end to end
MODEL = "tiny-upstream"


@pytest.fixture
def upstream_plane(make_settings, state, span_exporter, upstream):
    @contextlib.asynccontextmanager
    async def start(policy: str = "least_outstanding", workers: int = 1, **worker_kw):
        await state.put_deployment(Deployment(id=MODEL, model=MODEL, engine="openai-http", policy=policy,
                                              scaler=ScalerPolicy(min_replicas=workers, max_replicas=workers)))
        wkw = dict(deployment=MODEL, model=MODEL, engine="openai-http",
                   upstream_url=upstream.url, upstream_model=upstream.model, model_path=upstream.model,
                   upstream_start_timeout_s=30.0, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0)
        wkw.update(worker_kw)
        fleet = [WorkerService(make_settings(WorkerSettings, "worker", worker_id="w-up" + "-x" * i, **wkw),
                               span_exporter=span_exporter) for i in range(workers)]
        gateway = GatewayService(make_settings(GatewaySettings, "gateway", port=0), span_exporter=span_exporter)
        services = [PredictorService(make_settings(PredictorSettings, "predictor", proxy_artifact=""),
                                     span_exporter=span_exporter),
                    DispatcherService(make_settings(DispatcherSettings, "dispatcher"), span_exporter=span_exporter),
                    *fleet, gateway]
        async with running(*services, timeout=60):
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                yield client, fleet[0]
            finally:
                await client.close()

    return start


async def test_openai_client_through_polyserve_to_transformers_serve(upstream_plane, upstream):
    async with _engine(upstream) as eng:  # what the upstream answers directly, for comparison
        direct = "".join(d.text for d in (await _collect(eng, _greedy("direct", max_tokens=6)))[0])
    async with upstream_plane() as (client, worker):
        hb = worker.heartbeat()
        assert hb.engine == "openai-http" and not hb.simulated
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        assert out.choices[0].text == direct and out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == eng.count_tokens(PROMPT)

        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        pieces, reasons, usage = [], [], None
        async for chunk in stream:
            for c in chunk.choices:
                pieces.append(c.text)
                reasons.append(c.finish_reason)
            usage = chunk.usage or usage
        assert "".join(pieces) == direct and "length" in reasons
        assert usage is not None and usage.completion_tokens == 6

        chat = await client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0,
                                                    messages=[{"role": "user", "content": "hello there"}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
        chat_stream = await client.chat.completions.create(
            model=MODEL, max_tokens=5, temperature=0, stream=True,
            messages=[{"role": "user", "content": "hello there"}])
        text = ""
        async for chunk in chat_stream:
            for c in chunk.choices:
                text += c.delta.content or ""
        assert text == chat.choices[0].message.content

        # An upstream refusal reaches the client with the upstream's status and words in the message; the
        # HTTP status is the gateway's 502, since the worker accepts before the upstream answers.
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"top_k": 3})
        assert err.value.status_code == 502 and "answered 422" in err.value.message and "top_k" in err.value.message


async def test_a_chat_without_a_local_template_is_the_upstreams_own_chat(upstream_plane, upstream):
    """No checkpoint directory on the worker: a chat goes to transformers serve's /v1/chat/completions as
    messages, so the server applies the checkpoint's template, and the client gets what a client of
    that server directly would get (greedy), streamed or not."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    direct_client = openai.AsyncOpenAI(base_url=upstream.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        direct = await direct_client.chat.completions.create(model=upstream.model, messages=messages, max_tokens=5,
                                                             temperature=0)
    finally:
        await direct_client.close()
    assert direct.choices[0].message.content
    async with upstream_plane(model_path="") as (client, worker):
        assert worker.engine.model_card()["chat"] == "/v1/chat/completions"
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
        assert chat.choices[0].message.content == direct.choices[0].message.content
        assert chat.usage.prompt_tokens == direct.usage.prompt_tokens and chat.usage.completion_tokens == 5
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                      stream=True)
        text = ""
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
        assert text == direct.choices[0].message.content
        # tools, auto: the messages and tools go to the server's chat endpoint (its template formats
        # them); random weights answer text, the same text as a direct tool chat. A forced call's JSON
        # schema is a completion's field transformers serve refuses: its 422 reaches the client
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        auto = await client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_tokens=4,
                                                    temperature=0)
        assert auto.choices[0].message.content and auto.choices[0].finish_reason == "length"
        assert worker.engine.tools_answered == 1 and worker.engine.model_card()["tools"].startswith(
            "/v1/chat/completions with tools")
        direct_client = openai.AsyncOpenAI(base_url=upstream.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            direct_tools = await direct_client.chat.completions.create(
                model=upstream.model, messages=messages, tools=[tool], tool_choice="auto", max_tokens=4, temperature=0)
        finally:
            await direct_client.close()
        assert auto.choices[0].message.content == direct_tools.choices[0].message.content
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], tool_choice="required",
                                                 max_tokens=4)
        assert "answered 422" in err.value.message and "response_format" in err.value.message


async def test_a_conversation_stays_with_its_prefix_on_openai_http_workers(upstream_plane, upstream, bus, subjects):
    """Prefix-aware placement as shipped (`prefix_affinity` auto: on for openai-http deployments):
    two openai-http workers in front of `transformers serve`, round robin; a conversation's turns all
    reach one worker, while unrelated short prompts alternate. transformers serve reports no cached
    tokens: the usage has no prompt_tokens_details."""
    where = await placements(bus, subjects, ["w-up", "w-up-x"])
    system = "You are the support assistant of a small bookshop. Answer in one short sentence. " * 5
    async with upstream_plane(policy="round_robin", workers=2) as (client, _):
        short = [(await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)).id for _ in range(2)]
        messages, turns = [{"role": "system", "content": system}], []
        for i in range(3):
            messages.append({"role": "user", "content": f"question {i}: do you have this book?"})
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
            turns.append(r.id)
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        assert r.usage.prompt_tokens_details is None
    assert sorted(where[i] for i in short) == ["w-up", "w-up-x"]  # round robin
    assert len({where[i] for i in turns}) == 1, [where[i] for i in turns]
