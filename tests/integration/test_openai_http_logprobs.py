"""The `openai-http` engine's logprobs, echo and structured outputs against a loopback
stand-in that speaks vLLM 0.33's `/v1/completions` wire (the shapes of
vllm/entrypoints/openai/completion/serving.py: `choices[].logprobs` {tokens, token_logprobs,
top_logprobs, text_offset}; with `echo`, the prompt's text and tokens first, the first token's
logprob null), and one that ignores the fields the way `transformers serve` does (answers
without logprobs) or rejects them with a 400. Runs no model."""
from __future__ import annotations

import json
import types

import pytest

from polyserve.proto import SamplingParams, StructuredOutput
from polyserve.worker.engine import Delta, EngineError, EngineRequest, Finished
from polyserve.worker.engines.openai_http import OpenAIHttpEngine
from tests.helpers import LoopbackHTTP

pytestmark = pytest.mark.integration

PROMPT = "a b c"
PROMPT_TOKENS = ["a", " b", " c"]
OUTPUT = [" x", " y", " z"]


def _lp(tokens: list[str], k: int, first_none: bool = False, offset: int = 0) -> dict:
    values = [None if first_none and j == 0 else -0.5 * (j + 1) for j in range(len(tokens))]
    tops = [None if v is None else {t: v, **{f"alt{r}": -5.0 - r for r in range(k)}} for t, v in zip(tokens, values)]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class StandIn(LoopbackHTTP):
    """mode: "vllm" (answers with logprobs/echo), "ignore" (drops them, as transformers serve),
    "reject" (400 with vLLM's error body)."""

    def __init__(self, mode: str = "vllm"):
        super().__init__()
        self.mode = mode

    @property
    def bodies(self) -> list[dict]:
        return [b for _, b in self.posts]

    def answer(self, method: str, path: str, body: dict) -> tuple[int, bytes, str]:
        if method == "GET":
            return 200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode(), \
                "application/json"
        if self.mode == "reject" and ("logprobs" in body or "response_format" in body
                                      or "structured_outputs" in body):
            msg = {"error": {"message": "logprobs are not allowed here", "type": "BadRequestError",
                             "param": "logprobs", "code": 400}}
            return 400, json.dumps(msg).encode(), "application/json"
        return (200, *self.completion(body))

    def completion(self, body: dict) -> tuple[bytes, str]:
        k = body.get("logprobs")
        with_lp = k is not None and self.mode == "vllm"
        usage = {"prompt_tokens": len(PROMPT_TOKENS), "completion_tokens": len(OUTPUT),
                 "total_tokens": len(PROMPT_TOKENS) + len(OUTPUT)}
        base = {"id": "cmpl-1", "created": 0, "model": "m"}
        if not body.get("stream"):
            text, toks, first_none = "".join(OUTPUT), OUTPUT, False
            if body.get("echo") and self.mode == "vllm":
                text, toks, first_none = PROMPT + text, PROMPT_TOKENS + OUTPUT, True
            choice = {"index": 0, "text": text, "finish_reason": "length",
                      "logprobs": _lp(toks, k, first_none) if with_lp else None}
            return json.dumps({**base, "object": "text_completion", "choices": [choice], "usage": usage}).encode(), \
                "application/json"
        events, offset = [], 0
        for j, tok in enumerate(OUTPUT):
            lp = _lp([tok], k, offset=offset) if with_lp else None
            offset += len(tok)
            choice = {"index": 0, "text": tok, "logprobs": lp,
                      "finish_reason": "length" if j == len(OUTPUT) - 1 else None}
            events.append({**base, "object": "text_completion", "choices": [choice]})
        events.append({**base, "object": "text_completion", "choices": [], "usage": usage})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return sse.encode(), "text/event-stream"


async def run(up: StandIn, stream: bool = True, **params) -> list[Delta]:
    eng = OpenAIHttpEngine(types.SimpleNamespace(upstream_url=up.url, upstream_model="m", upstream_metrics_url="off",
                                                 upstream_stream=stream, upstream_start_timeout_s=5.0))
    await eng.start()
    try:
        deltas = []
        req = EngineRequest("r1", PROMPT, SamplingParams(max_tokens=3, **params))
        async for ev in eng.generate(req):
            if isinstance(ev, Delta):
                deltas.append(ev)
            else:
                assert isinstance(ev, Finished)
        return deltas
    finally:
        await eng.stop()


