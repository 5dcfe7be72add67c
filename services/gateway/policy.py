"""Pure gateway logic: parameter validation, token estimates, prompt rendering
and OpenAI response shapes. No I/O, so tests and benchmarks call it directly."""
from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from polyserve.proto import ChatTurn, SamplingParams, chat_transcript

from . import limits
from .schemas import ChatBody, ChatMessage, CompletionBody

_WORD = re.compile(r"\S+")


class InvalidRequest(ValueError):
    """A client error: `param` names the field to fix (OpenAI error body)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_


def check_text(text: str, param: str) -> None:
    """400 for text UTF-8 cannot carry: a lone surrogate such as "\\ud800", which a JSON
    escape can hold but no service (NATS, Redis, an engine) can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{param} is not valid Unicode: it holds the lone surrogate "
                             f"{text[exc.start]!r} at character {exc.start}; send well-formed UTF-8 text",
                             param, code="invalid_unicode") from None


def estimate_tokens(text: str) -> int:
    """Gateway-side input-length estimate: 1.3 tokens per whitespace word (at least 1).

    The worker counts exact tokens with its engine's tokenizer and reports them in
    usage; this estimate only feeds the predictor and dispatcher before placement."""
    return max(1, math.ceil(len(_WORD.findall(text)) * 1.3))


def message_text(msg: ChatMessage) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    return "".join(part.get("text", "") for part in msg.content if part.get("type") == "text")


def render_chat(messages: list[ChatMessage], end: str = "open") -> str:
    """A plain role-prefixed transcript ending with the assistant's turn (`end` "open"; see
    `chat_end`). Engines with a chat template of their own receive the messages too."""
    text = chat_transcript(chat_turns(messages), end)
    check_text(text, "messages")
    return text


def chat_end(body) -> str:
    """How a chat's prompt ends (`GenerateRequest.chat_end`), from vLLM's two fields: "open" (the
    assistant's turn opened, add_generation_prompt), "closed" (add_generation_prompt false), or
    "continue" (continue_final_message: the output continues the last message, the assistant's)."""
    if not body.continue_final_message:
        return "open" if body.add_generation_prompt else "closed"
    if body.add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true (as in vLLM): "
                             "send add_generation_prompt false to continue the last message", "continue_final_message")
    if body.messages[-1].role != "assistant":
        raise InvalidRequest("continue_final_message continues the last message, which must be the assistant's "
                             f"(it is the {body.messages[-1].role}'s)", "continue_final_message")
    return "continue"


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    """The messages as the worker receives them (`GenerateRequest.chat`): role and text."""
    return [ChatTurn(role=m.role, content=message_text(m)) for m in messages]


def completion_prompts(body: CompletionBody, max_prompts: int) -> list[str]:
    """The prompts of a completions request: one string, or a list of strings (a batch, each
    prompt a request of its own). Token-id prompts are refused: the workers take text."""
    p = body.prompt
    if isinstance(p, str):
        check_text(p, "prompt")
        return [p]
    if not p:
        raise InvalidRequest("prompt is an empty list; send a string or a list of strings", "prompt")
    if not all(isinstance(x, str) for x in p):
        raise InvalidRequest("token-id prompts are not supported by polyserve (its workers take text); send the "
                             "prompt as text (POST /detokenize turns token ids into text)", "prompt",
                             code="unsupported_parameter")
    if len(p) > max_prompts:
        raise InvalidRequest(f"{len(p)} prompts in one request; the limit is {max_prompts}: split it", "prompt")
    for x in p:
        check_text(x, "prompt")
    return list(p)


def sampling_params(body: CompletionBody | ChatBody, *, default_max_tokens: int, max_tokens_limit: int,
                    max_n: int) -> SamplingParams:
    """Validate the sampling fields and turn them into the wire SamplingParams (None: the default;
    top_k -1 or 0: off; ignore_eos: min_tokens = max_tokens)."""
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > max_tokens_limit:
        raise InvalidRequest(f"max_tokens {max_tokens} is above this deployment's limit of "
                             f"{max_tokens_limit}; ask for fewer", "max_tokens")
    n = 1 if body.n is None else body.n
    if n > max_n:
        raise InvalidRequest(f"n must be between 1 and {max_n}, got {n}", "n")
    if body.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({body.min_tokens}) cannot exceed max_tokens ({max_tokens})",
                             "min_tokens")
    if body.truncate_prompt_tokens and getattr(body, "echo", False):
        raise InvalidRequest("truncate_prompt_tokens cannot be combined with echo (the echoed prompt is the "
                             "one sent)", "truncate_prompt_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    lim = limits.current()
    if len(stop) > lim.max_stop or any(not s or len(s) > lim.max_stop_chars for s in stop):
        raise InvalidRequest(f"stop takes up to {lim.max_stop} non-empty strings of at most "
                             f"{lim.max_stop_chars} characters", "stop")
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens if body.ignore_eos else body.min_tokens,
                          temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                          seed=body.seed, stop=stop, n=n, frequency_penalty=body.frequency_penalty or 0.0,
                          presence_penalty=body.presence_penalty or 0.0,
                          repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                          min_p=body.min_p or 0.0, logit_bias=logit_bias(body.logit_bias),
                          stop_token_ids=stop_token_ids(body.stop_token_ids),
                          include_stop=bool(body.include_stop_str_in_output),
                          truncate_prompt_tokens=body.truncate_prompt_tokens or 0,
                          allowed_token_ids=allowed_token_ids(body.allowed_token_ids),
                          bad_words=bad_words(body.bad_words),
                          skip_special_tokens=body.skip_special_tokens is not False,
                          return_token_ids=bool(body.return_token_ids), cache_salt=body.cache_salt or "")


