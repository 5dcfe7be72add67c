"""A chat's messages through a checkpoint's own chat template (transformers' `apply_chat_template`),
as the workers (hf, vllm, openai-http) run chats and the gateway's `/tokenize` counts them. No
template: None, and the gateway's role-prefixed transcript (`proto.chat_transcript`) is used.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


class TemplateRefused(ValueError):
    """The template raised for these messages (e.g. roles that do not alternate): the client's 400."""


# apply_chat_template's own keywords, and what render sets: a request's template variables may not be these
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def render(tokenizer, messages: list[dict], adds_bos: bool | None = None, end: str = "open",
           tools: list[dict] | None = None, extra: dict | None = None) -> str | None:
    """`messages` through the tokenizer's chat template (None when it has no template), ending as
    `end` says (`GenerateRequest.chat_end`): "open" with the assistant's turn opened
    (add_generation_prompt), "closed" after the last message, "continue" inside the last message
    (transformers' continue_final_message). A template that writes the BOS token's text itself
    (Llama 3, Mistral, Gemma) would get a second BOS from a tokenizer that adds one to a text
    prompt (`adds_bos`; None: whether `tokenizer.encode` does), so that text is dropped here.

    `tools` (and messages with `tool_calls` or the tool role) go to the template only when its
    source reads them (`handles_tools`): a template that does not would drop the tool definitions
    or the calls without a word, so such a chat is None here and keeps the gateway's transcript,
    which lists them. `extra`: more template variables (vLLM's chat_template_kwargs; never one of
    RESERVED_KWARGS, which the gateway refuses)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if (tools or calls) and not handles_tools(tokenizer, bool(tools), calls):
        return None
    if adds_bos is None:
        bos_id = getattr(tokenizer, "bos_token_id", None)
        adds_bos = bos_id is not None and list(tokenizer.encode(""))[:1] == [bos_id]
    try:
        kw: dict = {k: v for k, v in (extra or {}).items() if k not in RESERVED_KWARGS}
        if end == "continue":  # (left out by default: older tokenizers lack the keyword)
            kw["continue_final_message"] = True
        if tools:
            kw["tools"] = tools
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=end == "open", **kw)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, ...
        raise TemplateRefused(f"the model's chat template refused these messages: {exc}") from exc
    bos = getattr(tokenizer, "bos_token", None)
    if adds_bos and isinstance(bos, str) and bos and text.startswith(bos):
        text = text[len(bos):]
    return text


def handles_tools(tokenizer, listed: bool, calls: bool) -> bool:
    """Whether the tokenizer's chat template reads tool definitions (`listed`: its source names
    `tools`) and earlier turns' calls and results (`calls`: it names `tool_calls` and the tool role)."""
    src = tokenizer.chat_template
    src = src if isinstance(src, str) else json.dumps(src)
    return (not listed or "tools" in src) and (not calls or ("tool_calls" in src and "tool" in src.replace(
        "tool_calls", "").replace("tools", "")))


def has_template(path: str | Path) -> bool:
    """Whether the checkpoint directory `path` has a chat template (tokenizer_config.json or chat_template.jinja)."""
    root = Path(path).expanduser()
    if (root / "chat_template.jinja").is_file():
        return True
    cfg = root / "tokenizer_config.json"
    try:
        return cfg.is_file() and bool(json.loads(cfg.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return False


def load_tokenizer(path: str):
    """The HF tokenizer of the checkpoint directory `path` when it has a chat template, else None
    (no directory, no template, or no transformers installed: the transcript is used)."""
    root = Path(path).expanduser() if path else None
    if root is None or not root.is_dir() or not has_template(root):
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as exc:  # noqa: BLE001 - a tokenizer we cannot read: the transcript, as before
        logger.warning("cannot load the chat template of %s (%s); chats run as the transcript", root, exc)
        return None
