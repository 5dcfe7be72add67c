"""Logprobs, echo and structured outputs of the `openai-http` engine, on the wire of an
OpenAI-compatible server's `POST /v1/completions` (vLLM 0.33's shapes).

Request fields (`request_fields`):
- `logprobs: k` (completions' int): k alternatives per token; asked with the larger of
  params.logprobs and params.prompt_logprobs when either is set;
- `echo: true` when params.prompt_logprobs is set: the upstream then returns the prompt before
  each choice's text and the prompt's tokens first in `logprobs` (vLLM computes them as
  `prompt_logprobs = logprobs`); such a request is sent unstreamed, so the prompt's tokens are
  split off at the answer's `usage.prompt_tokens`;
- structured outputs: `response_format` for JSON (`json_object`, `json_schema` with the schema,
  strict), vLLM's `structured_outputs` {regex|choice|grammar} for the rest (`upstream_structured
  = "guided"`: the older `guided_regex` / `guided_choice` / `guided_grammar` fields).

Answers (`entries`): `choices[].logprobs` {tokens, token_logprobs, top_logprobs, text_offset}
becomes one TokenLogprob per token (token ids are not on this wire: -1), its alternatives the
k best of `top_logprobs` (a dict token text -> logprob); a chat's `logprobs.content` (a list of
{token, logprob, top_logprobs: [{token, logprob}]}) the same way. A server that ignores the fields
(`transformers serve` drops `logprobs` and `echo` with a warning) answers without them: that
is an error (502 naming the field), never a silently dropped field; one that rejects them
answers 4xx, which reaches the client with the upstream's message.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from polyserve.proto import SamplingParams, StructuredOutput, TokenLogprob, TopLogprob
from polyserve.worker.engine import Delta, EngineError, EngineRequest


def request_fields(p: SamplingParams, style: str = "structured_outputs") -> dict[str, Any]:
    """The body fields (sent as extra body) for p's logprobs, echo and structured output."""
    out: dict[str, Any] = {}
    ks = [k for k in (p.logprobs, p.prompt_logprobs) if k is not None]
    if ks:
        out["logprobs"] = max(ks)
    if p.prompt_logprobs is not None:
        out["echo"] = True
    if p.structured is not None:
        out.update(structured_fields(p.structured, style))
    return out


def penalty_fields(p: SamplingParams) -> dict[str, Any]:
    """The OpenAI penalty fields a request sets (completions and chat alike): frequency and presence
    penalty, logit_bias (token ids as JSON keys)."""
    out: dict[str, Any] = {}
    if p.frequency_penalty:
        out["frequency_penalty"] = p.frequency_penalty
    if p.presence_penalty:
        out["presence_penalty"] = p.presence_penalty
    if p.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in p.logit_bias.items()}
    return out


