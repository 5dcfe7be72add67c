"""The gateway's short way in for `POST /v1/completions` and `/v1/chat/completions`
(gateway/fastpath.py, issue 15) answers every request exactly as FastAPI's routing does: the
same requests, good and bad, sent with the short way on and then off (every request through
FastAPI) get the same status and the same error body; good ones the same response shape."""
from __future__ import annotations

import json

import httpx
import pytest

from polyserve.gateway import fastpath
from polyserve.gateway.compat import IGNORED_HEADER

from .conftest import MODEL

pytestmark = pytest.mark.integration

JSON = {"content-type": "application/json"}
CASES = [  # (path, headers, body)
    ("/v1/completions", JSON, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3})),
    ("/v1/chat/completions", JSON, json.dumps({"model": MODEL, "max_tokens": 3,
                                               "messages": [{"role": "user", "content": "hi"}]})),
    ("/v1/completions", {"content-type": "application/vnd.x+json; charset=utf-8"},
     json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})),
    ("/v1/completions", JSON, '{"model": "sim-test", "prompt": '),  # not JSON
    ("/v1/completions", JSON, json.dumps({"prompt": "no model"})),
    ("/v1/completions", JSON, json.dumps({"model": MODEL, "prompt": "hi", "frobnicate": 1})),  # unknown: named
    ("/v1/completions", JSON, json.dumps({"model": MODEL, "prompt": "hi", "suffix": "refused"})),  # not honoured
    ("/v1/completions", JSON, "[]"),
    ("/v1/completions", JSON, "[" * 50_000 + "]" * 50_000),  # too deep for json.loads: FastAPI's 400
    ("/v1/completions", JSON, ""),
    ("/v1/completions", {"content-type": "text/plain"}, json.dumps({"model": MODEL, "prompt": "hi"})),
    ("/v1/completions", {}, json.dumps({"model": MODEL, "prompt": "hi"})),  # no content type
    ("/v1/completions", JSON, json.dumps({"model": "no-such-model", "prompt": "hi"})),
    ("/v1/completions", JSON, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 9})),
    ("/v1/completions", JSON, '{"model": "sim-test", "prompt": "\\ud800 lone surrogate"}'),
    ("/v1/chat/completions", JSON, json.dumps({"model": MODEL, "messages": []})),
    ("/v1/chat/completions", JSON, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "stream": True, "max_tokens": 2})),
]


def _shape(resp: httpx.Response) -> tuple:
    """What must match: status, content type, and the error body whole or the answer's shape (ids,
    timestamps and generated text differ between two runs)."""
    kind = resp.headers.get("content-type", "").split(";")[0]
    ignored = resp.headers.get(IGNORED_HEADER)
    if resp.status_code != 200:
        return resp.status_code, kind, ignored, resp.json()
    if kind == "text/event-stream":
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        return resp.status_code, kind, ignored, events[-1], sorted(json.loads(events[0][6:]))
    body = resp.json()
    # usage's keys and the prompt's count; not completion_tokens: without a seed the sim engine
    # draws each request's natural length from its id, so a request without max_tokens (or one
    # whose draw falls under it) ends at another length in the second run (a fresh-clone CI saw 16
    # against 10 tokens for the same body)
    usage = body["usage"]
    return (resp.status_code, kind, ignored, body["object"], sorted(body), sorted(body["choices"][0]),
            sorted(usage), usage["prompt_tokens"])


async def test_the_short_way_answers_as_fastapi_does(plane, monkeypatch):
    taken = []
    routes = dict(fastpath.ROUTES)
    for path, (model, endpoint) in routes.items():
        async def spy(body, request, gs, endpoint=endpoint, path=path):
            taken.append(path)
            return await endpoint(body, request, gs)
        monkeypatch.setitem(fastpath.ROUTES, path, (model, spy))
    async with plane() as p, httpx.AsyncClient(base_url=p.url, timeout=20) as http:
        async def run_all() -> list[tuple]:
            return [_shape(await http.post(path, headers=headers, content=body.encode("utf-8", "surrogatepass")))
                    for path, headers, body in CASES]

        short = await run_all()
        assert sorted(set(taken)) == sorted(routes), "the good requests did not take the short way"
        # the bodies that validate reach their endpoint (which may refuse them); no other does
        assert len(taken) == 9, taken
        monkeypatch.setattr(fastpath, "ROUTES", {})  # every request through FastAPI's routing
        through_fastapi = await run_all()
        for case, a, b in zip(CASES, short, through_fastapi):
            assert a == b, case
        assert [s[0] for s in short] == [200, 200, 200, 400, 400, 200, 400, 400, 400, 400, 400, 400, 404, 400, 400,
                                          400, 200]
        assert short[5][2] == "frobnicate" and "suffix" in short[6][3]["error"]["message"]


async def test_other_methods_and_paths_go_to_fastapi(plane):
    async with plane() as p, httpx.AsyncClient(base_url=p.url, timeout=20) as http:
        assert (await http.get("/v1/completions")).status_code == 405
        assert (await http.post("/v1/completions/", json={"model": MODEL, "prompt": "x"})).status_code in (307, 404)
        assert (await http.get("/v1/models")).status_code == 200


async def test_the_server_span_continues_the_clients_trace(plane, span_exporter):
    """A client's `traceparent` (any header case) parents the gateway's server span, on the short
    way too (Admission.begin copies only the propagators' headers)."""
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with plane() as p, httpx.AsyncClient(base_url=p.url, timeout=20) as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "traced", "max_tokens": 2},
                            headers={"TraceParent": f"00-{trace_id}-{parent}-01", "x-other": "1"})
        assert r.status_code == 200, r.text
    [span] = [s for s in span_exporter.get_finished_spans() if s.name == "gateway completion"]
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == parent
