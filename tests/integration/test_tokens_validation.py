"""`/tokenize` and `/detokenize` validate the body before asking whether the engine can tokenize
(issue 14 gap): on the sim engine, which has no token ids, a body missing its required field is
a 400 naming it; only a valid body gets the 501 that says why the engine cannot."""
from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration


async def test_a_bad_body_is_a_400_before_the_sim_engines_501(plane):
    async with plane() as p, httpx.AsyncClient(base_url=p.url) as h:
        for body in ({}, {"model": "sim-test"}, {"model": "sim-test", "tokens": None}):
            r = await h.post("/detokenize", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == "tokens" and "tokens" in err["message"], r.text
        r = await h.post("/detokenize", json={"model": "sim-test", "tokens": ["a"]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens"), r.text
        r = await h.post("/tokenize", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        # a valid body: the sim engine truly cannot, and says why
        for path, body in (("/detokenize", {"model": "sim-test", "tokens": [1, 2]}), ("/detokenize", {"tokens": []}),
                           ("/tokenize", {"model": "sim-test", "prompt": "hi"})):
            r = await h.post(path, json=body)
            assert r.status_code == 501 and "sim engine has no tokenizer" in r.json()["error"]["message"], r.text
        schema = (await h.get("/openapi.json")).json()["components"]["schemas"]["DetokenizeBody"]
        assert schema["required"] == ["tokens"]  # documented as required
