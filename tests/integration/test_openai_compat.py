"""The compatibility matrix (services/gateway/compat_table.py, docs/openai-compatibility.md)
walked with the official `openai` client against a real gateway (sim worker; encoder workers
for the embeddings rows that need one): every honoured and ignored field with its example
value succeeds, every refused field gets a 400 whose `param` names it, and a refused field at
one of its no-op values succeeds. The table covers every request field of vLLM 0.33's server,
and the document is what the table generates."""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from polyserve.gateway import compat
from polyserve.gateway.compat_table import HONOURED, IGNORED, REFUSED, TABLES, Rule
from polyserve.proto import Deployment, ScalerPolicy
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Request fields of vLLM 0.33.0's protocol classes (vllm/entrypoints/.../protocol.py, read with ast).
VLLM_FIELDS = {
    "completions": "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop "
    "stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty "
    "watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids "
    "prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens response_format "
    "structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids "
    "return_weight_versions routed_experts_prompt_start return_token_offsets mm_payload return_mm_kwargs "
    "cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection thinking_token_budget "
    "stream_interval",
    "chat": "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k "
    "min_p repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos "
    "min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side "
    "prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt "
    "continue_final_message add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs "
    "mm_processor_kwargs structured_outputs priority request_id session_id return_tokens_as_token_ids "
    "return_token_ids return_weight_versions routed_experts_prompt_start return_token_offsets return_prompt_text "
    "mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection stream_interval",
    "embeddings": "model user truncate_prompt_tokens padding truncation_side request_id priority mm_processor_kwargs "
    "cache_salt input add_special_tokens encoding_format embed_dtype endianness dimensions use_activation "
    "add_generation_prompt continue_final_message chat_template chat_template_kwargs media_io_kwargs messages",
    "tokenize": "model prompt add_special_tokens return_token_strs messages add_generation_prompt "
    "continue_final_message chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs tools",
    "detokenize": "model tokens",
}


def test_table_covers_every_vllm_field_and_the_doc_is_generated_from_it():
    for endpoint, names in VLLM_FIELDS.items():
        missing = set(names.split()) - set(TABLES[endpoint])
        assert not missing, f"{endpoint}: fields vLLM accepts that the table does not say anything about: {missing}"
    for table in TABLES.values():
        for name, rule in table.items():
            assert rule.status in (HONOURED, REFUSED, IGNORED) and rule.why, name
            assert rule.example is None or not compat.is_noop(rule.example, rule.noop), name
    doc = (Path(__file__).resolve().parents[2] / compat.DOC).read_text()
    assert compat.document(doc) == doc, "docs/openai-compatibility.md is stale: python -m polyserve.gateway.compat"


def rows(endpoint: str, engine: str = "sim") -> list[tuple[str, Any, str]]:
    """(field, value, expected status) for every example and every non-null no-op value."""
    out = []
    for name, rule in TABLES[endpoint].items():
        status = rule.status_for(engine)
        if rule.example is not None:
            out.append((name, rule.example, status))
        out += [(name, v, HONOURED) for v in rule.noop if v is not None]  # a no-op value is accepted
    return out


def _kwargs(create, name: str, value: Any) -> dict:
    """`name=value` as the client's own keyword when it has one, else in extra_body."""
    kw: dict[str, Any] = {name: value}
    if name == "stream_options":
        kw["stream"] = True
    if name not in inspect.signature(create).parameters:
        kw = {"extra_body": kw}
    return kw


async def _call(create, base: dict, name: str, value: Any) -> None:
    out = await create(**{**base, **_kwargs(create, name, value)})
    if isinstance(out, openai.AsyncStream):
        chunks = [c async for c in out]
        assert chunks, f"{name}: empty stream"
    else:
        assert out.choices, f"{name}: no choices"


