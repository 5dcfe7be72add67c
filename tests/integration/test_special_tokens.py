"""skip_special_tokens (vLLM's) end to end with the official `openai` client on an hf worker whose
checkpoint has a special token, `<|python_tag|>` (Llama 3.1 marks its calls with it): dropped from
the text by default, kept with `skip_special_tokens: false`, and kept when tools are listed with
`tool_choice: auto`, so a call marked by a special token can be found (vLLM's tool parsers turn the
skipping off the same way). `logit_bias` makes the random model write the token first."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from polyserve.proto import Deployment  # noqa: E402
from tests.helpers import checkpoint_with_tokens  # noqa: E402
from tests.integration.test_structured_outputs import MESSAGES, WEATHER  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]
TAG = "<|python_tag|>"


async def test_special_tokens_are_dropped_unless_asked_or_tools_are_listed(plane, state, tmp_path):
    from transformers import AutoTokenizer
    path = checkpoint_with_tokens(tmp_path / "tagged", [TAG], special=True)
    tag = AutoTokenizer.from_pretrained(str(path)).convert_tokens_to_ids(TAG)
    await state.put_deployment(Deployment(id="tagged", model=str(path), engine="hf"))
    async with plane(worker_kw={"engine": "hf", "model": "tagged", "model_path": str(path),
                                "deployment": "tagged"}) as p:
        kw = dict(model="tagged", messages=MESSAGES, max_tokens=4, temperature=0, logit_bias={str(tag): 30})
        plain = (await p.client.chat.completions.create(**kw)).choices[0].message.content
        kept = (await p.client.chat.completions.create(**kw, extra_body={"skip_special_tokens": False}))
        tools = (await p.client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="auto")).choices[0]
        raw = await p.client.completions.create(model="tagged", prompt="hi", max_tokens=2, temperature=0,
                                                logit_bias={str(tag): 30}, extra_body={"skip_special_tokens": False})
    assert TAG not in plain and kept.choices[0].message.content.strip().startswith(TAG), (plain, kept)
    assert TAG in (tools.message.content or ""), tools  # not a call (random weights), but the marker is there
    assert raw.choices[0].text.strip().startswith(TAG)
