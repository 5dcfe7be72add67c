"""Conversation workloads for `polyserve bench prefix` from real multi-turn text (an out-of-
distribution check beside Mooncake's block-hash trace): every turn's prompt is the conversation so
far, so it starts with the turn before.

* `hh_rlhf`: Anthropic's harmless-base test dialogues (`text/hh_rlhf/harmless-base_test.jsonl.gz`,
  the `chosen` side): a request per human turn, its answer the assistant turn after it;
* `mt_bench`: MT-bench's 80 two-turn questions, as answered by each of the 32 models of
  `text/mt_bench/model_answer/` (the second turn carries that model's first answer).

Each prompt is a one-line system prompt, then `USER:` / `ASSISTANT:` turns (Vicuna's layout).
Tokens are counted as characters / 4 (no tokenizer: the figures are simulated anyway), and the
engine's cache blocks are 16 tokens (vLLM's default), named by a chained hash of the prompt's
64-character pieces. Conversations start as a Poisson process at `rate` per second (seeded); a
conversation's next turn comes after its answer (output tokens × 30 ms) and a think time
(exponential, mean 20 s). Open loop: a turn does not wait for the simulated answer.
"""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from polyserve.bench.prefix import Req
from polyserve.shared.paths import datasets_dir

SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
          "helpful, detailed, and polite answers to the user's questions.")
CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
WORKLOADS = ("hh_rlhf", "mt_bench")


def _blocks(text: str) -> list[int]:
    h, out, step = 0, [], BLOCK_TOKENS * CHARS_PER_TOKEN
    for i in range(0, len(text) - step + 1, step):
        h = hash((h, text[i:i + step]))
        out.append(h)
    return out


def _hh_rlhf(root: Path) -> list[list[tuple[str, str]]]:
    """Dialogues as [(user turn, assistant answer), ...]."""
    out = []
    with gzip.open(root / "text" / "hh_rlhf" / "harmless-base_test.jsonl.gz", "rt") as f:
        for line in f:
            turns = []
            for part in json.loads(line)["chosen"].split("\n\nHuman: ")[1:]:
                user, _, answer = part.partition("\n\nAssistant: ")
                turns.append((user.strip(), answer.strip()))
            if turns:
                out.append(turns)
    return out


def _mt_bench(root: Path) -> list[list[tuple[str, str]]]:
    base = root / "text" / "mt_bench"
    questions = {}
    with open(base / "question.jsonl") as f:
        for line in f:
            q = json.loads(line)
            questions[q["question_id"]] = q["turns"]
    out = []
    for path in sorted((base / "model_answer").glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                a = json.loads(line)
                answers = a["choices"][0]["turns"]
                qs = questions.get(a["question_id"], [])
                out.append([(q, ans) for q, ans in zip(qs, answers)])
    return out


def conversations(name: str, rate: float, limit: int, seed: int = 0) -> list[Req]:
    """The requests of workload `name` (WORKLOADS), sorted by arrival."""
    root = datasets_dir()
    dialogues = _hh_rlhf(root) if name == "hh_rlhf" else _mt_bench(root)
    rng = random.Random(seed)
    rng.shuffle(dialogues)
    if limit:
        dialogues = dialogues[:limit]
    reqs, start = [], 0.0
    for c, turns in enumerate(dialogues):
        start += rng.expovariate(rate)
        t, text = start, SYSTEM
        for k, (user, answer) in enumerate(turns):
            text += f"\nUSER: {user}\nASSISTANT:"
            out_tokens = max(1, len(answer) // CHARS_PER_TOKEN)
            reqs.append(Req(f"c{c}t{k}", t, max(1, len(text) // CHARS_PER_TOKEN), out_tokens, _blocks(text), text))
            text += f" {answer}"
            t += out_tokens * 0.03 + rng.expovariate(1 / 20.0)
    reqs.sort(key=lambda r: r.arrival)
    return reqs
