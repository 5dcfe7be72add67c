"""Chats of the `openai-http` engine sent to the upstream's `/v1/chat/completions` (no chat
template in the worker's own checkpoint directory), against a loopback stand-in that speaks
vLLM 0.33's chat wire (vllm/entrypoints/openai/chat_completion/protocol.py: a first chunk with
the role, `delta.content` chunks with `logprobs.content` [{token, logprob, top_logprobs}], a
whole answer's `message`, `reasoning` split off by a reasoning parser), and the ways real servers
refuse chats: vLLM's 400 for a tokenizer without a chat template (its message, from
vllm/renderers/hf.py), a server without the endpoint (404), and `transformers serve` 5.x on a
checkpoint without a template (a bare "Internal Server Error" 500, observed here). The real
`transformers serve` path is in test_openai_http_engine.py. Tool chats: an `auto` one goes to the
chat endpoint with its tools and the upstream's `tool_calls` (vLLM's tool parsers' wire) come back as
calls; vLLM's 400 without a tool parser sends tool chats to the transcript; a forced call is a
completion under its schema. Runs no model."""
from __future__ import annotations

import json
import types

import pytest

from polyserve.proto import SamplingParams, StructuredOutput
from polyserve.shared.settings import SettingsError
from polyserve.worker.config import WorkerSettings
from polyserve.worker.engine import Delta, EngineError, EngineRequest, Finished
from polyserve.worker.engines.openai_http import OpenAIHttpEngine
from tests.helpers import LoopbackHTTP

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TRANSCRIPT = "system: be brief\nuser: hi\nassistant:"
CHAT_OUT = ["Hel", "lo", "!"]
COMPLETION_OUT = [" plain", " text"]
JSON = "application/json"
VLLM_NO_TOOLS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
VLLM_NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide "
                    "a chat template if the tokenizer does not define one.")


