"""LoRA adapters end to end: registered through the admin API, loaded by the hf
worker at runtime on first use, chosen by `model=<adapter>` (as in vLLM) or the
`adapter` field; an unknown adapter is a clear 404 at the gateway."""
from __future__ import annotations

import httpx
import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from polyserve.worker.lora import create_random_adapter  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]  # torch: builds torch models
BASE = "tiny-llama-random"


async def test_adapter_registered_then_served_and_unknown_is_404(plane, state, tmp_path):
    from polyserve.proto import Deployment

    a8 = create_random_adapter("random", 8, tmp_path / "a8", seed=1)
    async with plane(worker_kw={"engine": "hf", "model": BASE, "deployment": "sim-test"},
                     adapter_roots=str(tmp_path)) as p:
        await state.put_deployment(Deployment(id=BASE, model=BASE, engine="hf"))
        # the plane's worker serves deployment sim-test; attach the adapter there
        async with httpx.AsyncClient(base_url=p.url) as h:
            r = await h.post("/v1/adapters", json={"name": "a8", "path": str(a8), "deployment": "sim-test"})
            assert r.status_code == 201 and r.json()["rank"] == 8
            r = await h.post("/v1/adapters", json={"name": "bad", "path": str(tmp_path), "deployment": "sim-test"})
            assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        ids = {m.id: m for m in (await p.client.models.list()).data}
        assert ids["a8"].model_extra["parent"] == "sim-test"

        base = await p.client.completions.create(model="sim-test", prompt="the quick brown fox", max_tokens=8,
                                                 temperature=0)
        with_lora = await p.client.completions.create(model="a8", prompt="the quick brown fox", max_tokens=8,
                                                      temperature=0)
        assert with_lora.choices[0].text != base.choices[0].text
        assert [a.name for a in p.worker.engine.load().adapters] == ["a8"]
        again = await p.client.completions.create(model="sim-test", prompt="the quick brown fox", max_tokens=8,
                                                  temperature=0, extra_body={"adapter": "a8"})
        assert again.choices[0].text == with_lora.choices[0].text

        with pytest.raises(openai.NotFoundError, match="unknown adapter 'nope'"):
            await p.client.completions.create(model="sim-test", prompt="x", max_tokens=2,
                                              extra_body={"adapter": "nope"})
        async with httpx.AsyncClient(base_url=p.url) as h:
            assert (await h.delete("/v1/adapters/a8")).status_code == 200
        with pytest.raises(openai.NotFoundError):
            await p.client.completions.create(model="a8", prompt="x", max_tokens=2)