def vllm_fields(p: SamplingParams) -> dict[str, Any]:
    """vLLM's extensions of the OpenAI body that a request sets, sent as extra body fields (a server
    without them, such as `transformers serve`, answers 422)."""
    out: dict[str, Any] = {}
    if p.top_k > 0:
        out["top_k"] = p.top_k
    if p.min_tokens > 0:
        out["min_tokens"] = p.min_tokens
    if p.repetition_penalty != 1.0:
        out["repetition_penalty"] = p.repetition_penalty
    if p.min_p > 0.0:
        out["min_p"] = p.min_p
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.include_stop:
        out["include_stop_str_in_output"] = True
    if p.truncate_prompt_tokens:
        out["truncate_prompt_tokens"] = p.truncate_prompt_tokens
    if not p.skip_special_tokens:
        out["skip_special_tokens"] = False
    if p.allowed_token_ids:
        out["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.bad_words:
        out["bad_words"] = list(p.bad_words)
    if p.return_token_ids:  # read back by choice_delta
        out["return_token_ids"] = True
    if p.thinking_budget is not None:  # the upstream's reasoning config enforces it (vLLM's)
        out["thinking_token_budget"] = p.thinking_budget
    return out


def structured_fields(spec: StructuredOutput, style: str = "structured_outputs") -> dict[str, Any]:
    if spec.json_object:
        return {"response_format": {"type": "json_object"}}
    kind = spec.kind()
    if kind == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "output", "schema": json.loads(spec.json or "{}"), "strict": True}}}
    if style == "guided":
        return {f"guided_{kind}": getattr(spec, kind)}
    return {"structured_outputs": {kind: getattr(spec, kind)}}


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def usage_of(usage: Any) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt tokens) of an upstream answer's `usage`; the cached ones from
    `prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details, OpenAI; 0 when
    the server leaves it out)."""
    details = _get(usage, "prompt_tokens_details")
    cached = _get(details, "cached_tokens") if details is not None else None
    return int(_get(usage, "prompt_tokens") or 0), int(_get(usage, "completion_tokens") or 0), int(cached or 0)


def entries(logprobs: Any, k: int) -> list[TokenLogprob]:
    """A choice's completions (or chat) `logprobs` object as TokenLogprob entries with k alternatives each."""
    content = _get(logprobs, "content")
    if isinstance(content, list):  # a chat's
        return [TokenLogprob(token=str(_get(c, "token")), logprob=_float(_get(c, "logprob")),
                             top=[TopLogprob(token=str(_get(t, "token")), logprob=float(_get(t, "logprob")))
                                  for t in sorted(_get(c, "top_logprobs") or [],
                                                  key=lambda t: -float(_get(t, "logprob")))[:k]])
                for c in content]
    tokens = list(_get(logprobs, "tokens") or [])
    values = list(_get(logprobs, "token_logprobs") or [])
    tops = list(_get(logprobs, "top_logprobs") or [])
    out = []
    for j, tok in enumerate(tokens):
        value = values[j] if j < len(values) else None
        top = tops[j] if j < len(tops) else None
        best = sorted((top or {}).items(), key=lambda kv: -float(kv[1]))[:k] if k > 0 else []
        out.append(TokenLogprob(token=str(tok), logprob=_float(value),
                                top=[TopLogprob(token=str(t), logprob=float(v)) for t, v in best]))
    return out


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def detail(exc: Any) -> str:
    """The upstream's error message: its JSON body's message/detail/error when there is one."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            inner = inner.get("message") or inner.get("detail") or inner
        body = body.get("detail", inner) if "detail" in body else inner
    text = body if isinstance(body, str) else (json.dumps(body) if body is not None else str(exc))
    return text[:1000]


def missing(url: str, what: str) -> EngineError:
    return EngineError(f"upstream {url} answered without {what} (the server ignores the field; "
                       "`transformers serve` does): leave it out, or serve with vLLM", 502)


def split_echo(text: str, lps: list[TokenLogprob] | None, prompt: str, prompt_tokens: int | None,
               url: str) -> tuple[str, list[TokenLogprob], list[TokenLogprob] | None]:
    """An echoed choice (prompt + output, logprobs of both) as (output text, prompt entries,
    output entries); 502 when the upstream did not echo or did not say how long the prompt is."""
    if not text.startswith(prompt):
        raise missing(url, "the echoed prompt (`echo`)")
    if lps is None:
        raise missing(url, "logprobs")
    if not prompt_tokens or prompt_tokens > len(lps):
        raise EngineError(f"upstream {url} answered an echo without usage.prompt_tokens matching its logprobs "
                          f"({prompt_tokens} prompt tokens, {len(lps)} entries)", 502)
    return text[len(prompt):], lps[:prompt_tokens], lps[prompt_tokens:]


def choice_delta(req: EngineRequest, choice: Any, text: str, whole: bool, usage: tuple[int, int, int] | None,
                 url: str, chunk: Any = None) -> Delta:
    """A choice's Delta (tokens and finish set by the caller) with its logprobs entries, the echoed
    prompt split off (its entries as prompt_logprobs), and vLLM's token ids (`return_token_ids`:
    the choice's `token_ids`, the prompt's on the choice or, for a chat, on `chunk`); 502 when the
    upstream left asked-for fields out."""
    p, i = req.params, int(getattr(choice, "index", 0) or 0)
    delta = Delta(index=i, text=text, tokens=0)
    if p.return_token_ids:
        ids = getattr(choice, "token_ids", None)
        if ids is None and (text or whole):
            raise missing(url, "token_ids (vLLM's return_token_ids)")
        delta.token_ids = list(ids or ())
        prompt = getattr(choice, "prompt_token_ids", None) or getattr(chunk, "prompt_token_ids", None)
        delta.prompt_token_ids = list(prompt) if prompt else None
    if p.logprobs is None and p.prompt_logprobs is None:
        return delta
    raw = getattr(choice, "logprobs", None)
    k = p.logprobs if p.logprobs is not None else 0
    lps = entries(raw, max(k, p.prompt_logprobs or 0)) if raw is not None else None
    if p.prompt_logprobs is not None:
        prompt_tokens = usage[0] if usage else None
        delta.text, plps, lps = split_echo(text, lps, req.prompt, prompt_tokens, url)
        delta.prompt_logprobs = [msgspec.structs.replace(e, top=e.top[:p.prompt_logprobs]) for e in plps]
    elif lps is None and (text or whole):
        raise missing(url, "logprobs")
    if lps is not None:
        delta.logprobs = [msgspec.structs.replace(e, top=e.top[:k]) for e in lps]
    return delta
