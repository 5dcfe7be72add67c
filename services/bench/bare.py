"""A bare FastAPI endpoint returning a fixed completion body: the baseline that
`polyserve bench overhead` measures the control plane against."""
from __future__ import annotations

import argparse
import json
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse


def build(tokens: int) -> FastAPI:
    app = FastAPI()
    words = [f"w{i} " for i in range(tokens)]

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("stream"):
            async def gen():
                for i, w in enumerate(words):
                    chunk = {"id": "cmpl-bare", "object": "text_completion", "created": int(time.time()),
                             "model": "bare", "choices": [{"index": 0, "text": w, "logprobs": None,
                                                           "finish_reason": "length" if i == tokens - 1 else None}]}
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse({"id": "cmpl-bare", "object": "text_completion", "created": int(time.time()),
                             "model": "bare", "choices": [{"index": 0, "text": "".join(words), "logprobs": None,
                                                           "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    uvicorn.run(build(a.tokens), host="127.0.0.1", port=a.port, log_level="warning", access_log=False)
