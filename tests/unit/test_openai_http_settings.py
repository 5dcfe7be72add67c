"""The openai-http engine's settings and how `polyserve up` passes them on (no servers)."""
from __future__ import annotations

import json

import pytest

from polyserve.cli import commands, launcher
from polyserve.proto import SamplingParams
from polyserve.shared import settings as settings_mod
from polyserve.shared.settings import SettingsError
from polyserve.worker.config import WorkerSettings
from polyserve.worker.engine import EngineRequest
from polyserve.worker.engines import ENGINES
from polyserve.worker.engines.openai_http import OpenAIHttpEngine
from polyserve.worker.engines.openai_http_metrics import parse_metrics


def test_settings_from_env_and_validation():
    s = settings_mod.load(WorkerSettings, "worker", environ={
        "POLYSERVE_WORKER_ENGINE": "openai-http", "POLYSERVE_WORKER_UPSTREAM_URL": "http://10.0.0.5:8000/v1",
        "POLYSERVE_WORKER_UPSTREAM_MODEL": "meta-llama/Llama-3.1-8B-Instruct",
        "POLYSERVE_WORKER_UPSTREAM_API_KEY": "sk-x", "POLYSERVE_WORKER_UPSTREAM_STREAM": "false",
        "POLYSERVE_WORKER_UPSTREAM_EXTRA_BODY": '{"repetition_penalty": 1.1}'})
    assert s.engine == "openai-http" and s.upstream_stream is False and "openai-http" in ENGINES
    eng = OpenAIHttpEngine(s)
    assert eng.root == "http://10.0.0.5:8000" and eng.api_url == "http://10.0.0.5:8000/v1"
    assert eng.metrics_url == "http://10.0.0.5:8000/metrics" and eng.upstream_model.startswith("meta-llama/")
    kw, extra = eng.request_body(EngineRequest("r", "p", SamplingParams(max_tokens=3), adapter="sql-lora"))
    assert kw["model"] == "sql-lora" and extra == {"repetition_penalty": 1.1}  # adapters are model names
    assert "n" not in kw and "stop" not in kw and "seed" not in kw  # defaults are not sent
    for bad in ({}, {"upstream_url": "10.0.0.5:8000"}, {"upstream_url": "http://h", "upstream_extra_body": "[1]"},
                {"upstream_url": "http://h", "upstream_timeout_s": 0}):
        with pytest.raises(SettingsError):
            WorkerSettings(engine="openai-http", **bad).validate()
    assert OpenAIHttpEngine(WorkerSettings(engine="openai-http", upstream_url="http://h",
                                           upstream_metrics_url="off")).metrics_url is None


def test_tgi_and_sglang_gauges():
    tgi = parse_metrics("# TYPE tgi_queue_size gauge\ntgi_queue_size 4\n"
                        "# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 9\n")
    assert (tgi.running, tgi.waiting, tgi.kv_fraction) == (9, 4, None)
    sg = parse_metrics('# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.5\n'
                       '# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{model_name="m"} 700\n')
    assert (sg.kv_fraction, sg.kv_used) == (0.5, 700)


def test_up_passes_upstream_flags(tmp_path, monkeypatch):
    args = commands.build_parser().parse_args(["--run-dir", str(tmp_path), "up", "--engine", "openai-http",
                                               "--upstream-url", "http://127.0.0.1:8001",
                                               "--upstream-model", "m1", "--upstream-metrics-url", "off"])
    captured = {}

    def fake_up(spec, progress):
        captured["spec"] = spec
        raise launcher.LaunchError("stop here")

    monkeypatch.setattr(launcher, "up", fake_up)
    assert commands.cmd_up(args) == 1
    spec = captured["spec"]
    assert launcher.upstream_env(spec) == {"POLYSERVE_WORKER_UPSTREAM_URL": "http://127.0.0.1:8001",
                                           "POLYSERVE_WORKER_UPSTREAM_MODEL": "m1",
                                           "POLYSERVE_WORKER_UPSTREAM_METRICS_URL": "off"}
    assert launcher.default_model("openai-http") == "upstream-model"


def test_up_gives_vllm_workers_the_deployments_reasoning_parser(tmp_path):
    spec = launcher.ClusterSpec(run_dir=tmp_path, engine="vllm", reasoning_parser="qwen3")
    assert launcher.reasoning_env(spec, {}) == {"POLYSERVE_WORKER_VLLM_ENGINE_ARGS": '{"reasoning_parser": "qwen3"}'}
    mine = {"POLYSERVE_WORKER_VLLM_ENGINE_ARGS": '{"reasoning_parser": "deepseek_r1", "seed": 3}'}
    assert json.loads(launcher.reasoning_env(spec, mine)["POLYSERVE_WORKER_VLLM_ENGINE_ARGS"]) == {
        "reasoning_parser": "deepseek_r1", "seed": 3}  # the operator's own engine args win
    assert launcher.reasoning_env(launcher.ClusterSpec(run_dir=tmp_path), mine) == {}


def test_up_refuses_openai_http_without_an_address(tmp_path, monkeypatch):
    monkeypatch.delenv("POLYSERVE_WORKER_UPSTREAM_URL", raising=False)
    with pytest.raises(launcher.LaunchError, match="--upstream-url"):
        launcher.up(launcher.ClusterSpec(run_dir=tmp_path, engine="openai-http"), progress=lambda *_: None)


def test_vllm_engine_args_is_a_worker_setting_read_as_json():
    s = WorkerSettings(engine="sim", vllm_engine_args='{"reasoning_parser": "qwen3"}')
    s.validate()
    with pytest.raises(SettingsError, match="vllm_engine_args"):
        WorkerSettings(engine="sim", vllm_engine_args="[1]").validate()


def test_an_upstream_answer_without_thinking_is_content_when_the_constraint_follows_the_thinking():
    """openai_http_chat.ThinkText: the upstream's `reasoning` goes back between the tags; a request
    constrained after its thinking (SamplingParams.think) whose answer has none gets an empty
    thinking first, so the gateway's parser reads the constrained text as the content."""
    from types import SimpleNamespace as NS

    from polyserve.proto import StructuredOutput
    from polyserve.worker.engines.openai_http_chat import ThinkText

    def chunk(content=None, reasoning=None, finish=None):
        return NS(delta=NS(content=content, reasoning=reasoning), finish_reason=finish)

    gated = SamplingParams(structured=StructuredOutput(choice=["a"]), think=["<think>", "</think>"])
    t = ThinkText.of(gated)
    assert t.text(0, chunk('{"a"')) + t.text(0, chunk("}", finish="stop")) == '<think></think>{"a"}'
    t = ThinkText.of(gated)
    said = [t.text(0, chunk(reasoning="hm")), t.text(0, chunk('{"a"}')), t.text(0, chunk(finish="stop"))]
    assert "".join(said) == '<think>hm</think>{"a"}'
    plain = ThinkText.of(SamplingParams())
    assert plain.text(0, chunk("x")) == "x"
