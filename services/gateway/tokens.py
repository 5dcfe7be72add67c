"""vLLM's `POST /tokenize` and `POST /detokenize` with the deployment's tokenizer, loaded
by the gateway through the shared tokenizer lookup (polyserve.core.encoder_text, the
code that tokenizes embedding inputs):

* encoder: the checkpoint directory its `model` names, else the packaged
  all-MiniLM-L6-v2 (exactly the tokenizer /v1/embeddings counts with);
* hf, vllm, openai-http: the deployment's `model` when it is a local checkpoint directory
  with a `tokenizer.json`; prompts are encoded as the hf engine encodes them (an
  encoder-style tokenizer gets its [CLS] only, never a trailing [SEP]);
* anything else (the sim engine, whose stand-in tokenizer counts ceil(1.3 x words) and has
  no token ids; a model the workers load from a path the gateway does not see): 501 with
  a message saying why, only once the body is valid (a body without `tokens`, or with
  neither `prompt` nor `messages`, is a 400 naming the field on every engine).

Shapes as vLLM's: tokenize {model, prompt} or {model, messages} -> {count, max_model_len,
tokens[, token_strs]}; detokenize {model, tokens} -> {prompt}. `model` may be left out when
there is exactly one deployment."""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from polyserve.proto import Deployment

from . import compat, tools
from .context import Gateway, GatewayState
from .errors import GatewayError
from .policy import InvalidRequest, chat_end, chat_turns, render_chat, template_kwargs
from .schemas import ChatMessage

NO_IDS = {"sim": "the sim engine has no tokenizer: it counts ceil(1.3 x whitespace words) as prompt tokens "
                 "and has no token ids"}


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: what the engine does for a prompt
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # required: a body without it is a 400 naming `tokens` (validated before the deployment's
    # tokenizer is looked up, so the sim engine's 501 is only for a request it could otherwise serve)
    tokens: list[int] = Field(description="the token ids to turn back into text")