class StandIn(LoopbackHTTP):
    """refuse: None (answers chats), "vllm-400", "404", "500" (every chat), "500-later" (the
    second and later chats), "no-tools" (a chat with tools: vLLM's 400 without a tool parser).
    reasoning: the first chunk's text comes as `reasoning`. A chat with tools is answered with a
    call as vLLM's tool parsers send it (`tool_calls`; streamed: id and name, then the arguments
    in fragments; finish_reason "tool_calls"), after `said` as its content when given (the model's
    words before the call, which vLLM's parsers return beside the calls). cached: the usage's
    `prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details; None: left out)."""

    def __init__(self, refuse: str | None = None, reasoning: bool = False, completion_out: list[str] | None = None,
                 finish: str = "length", said: str | None = None, cached: int | None = None):
        super().__init__()
        self.refuse, self.reasoning, self.said = refuse, reasoning, said
        self.completion_out, self.finish, self.cached = completion_out or COMPLETION_OUT, finish, cached

    def _usage(self, prompt: int, completion: int) -> dict:
        usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    def answer(self, method: str, path: str, body: dict) -> tuple[int, bytes, str]:
        if method == "GET":
            return 200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode(), JSON
        if path != "/v1/chat/completions":
            return (200, *self.completion(body))
        chats, refuse = self.paths().count("/v1/chat/completions"), self.refuse
        if refuse == "vllm-400":
            err = {"error": {"message": VLLM_NO_TEMPLATE, "type": "BadRequestError", "code": 400}}
            return 400, json.dumps(err).encode(), JSON
        if refuse == "404":
            return 404, b'{"detail": "Not Found"}', JSON
        if refuse == "500" or (refuse == "500-later" and chats > 1):
            return 500, b"Internal Server Error", "text/plain"
        if body.get("tools") and refuse == "no-tools":
            return 400, json.dumps({"error": {"message": VLLM_NO_TOOLS, "type": "BadRequestError"}}).encode(), JSON
        if body.get("tools"):
            return (200, *self.call(body, self.said))
        return (200, *self.chat(body, self.reasoning))

    @staticmethod
    def call(body: dict, said: str | None = None) -> tuple[bytes, str]:
        base = {"id": "chatcmpl-2", "created": 0, "model": "m"}
        name, args = body["tools"][0]["function"]["name"], '{"city": "Oslo"}'
        if not body.get("stream"):
            msg = {"role": "assistant", "content": said, "tool_calls": [
                {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": name, "arguments": args}}]}
            choice = {"index": 0, "message": msg, "finish_reason": "tool_calls"}
            return json.dumps({**base, "object": "chat.completion", "choices": [choice]}).encode(), JSON
        words = [{"content": w} for w in (said.split(" ") if said else [])]
        words = [{"content": w["content"] + " "} for w in words[:-1]] + words[-1:]
        deltas = [{"role": "assistant", "content": ""}, *words,
                  {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                                   "function": {"name": name, "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": args[:9]}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": args[9:]}}]}, {}]
        events = [{**base, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": d, "finish_reason": "tool_calls" if j == len(deltas) - 1 else None}]}
            for j, d in enumerate(deltas)]
        return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode(), \
            "text/event-stream"

    @staticmethod
    def _lp(tok: str, k: int) -> dict:
        return {"content": [{"token": tok, "logprob": -0.25, "bytes": list(tok.encode()),
                             "top_logprobs": [{"token": f"alt{r}", "logprob": -5.0 - r} for r in range(k)]
                             + [{"token": tok, "logprob": -0.25}]}]}

    def chat(self, body: dict, reasoning: bool) -> tuple[bytes, str]:
        k = body.get("top_logprobs", 0) if body.get("logprobs") else None
        usage = self._usage(11, len(CHAT_OUT))
        base = {"id": "chatcmpl-1", "created": 0, "model": "m"}
        if not body.get("stream"):
            lp = {"content": [c for t in CHAT_OUT for c in self._lp(t, k)["content"]]} if k is not None else None
            msg = {"role": "assistant", "content": "".join(CHAT_OUT[1:] if reasoning else CHAT_OUT)}
            if reasoning:
                msg["reasoning"] = CHAT_OUT[0]
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": "length"}
            return json.dumps({**base, "object": "chat.completion", "choices": [choice], "usage": usage}).encode(), \
                "application/json"
        events = [{**base, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
        for j, tok in enumerate(CHAT_OUT):
            delta = {"reasoning": tok} if reasoning and j == 0 else {"content": tok}
            events.append({**base, "object": "chat.completion.chunk", "choices": [{
                "index": 0, "delta": delta, "logprobs": self._lp(tok, k) if k is not None else None,
                "finish_reason": "length" if j == len(CHAT_OUT) - 1 else None}]})
        events.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode(), \
            "text/event-stream"

    def completion(self, body: dict) -> tuple[bytes, str]:
        out, last = self.completion_out, len(self.completion_out) - 1
        usage = self._usage(9, len(out))
        base = {"id": "cmpl-1", "created": 0, "model": "m", "object": "text_completion"}
        ids = body.get("return_token_ids")  # vLLM's: one id per piece here (100, 101, ...), the prompt's 1..9
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(out), "finish_reason": self.finish}
            if ids:
                choice.update(token_ids=list(range(100, 100 + len(out))), prompt_token_ids=list(range(1, 10)))
            return json.dumps({**base, "choices": [choice], "usage": usage}).encode(), "application/json"
        events = [{**base, "choices": [{"index": 0, "text": t, "finish_reason": self.finish if j == last else None,
                                        **({"token_ids": [100 + j]} if ids else {}),
                                        **({"prompt_token_ids": list(range(1, 10))} if ids and j == 0 else {})}]}
                  for j, t in enumerate(out)] + [{**base, "choices": [], "usage": usage}]
        return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode(), \
            "text/event-stream"


def _engine(up: StandIn, **kw) -> OpenAIHttpEngine:
    return OpenAIHttpEngine(types.SimpleNamespace(upstream_url=up.url, upstream_model="m", upstream_metrics_url="off",
                                                  upstream_start_timeout_s=5.0, **kw))


def _chat(rid: str = "c1", continuation: str = "", **params) -> EngineRequest:
    return EngineRequest(rid, TRANSCRIPT + continuation, SamplingParams(max_tokens=3, **params),
                         messages=MESSAGES, continuation=continuation)


async def _run(eng: OpenAIHttpEngine, req: EngineRequest) -> tuple[list[Delta], Finished]:
    deltas, fin = [], None
    async for ev in eng.generate(req):
        if isinstance(ev, Delta):
            deltas.append(ev)
        else:
            fin = ev
    assert isinstance(fin, Finished)
    return deltas, fin


@pytest.mark.parametrize("stream", [True, False])
async def test_a_chat_goes_to_the_chat_endpoint_as_messages(stream):
    with StandIn() as up:
        eng = _engine(up, upstream_stream=stream)
        await eng.start()
        try:
            assert eng.model_card()["chat"] == "/v1/chat/completions"
            req = _chat(logprobs=2)
            req.template_kwargs = {"enable_thinking": False}  # chat_template_kwargs: the upstream's template gets them
            deltas, fin = await _run(eng, req)
            plain, _ = await _run(eng, EngineRequest("p1", "a completion", SamplingParams(max_tokens=2)))
        finally:
            await eng.stop()
    (path, body), (path2, body2) = up.posts
    assert path == "/v1/chat/completions" and body["messages"] == MESSAGES and "prompt" not in body
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and "chat_template_kwargs" not in body2
    assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["max_tokens"] == 3
    assert path2 == "/v1/completions" and body2["prompt"] == "a completion"  # no messages: a completion
    assert "".join(d.text for d in deltas) == "".join(CHAT_OUT) and deltas[-1].finish_reason == "length"
    assert fin.stats.output_tokens == 3 and fin.stats.input_tokens == 11  # the upstream's usage
    entries = [e for d in deltas for e in d.logprobs or []]
    assert [e.token for e in entries] == CHAT_OUT and all(e.logprob == -0.25 for e in entries)
    assert all(len(e.top) == 2 and e.top[0].token == e.token for e in entries)  # the k best, most likely first
    assert "".join(d.text for d in plain) == "".join(COMPLETION_OUT)


async def test_reasoning_comes_back_in_think_tags_and_structured_outputs_go_under_vllms_field():
    with StandIn(reasoning=True) as up:
        for stream in (True, False):
            eng = _engine(up, upstream_stream=stream)
            await eng.start()
            try:
                deltas, _ = await _run(eng, _chat(structured=StructuredOutput(json='{"type": "object"}')))
                assert "".join(d.text for d in deltas) == f"<think>{CHAT_OUT[0]}</think>" + "".join(CHAT_OUT[1:])
                await _run(eng, _chat("c2", structured=StructuredOutput(json_object=True)))
                await _run(eng, _chat("c3", structured=StructuredOutput(regex="[a-z]+")))
            finally:
                await eng.stop()
    bodies = [b for p, b in up.posts if p == "/v1/chat/completions"]
    assert [b["structured_outputs"] for b in bodies[:3]] == [{"json": {"type": "object"}}, {"json_object": True},
                                                             {"regex": "[a-z]+"}]
    # A chat's response_format is ignored (a logged warning) by transformers serve: never sent.
    assert not any("response_format" in b for b in bodies)


async def test_a_migrated_chat_continues_the_assistants_message():
    with StandIn() as up:
        eng = _engine(up)
        await eng.start()
        try:
            await _run(eng, _chat(continuation=" Hi the"))
        finally:
            await eng.stop()
    body = up.posts[0][1]
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": " Hi the"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False


async def test_a_chats_end_goes_as_vllms_fields():
    prefill = [*MESSAGES, {"role": "assistant", "content": "Hi"}]
    with StandIn() as up:
        eng = _engine(up)
        await eng.start()
        try:
            await _run(eng, EngineRequest("a", TRANSCRIPT, SamplingParams(max_tokens=3), messages=MESSAGES,
                                          chat_end="closed"))
            await _run(eng, EngineRequest("b", TRANSCRIPT, SamplingParams(max_tokens=3), messages=prefill,
                                          chat_end="continue"))
            await _run(eng, EngineRequest("c", TRANSCRIPT, SamplingParams(max_tokens=3), messages=prefill,
                                          chat_end="continue", continuation=" the"))  # migrated
        finally:
            await eng.stop()
    (_, closed), (_, cont), (_, moved) = up.posts
    assert closed["add_generation_prompt"] is False and "continue_final_message" not in closed
    assert closed["messages"] == MESSAGES
    assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
    assert cont["messages"] == prefill
    assert moved["messages"] == [*MESSAGES, {"role": "assistant", "content": "Hi the"}]  # the same message, longer


@pytest.mark.parametrize("refuse", ["vllm-400", "404", "500"])
async def test_an_upstream_that_cannot_take_chats_gets_the_transcript_from_then_on(refuse):
    with StandIn(refuse=refuse) as up:
        eng = _engine(up)
        await eng.start()
        try:
            deltas, fin = await _run(eng, _chat())
            card = eng.model_card()["chat"]
            deltas2, _ = await _run(eng, _chat("c2"))
        finally:
            await eng.stop()
    # The refused chat is answered all the same, as the transcript; the next goes there directly.
    assert up.paths() == ["/v1/chat/completions", "/v1/completions", "/v1/completions"]
    assert up.posts[1][1]["prompt"] == TRANSCRIPT and up.posts[2][1]["prompt"] == TRANSCRIPT
    assert "".join(d.text for d in deltas) == "".join(COMPLETION_OUT) == "".join(d.text for d in deltas2)
    assert fin.stats.output_tokens == 2
    assert card.startswith("the gateway's transcript") and f"answered {refuse[-3:]}" in card


async def test_after_a_chat_was_answered_a_server_error_is_the_requests_own():
    with StandIn(refuse="500-later") as up:
        eng = _engine(up)
        await eng.start()
        try:
            await _run(eng, _chat())
            with pytest.raises(EngineError) as err:
                await _run(eng, _chat("c2"))
            assert eng.model_card()["chat"] == "/v1/chat/completions"  # not switched to transcripts
        finally:
            await eng.stop()
    assert err.value.status == 500 and "answered 500" in str(err.value)
    assert up.paths() == ["/v1/chat/completions", "/v1/chat/completions"]


async def test_upstream_chat_setting_forces_either_route():
    with StandIn(refuse="vllm-400") as up:
        eng = _engine(up, upstream_chat="chat")
        await eng.start()
        try:
            with pytest.raises(EngineError) as err:
                await _run(eng, _chat())
        finally:
            await eng.stop()
        assert err.value.status == 400 and "chat template" in str(err.value)
        eng = _engine(up, upstream_chat="completions")
        await eng.start()
        try:
            await _run(eng, _chat("c2"))
            assert eng.model_card()["chat"] == "the gateway's transcript to /v1/completions"
        finally:
            await eng.stop()
    assert up.paths() == ["/v1/chat/completions", "/v1/completions"]
    with pytest.raises(SettingsError, match="upstream_chat"):
        WorkerSettings(engine="openai-http", upstream_url="http://127.0.0.1:1", upstream_chat="both").validate()
    with pytest.raises(EngineError, match="upstream_chat"):
        _engine(up, upstream_chat="both")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


HERMES = ["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "\n</tool_call>"]


async def _ask_weather(p, choice: str) -> None:
    """A tool chat, whole and streamed: each answer is one call, get_weather(city=Oslo)."""
    messages = [{"role": "user", "content": "weather in oslo?"}]
    out = await p.client.chat.completions.create(model="up", messages=messages, tools=[WEATHER],
                                                 tool_choice=choice, max_tokens=30)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    stream = await p.client.chat.completions.create(model="up", messages=messages, tools=[WEATHER],
                                                    tool_choice=choice, max_tokens=30, stream=True)
    names, args, finish = [], "", None
    async for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names += [tc.function.name] if tc.function and tc.function.name else []
                args += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and json.loads(args) == {"city": "Oslo"} and finish == "tool_calls"


def _worker(up: StandIn) -> dict:
    return {"engine": "openai-http", "deployment": "up", "model": "up", "upstream_url": up.url,
            "upstream_model": "m", "upstream_metrics_url": "off", "upstream_start_timeout_s": 5.0}


async def test_a_forced_call_is_a_completion_under_its_schema(plane, state):
    """openai client -> gateway -> openai-http worker -> an upstream speaking vLLM's wire: `required`
    is a completion of the gateway's transcript (it lists the tools: this worker has no checkpoint)
    under the call's JSON schema, which the upstream enforces."""
    import openai

    from polyserve.proto import Deployment
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(completion_out=['{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}'], finish="stop") as up:
        async with plane(worker_kw=_worker(up)) as p:
            await _ask_weather(p, "required")
            with pytest.raises(openai.BadRequestError):  # tools still need a chat the gateway can check
                await p.client.chat.completions.create(model="up", messages=[{"role": "user", "content": "x"}],
                                                       tools=[{"type": "x"}])
    assert up.paths() == ["/v1/completions"] * 2
    body = up.posts[0][1]
    assert "get_weather" in body["prompt"] and body["prompt"].endswith("user: weather in oslo?\nassistant:")
    schema = body["response_format"]["json_schema"]["schema"]  # JSON on /v1/completions (openai_http_wire)
    assert schema["properties"]["name"] == {"const": "get_weather"} and body["max_tokens"] == 30


async def test_an_auto_tool_chat_goes_to_the_upstreams_tool_parser(plane, state):
    """`auto`: the messages and tools go to the upstream's chat endpoint (its template, its tool
    parser); its `tool_calls`, whole or streamed in fragments, come back as the client's tool calls.
    An earlier call travels with its arguments as the JSON string the chat wire carries."""
    from polyserve.proto import Deployment
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn() as up:
        async with plane(worker_kw=_worker(up)) as p:
            await _ask_weather(p, "auto")
            history = [{"role": "user", "content": "weather in oslo?"},
                       {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                              "function": {"name": "get_weather",
                                                                                           "arguments": '{"city": "Oslo"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
            out = await p.client.chat.completions.create(model="up", messages=history, max_tokens=3)
            assert out.choices[0].message.content == "".join(CHAT_OUT)  # no tools listed: text
    assert up.paths() == ["/v1/chat/completions"] * 3
    body = up.posts[0][1]
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "auto" and "prompt" not in body
    assert body["messages"] == [{"role": "user", "content": "weather in oslo?"}]
    sent = up.posts[2][1]["messages"]
    assert sent[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert "tools" not in up.posts[2][1]


async def test_text_before_an_upstream_call_reaches_the_client_as_content_beside_the_call(plane, state):
    """An upstream answer with both `content` (the model's words before its call) and `tool_calls`:
    the client gets both, on chat (whole and streamed: the text as content deltas, then the call
    chunks) and on the Responses API (a message item, then the function_call item)."""
    from polyserve.proto import Deployment
    said = "Let me check the weather in Oslo."
    await state.put_deployment(Deployment(id="up", model="up", engine="openai-http"))
    with StandIn(said=said) as up:
        async with plane(worker_kw=_worker(up)) as p:
            messages = [{"role": "user", "content": "weather in oslo?"}]
            out = await p.client.chat.completions.create(model="up", messages=messages, tools=[WEATHER], max_tokens=30)
            msg = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls" and msg.content == said
            assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
                [("get_weather", {"city": "Oslo"})]
            stream = await p.client.chat.completions.create(model="up", messages=messages, tools=[WEATHER],
                                                            max_tokens=30, stream=True)
            text, args, finish = "", "", None
            async for chunk in stream:
                for c in chunk.choices:
                    assert not (text and args and c.delta.content)  # the text comes before the call
                    text += c.delta.content or ""
                    args += "".join(tc.function.arguments or "" for tc in c.delta.tool_calls or [])
                    finish = c.finish_reason or finish
            assert text == said and json.loads(args) == {"city": "Oslo"} and finish == "tool_calls"
            rtool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
            r = await p.client.responses.create(model="up", input="weather in oslo?", tools=[rtool])
            assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == said
            assert json.loads(r.output[1].arguments) == {"city": "Oslo"}
            async with p.client.responses.stream(model="up", input="weather in oslo?", tools=[rtool]) as rs:
                deltas = [e.delta async for e in rs if e.type == "response.output_text.delta"]
                final = await rs.get_final_response()
            assert "".join(deltas) == said and [o.type for o in final.output] == ["message", "function_call"]
            assert final.output[1].name == "get_weather" and final.output_text == said


async def test_an_upstream_without_a_tool_parser_gets_the_transcript():
    """vLLM started without --enable-auto-tool-choice answers a tool chat 400: that chat and every
    later tool chat go as the gateway's transcript to /v1/completions (the answer, a call in the
    model's own format, still reaches the gateway as a call); plain chats stay chats."""
    tools = [WEATHER]
    with StandIn(refuse="no-tools", completion_out=HERMES, finish="stop") as up:
        eng = _engine(up)
        await eng.start()
        try:
            msgs = [{"role": "user", "content": "weather in oslo?"}]
            req = EngineRequest("t1", "system: tools...\nuser: weather in oslo?\nassistant:",
                                SamplingParams(max_tokens=30), messages=msgs, tools=tools)
            deltas, _ = await _run(eng, req)
            assert "".join(d.text for d in deltas) == "".join(HERMES)
            assert "--enable-auto-tool-choice" in eng.model_card()["tools"]
            await _run(eng, EngineRequest("t2", req.prompt, req.params, messages=msgs, tools=tools))
            await _run(eng, _chat("c1"))
            assert eng.model_card()["chat"] == "/v1/chat/completions"
        finally:
            await eng.stop()
    assert up.paths() == ["/v1/chat/completions", "/v1/completions", "/v1/completions", "/v1/chat/completions"]
    assert up.posts[1][1]["prompt"].startswith("system: tools")