async def _walk(create, base: dict, cases: list[tuple[str, Any, str]]) -> list[str]:
    """Every case against the gateway; the failures, described."""
    failures = []
    for name, value, status in cases:
        try:
            await _call(create, base, name, value)
            if status == REFUSED:
                failures.append(f"{name}={value!r}: accepted, but the table says refused")
        except openai.BadRequestError as err:
            param = (err.body or {}).get("param") if isinstance(err.body, dict) else None
            if status != REFUSED:
                failures.append(f"{name}={value!r}: 400 ({err.message}), but the table says {status}")
            elif param != name:
                failures.append(f"{name}={value!r}: 400 names param {param!r}")
    return failures


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_generative_fields_walk_the_matrix(plane, endpoint):
    async with plane() as p:
        if endpoint == "completions":
            create, base = p.client.completions.create, {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
        else:
            create = p.client.chat.completions.create
            base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        # thinking_token_budget needs a reasoning_parser deployment (this one has none: its 400 is
        # test_reasoning_structured.py's, with the honoured case)
        cases = [c for c in rows(endpoint) if c[0] not in ("stop", "ignore_eos", "thinking_token_budget")
                 or (c[0] == "thinking_token_budget" and c[2] == REFUSED)]
        failures = await _walk(create, base, cases)
        # ignore_eos and stop work alone; together they are refused, naming ignore_eos
        failures += await _walk(create, base, [("ignore_eos", True, HONOURED), ("stop", ["zzz"], HONOURED)])
        failures += await _walk(create, {**base, "stop": ["zzz"]}, [("ignore_eos", True, REFUSED)])
        assert not failures, "\n".join(failures)

        # ignore_eos generates to max_tokens; a field the table does not know is accepted and named
        raw = await create.__self__.with_raw_response.create(
            **base, extra_body={"ignore_eos": True, "frobnicate": 1, "max_tokens": 9})
        assert raw.headers["x-polyserve-ignored-fields"] == "frobnicate"
        assert raw.parse().usage.completion_tokens == 9


async def test_chat_message_fields(plane):
    async with plane() as p:
        chat = p.client.chat.completions.create
        ok = await chat(model=MODEL, max_tokens=2, messages=[
            {"role": "system", "content": "be brief", "name": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert ok.choices[0].message.content
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        with pytest.raises(openai.BadRequestError) as err:
            await chat(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [image]}])
        assert err.value.body["param"] == "messages[0].content" and err.value.body["code"] == "unsupported_parameter"
        ok = await chat(model=MODEL, max_tokens=2, messages=[  # tool calls and results are rendered (tools.py)
            {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}])
        assert ok.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=2)
        assert err.value.body["param"] == "prompt" and "token-id" in err.value.message


@pytest.fixture
def encoder_plane(plane, make_settings, state, span_exporter):
    """The plane plus an encoder deployment (and, with `worker=True`, one encoder worker)."""
    import contextlib

    from tests.helpers import running

    @contextlib.asynccontextmanager
    async def start(worker: bool):
        await state.put_deployment(Deployment(id="enc", model="sentence-transformers/all-MiniLM-L6-v2",
                                              engine="encoder", policy="arlo_mlq",
                                              scaler=ScalerPolicy(min_replicas=1, max_replicas=1)))
        async with plane(with_worker=False) as p:
            if not worker:
                yield p
                return
            pytest.importorskip("torch")
            from polyserve.worker.config import WorkerSettings
            from polyserve.worker.engines.encoder import EncoderConfig, EncoderEngine
            from polyserve.worker.service import WorkerService

            settings = make_settings(WorkerSettings, "worker", worker_id="enc-64", deployment="enc", engine="sim",
                                     model="sentence-transformers/all-MiniLM-L6-v2", heartbeat_interval_s=0.2,
                                     heartbeat_ttl_s=1.0)
            engine = EncoderEngine(EncoderConfig(model="sentence-transformers/all-MiniLM-L6-v2", max_length=64,
                                                 batch_size=1, backend="jit", slo_ms=1000.0))
            async with running(WorkerService(settings, engine=engine, span_exporter=span_exporter), timeout=60):
                yield p

    return start


@pytest.mark.parametrize("worker", [False, True], ids=["refused", "honoured-and-ignored"])
async def test_embedding_fields_walk_the_matrix(encoder_plane, worker):
    """Refusals need no worker (the gateway answers); the rest run on an encoder worker."""
    async with encoder_plane(worker) as p:
        cases = [c for c in rows("embeddings", "encoder") if (c[2] == REFUSED) != worker]
        failures = []
        for name, value, status in cases:
            try:
                kw = {name: value} if name in ("dimensions", "encoding_format", "user") else {"extra_body": {name: value}}
                out = await p.client.embeddings.create(model="enc", input=["hello world"], **kw)
                assert out.data, name
                if status == REFUSED:
                    failures.append(f"{name}={value!r}: accepted, but the table says refused")
            except openai.BadRequestError as err:
                if status != REFUSED or err.body.get("param") != name:
                    failures.append(f"{name}={value!r}: {err.message} (param {err.body.get('param')})")
        assert not failures, "\n".join(failures)
        if worker:  # vLLM's truncate_prompt_tokens k cuts each input to k tokens, [SEP] kept
            out = await p.client.embeddings.create(model="enc", input=["word " * 40],
                                                   extra_body={"truncate_prompt_tokens": 8})
            assert out.usage.prompt_tokens == 8


def _hf_dep() -> Deployment:
    from polyserve.core.encoder_text import resolve_model_dir

    return Deployment(id="hf-minilm", model=str(resolve_model_dir()), engine="hf",
                      scaler=ScalerPolicy(min_replicas=1, max_replicas=1))


async def test_tokenize_and_detokenize(encoder_plane, state):
    """vLLM's shapes, the deployment's tokenizer: encoder ([CLS] x [SEP]), hf with a checkpoint
    directory (as the hf engine encodes: [CLS] as BOS, no [SEP]); sim and unknown ones: 501."""
    from polyserve.core.encoder_text import load_text_tokenizer, resolve_model_dir

    tok = load_text_tokenizer(str(resolve_model_dir()))
    plain = tok.tokenizer.encode("hello world", add_special_tokens=False).ids
    await state.put_deployment(_hf_dep())
    await state.put_deployment(Deployment(id="hf-random", model="tiny-llama-random", engine="hf"))
    async with encoder_plane(False) as p:
        with pytest.raises(openai.BadRequestError, match="embedding model") as err:  # and no completions there
            await p.client.completions.create(model="enc", prompt="x", max_tokens=2)
        assert err.value.body["param"] == "model"
        async with httpx.AsyncClient(base_url=p.url) as h:
            r = (await h.post("/tokenize", json={"model": "enc", "prompt": "hello world"})).json()
            assert r == {"count": len(plain) + 2, "max_model_len": 512, "tokens": [tok.cls_id, *plain, tok.sep_id]}
            r = (await h.post("/tokenize", json={"model": "hf-minilm", "prompt": "hello world",
                                                 "return_token_strs": True})).json()
            assert r["tokens"] == [tok.cls_id, *plain] and r["token_strs"] == ["[CLS]", "hello", "world"]
            r = (await h.post("/tokenize", json={"model": "hf-minilm", "prompt": "hello world",
                                                 "add_special_tokens": False})).json()
            assert r["tokens"] == plain
            chat = [{"role": "user", "content": "hello world"}]
            with_prompt = (await h.post("/tokenize", json={"model": "enc", "messages": chat})).json()
            without = (await h.post("/tokenize", json={"model": "enc", "messages": chat,
                                                       "add_generation_prompt": False})).json()
            assert with_prompt["count"] > without["count"] > len(plain)
            r = await h.post("/detokenize", json={"model": "enc", "tokens": plain})
            assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
            r = await h.post("/detokenize", json={"model": "enc", "tokens": [10 ** 7]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
            for model, why in ((MODEL, "sim engine has no tokenizer"), ("hf-random", "not a local checkpoint")):
                r = await h.post("/tokenize", json={"model": model, "prompt": "x"})
                assert r.status_code == 501 and why in r.json()["error"]["message"], r.text
            r = await h.post("/tokenize", json={"model": "nope", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await h.post("/tokenize", json={"prompt": "x"})  # several deployments: name one
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            failures = []
            for name, value, status in rows("tokenize", "encoder"):
                body = {"model": "enc", "prompt": "hello world", name: value}
                if name == "messages" or (status != REFUSED and name in ("add_generation_prompt",)):
                    body = {"model": "enc", "messages": chat, name: value}
                    body.pop("prompt", None)
                r = await h.post("/tokenize", json=body)
                ok = r.status_code == 200 if status != REFUSED else (
                    r.status_code == 400 and r.json()["error"]["param"] == name)
                if not ok:
                    failures.append(f"{name}={value!r}: {r.status_code} {r.text[:200]}")
            assert not failures, "\n".join(failures)


def test_is_noop_does_not_mix_bools_and_numbers():
    rule = Rule(REFUSED, "x", noop=(None, 1))
    assert compat.is_noop(1, rule.noop) and not compat.is_noop(True, rule.noop)
    assert compat.is_noop(False, (None, False)) and not compat.is_noop(0, (None, False))