@dataclass
class DeploymentTokenizer:
    """A deployment's tokenizer at the gateway: encode as its engine does, decode, limits."""

    tok: object  # polyserve.core.encoder_text.TextTokenizer
    engine: str
    max_model_len: int
    path: str = ""  # the checkpoint directory
    chat_template: bool = False  # it has one, which the workers run chats with (hf, vllm, openai-http)

    def encode(self, text: str, add_special_tokens: bool | None) -> list[int]:
        t = self.tok.tokenizer
        if add_special_tokens is not None:
            return list(t.encode(text, add_special_tokens=add_special_tokens).ids)
        if self.engine == "encoder" or not _encoder_style(t):
            return list(t.encode(text, add_special_tokens=True).ids)
        # an encoder-style tokenizer serving generation (the hf engine): the leading [CLS] as BOS, no [SEP]
        head = list(t.encode("a", add_special_tokens=True).ids)[:1]
        return head + list(t.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        vocab = self.tok.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return self.tok.tokenizer.decode(ids, skip_special_tokens=False)

    def strs(self, ids: list[int]) -> list[str]:
        return [self.tok.tokenizer.id_to_token(i) or "" for i in ids]


def _encoder_style(t) -> bool:
    """[CLS] x [SEP]: the plain and special encodings of 'a' end differently."""
    plain, full = t.encode("a", add_special_tokens=False).ids, t.encode("a", add_special_tokens=True).ids
    return bool(full and plain and full[-1] != plain[-1])


def _tokenizer_dir(dep: Deployment) -> Path:
    from polyserve.core.encoder_text import EncoderNotFound, model_dir_for

    if dep.engine in NO_IDS:
        raise GatewayError(501, f"'{dep.id}': {NO_IDS[dep.engine]}; /tokenize needs a real tokenizer")
    if dep.engine == "encoder":
        try:
            return model_dir_for(dep.model)
        except EncoderNotFound as exc:
            raise GatewayError(501, f"no tokenizer for '{dep.id}': {exc}") from exc
    path = Path(dep.model).expanduser()
    if (path / "tokenizer.json").is_file():
        return path
    raise GatewayError(501, f"the gateway does not know the tokenizer of '{dep.id}' (engine {dep.engine}): its "
                            f"model '{dep.model}' is not a local checkpoint directory with a tokenizer.json (the "
                            "workers load theirs from a path the gateway does not see). Create the deployment "
                            "with model = the checkpoint directory to tokenize at the gateway")


async def deployment_tokenizer(gs: GatewayState, dep: Deployment) -> DeploymentTokenizer:
    from polyserve.core.encoder_text import EncoderNotFound, load_text_tokenizer

    path = _tokenizer_dir(dep)
    try:
        tok = await asyncio.to_thread(load_text_tokenizer, str(path))
    except EncoderNotFound as exc:
        raise GatewayError(501, f"no tokenizer for '{dep.id}': {exc}") from exc
    workers = [hb.max_input_len for hb in await _live(gs, dep) if hb.max_input_len > 0]
    limit = min(tok.max_positions, max(workers)) if workers else tok.max_positions
    from polyserve.core.chat_template import has_template
    templated = dep.engine in ("hf", "vllm", "openai-http") and has_template(path)
    return DeploymentTokenizer(tok, dep.engine, limit, str(path), templated)


async def _live(gs: GatewayState, dep: Deployment) -> list:
    try:
        return await gs.live_workers(dep.id)
    except GatewayError:
        return []  # the limit then comes from the checkpoint's config


async def _deployment(gs: GatewayState, model: str | None) -> Deployment:
    try:
        if model is None:
            deps = await gs.refresh_deployments()
            if len(deps) != 1:
                raise InvalidRequest(f"name the model: this gateway serves {sorted(deps) or 'no models'}", "model")
            return next(iter(deps.values()))
        dep, _ = await gs.find_deployment(model)
    except InvalidRequest:
        raise
    except Exception as exc:
        raise GatewayError(503, f"cluster state unavailable: {exc}", retry_after=1) from exc
    if dep is None:
        raise InvalidRequest(f"The model '{model}' does not exist; GET /v1/models lists the served models",
                             "model", 404, "model_not_found")
    return dep


async def tokenize(body: TokenizeBody, gs: Gateway) -> JSONResponse:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send either 'prompt' (text) or 'messages' (a chat)", "prompt")
    dep = await _deployment(gs, body.model)
    unknown = compat.check_fields("tokenize", compat.given(body), dep.engine)
    if body.messages is not None:
        for i, msg in enumerate(body.messages):
            unknown += compat.check_fields("tokenize", {k: v for k, v in compat.given(msg).items()
                                                        if k not in ("role", "content")},
                                           dep.engine, compat.MESSAGE, prefix=f"messages[{i}].")
        end = chat_end(body)
        tl = tools.parse_tools(body)
        with_tools = tl.listed or any((m.model_extra or {}).get("tool_calls") for m in body.messages)
        turns = tools.chat_turns(body.messages) if with_tools else chat_turns(body.messages)
        dt = await deployment_tokenizer(gs, dep)
        extra = template_kwargs(body.chat_template_kwargs)
        text = await _templated(dt, turns, end, tl.definitions(), extra) if dt.chat_template else None
        if text is None and with_tools:  # as chat completions run a chat with tools (completions.chat)
            text = tools.render_chat(body.messages, tl, end)
        elif text is None:
            text = render_chat(body.messages, end)
    else:
        text = body.prompt
        dt = await deployment_tokenizer(gs, dep)
    ids = dt.encode(text, body.add_special_tokens)
    out = {"count": len(ids), "max_model_len": dt.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = dt.strs(ids)
    return JSONResponse(out, headers=compat.ignored_header(unknown))


@functools.lru_cache(maxsize=8)
def _chat_tokenizer(path: str):
    """The checkpoint's HF tokenizer, loaded once per directory (a load takes ~0.5 s)."""
    from polyserve.core import chat_template
    return chat_template.load_tokenizer(path)


async def _templated(dt: DeploymentTokenizer, turns: list, end: str, tool_defs: list | None,
                     extra: dict | None = None) -> str | None:
    """The messages through the checkpoint's chat template, as its workers run a chat (None: the
    template could not be loaded). A template that refuses them is the 400 a chat would get."""
    from polyserve.core import chat_template
    tok = await asyncio.to_thread(_chat_tokenizer, dt.path)
    if tok is None:
        return None
    try:
        return chat_template.render(tok, [t.message() for t in turns], end=end, tools=tool_defs, extra=extra)
    except chat_template.TemplateRefused as exc:
        raise InvalidRequest(str(exc), "messages") from exc


async def detokenize(body: DetokenizeBody, gs: Gateway) -> JSONResponse:
    dep = await _deployment(gs, body.model)
    unknown = compat.check_fields("detokenize", compat.given(body), dep.engine)
    dt = await deployment_tokenizer(gs, dep)
    return JSONResponse({"prompt": dt.decode(body.tokens)}, headers=compat.ignored_header(unknown))


def add_token_routes(app: FastAPI) -> None:
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
