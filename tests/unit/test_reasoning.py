"""The chat answer of a thinking model split into `reasoning` and `content` (gateway/reasoning.py,
vLLM's qwen3 and deepseek_r1 parsers' rules): whole, and streamed in pieces of every size, with
the same result either way."""
from __future__ import annotations

import pytest

from polyserve.gateway import reasoning

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", "<think>\nsum the digits\n</think>\n\nIt is 7.", ("\nsum the digits\n", "It is 7.")),
    ("qwen3", "It is 7.", (None, "It is 7.")),  # no thinking (enable_thinking false): all content
    ("qwen3", "It is 7 </think> really", (None, "It is 7 </think> really")),  # no opening tag: content
    ("qwen3", "<think>still thinking when max_tokens", ("still thinking when max_tokens", "")),
    ("deepseek_r1", "sum the digits</think>\n\nIt is 7.", ("sum the digits", "It is 7.")),  # opened in the prompt
    ("deepseek_r1", "<think>sum</think>It is 7.", ("sum", "It is 7.")),
    ("deepseek_r1", "cut while thinking", ("cut while thinking", "")),
])
def test_whole_and_streamed_answers_split_alike(parser, text, want):
    assert reasoning.split(text, parser) == want
    for size in (1, 2, 3, 5, len(text)):
        rs, got_r, got_c = reasoning.ReasoningStream(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for j, piece in enumerate(pieces):
            last = j == len(pieces) - 1
            body = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if last else None}]}
            for out in rs.feed(body):
                d = out["choices"][0]["delta"]
                assert not (got_c and d.get("reasoning")), "reasoning after content"
                got_r += d.get("reasoning", "")
                got_c += d.get("content") or ""
        assert (got_r if want[0] is not None else None, got_c) == want, (size, got_r, got_c)


def test_a_whole_message_keeps_its_reasoning_unless_left_out():
    for include in (True, False):
        choice = {"message": {"role": "assistant", "content": "<think>hmm</think>\nYes."}}
        reasoning.render_message(choice, "qwen3", include)
        assert choice["message"]["content"] == "Yes." and choice["message"].get("reasoning") == ("hmm" if include else None)
    streamed = reasoning.ReasoningStream("qwen3", include=False)
    outs = [o for p in ("<think>hm", "m</think>", "Yes.") for o in streamed.feed(
        {"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": "stop" if p == "Yes." else None}]})]
    assert all("reasoning" not in o["choices"][0]["delta"] for o in outs)
    assert "".join(o["choices"][0]["delta"].get("content") or "" for o in outs) == "Yes."


def test_an_unknown_parser_is_refused_with_the_choices():
    assert reasoning.canonical(" Qwen3 ") == "qwen3" and reasoning.canonical(None) == ""
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning.canonical("granite")
