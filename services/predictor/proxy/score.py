"""`polyserve predictor score ROWS.jsonl`: the shipped predictor, as served, on data of your own.

`eval --ood` holds sets and models of this project's corpus out; this scores the artifact on
rows it has certainly never seen, with the same metrics (`ood.score`): a row's true class comes
from its (source, model) group's own p25/p50/p75/p99, accuracy compares it with the predicted
class, tau is Kendall's tau-b of the predicted value against the true length within the group.
Classes are decoded as served (`calibrate`: by rank among the model's earlier predictions, one
traffic stream per group, rows in a fixed hash order).

Input: JSON lines, one answer each: ``prompt`` and ``model`` (the answering model's name), and
``output_tokens`` (an int) or ``response`` (its text, counted with the artifact's tokenizer);
``source`` (the prompt set) is optional, default the file's name. A chat may stand for the prompt:
``messages`` ([{role, content}], OpenAI's shape) becomes the role-prefixed transcript the gateway
asks the predictor about for a chat (`proto.chat_transcript`); when the last message is the
assistant's and neither length field is given, it is the answer. Lengths in the artifact's
tokenizer (WordPiece), as everywhere in `proxy`: a model's own token counts order the rows the
same way, which is all tau and the per-group classes read.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from polyserve.core.model_names import canonical
from polyserve.predictor.proxy import calibrate, data, ood
from polyserve.proto import ChatTurn, chat_transcript

REQUIRED = ("prompt", "model")


def read_rows(path: str | Path, tokenizer) -> list[data.Row]:
    """The file's rows; a line that lacks a field or has the wrong type raises ValueError naming it."""
    path = Path(path)
    raw: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {n}: not JSON ({exc})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}, line {n}: a row is a JSON object")
            if "messages" in item and "prompt" not in item:
                item = _from_chat(item, f"{path}, line {n}")
            missing = [k for k in REQUIRED if not isinstance(item.get(k), str) or not item.get(k)]
            has_len = isinstance(item.get("output_tokens"), int) and not isinstance(item.get("output_tokens"), bool)
            if missing or not (has_len or isinstance(item.get("response"), str)):
                raise ValueError(f"{path}, line {n}: a row needs the strings prompt and model, and output_tokens "
                                 f"(an int) or response (its text); missing or wrong: "
                                 f"{', '.join(missing + ([] if has_len or 'response' in item else ['output_tokens']))}")
            raw.append(item)
    if not raw:
        raise ValueError(f"{path}: no rows")
    texts = [r["response"] for r in raw if not isinstance(r.get("output_tokens"), int)]
    counted = iter(data.count_tokens(texts, tokenizer)) if texts else iter(())
    prompt_tokens = data.count_tokens([r["prompt"] for r in raw], tokenizer)
    return [data.Row(prompt=r["prompt"], model=r["model"],
                     output_tokens=r["output_tokens"] if isinstance(r.get("output_tokens"), int) else next(counted),
                     input_tokens=p, source=str(r.get("source") or path.stem), split="test")
            for r, p in zip(raw, prompt_tokens)]


def _from_chat(item: dict, where: str) -> dict:
    """A row whose prompt is a chat (`messages`) as one with the gateway's transcript of it; its
    last message, the assistant's, is the answer when the row gives no length."""
    msgs = item["messages"]
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} with string values")
    item = dict(item)
    if "output_tokens" not in item and "response" not in item and msgs[-1]["role"] == "assistant":
        item["response"], msgs = msgs[-1]["content"], msgs[:-1]
    if not msgs:
        raise ValueError(f"{where}: messages hold only the answer; the prompt is missing")
    item["prompt"] = chat_transcript([ChatTurn(role=m["role"], content=m["content"]) for m in msgs])
    return item


def run(rows: list[data.Row], predictor, seed: int = 0) -> dict:
    """Figures of `predictor` (a `lexical.LexicalPredictor`) on `rows`: overall, per source, per model."""
    answers, _ = predictor.predict([r.prompt for r in rows], [r.model for r in rows], with_keys=False)
    values = np.array([a.value for a in answers], dtype=np.float64)
    keys = [(r.source, canonical(r.model)) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: ood._h(f"{rows[i].prompt}\0{rows[i].model}", seed))
    calib = predictor.meta.extra.get("calibration")
    cls = calibrate.stream_classes(keys, [r.model for r in rows], values, calib, order) if calib else \
        np.searchsorted(predictor.thresholds, values, side="right")
    out = {"all": ood.score(rows, values, cls), "by_source": {}, "by_model": {}}
    for field, name in (("by_source", lambda r: r.source), ("by_model", lambda r: r.model)):
        idx: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(rows):
            idx[name(r)].append(i)
        for k, ix in sorted(idx.items()):
            sub = [rows[i] for i in ix]
            out[field][k] = ood.score(sub, values[ix], cls[ix])
    out["known_models"] = sorted({r.model for r, a in zip(rows, answers) if a.known_model})
    return out


def render(out: dict) -> str:
    lines = [f"{'rows':<34}{'n':>7}{'accuracy':>10}{'tau':>8}"]

    def row(label, s):
        lines.append(f"{label[:33]:<34}{s.n:>7}{s.accuracy:>10.3f}{s.tau:>8.3f}")
    row("all", out["all"])
    for field in ("by_source", "by_model"):
        for k, s in out[field].items():
            row(f"  {field[3:]} {k}", s)
    unknown = sorted(set(out["by_model"]) - set(out["known_models"]))
    lines.append(f"models the artifact knows by name: {', '.join(out['known_models']) or 'none'}; "
                 f"unseen (its unknown-model row): {', '.join(unknown) or 'none'}")
    return "\n".join(lines)


def to_json(out: dict) -> dict:
    return {"all": out["all"].to_json(), "known_models": out["known_models"],
            **{f: {k: s.to_json() for k, s in out[f].items()} for f in ("by_source", "by_model")}}
