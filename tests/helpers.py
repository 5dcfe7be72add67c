"""Helpers shared by tests: run services in-process, wait on conditions without bare sleeps."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from polyserve.shared.lifecycle import ServiceBase


@contextlib.asynccontextmanager
async def running(*services: ServiceBase, timeout: float = 15.0) -> AsyncIterator[None]:
    """Run services in this event loop until the block exits, then stop them in reverse."""
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        for s, t in zip(services, tasks):
            ready = asyncio.create_task(s.ready.wait())
            done, _ = await asyncio.wait({ready, t}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if ready not in done:
                ready.cancel()
                if t.done():
                    t.result()
                raise TimeoutError(f"{s.name} not ready within {timeout}s")
        yield
    finally:
        for s in reversed(services):
            s.request_stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout + 10)


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll an (a)sync predicate until truthy; fail with `what` after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_until(predicate: Callable, timeout: float = 20.0, interval: float = 0.05, what: str = "condition",
               changed: threading.Condition | None = None):
    """`wait_for` for synchronous code (system tests: processes, threads): the predicate's first
    truthy value, or AssertionError naming `what` after `timeout`.

    With `changed`, a Condition notified whenever what the predicate reads changes, it waits on
    that condition (checked under its lock, so no change is missed) instead of polling; without,
    it polls every `interval` (e.g. Redis or HTTP, which cannot notify)."""
    if changed is not None:
        with changed:
            value = changed.wait_for(predicate, timeout)
        if not value:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        return value
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def assert_lifecycle(kinds: list[str]) -> None:
    """The order the gateway promises for one request's events: `admitted` first, the
    terminal event last and once; `predicted` and `dispatched` once each before it, and
    `dispatched` before `first_token`. `predicted` may come after `dispatched` and even after
    `first_token`: a request the gateway places on a worker with a free slot does not wait for
    its prediction (services/gateway/handlers.py `_predict_and_place`)."""
    assert kinds[0] == "admitted", kinds
    assert kinds[-1] in ("completed", "failed") and sum(k in ("completed", "failed") for k in kinds) == 1, kinds
    assert kinds.count("predicted") == 1 and kinds.count("dispatched") == 1, kinds
    if "first_token" in kinds:
        assert kinds.index("dispatched") < kinds.index("first_token"), kinds


class LoopbackHTTP:
    """A threaded HTTP server on a free 127.0.0.1 port standing in for another program's API:
    subclasses answer `answer(method, path, body) -> (status, bytes, content type)`, or with a
    fourth item True to cut the answer short (a Content-Length it never reaches, then the
    connection closed); the JSON body of every POST is kept in `posts` as (path, body). Use as a
    context manager."""

    def __init__(self):
        self.posts: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                body = json.loads(raw) if raw else {}
                if method == "POST":
                    outer.posts.append((self.path, body))
                status, data, ctype, *cut = outer.answer(method, self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data) + (100_000 if cut and cut[0] else 0)))
                self.end_headers()
                self.wfile.write(data)
                if cut and cut[0]:
                    self.wfile.flush()
                    self.connection.shutdown(2)

            def do_GET(self):
                self._reply("GET")

            def do_POST(self):
                self._reply("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, method: str, path: str, body: dict) -> tuple[int, bytes, str]:
        return 404, b"not found", "text/plain"  # subclasses answer what they stand in for

    def paths(self) -> list[str]:
        return [p for p, _ in self.posts]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def checkpoint_with_tokens(out, tokens: list[str], special: bool = False, chat_template: str | None = None):
    """The small random Llama saved at `out` with `tokens` added to its vocabulary (its embeddings
    resized), as a real model's `<think>` or `<|python_tag|>` are single tokens; `special`: added as
    special tokens (dropped from text unless skip_special_tokens is off). Returns the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyserve.worker.engines.hf_model import save_random_checkpoint
    out = save_random_checkpoint(out, seed=0)
    tok = AutoTokenizer.from_pretrained(str(out))
    if special:
        tok.add_special_tokens({"additional_special_tokens": tokens})
    else:
        tok.add_tokens(tokens)
    if chat_template is not None:
        tok.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(str(out))
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
