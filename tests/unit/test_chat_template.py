"""A chat's messages through the checkpoint's own chat template (`worker.engine.templated_chat`),
as the hf, vllm and openai-http engines format them: one BOS, a refusing template as a 400, and
no template (or no checkpoint) as None, which keeps the gateway's transcript."""
from __future__ import annotations

import copy
import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from polyserve.core.chat_template import load_tokenizer as load_chat_tokenizer  # noqa: E402
from polyserve.worker.engine import EngineError, templated_chat  # noqa: E402
from polyserve.worker.engines.hf_model import fallback_tokenizer  # noqa: E402

pytestmark = pytest.mark.unit
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
            "role here') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def _tokenizer(template: str | None = TEMPLATE):
    tok = copy.deepcopy(fallback_tokenizer())
    tok.bos_token = tok.cls_token
    tok.chat_template = template
    return tok


def test_a_template_that_writes_bos_loses_it_only_where_the_tokenizer_adds_one():
    tok = _tokenizer()
    assert templated_chat(tok, MESSAGES, adds_bos=True) == "[user] hi [assistant] yo [user] x [assistant]"
    assert templated_chat(tok, MESSAGES, adds_bos=False).startswith("[CLS][user] hi")
    # None: asks the tokenizer (WordPiece adds [CLS] to a text prompt)
    assert templated_chat(tok, MESSAGES) == templated_chat(tok, MESSAGES, adds_bos=True)


def test_no_template_is_none_and_a_refusing_template_is_a_400():
    assert templated_chat(_tokenizer(None), MESSAGES) is None
    with pytest.raises(EngineError) as err:
        templated_chat(_tokenizer(), [{"role": "system", "content": "s"}] + MESSAGES)
    assert err.value.status == 400 and "no system role here" in str(err.value)


def test_openai_http_formats_chats_with_the_checkpoints_template_else_the_transcript(tmp_path):
    from polyserve.worker.engines.openai_http import OpenAIHttpEngine
    with_template, without = tmp_path / "with", tmp_path / "without"
    _tokenizer().save_pretrained(str(with_template))
    _tokenizer(None).save_pretrained(str(without))
    assert load_chat_tokenizer(str(without)) is None and load_chat_tokenizer("") is None
    for path, want in ((with_template, "[user] hi [assistant] yo [user] x [assistant]"), (without, None),
                       (tmp_path / "missing", None)):
        engine = OpenAIHttpEngine(types.SimpleNamespace(upstream_url="http://127.0.0.1:9", model_path=str(path)))
        assert engine.chat_prompt(MESSAGES) == want


def test_a_chat_ends_open_closed_or_inside_the_assistants_last_message():
    """`GenerateRequest.chat_end`, through a template (transformers' add_generation_prompt and
    continue_final_message) and through the transcript, as the gateway and the worker both render it."""
    from polyserve.proto import ChatTurn, chat_transcript
    tok = _tokenizer()
    prefill = [*MESSAGES, {"role": "assistant", "content": "the answer is"}]
    assert templated_chat(tok, MESSAGES, end="closed") == "[user] hi [assistant] yo [user] x "
    assert templated_chat(tok, prefill, end="continue") == "[user] hi [assistant] yo [user] x [assistant] the answer is"
    turns = [ChatTurn(**m) for m in prefill]
    assert chat_transcript(turns) == "user: hi\nassistant: yo\nuser: x\nassistant: the answer is\nassistant:"
    assert chat_transcript(turns, "closed") == chat_transcript(turns, "continue") \
        == "user: hi\nassistant: yo\nuser: x\nassistant: the answer is"


def test_the_worker_refuses_a_chat_end_it_cannot_run():
    from polyserve.proto import ChatTurn, GenerateRequest, SamplingParams
    from polyserve.shared.bus import BusError
    from polyserve.worker.handlers import validate

    def req(end: str, last: str) -> GenerateRequest:
        return GenerateRequest(request_id="r", deployment="d", model="m", prompt="p", input_tokens=1,
                               params=SamplingParams(),
                               stream_to="inbox", chat=[ChatTurn(role=last, content="c")], chat_end=end)
    validate(req("continue", "assistant"))
    for end, last, words in (("continue", "user", "last message is the assistant's"), ("sideways", "user", "one of")):
        with pytest.raises(BusError) as err:
            validate(req(end, last))
        assert err.value.code == 400 and words in str(err.value)
