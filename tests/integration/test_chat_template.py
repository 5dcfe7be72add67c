"""Chat completions through the gateway, with the official `openai` client, on an hf worker whose
checkpoint has a chat template of its own: the worker formats the messages with it (not the
gateway's role-prefixed transcript), with one BOS where the template writes one too; a template
that refuses the messages is the client's 400; a chat with tools keeps the transcript."""
from __future__ import annotations

import copy
import json

import openai
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.gateway.policy import render_chat  # noqa: E402
from polyserve.gateway.schemas import ChatMessage  # noqa: E402
from tests.integration.conftest import MODEL  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]
# Llama-3 style: the template writes the BOS token's text itself; roles must alternate
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
            "{{ raise_exception('conversation roles must alternate') }}{% endif %}"
            "<{{ m['role'] }}> {{ m['content'] }} </{{ m['role'] }}> {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "name a colour"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    from polyserve.worker.engines.hf_model import save_random_checkpoint
    out = save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "templated", seed=0)
    tok = copy.deepcopy(AutoTokenizer.from_pretrained(str(out)))
    tok.bos_token = tok.cls_token  # the WordPiece tokenizer's [CLS] plays BOS (the engine prepends it)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


def hf(checkpoint) -> dict:
    return {"engine": "hf", "model": MODEL, "model_path": str(checkpoint), "deployment": MODEL}


async def test_chat_runs_the_models_own_template_with_one_bos(plane, checkpoint):
    async with plane(worker_kw=hf(checkpoint)) as p:
        engine = p.worker.engine
        templated = engine._bundle.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert templated.startswith("[CLS]<system>")
        prompt = engine.chat_prompt(MESSAGES)
        assert prompt == templated.removeprefix("[CLS]")
        ids = engine._bundle.encode(prompt)
        assert ids.count(engine._bundle.bos_id) == 1 and ids[0] == engine._bundle.bos_id
        chat = await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
        same = await p.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == same.choices[0].text
        assert chat.usage.prompt_tokens == same.usage.prompt_tokens == len(ids)
        transcript = render_chat([ChatMessage(**m) for m in MESSAGES])
        assert len(engine._bundle.encode(transcript)) != len(ids)  # so the count above is the template's
        streamed = await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                          temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
        assert text == chat.choices[0].message.content


