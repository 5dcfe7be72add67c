"""What one completion request ended with (`RequestRun.collect`), and several merged into one."""
from __future__ import annotations

from dataclasses import dataclass, field

from polyserve.proto import TokenLogprob


@dataclass
class Outcome:
    texts: list[str]
    finish: list[str | None]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    simulated: bool = False
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # per choice (params.logprobs set)
    prompt_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)  # per choice
    prompts: list[str] = field(default_factory=list)  # per choice: the prompt it answers (echo)
    token_ids: list[list[int]] = field(default_factory=list)  # per choice (params.return_token_ids)
    prompt_token_ids: list[list[int] | None] = field(default_factory=list)  # per choice
    cached_tokens: int = 0  # of prompt_tokens, those the engine took from its prefix cache


def merge(outs: list[Outcome]) -> Outcome:
    """One Outcome for a batch: choices in prompt order (index = prompt * n + j), usage summed."""
    if len(outs) == 1:
        return outs[0]
    return Outcome(texts=[t for o in outs for t in o.texts], finish=[f for o in outs for f in o.finish],
                   prompt_tokens=sum(o.prompt_tokens for o in outs),
                   completion_tokens=sum(o.completion_tokens for o in outs),
                   simulated=any(o.simulated for o in outs), logprobs=[x for o in outs for x in o.logprobs],
                   prompt_logprobs=[x for o in outs for x in o.prompt_logprobs],
                   prompts=[x for o in outs for x in o.prompts], token_ids=[x for o in outs for x in o.token_ids],
                   prompt_token_ids=[x for o in outs for x in o.prompt_token_ids],
                   cached_tokens=sum(o.cached_tokens for o in outs))