TEMPLATE_KWARGS_MAX_BYTES = 8192


def template_kwargs(value: dict[str, Any] | None, effort: str | None = None) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: extra variables for the model's chat template (e.g.
    `enable_thinking`); 400 naming the field for one of apply_chat_template's own keywords or
    more than TEMPLATE_KWARGS_MAX_BYTES of JSON. `effort` (`reasoning_effort`) goes to the template
    as vLLM passes it: `reasoning_effort` (over the kwargs' own), and `enable_thinking` (false for
    "none") unless the kwargs set it."""
    from polyserve.core.chat_template import RESERVED_KWARGS
    value = value or {}
    taken = sorted(set(value) & RESERVED_KWARGS)
    if taken:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)}: those come from the request's "
                             "own fields", "chat_template_kwargs")
    if len(json.dumps(value)) > TEMPLATE_KWARGS_MAX_BYTES:
        raise InvalidRequest(f"chat_template_kwargs is over {TEMPLATE_KWARGS_MAX_BYTES} bytes of JSON",
                             "chat_template_kwargs")
    if effort is None:
        return dict(value)
    return {"enable_thinking": effort != "none", **value, "reasoning_effort": effort}


def allowed_token_ids(value: list[int] | None) -> list[int]:
    """vLLM's `allowed_token_ids`: only these are sampled; not empty, ids >= 0 (beyond the vocabulary:
    the engine's 400)."""
    if value is not None and (not value or min(value) < 0):
        raise InvalidRequest("allowed_token_ids takes a non-empty list of token ids (>= 0)", "allowed_token_ids")
    return sorted(set(value or ()))


def bad_words(value: list[str] | None) -> list[str]:
    """vLLM's `bad_words`: words never generated (each as its token sequences, with and without a
    leading space: the engine); none may be empty or blank."""
    if any(not w.strip() or len(w) > 200 for w in value or ()):
        raise InvalidRequest("bad_words takes non-blank words of at most 200 characters", "bad_words")
    return list(value or ())


def stop_token_ids(value: list[int] | None) -> list[int]:
    """vLLM's `stop_token_ids`: non-negative ids (beyond the vocabulary: the engine's 400)."""
    if any(t < 0 for t in value or ()):
        raise InvalidRequest("stop_token_ids are token ids (>= 0)", "stop_token_ids")
    return list(value or ())


LOGIT_BIAS_MAX = 300  # OpenAI's limit on the entries of logit_bias


def logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON keys, biases in [-100, 100]) as token id -> bias;
    400 naming the field when a key is not a token id or a bias is out of range. Ids beyond the
    model's vocabulary are the engine's 400 (the gateway does not know the vocabulary)."""
    if len(value or ()) > LOGIT_BIAS_MAX:
        raise InvalidRequest(f"logit_bias has {len(value)} entries; the limit is {LOGIT_BIAS_MAX}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys are token ids; {key!r} is not one", "logit_bias") from None
        if tok < 0 or not -100.0 <= bias <= 100.0:
            raise InvalidRequest(f"logit_bias[{key!r}] = {bias}: ids are >= 0 and biases in [-100, 100]",
                                 "logit_bias")
        out[tok] = float(bias)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` when the engine served part of the
    prompt from its prefix cache (vllm, openai-http), as vLLM's server reports it."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def full_response(*, chat: bool, request_id: str, model: str, texts: list[str], finish: list[str | None],
                  prompt_tokens: int, completion_tokens: int, simulated: bool,
                  cached_tokens: int = 0) -> dict[str, Any]:
    """A non-streamed completion or chat.completion body."""
    choices = []
    for i, (text, reason) in enumerate(zip(texts, finish)):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": reason, "logprobs": None})
        else:
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
    body: dict[str, Any] = {
        "id": request_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model, "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens), "system_fingerprint": "polyserve",
    }
    if simulated:
        body["simulated"] = True
    return body


def whole_token_ids(answer: dict[str, Any], chat: bool, token_ids: list[list[int]],
                    prompt_token_ids: list[list[int] | None]) -> None:
    """vLLM's `return_token_ids` on a whole answer: each choice's `token_ids`; the prompt's ids on
    each choice (completions: one prompt each) or once on the response (chat: one prompt)."""
    for choice, ids, prompt in zip(answer["choices"], token_ids, prompt_token_ids):
        choice["token_ids"] = ids
        if not chat:
            choice["prompt_token_ids"] = prompt
    if chat:
        answer["prompt_token_ids"] = prompt_token_ids[0] if prompt_token_ids else None


def chunk_token_ids(body: dict[str, Any], chat: bool, token_ids: list[int], prompt: list[int] | None) -> None:
    """The same on a streamed chunk: the tokens it adds, the prompt's ids on a choice's first chunk."""
    body["choices"][0]["token_ids"] = token_ids
    if prompt is not None:
        (body if chat else body["choices"][0])["prompt_token_ids"] = prompt


def stream_chunk(*, chat: bool, request_id: str, model: str, index: int, text: str,
                 finish_reason: str | None, first: bool, simulated: bool) -> dict[str, Any]:
    """One SSE chunk of a streamed completion or chat completion."""
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    body: dict[str, Any] = {"id": request_id, "object": obj, "created": int(time.time()), "model": model,
                            "choices": [choice], "system_fingerprint": "polyserve"}
    if simulated:
        body["simulated"] = True
    return body


def usage_chunk(*, chat: bool, request_id: str, model: str, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The final chunk of a stream when `stream_options.include_usage` is set."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            408: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
            429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable",
            504: "timeout"}.get(status, "server_error")