def flat(deltas: list[Delta]) -> list:
    return [e for d in deltas for e in (d.logprobs or [])]


@pytest.mark.parametrize("stream", [True, False])
async def test_logprobs_are_asked_for_and_mapped(stream):
    with StandIn() as up:
        deltas = await run(up, stream=stream, logprobs=2)
    assert up.bodies[0]["logprobs"] == 2 and "echo" not in up.bodies[0]
    assert "".join(d.text for d in deltas) == "".join(OUTPUT)
    entries = flat(deltas)
    assert [e.token for e in entries] == OUTPUT  # streamed: one token per chunk, each its chunk's first
    assert [e.logprob for e in entries] == ([-0.5, -0.5, -0.5] if stream else [-0.5, -1.0, -1.5])
    assert all(len(e.top) == 2 and e.top[0].token == e.token for e in entries)  # the k best, most likely first
    assert sum(d.tokens for d in deltas) == 3 and all(d.prompt_logprobs is None for d in deltas)


async def test_echo_gives_prompt_logprobs_unstreamed_and_strips_the_prompt():
    with StandIn() as up:
        deltas = await run(up, stream=True, prompt_logprobs=1)
    body = up.bodies[0]
    assert body["echo"] is True and body["logprobs"] == 1 and not body.get("stream")
    assert "".join(d.text for d in deltas) == "".join(OUTPUT)  # the gateway adds the prompt itself
    plps = deltas[0].prompt_logprobs
    assert [e.token for e in plps] == PROMPT_TOKENS and plps[0].logprob is None and plps[1].logprob == -1.0
    assert all(len(e.top) == 1 for e in plps[1:])
    assert flat(deltas) == [] and sum(d.tokens for d in deltas) == 3  # logprobs not asked for: none sent


async def test_echo_and_logprobs_together():
    with StandIn() as up:
        deltas = await run(up, stream=False, logprobs=0, prompt_logprobs=2)
    assert up.bodies[0]["logprobs"] == 2
    assert [e.token for e in deltas[0].prompt_logprobs] == PROMPT_TOKENS
    assert [e.token for e in flat(deltas)] == OUTPUT and all(e.top == [] for e in flat(deltas))


@pytest.mark.parametrize("spec,fields", [
    (StructuredOutput(json_object=True), {"response_format": {"type": "json_object"}}),
    (StructuredOutput(json='{"type": "object"}'), {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": {"type": "object"}, "strict": True}}}),
    (StructuredOutput(regex="[a-z]+"), {"structured_outputs": {"regex": "[a-z]+"}}),
    (StructuredOutput(choice=["a", "b"]), {"structured_outputs": {"choice": ["a", "b"]}}),
    (StructuredOutput(grammar='root ::= "a"'), {"structured_outputs": {"grammar": 'root ::= "a"'}}),
])
async def test_structured_outputs_go_upstream_in_vllms_fields(spec, fields):
    with StandIn() as up:
        await run(up, structured=spec)
    body = up.bodies[0]
    assert {k: body[k] for k in fields} == fields


@pytest.mark.parametrize("params", [dict(logprobs=1), dict(prompt_logprobs=1)])
async def test_an_upstream_that_ignores_the_fields_is_an_explicit_error(params):
    with StandIn("ignore") as up:
        with pytest.raises(EngineError) as err:
            await run(up, **params)
    assert err.value.status == 502 and "answered without" in str(err.value)


async def test_an_upstream_that_rejects_the_fields_passes_its_message_on():
    with StandIn("reject") as up:
        with pytest.raises(EngineError) as err:
            await run(up, logprobs=1)
        with pytest.raises(EngineError) as err2:
            await run(up, structured=StructuredOutput(regex="a"))
    assert err.value.status == 400 and "logprobs are not allowed here" in str(err.value)
    assert err2.value.status == 400


async def test_plain_requests_send_none_of_the_fields():
    with StandIn() as up:
        await run(up)
    assert not {"logprobs", "echo", "response_format", "structured_outputs"} & set(up.bodies[0])
