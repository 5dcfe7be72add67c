"""`polyserve predictor score`: the shipped lexical predictor, as served, on a JSON-lines file of
someone else's data; bad rows are refused with the line and the field named."""
from __future__ import annotations

import json
import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lightgbm")

from polyserve.predictor.cli import main  # noqa: E402

pytestmark = pytest.mark.unit

SHORT = ["Answer yes or no: is {x} a fruit?", "One word: the colour of {x}?", "True or false: {x} is heavy."]
LONG = ["Write a detailed, step-by-step essay on the history of {x}, with examples and a conclusion.",
        "Explain in depth how {x} works, covering every component, and list ten practical tips."]


def _rows(path, n=60, seed=0):
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            x = f"thing{i}"
            long = i % 2 == 0
            prompt = rnd.choice(LONG if long else SHORT).format(x=x)
            for model in ("acme-chat-7b", "vicuna-13b"):
                row = {"prompt": prompt, "model": model, "source": "mine"}
                if model == "vicuna-13b":  # its answers given as text, counted with the artifact's tokenizer
                    row["response"] = " ".join(["word"] * (rnd.randint(300, 600) if long else rnd.randint(2, 30)))
                else:
                    row["output_tokens"] = rnd.randint(300, 600) if long else rnd.randint(2, 30)
                f.write(json.dumps(row) + "\n")


def test_scores_the_shipped_predictor_on_rows_it_never_saw(tmp_path, capsys):
    rows, out = tmp_path / "rows.jsonl", tmp_path / "out.json"
    _rows(rows)
    assert main(["score", str(rows), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["all"]["n"] == 120 and set(figures["by_model"]) == {"acme-chat-7b", "vicuna-13b"}
    assert figures["known_models"] == ["vicuna-13b"]  # acme-chat-7b goes through the unknown-model row
    # essays against yes/no questions: any predictor worth shipping orders these
    assert figures["all"]["tau"] > 0.3 and sum(map(sum, figures["all"]["confusion"])) == 120
    text = capsys.readouterr().out
    assert "unseen (its unknown-model row): acme-chat-7b" in text


@pytest.mark.parametrize("line, named", [
    ('{"prompt": "hi", "model": "m"}', "output_tokens"),
    ('{"prompt": "hi", "output_tokens": 3}', "model"),
    ('{"prompt": "hi", "model": "m", "output_tokens": "3"}', "output_tokens"),
    ("not json", "not JSON"),
    ('{"messages": "hi", "model": "m", "output_tokens": 3}', "messages must be"),
    ('{"messages": [{"role": "assistant", "content": "a"}], "model": "m"}', "only the answer"),
    ('[1, 2]', "JSON object"),
])
def test_a_bad_row_is_refused_with_its_line_and_field(tmp_path, capsys, line, named):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi", "model": "m", "output_tokens": 3}\n' + line + "\n")
    assert main(["score", str(rows)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and named in err


def test_a_chat_row_is_scored_on_the_transcript_the_gateway_predicts_on(tmp_path, monkeypatch):
    """`messages` instead of `prompt`: the gateway's transcript of the chat is the prompt (what a chat
    request asks the predictor about), and a last assistant message is the answer when no length is given."""
    from polyserve.predictor.proxy import score
    from polyserve.proto import ChatTurn, chat_transcript

    rows = tmp_path / "chats.jsonl"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Explain tides in depth."}]
    rows.write_text("\n".join(json.dumps(r) for r in (
        {"messages": [*chat, {"role": "assistant", "content": "word " * 40}], "model": "m"},
        {"messages": chat, "model": "m", "output_tokens": 7},
        {"prompt": "plain", "model": "m", "response": "a b c"})) + "\n")
    monkeypatch.setattr(score.data, "count_tokens", lambda texts, _tok: [len(t.split()) for t in texts])
    out = score.read_rows(rows, None)  # (tokens counted as words here)
    transcript = chat_transcript([ChatTurn(**m) for m in chat])
    assert [r.prompt for r in out] == [transcript, transcript, "plain"]
    assert [r.output_tokens for r in out] == [40, 7, 3]
