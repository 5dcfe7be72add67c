"""The wide corpus for out-of-distribution evaluation (issue 17): every prompt set in
``../shared/datasets/text/`` that has model answers, one row per (prompt, answering model).

Sources (the ``source`` field of a row; the folder names of the datasets README):

* ``alpaca_eval``: 805 instructions x 31 models; the ``_concise`` / ``_verbose`` runs are kept
  as their own target models, with the hint they were given appended to the prompt (so the
  prompt says what the model was told);
* ``flask``: 1,700 prompts x 13 models; ``mt_bench`` (80 x 32, first turn), ``mt_bench_pl``
  (80 x 11, Polish, first turn), ``vicuna_bench`` (80 x 7), ``lima_test`` (300 x 4),
  ``llmzoo`` (70 English + 70 Chinese x 7), ``pandalm`` (170 instructions, answers of five 7B
  models), ``hh_rlhf`` (red-team dialogues; the chosen last reply of Anthropic's 52B model),
  ``gpteacher`` and ``codealpaca`` (one answering model each);
* ``self_instruct``: 252 tasks x 7 GPT-3 models; **test only** (its authors ask that it not
  be trained on), and without the ``davinci`` base model (it runs on to its token limit, so
  its lengths say nothing about the prompt).

Second turns of MT-bench are left out: their prompt holds the model's own first answer.

**Deduplication**: prompts recur across sets (the Vicuna and self-instruct prompts are in
alpaca_eval, FLASK, LLMZoo, PandaLM). A (normalised prompt, canonical model name) pair is
kept once, from the first source in `SOURCES` order. The in-distribution split is by prompt
text (`data.split_of`), so a prompt is in one split whatever set it came from; the
out-of-distribution folds (`ood`) drop from training every prompt of the held-out set.

Lengths are WordPiece tokens of the encoder's tokenizer (as `data`), not the target models'.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from polyserve.core.model_names import canonical
from polyserve.predictor.proxy import data

logger = logging.getLogger(__name__)

SOURCES = ("alpaca_eval", "flask", "mt_bench", "mt_bench_pl", "vicuna_bench", "lima_test", "llmzoo", "pandalm",
           "hh_rlhf", "gpteacher", "codealpaca", "self_instruct")
TEST_ONLY = frozenset({"self_instruct"})
HH_MODEL = "anthropic-52b-context-distilled"
CONCISE = "Be as concise as possible while still providing all the necessary information to answer the question."
VERBOSE = "Answer with as much detail as possible."

Example = tuple[str, str, str, str]  # prompt, answer, model, source


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _alpaca_eval(d: Path) -> Iterator[Example]:
    for f in sorted((d / "alpaca_eval").glob("*.json")):
        hint = CONCISE if f.stem.endswith("_concise") else VERBOSE if f.stem.endswith("_verbose") else ""
        for item in json.loads(f.read_text(encoding="utf-8")):
            prompt = (item.get("instruction") or "").strip()
            if prompt and item.get("output"):
                yield (f"{prompt}\n\n{hint}" if hint else prompt), item["output"], f.stem, "alpaca_eval"


def _turn_sets(d: Path, folder: str, source: str) -> Iterator[Example]:
    """MT-bench format (question.jsonl + model_answer/<model>.jsonl), first turn only."""
    qs = {q["question_id"]: q["turns"][0] for q in _jsonl(d / folder / "question.jsonl")}
    for f in sorted((d / folder / "model_answer").glob("*.jsonl")):
        for a in _jsonl(f):
            turns = a.get("choices", [{}])[0].get("turns") or []
            if a.get("question_id") in qs and turns and turns[0]:
                yield qs[a["question_id"]].strip(), turns[0], f.stem, source


def _flask(d: Path) -> Iterator[Example]:
    qs = {q["question_id"]: q["text"] for q in _jsonl(d / "flask" / "flask_evaluation_raw.jsonl")}
    for f in sorted((d / "flask" / "outputs").glob("*.jsonl")):
        for a in _jsonl(f):
            if a.get("question_id") in qs and a.get("text"):
                yield qs[a["question_id"]].strip(), a["text"], f.stem, "flask"


def _qa_sets(d: Path, qfiles: list[Path], answers: Path, source: str) -> Iterator[Example]:
    """Vicuna-bench / LLMZoo format: questions with `text`, answer_<model>.jsonl joined on question_id."""
    qs = {q["question_id"]: q["text"] for qf in qfiles for q in _jsonl(qf)}
    for f in sorted(answers.glob("answer_*.jsonl")):
        for a in _jsonl(f):
            if a.get("question_id") in qs and a.get("text"):
                yield qs[a["question_id"]].strip(), a["text"], f.stem.removeprefix("answer_"), source


def _pandalm(d: Path) -> Iterator[Example]:
    for item in json.loads((d / "pandalm" / "testset-v1.json").read_text(encoding="utf-8")):
        prompt = data._prompt(item["instruction"], item.get("input"))
        m1, _, m2 = item["cmp_key"].partition("_")
        for model, resp in ((m1, item.get("response1")), (m2, item.get("response2"))):
            if prompt and resp and model:
                yield prompt, resp, model, "pandalm"


def _hh_rlhf(d: Path) -> Iterator[Example]:
    with gzip.open(d / "hh_rlhf" / "harmless-base_test.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            dialogue = json.loads(line)["chosen"]
            head, sep, reply = dialogue.rpartition("\n\nAssistant:")
            if sep and head.strip() and reply.strip():
                yield (head + sep).strip(), reply.strip(), HH_MODEL, "hh_rlhf"


def _self_instruct(d: Path) -> Iterator[Example]:
    for f in sorted((d / "self_instruct_user_oriented" / "predictions").glob("*_predictions.jsonl")):
        model = f.stem.removesuffix("_predictions")
        if model == "davinci":
            continue
        for a in _jsonl(f):
            prompt = data._prompt(a.get("instruction", ""), a.get("input"))
            if prompt and a.get("response"):
                yield prompt, a["response"], model, "self_instruct"


def _single(d: Path) -> Iterator[Example]:
    """GPTeacher and Code Alpaca: one answering model each (as `data.read_examples` reads them)."""
    for folder, model, key in (("gpteacher", data.GPTEACHER_MODEL, "response"),
                               ("codealpaca", data.CODEALPACA_MODEL, "output")):
        for f in sorted((d / folder).glob("*.json")):
            for item in json.loads(f.read_text(encoding="utf-8")):
                prompt = data._prompt(item["instruction"], item.get("input"))
                if prompt and item.get(key) is not None:
                    yield prompt, item[key], model, folder


def read_all(d: Path) -> Iterator[Example]:
    """Every example of every source, in `SOURCES` order."""
    yield from _alpaca_eval(d)
    yield from _flask(d)
    yield from _turn_sets(d, "mt_bench", "mt_bench")
    yield from _turn_sets(d, "mt_bench_pl", "mt_bench_pl")
    yield from _qa_sets(d, [d / "vicuna_bench" / "question.jsonl"], d / "vicuna_bench" / "answer", "vicuna_bench")
    yield from _turn_sets(d, "lima_test", "lima_test")
    yield from _qa_sets(d, sorted((d / "llmzoo").glob("questions-*.jsonl")), d / "llmzoo" / "answers", "llmzoo")
    yield from _pandalm(d)
    yield from _hh_rlhf(d)
    yield from _single(d)
    yield from _self_instruct(d)


def corpus_hash(d: Path, tokenizer: str) -> str:
    """Hash of the file names and sizes under `d` (cheap; the files are never edited in place)."""
    h = hashlib.sha256(f"corpus-v1|{tokenizer}".encode())
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(d)}:{f.stat().st_size}".encode())
    return h.hexdigest()


def build(text_dir: str | Path, tokenizer, tokenizer_name: str, *, cache_dir: str | Path | None = None,
          seed: int = 0) -> data.Dataset:
    """Rows of every source, deduplicated, lengths counted, split by prompt; cached in `cache_dir`."""
    d = Path(text_dir)
    h = corpus_hash(d, tokenizer_name)
    cached = Path(cache_dir) / f"corpus-{h[:16]}.jsonl" if cache_dir else None
    if cached is not None and cached.is_file():
        return data.Dataset.load(cached)
    seen: set[tuple[str, str]] = set()
    examples: list[Example] = []
    for p, a, m, src in read_all(d):
        if not isinstance(p, str) or not isinstance(a, str):
            continue  # a few answers are null or lists in the published files
        key = (data.normalise(p), canonical(m))
        if key not in seen:
            seen.add(key)
            examples.append((p, a, m, src))
    out_tok = data.count_tokens([e[1] for e in examples], tokenizer)
    in_tok = data.count_tokens([e[0] for e in examples], tokenizer)
    rows = [data.Row(prompt=p, model=m, output_tokens=o, input_tokens=i, source=src,
                     split=data.split_of(p, seed))
            for (p, _, m, src), o, i in zip(examples, out_tok, in_tok) if o > 0]
    ds = data.Dataset(rows, h, tokenizer_name)
    logger.info("corpus: %d rows, %d prompts, %d models from %d sources", len(rows),
                len({data.normalise(r.prompt) for r in rows}), len({r.model for r in rows}),
                len({r.source for r in rows}))
    if cached is not None:
        ds.save(cached)
    return ds