async def test_a_chat_can_end_closed_or_continue_the_assistants_message(plane, checkpoint):
    """vLLM's add_generation_prompt / continue_final_message: the chat runs what the completion of the
    template's prompt, ended that way, runs; the combinations vLLM refuses are 400s naming the field."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "the colour is"}]
    async with plane(worker_kw=hf(checkpoint)) as p:
        engine = p.worker.engine
        cases = ((MESSAGES, {"add_generation_prompt": False}, "closed", "</user> "),
                 (prefill, {"add_generation_prompt": False, "continue_final_message": True}, "continue",
                  "<assistant> the colour is"))
        for messages, extra, end, tail in cases:
            prompt = engine.chat_prompt(messages, end)
            assert prompt.endswith(tail) and prompt != engine.chat_prompt(messages)
            chat = await p.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                          temperature=0, extra_body=extra)
            same = await p.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            assert chat.choices[0].message.content == same.choices[0].text
            assert chat.usage.prompt_tokens == same.usage.prompt_tokens
        for messages, extra, words in ((prefill, {"continue_final_message": True}, "cannot both be true"),
                                       (MESSAGES, {"continue_final_message": True, "add_generation_prompt": False},
                                        "must be the assistant's")):
            with pytest.raises(openai.BadRequestError) as err:
                await p.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
            assert err.value.body["param"] == "continue_final_message" and words in err.value.message


async def test_tokenize_counts_a_chat_as_the_worker_runs_it(plane, state, checkpoint):
    import httpx

    from polyserve.proto import Deployment
    # a deployment whose model is the checkpoint directory, so the gateway can load its tokenizer
    await state.put_deployment(Deployment(id="templated", model=str(checkpoint), engine="hf"))
    worker = {"engine": "hf", "model": "templated", "model_path": str(checkpoint), "deployment": "templated"}
    async with plane(worker_kw=worker) as p:
        chat = await p.client.chat.completions.create(model="templated", messages=MESSAGES, max_tokens=2,
                                                      temperature=0)
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as http:
            got = await http.post("/tokenize", json={"model": "templated", "messages": MESSAGES})
            refused = await http.post("/tokenize", json={"model": "templated", "messages": [
                {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert got.status_code == 200, got.text
        assert got.json()["count"] == chat.usage.prompt_tokens
        assert got.json()["tokens"] == p.worker.engine._bundle.encode(p.worker.engine.chat_prompt(MESSAGES))
        assert refused.status_code == 400 and "conversation roles must alternate" in refused.text


async def test_a_template_that_refuses_the_messages_is_a_400_and_tools_keep_the_transcript(plane, checkpoint):
    async with plane(worker_kw=hf(checkpoint)) as p:
        with pytest.raises(openai.BadRequestError) as err:
            await p.client.chat.completions.create(
                model=MODEL, max_tokens=4,
                messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        assert "conversation roles must alternate" in str(err.value)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
        out = await p.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, max_tokens=4,
                                                     temperature=0)
        assert out.usage.prompt_tokens > 0
        # still served, from the transcript with the tool definitions: not the template's count
        assert out.usage.prompt_tokens != len(p.worker.engine._bundle.encode(p.worker.engine.chat_prompt(MESSAGES)))


async def test_a_long_chat_travels_once_and_the_worker_rebuilds_its_transcript(plane, monkeypatch):
    """Past INLINE_TRANSCRIPT_CHARS the gateway sends the messages without their transcript (a long
    chat would be on the wire twice); a sim worker (no template) runs the transcript it rebuilds."""
    from polyserve.proto import INLINE_TRANSCRIPT_CHARS
    long = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "word " * 16_000}]
    transcript = render_chat([ChatMessage(**m) for m in long])
    assert len(transcript) > INLINE_TRANSCRIPT_CHARS
    from polyserve.worker.handlers import WorkerHandlers
    seen, prompt_of = [], WorkerHandlers._prompt

    def spy(self, req):
        seen.append((len(req.prompt), req.chat is not None))
        return prompt_of(self, req)
    monkeypatch.setattr(WorkerHandlers, "_prompt", spy)
    async with plane(worker_kw={"max_input_len": 60_000}) as p:
        chat = await p.client.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
        assert seen == [(0, True)]  # the messages alone
        same = await p.client.completions.create(model=MODEL, prompt=transcript, max_tokens=4)
        assert chat.usage.prompt_tokens == same.usage.prompt_tokens > 16_000


# A template that lists tools and renders earlier calls and results itself (as Qwen's, Llama 3.1's, ...)
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools> {% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }} {% endfor %}</tools> {% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<assistant> {% for c in m.tool_calls %}"
    "<call> {{ c.function.name }} {{ c.function.arguments | tojson }} </call> {% endfor %}</assistant> "
    "{% elif m.role == 'tool' %}{% if m.name is not defined %}{{ raise_exception('a tool result needs its "
    "function name') }}{% endif %}<tool {{ m.name }}> {{ m.content }} </tool> "
    "{% else %}<{{ m.role }}> {{ m.content }} </{{ m.role }}> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                                                           "required": ["city"], "additionalProperties": False}}}


# a chat with an earlier call (its arguments a JSON string, as OpenAI clients send them) and its result
TOOL_HISTORY = [{"role": "user", "content": "weather in oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12C and rain"},
                {"role": "user", "content": "and tomorrow?"}]


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    from polyserve.worker.engines.hf_model import save_random_checkpoint
    out = save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tool-templated", seed=0)
    tok = copy.deepcopy(AutoTokenizer.from_pretrained(str(out)))
    tok.bos_token = tok.cls_token
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(str(out))
    return out


async def test_a_template_that_takes_tools_formats_the_tools_calls_and_results_itself(plane, tool_checkpoint):
    """tools, an earlier call (its arguments sent as a JSON string, as OpenAI clients do) and its
    result (named after its call: OpenAI's tool messages carry no name, Hermes-style templates
    require one) reach the template as templates read them; `auto` answers as the completion of that prompt,
    `required` is still a call that parses."""
    messages = TOOL_HISTORY
    as_template_reads = [messages[0], {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12C and rain", "tool_call_id": "call_1", "name": "get_weather"}, messages[3]]
    async with plane(worker_kw=hf(tool_checkpoint)) as p:
        engine = p.worker.engine
        prompt = engine.chat_prompt(as_template_reads, "open", [WEATHER])
        assert '<tools> get_weather: {"type": "object", "properties": {"city"' in prompt
        assert '<call> get_weather {"city": "Oslo"} </call>' in prompt and "<tool get_weather> 12C and rain </tool>" in prompt
        auto = await p.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                      max_tokens=6, temperature=0)
        same = await p.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert auto.choices[0].message.content == same.choices[0].text  # random weights: text, not a call
        assert auto.usage.prompt_tokens == same.usage.prompt_tokens == len(engine._bundle.encode(prompt))
        forced = await p.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                        tool_choice="required", max_tokens=40, temperature=0)
        assert forced.usage.prompt_tokens == auto.usage.prompt_tokens  # the same templated prompt
        assert forced.choices[0].finish_reason == "tool_calls"  # (a bounded string: the call ends)
        (call,) = forced.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


async def test_tokenize_counts_a_tool_chat_as_the_worker_runs_it(plane, state, tool_checkpoint, checkpoint):
    import httpx

    from polyserve.proto import Deployment
    messages = [{"role": "user", "content": "weather in oslo?"}]
    for dep, ckpt in (("tool-templated", tool_checkpoint), ("plain-templated", checkpoint)):  # reads tools / not
        await state.put_deployment(Deployment(id=dep, model=str(ckpt), engine="hf"))
        async with plane(worker_kw={"engine": "hf", "model": dep, "model_path": str(ckpt), "deployment": dep}) as p:
            chat = await p.client.chat.completions.create(model=dep, messages=messages, tools=[WEATHER],
                                                          max_tokens=2, temperature=0)
            async with httpx.AsyncClient(base_url=p.url, timeout=20) as http:
                got = await http.post("/tokenize", json={"model": dep, "messages": messages, "tools": [WEATHER]})
                plain = await http.post("/tokenize", json={"model": dep, "messages": messages})
            assert got.status_code == 200, got.text
            assert got.json()["count"] == chat.usage.prompt_tokens > plain.json()["count"]


async def test_a_responses_tool_turn_runs_the_same_template_prompt_as_its_chat(plane, tool_checkpoint):
    """/v1/responses with function tools and the same history as input items (function_call,
    function_call_output) reaches the template as the chat completion does: the same prompt tokens
    and, greedy, the same text."""
    messages = TOOL_HISTORY
    items = [messages[0], {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": "{\"city\": \"Oslo\"}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "12C and rain"}, messages[3]]
    flat = {"type": "function", **WEATHER["function"]}
    async with plane(worker_kw=hf(tool_checkpoint)) as p:
        chat = await p.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                      max_tokens=6, temperature=0)
        resp = await p.client.responses.create(model=MODEL, input=items, tools=[flat], max_output_tokens=6,
                                               temperature=0, store=False)
        assert resp.output_text == chat.choices[0].message.content
        assert resp.usage.input_tokens == chat.usage.prompt_tokens
