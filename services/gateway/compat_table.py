"""The OpenAI/vLLM request-field contract of the gateway, as data: for every request field
of the OpenAI API that vLLM's OpenAI-compatible server (0.33) accepts, per endpoint, whether
polyserve honours it, refuses it (400 naming the field) or ignores it on purpose (with the
reason). `compat.py` enforces it, docs/openai-compatibility.md is generated from it
(`python -m polyserve.gateway.compat`) and tests/integration/test_openai_compat.py walks it
with the official `openai` client, so the three cannot drift apart.

A refused field is still accepted at its no-op values (`noop`: e.g. `echo: false`,
`logprobs: null`), which clients send by default. `example` is a value that the
conformance test sends (never a no-op). Engines: what one engine does differently from
the rest goes into `engines`; everything else goes through the same wire SamplingParams."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"
GENERATIVE = ("sim", "hf", "vllm", "openai-http")
ENGINES = GENERATIVE + ("encoder",)
ENDPOINTS = {  # endpoint -> (method and path, the engines that serve it)
    "completions": ("POST /v1/completions", GENERATIVE),
    "chat": ("POST /v1/chat/completions", GENERATIVE),
    "embeddings": ("POST /v1/embeddings", ("encoder",)),
    "tokenize": ("POST /tokenize", ("hf", "vllm", "openai-http", "encoder")),  # sim: 501, no token ids
    "detokenize": ("POST /detokenize", ("hf", "vllm", "openai-http", "encoder")),
    "responses": ("POST /v1/responses", GENERATIVE),
}
LATER = "not implemented: vLLM-only token-id output"


@dataclass(frozen=True)
class Rule:
    status: str
    why: str
    noop: tuple = ()  # values accepted although the field is refused (they ask for nothing)
    example: Any = None  # a value the conformance test sends; None: not walked (shape needs a worker)
    engines: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # engine -> (status, why) where it differs

    def status_for(self, engine: str) -> str:
        return self.engines.get(engine, (self.status, self.why))[0]

    def why_for(self, engine: str) -> str:
        return self.engines.get(engine, (self.status, self.why))[1]


def H(why: str, example: Any = None, **engines: tuple[str, str]) -> Rule:
    return Rule(HONOURED, why, example=example, engines=engines)


def R(why: str, noop: tuple = (None,), example: Any = None) -> Rule:
    return Rule(REFUSED, why, noop=noop, example=example)


def I(why: str, example: Any = None) -> Rule:
    return Rule(IGNORED, why, example=example)


LOGPROBS_VLLM = (HONOURED, "SamplingParams.logprobs / prompt_logprobs; vLLM's own values (its "
                 "`logprobs_mode`, default raw_logprobs; at most its max_logprobs, 20 by default)")
LOGPROBS_UPSTREAM = (HONOURED, "passed upstream as completions `logprobs: k` (prompt logprobs: `echo`, "
                     "sent unstreamed); token ids are not on that wire; a server that ignores them (e.g. "
                     "`transformers serve`) is a 502 saying so, one that rejects them passes its 4xx on")


def LP(why: str, noop: tuple, example: Any = None) -> Rule:
    """Logprobs/echo: honoured by every generative engine (sim: simulated values; openai-http:
    where the upstream server returns them)."""
    return Rule(HONOURED, why, noop=noop, example=example,
                engines={"vllm": LOGPROBS_VLLM, "openai-http": LOGPROBS_UPSTREAM})


STRUCTURED = ("enforced per token: hf with llguidance masks (EOS only where the grammar may end; "
              "docs/benchmarks/structured-outputs.md), vllm as SamplingParams.structured_outputs "
              "(StructuredOutputsParams), sim with a simulated schema-valid instance (sim_json.py: no "
              "`pattern`, no unusual `format`s: 400)")
SO_UPSTREAM = (HONOURED, "passed upstream: JSON as `response_format` (json_object, json_schema), regex, "
               "choice and grammar as vLLM's `structured_outputs`; the upstream enforces it, and a server "
               "without it (e.g. `transformers serve`) rejects the field: its 4xx is passed on")


def SO(why: str, example: Any, noop: tuple = (None,), sim: bool = False) -> Rule:
    """A structured-output field: honoured by hf, vllm and sim (unless `sim`: refused there),
    and by openai-http where the upstream server enforces it."""
    engines = {"openai-http": SO_UPSTREAM}
    if sim:
        engines["sim"] = (REFUSED, "the sim generates JSON and choices only")
    return Rule(HONOURED, f"{why}; {STRUCTURED}", noop=noop, example=example, engines=engines)


SIM_IGNORES = (IGNORED, "the sim draws pseudo-words (labelled simulated); only seed and temperature 0 shape them")
SIM_NO_IDS = (REFUSED, "the sim draws pseudo-words: it has no token ids")
PEN_UPSTREAM = (HONOURED, "passed upstream (frequency/presence penalty and logit_bias as OpenAI fields, "
                "repetition_penalty and min_p as vLLM's extra fields), where the server applies it: vLLM does; "
                "`transformers serve` maps frequency_penalty to its repetition penalty, ignores presence_penalty "
                "and refuses repetition_penalty / min_p (its 422 is passed on)")

UPSTREAM_VLLM = (HONOURED, "passed upstream as vLLM's extra field (a server without it, e.g. `transformers "
                 "serve`, answers 422, passed on)")


def PEN(why: str, example: Any) -> Rule:
    """A penalty, bias or min-p field: applied to the logits by hf (hf_sampling.sample) and vllm
    (SamplingParams), passed upstream by openai-http, ignored by the sim (no distribution)."""
    return Rule(HONOURED, f"{why}; applied before the token is chosen, greedy decoding too (the logprobs "
                "stay the model's raw ones)", example=example, engines={"sim": SIM_IGNORES,
                                                                          "openai-http": PEN_UPSTREAM})


# Fields of both /v1/completions and /v1/chat/completions.
SAMPLING: dict[str, Rule] = {
    "model": H("a deployment id or model name, or a registered LoRA adapter"),
    "max_tokens": H("per choice; capped by the gateway's max_tokens_limit", 3),
    "n": H("choices per prompt, up to the gateway's max_n", 2),
    "temperature": H("0 is greedy", 0.5, sim=(HONOURED, "0: the same prompt gives the same text")),
    "top_p": H("nucleus sampling", 0.9, sim=SIM_IGNORES),
    "top_k": H("0 or -1: off (vLLM's convention)", 5, sim=SIM_IGNORES),
    "seed": H("the same seed gives the same text", 7),
    "stop": H("up to 4 strings; the text ends before the stop string", ["zzz"]),
    "stream": H("server-sent events, ending with `data: [DONE]`", True),
    "stream_options": H("`include_usage` adds a final usage chunk; `continuous_usage_stats` is ignored: usage "
                        "comes once, in that final chunk (guidellm sends it and reads the last usage)",
                        {"include_usage": True}),
    "min_tokens": H("no EOS and no stop string before this many tokens", 2),
    "ignore_eos": H("generate to max_tokens (min_tokens = max_tokens); refused together with `stop`", True),
    "priority": H("lower is served first, as in vLLM, by workers with a priority-aware `scheduling`", 1),
    "adapter": H("polyserve extension: a registered LoRA adapter of the deployment"),
    "user": I("polyserve keeps no per-user accounting; the field is not forwarded", "someone"),
    "metadata": I("OpenAI's stored-completion tags; polyserve stores no completions", {"k": "v"}),
    "request_id": I("polyserve assigns its own request ids (the response's `id`)", "my-id"),
    "session_id": I("a routing hint; the dispatcher places by load and SLO, not by session", "s1"),
    "stream_interval": I("chunks are relayed as the worker emits them; the text is the same", 2),
    "service_tier": I("polyserve schedules by priority and SLO, not by OpenAI's service tiers", "default"),
    "prompt_cache_key": H("cache affinity (up to 256 characters): requests with one key (per tenant) go to one "
                          "worker while its load stays within `affinity_load_factor` (1.25) x the mean plus 4, so its "
                          "prompt prefix cache serves them (consistent hashing with bounded loads; the gateway places them: "
                          "load-only policies, no LoRA adapter; the dispatcher's policies do not read it)", "k"),
    "safety_identifier": I("polyserve keeps no per-user accounting", "someone"),
    "store": R("polyserve stores no completions", (None, False), True),
    "frequency_penalty": PEN("-2 to 2: each token's logit minus f x its count in the output so far", 0.5),
    "presence_penalty": PEN("-2 to 2: each token's logit minus p once it occurs in the output", 0.5),
    "repetition_penalty": PEN("> 0 (1: off): a token of the prompt or the output has a positive logit divided, "
                              "a negative one multiplied, by it (vLLM's and transformers' rule)", 1.2),
    "logit_bias": PEN("token id -> bias in [-100, 100] added to its logit (-100 bans it, 100 all but forces it), "
                      "up to 300 ids; an id beyond the model's vocabulary is a 400", {"3": -100}),
    "min_p": PEN("0 to 1: after temperature, tokens below min_p x the most likely token's probability are "
                 "dropped", 0.1),
    "use_beam_search": R("no beam search", (None, False), True),
    "length_penalty": R("beam search only; no beam search", (None, 1, 1.0), 0.5),
    "best_of": R("OpenAI's best_of (removed from vLLM): not supported", (None, 1), 2),
    "stop_token_ids": Rule(HONOURED, "up to 64 ids: the answer ends when one is sampled (after min_tokens, as "
                           "EOS), its text not included; an id beyond the model's vocabulary is a 400", example=[2],
                           engines={"sim": (IGNORED, "the sim draws pseudo-words, not token ids; `stop` strings "
                                                     "apply"),
                                    "openai-http": UPSTREAM_VLLM}),
    "include_stop_str_in_output": H("the stop string that ended the text is kept at its end", True,
                                    **{"openai-http": UPSTREAM_VLLM}),
    "skip_special_tokens": Rule(HONOURED, "vLLM's: false keeps the model's special tokens in the text (with tools "
                                "listed and `auto`, chat keeps them anyway, so calls marked by a special token, "
                                "Llama 3.1's `<|python_tag|>` or Mistral's `[TOOL_CALLS]`, are found)", example=False,
                                noop=(None, True), engines={"sim": (IGNORED, "the sim's text has no special tokens"),
                                                            "openai-http": UPSTREAM_VLLM}),
    "spaces_between_special_tokens": R("special tokens are always skipped", (None, True), False),
    "truncate_prompt_tokens": H("k: the prompt's last k tokens are kept (its left side cut, as vLLM cuts for "
                                "generation); -1: its last max_input_len tokens (the worker's limit); without it "
                                "an over-long prompt is a 400; not with `echo`", 8,
                                **{"openai-http": UPSTREAM_VLLM}),
    "truncation_side": R("prompts are cut on the left only (truncate_prompt_tokens)", (None, "left"), "right"),
    "allowed_token_ids": Rule(HONOURED, "vLLM's: only these token ids are sampled (not empty; an id beyond the "
                              "model's vocabulary is a 400); greedy decoding too", example=[1, 2],
                              engines={"sim": SIM_IGNORES, "openai-http": UPSTREAM_VLLM}),
    "bad_words": Rule(HONOURED, "vLLM's: up to 128 words never generated: each word's tokens, with and without a "
                      "leading space, are kept from completing (its last token is barred after the others)",
                      example=["bad"], noop=(None, []), engines={"sim": SIM_IGNORES, "openai-http": UPSTREAM_VLLM}),
    "prompt_logprobs": Rule(HONOURED, "vLLM's: 0-20; each prompt token's logprob and rank with its k best "
                            "alternatives, as vLLM's dicts keyed by token id (the first token: null); completions: "
                            "on each choice, chat: on the response; not with stream (400); with `echo` its "
                            "k wins", example=1, engines={
                                "sim": SIM_NO_IDS,
                                "openai-http": (REFUSED, "an upstream's prompt logprobs carry no token ids")}),
    "logprob_token_ids": R(LATER, (None,), [1]),
    "return_tokens_as_token_ids": Rule(HONOURED, "vLLM's: with `logprobs`, each token and alternative as the "
                                       "string `token_id:N` (text offsets counted on those strings; chat's "
                                       "`bytes`: the token's text, an alternative's: the string's, as vLLM's)",
                                       example=True, noop=(None, False), engines={
                                           "sim": SIM_NO_IDS,
                                           "openai-http": (REFUSED, "an upstream's logprobs carry token text, "
                                                           "no ids")}),
    "return_token_ids": Rule(HONOURED, "vLLM's: each choice's `token_ids` (every token generated, EOS and stop "
                             "tokens too; streamed: those of each chunk) and the prompt's `prompt_token_ids` (after "
                             "any truncation; completions: on each choice, chat: on the response; streamed: on the "
                             "first chunk)", example=True, noop=(None, False),
                             engines={"sim": SIM_NO_IDS,
                                      "openai-http": (HONOURED, "passed upstream as vLLM's field and its "
                                                      "`token_ids` / `prompt_token_ids` read back; a server that "
                                                      "leaves them out (e.g. `transformers serve`) is a 502 saying so")}),
    "return_token_offsets": R("responses carry text only", (None, False), True),
    "return_weight_versions": R("no weight versions", (None, False), True),
    "routed_experts_prompt_start": R("no expert routing data", (None, 0), 1),
    "response_format": SO("`text`, `json_object`, `json_schema` (its `schema`; the output always matches it, so "
                          "`strict` is implied)", {"type": "json_object"}, noop=(None, {"type": "text"})),
    "structured_outputs": SO("vLLM's: exactly one of `json`, `json_object`, `regex`, `choice`, `grammar` (other keys: "
                             "400); sim: `json`, `json_object`, `choice` (400 for regex and grammar)",
                             {"choice": ["a", "b"]}),
    "guided_json": SO("vLLM's older name for structured_outputs.json", {"type": "object"}),
    "guided_regex": SO("vLLM's older name for structured_outputs.regex", "[a-z]+", sim=True),
    "guided_choice": SO("vLLM's older name for structured_outputs.choice", ["a", "b"]),
    "guided_grammar": SO("vLLM's older name for structured_outputs.grammar: Lark, or GBNF/EBNF (`::=` rules)",
                         "root ::= \"a\"", sim=True),
    "guided_decoding_backend": I("polyserve's hf engine always uses llguidance; vLLM uses its configured backend",
                                 "xgrammar"),
    "guided_whitespace_pattern": R("no whitespace control: constrained JSON is compact on hf", (None,), " "),
    "prompt_embeds": R("text prompts only", (None,), "AAAA"),
    "mm_payload": R("no multimodal inputs", (None, "tensors"), "none"),
    "return_mm_kwargs": R("no multimodal inputs", (None, False), True),
    "mm_processor_kwargs": R("no multimodal inputs", (None, {}), {"x": 1}),
    "cache_salt": Rule(HONOURED, "vLLM's (1-256 characters): requests share cached prompt prefixes only with "
                       "equal salts; the engine's salt is a hash of the API key's tenant and this salt, so no two "
                       "tenants share and none can pick another's (docs/security.md)", example="salt", engines={
                           "vllm": (HONOURED, "TokensPrompt.cache_salt; requests with a client key are salted by "
                                    "tenant even without it (worker setting cache_salt_tenants)"),
                           "openai-http": (HONOURED, "passed upstream as vLLM's field, hashed with the tenant (a "
                                           "server without it, e.g. `transformers serve`, answers 422, passed on); "
                                           "cache_salt_tenants=on salts every keyed request for a vLLM upstream"),
                           "hf": (HONOURED, "the hf engine shares no KV cache between requests: nothing to salt"),
                           "sim": (HONOURED, "the sim keeps no KV cache: nothing to salt")}),
    "kv_transfer_params": R("no KV transfer between engines", (None,), {"x": 1}),
    "ec_transfer_params": R("no encoder-cache transfer", (None,), {"x": 1}),
    "vllm_xargs": R("no extra engine arguments per request", (None, {}), {"x": 1}),
    "repetition_detection": R("not applied", (None,), {"x": 1}),
    "thinking_token_budget": R("no reasoning budget", (None,), 10),
    "watermarking": R("no watermarking", (None, False), True),
}

COMPLETIONS: dict[str, Rule] = {
    **SAMPLING,
    "prompt": H("a string, or a list of strings (each its own request; choice index = prompt × n + j); "
                "token-id prompts are refused (workers take text)", ["one", "two"]),
    "echo": LP("the prompt leads each choice's text; with `logprobs`, its tokens and logprobs lead "
               "`logprobs` (first token: null)", (None, False), True),
    "logprobs": LP("0-20 alternatives per token: {tokens, token_logprobs, top_logprobs, text_offset}; "
                   "log-softmax of the raw model distribution (vLLM's default `raw_logprobs`: before "
                   "temperature, top-k/top-p); sim: simulated values", (None,), 2),
    "suffix": R("no insertion (fill-in-the-middle)", (None, ""), "end"),
    "add_special_tokens": R("the engine adds the special tokens its model needs", (None, True), False),
}

CHAT: dict[str, Rule] = {
    **SAMPLING,
    "messages": H("text content (strings or `text` parts); an hf, vllm or openai-http worker whose checkpoint "
                  "has a chat template formats them with it (one BOS; a template that refuses them is a 400); an "
                  "openai-http worker without one sends them (not with earlier tool calls) to its upstream's "
                  "/v1/chat/completions (`upstream_chat`); "
                  "tools and calls go to that template only where it reads them; otherwise a role-prefixed "
                  "transcript (with `tools` listed or called: the transcript of services/gateway/tools.py, assistant "
                  "`tool_calls` as the calls' JSON, `tool` results as `tool:` lines); other content parts are "
                  "refused"),
    "max_completion_tokens": H("as max_tokens (wins over it)", 3),
    "logprobs": LP("`logprobs.content`: token, logprob, bytes and `top_logprobs` per token; log-softmax of "
                   "the raw model distribution (vLLM's default `raw_logprobs`); sim: simulated values",
                   (None, False), True),
    "top_logprobs": LP("0-20 alternatives per token, most likely first; needs `logprobs: true` (400 "
                       "otherwise, as in vLLM)", (None, 0)),
    "echo": R("vLLM's chat echo (repeat the last message) is not served", (None, False), True),
    "tools": Rule(HONOURED, "functions, listed in the prompt with their parameter schemas: by the checkpoint's chat "
                  "template where it reads tools (hf, vllm, openai-http with a checkpoint), else by the gateway's "
                  "transcript (services/gateway/tools.py); openai-http without a checkpoint sends an `auto` tool chat to "
                  "its upstream's chat endpoint with the tools (its template and tool parser; its `tool_calls` come "
                  "back as calls) and a forced call as a completion under the call's schema; "
                  "a call comes back as `message.tool_calls` (streamed: `delta.tool_calls`), finish_reason "
                  "`tool_calls`", noop=(None, []),
                  example=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice": Rule(HONOURED, "`required` or a named function: the call's JSON is generated under its "
                        "schema (constrained decoding, as response_format), so it always parses; `auto`: free "
                        "text, returned as calls when the whole answer is calls: the gateway's JSON or the formats "
                        "models are trained on (Hermes/Qwen `<tool_call>`, Mistral `[TOOL_CALLS]`, Llama 3.1 "
                        "`<|python_tag|>` / `parameters`), several as parallel calls (random weights: text); text "
                        "then calls in one of the marked formats: the text as `content` beside the calls; `none`",
                        noop=(None, "none", "auto")),
    "parallel_tool_calls": I("a forced call is one call; with `auto` every call the answer holds is returned "
                             "(parallel calls are never asked for in the prompt)", False),
    "functions": R("OpenAI's deprecated functions API: send `tools`", (None, []), [{"name": "f", "parameters": {}}]),
    "function_call": R("OpenAI's deprecated functions API: send `tool_choice`", (None, "none", "auto"),
                       {"name": "f"}),
    "reasoning_effort": H("vLLM's: none, minimal, low, medium, high, xhigh or max, passed to the model's chat "
                          "template as `reasoning_effort`, with `enable_thinking` false for none and true otherwise "
                          "unless chat_template_kwargs sets it (a template that reads neither is unchanged)", "low",
                          sim=(IGNORED, "the sim runs the transcript: no chat template")),
    "include_reasoning": H("a deployment with a `reasoning_parser` (qwen3, deepseek_r1: vLLM's) returns a thinking "
                           "model's reasoning as the message's `reasoning` (streamed: `delta.reasoning`), apart from "
                           "its `content`; false leaves it out; without a parser the model's text is all content",
                           False),
    "thinking_token_budget": H("vLLM's: a `reasoning_parser` deployment's model thinks at most this many tokens, "
                               "then `</think>` is forced and the answer follows (hf; vllm with `reasoning_config` "
                               "in its engine args; openai-http: passed upstream; sim: it does not think); a "
                               "deployment without a parser: 400", 0),
    "verbosity": R("no verbosity control", (None,), "low"),
    "modalities": R("text output only", (None, ["text"]), ["text", "audio"]),
    "audio": R("text output only", (None,), {"voice": "alloy", "format": "wav"}),
    "prediction": R("no predicted outputs", (None,), {"type": "content", "content": "x"}),
    "web_search_options": R("no web search", (None,), {}),
    "add_generation_prompt": H("false: the prompt ends after the last message, without the assistant's opening "
                               "(the chat template's `add_generation_prompt`; the transcript's `assistant:`)", False),
    "continue_final_message": H("the output continues the last message, which must be the assistant's, with "
                                "add_generation_prompt false (as vLLM: both true is a 400); the chat template's "
                                "`continue_final_message`, the transcript's last line; an openai-http upstream "
                                "gets vLLM's field"),
    "add_special_tokens": R("the engine adds the special tokens its model needs", (None, False), True),
    "documents": R("no RAG documents in the prompt", (None,), [{"text": "x"}]),
    "chat_template": R("the checkpoint's own chat template or the transcript; none from the request", (None,),
                       "{{ messages }}"),
    "chat_template_kwargs": H("extra variables for the model's chat template (e.g. `enable_thinking`), where one renders the chat: the "
                              "worker's checkpoint (hf, vllm, openai-http with a local one; an openai-http upstream's chat "
                              "endpoint gets vLLM's field); a chat without a template (the transcript) has no use for them; "
                              "apply_chat_template's own keywords (tools, add_generation_prompt, ...) are a 400",
                              {"enable_thinking": False}, sim=(IGNORED, "the sim runs the transcript: no chat template")),
    "media_io_kwargs": R("no multimodal inputs", (None, {}), {"x": {}}),
    "return_prompt_text": R("responses carry the completion only", (None, False), True),
}

# Fields of a chat message (`messages[i].<field>`).
MESSAGE: dict[str, Rule] = {
    "role": H("system, developer, user, assistant, tool"),
    "content": H("a string or `text` parts; image, audio and file parts are refused"),
    "name": I("a tool result's name goes to a chat template that reads tools (taken from the call it answers "
              "when left out); other messages reach the prompt as their role and text only"),
    "tool_call_id": I("given to a chat template that reads tool results; the transcript renders a tool message "
                      "as `tool: <content>`"),
    "tool_calls": H("an assistant's calls: given to a chat template that reads them (arguments as an object), "
                    "else rendered into the transcript as `{\"name\": ..., \"arguments\": ...}`"),
    "function_call": R("OpenAI's deprecated functions API: send `tool_calls`", (None,)),
    "reasoning_content": I("earlier reasoning is not part of the prompt"),
    "reasoning": I("earlier reasoning is not part of the prompt"),
    "refusal": I("an assistant refusal is not part of the prompt"),
}

EMBEDDINGS: dict[str, Rule] = {
    "model": H("a deployment of the encoder engine"),
    "input": H("a string, a list of strings, token ids or a list of token-id lists"),
    "encoding_format": H("float or base64 (little-endian float32)", "base64"),
    "dimensions": H("only the model's own dimension (no Matryoshka truncation)"),
    "truncate_prompt_tokens": H("-1: cut to the largest runtime; k: cut to k tokens (specials included)", -1),
    "truncate": H("polyserve extension: true is truncate_prompt_tokens -1", True),
    "user": I("polyserve keeps no per-user accounting", "someone"),
    "request_id": I("polyserve assigns its own request ids", "my-id"),
    "priority": I("encoder runtimes serve their queue in order (Arlo)", 1),
    "cache_salt": I("encoders keep no cache across requests", "salt"),
    "add_special_tokens": R("[CLS] and [SEP] are always added", (None, True), False),
    "padding": R("each runtime pads to its own length", (None,), "max_length"),
    "truncation_side": R("inputs are cut on the right", (None, "right"), "left"),
    "embed_dtype": R("float32 only", (None, "float32"), "float16"),
    "endianness": R("little-endian only", (None, "native", "little"), "big"),
    "use_activation": R("the pooled, normalised vector only", (None,), False),
    "normalize": R("vectors are always normalised", (None, True), False),
    "mm_processor_kwargs": R("no multimodal inputs", (None, {}), {"x": 1}),
    "messages": R("chat embeddings are not served: send `input`", (None,), [{"role": "user", "content": "x"}]),
    "add_generation_prompt": R("chat embeddings are not served", (None, False), True),
    "continue_final_message": R("chat embeddings are not served", (None, False), True),
    "chat_template": R("chat embeddings are not served", (None,), "{{ messages }}"),
    "chat_template_kwargs": R("chat embeddings are not served", (None, {}), {"x": 1}),
    "media_io_kwargs": R("no multimodal inputs", (None, {}), {"x": {}}),
}

TOKENIZE: dict[str, Rule] = {
    "model": H("a deployment whose tokenizer the gateway can load (\"Which tokenizer\" above); optional with one deployment"),
    "prompt": H("text, tokenized as the engine tokenizes prompts"),
    "messages": H("through the checkpoint's chat template where it has one (hf, vllm, openai-http), as the "
                  "workers run a chat, else the gateway's role-prefixed transcript"),
    "add_special_tokens": H("default: what the engine does for a prompt", False),
    "add_generation_prompt": H("false leaves the assistant's opening (the transcript's `assistant:`) out", False),
    "return_token_strs": H("adds `token_strs`", True),
    "continue_final_message": H("the last message, the assistant's, is left open (with add_generation_prompt "
                                "false; the template's `continue_final_message`, the transcript's last line)"),
    "chat_template": R("the checkpoint's own chat template or the transcript; none from the request", (None,),
                       "{{ messages }}"),
    "chat_template_kwargs": H("with `messages`: passed to the checkpoint's chat template as chat completions "
                              "pass them", {"enable_thinking": False}),
    "media_io_kwargs": R("no multimodal inputs", (None, {}), {"x": {}}),
    "mm_processor_kwargs": R("no multimodal inputs", (None, {}), {"x": 1}),
    "tools": H("with `messages`: listed as chat completions list them (through the chat template where it "
               "reads tools, else the transcript's `system:` line), so the count is the chat's",
               [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
}

DETOKENIZE: dict[str, Rule] = {
    "model": H("as for /tokenize"),
    "tokens": H("token ids inside the vocabulary"),
}

# Fields of POST /v1/responses (OpenAI's Responses API, and vLLM's extensions of it).
RESPONSES: dict[str, Rule] = {
    "model": H("a deployment id or model name, or a registered LoRA adapter"),
    "input": H("a string (one user message) or items: messages (`role` and string content or `input_text` "
               "(`output_text` for assistant) parts), `function_call` (an earlier call) and `function_call_output` "
               "(its result; a `call_id` that answers no call in the conversation is a 400); other item and part "
               "types are refused (400 `input[i]...`)"),
    "instructions": H("a system message before the conversation; not carried into the next turn", "be brief"),
    "max_output_tokens": H("as max_tokens; reaching it gives `status: incomplete` (reason `max_output_tokens`); "
                           "unset: the gateway's default_max_tokens", 3),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "top_k": SAMPLING["top_k"],
    "seed": SAMPLING["seed"],
    "stop": SAMPLING["stop"],
    "priority": SAMPLING["priority"],
    "stream": H("the Responses SSE events (`response.created` ... `response.completed`), each with a "
                "`sequence_number`", True),
    "previous_response_id": H("continues a stored response: its conversation (input and output, not its "
                              "instructions) comes before `input`; unknown or expired: 404"),
    "store": H("default true: the response and its conversation are kept in Redis for the gateway's "
               "`response_ttl_s` (GET/DELETE /v1/responses/{id}, previous_response_id); false: not kept", False),
    "metadata": H("stored and echoed in the Response object", {"k": "v"}),
    "user": SAMPLING["user"],
    "safety_identifier": SAMPLING["safety_identifier"],
    "prompt_cache_key": SAMPLING["prompt_cache_key"],
    "prompt_cache_retention": I("a cache-routing hint; the dispatcher does not route by cache key", "24h"),
    "service_tier": SAMPLING["service_tier"],
    "request_id": SAMPLING["request_id"],
    "stream_options": I("`include_obfuscation` pads deltas against side channels; polyserve adds no padding",
                        {"include_obfuscation": False}),
    "tools": H("function tools (`name`, `description`, `parameters`), listed in the prompt as on chat "
               "(services/gateway/responses_tools.py); an answer that is calls (after some text in a marked format: "
               "a message item first) comes back as `function_call` output items (streamed: `response.function_call_arguments.delta`/`.done`); built-in tools (web "
               "search, file search, code interpreter, MCP, ...) are refused (400 `tools[i]`)",
               [{"type": "function", "name": "f", "parameters": {}}]),
    "tool_choice": H("as on chat: `required` or `{'type': 'function', 'name': ...}` generate the call's JSON "
                     "under its schema; `auto`; `none`"),
    "parallel_tool_calls": I("as on chat: a forced call is one call; with `auto` every call the answer holds is "
                             "returned", False),
    "max_tool_calls": R("counts calls to built-in tools, which polyserve has none of", (None,), 1),
    "text": H("`format`: `text`, `json_object` or `json_schema` (its `schema`): the output always matches it, as "
              "chat's response_format; `verbosity` is refused", {"format": {"type": "json_object"}}),
    "reasoning": H("`effort` as chat's `reasoning_effort` (vLLM's: to the chat template); `summary` and other keys "
                   "are refused (no reasoning summaries)", {"effort": "low"},
                   sim=(IGNORED, "the sim runs the transcript: no chat template")),
    "include": H("`message.output_text.logprobs`: each output token's logprob (and `top_logprobs` "
                 "alternatives) in the output_text part and the delta events, as chat's logprobs; other values "
                 "(reasoning, tool results, ...) are refused", ["message.output_text.logprobs"]),
    "top_logprobs": H("0-20 alternatives per token, with include `message.output_text.logprobs` (alone, a 400)"),
    "truncation": R("the conversation is never truncated; an over-long one is a 400", (None, "disabled"), "auto"),
    "background": R("responses run in the foreground only", (None, False), True),
    "conversation": R("no Conversations API: chain turns with previous_response_id", (None,), "conv_1"),
    "prompt": R("no stored prompt templates", (None,), {"id": "pmpt_1"}),
    "context_management": R("the conversation is never compacted", (None, []), [{"type": "compaction"}]),
    "frequency_penalty": SAMPLING["frequency_penalty"],
    "presence_penalty": SAMPLING["presence_penalty"],
    "repetition_penalty": SAMPLING["repetition_penalty"],
    "cache_salt": SAMPLING["cache_salt"],
    "mm_processor_kwargs": SAMPLING["mm_processor_kwargs"],
    "previous_input_messages": R("chain turns with previous_response_id", (None, []), [{"role": "user",
                                                                                       "content": "x"}]),
    "enable_response_messages": R("responses carry the Response object only", (None, False), True),
}

TABLES: dict[str, dict[str, Rule]] = {"completions": COMPLETIONS, "chat": CHAT, "embeddings": EMBEDDINGS,
                                      "tokenize": TOKENIZE, "detokenize": DETOKENIZE, "responses": RESPONSES}
