"""Ordinal length classes, the dataset split and the Table-2 metrics of the proxy predictor."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from polyserve.predictor.proxy import data, evaluate, labels

pytestmark = pytest.mark.unit


def test_percentile_bounds_make_five_classes():
    lengths = list(range(1, 101))  # 1..100
    mc = labels.ModelClasses.fit(lengths)
    assert mc.bounds == pytest.approx((25.75, 50.5, 75.25, 99.01))
    assert mc.num_classes == 5
    assert list(mc.classes([1, 25, 26, 50, 51, 75, 76, 99, 100, 10_000])) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # medians of the training lengths inside each class; the token estimate rounds them
    assert mc.medians == pytest.approx((13.0, 38.0, 63.0, 87.5, 100.0))
    assert [mc.tokens(k) for k in range(5)] == [13, 38, 63, 88, 100]
    assert mc.tokens(-3) == 13 and mc.tokens(9) == 100  # clipped to the classes


def test_tied_percentiles_stay_strictly_increasing():
    lengths = [10] * 90 + [11] * 9 + [500]
    b = labels.percentile_bounds(lengths)
    assert b == (10.0, 11.0, 12.0, 13.0) or all(x < y for x, y in zip(b, b[1:]))
    assert all(x < y for x, y in zip(b, b[1:]))
    mc = labels.ModelClasses.fit(lengths)
    assert len(mc.medians) == 5 and all(m > 0 for m in mc.medians)
    with pytest.raises(ValueError):
        labels.percentile_bounds([])


def test_model_classes_round_trip_json():
    mc = labels.ModelClasses.fit([3, 5, 8, 13, 21, 34, 55, 89])
    again = labels.ModelClasses.from_json(json.loads(json.dumps(mc.to_json())))
    assert again == mc
    with pytest.raises(ValueError):
        labels.ModelClasses.from_json({"bounds": [5, 3, 8, 9], "medians": [1, 2, 3, 4, 5]})


def test_rounding_to_the_nearest_class():
    assert list(labels.round_to_class([-1.2, 0.49, 0.5, 1.5, 2.51, 3.49, 4.4, 7])) == [0, 0, 1, 2, 3, 3, 4, 4]


def test_metrics():
    y = np.array([0, 1, 2, 3, 4, 4])
    p = np.array([0, 1, 2, 4, 4, 2])
    sc = labels.scores(y, p, values=np.array([0.1, 1, 2, 4, 4.2, 2]), lengths=np.array([1, 5, 9, 20, 50, 60]))
    assert sc["n"] == 6
    assert sc["accuracy"] == pytest.approx(4 / 6)
    assert sc["l1"] == pytest.approx((0 + 0 + 0 + 1 + 0 + 2) / 6)
    assert sc["mse"] == pytest.approx((1 + 4) / 6)
    # per-class F1: 0:1, 1:1, 2: tp1 fp1 fn0 -> 2/3, 3: 0, 4: tp1 fp1 fn1 -> 1/2
    assert sc["macro_f1"] == pytest.approx((1 + 1 + 2 / 3 + 0 + 0.5) / 5)
    assert 0.5 < sc["kendall_tau"] <= 1.0
    assert labels.kendall_tau(np.arange(5), np.arange(5)) == pytest.approx(1.0)
    assert labels.kendall_tau(np.arange(5), -np.arange(5)) == pytest.approx(-1.0)
    assert math.isnan(labels.kendall_tau(np.zeros(5), np.arange(5)))  # a constant predictor has no ranking


def test_split_is_by_prompt_and_deterministic():
    prompts = [f"question number {i}" for i in range(2000)]
    splits = [data.split_of(p) for p in prompts]
    assert splits == [data.split_of(p) for p in prompts]
    share = {s: splits.count(s) / len(splits) for s in data.SPLITS}
    assert 0.07 < share["test"] < 0.13 and 0.07 < share["val"] < 0.13
    # the same text with other case and white space is the same prompt
    assert data.split_of("Question  number 7\n") == data.split_of("question number 7")
    assert data.split_of("question number 7", seed=1) in data.SPLITS


class WordTokenizer:
    """Whitespace 'tokenizer' with the call signature of a Hugging Face one."""

    def __call__(self, texts, **_):
        return {"input_ids": [t.split() for t in texts]}


def test_build_dataset_from_the_three_sources(tmp_path):
    (tmp_path / "alpaca_eval").mkdir()
    (tmp_path / "gpteacher").mkdir()
    (tmp_path / "codealpaca").mkdir()
    for model, words in (("modelA", 3), ("modelB", 7)):
        rows = [{"dataset": "x", "instruction": f"tell me about topic {i}", "output": "w " * (words + i),
                 "generator": model} for i in range(30)]
        (tmp_path / "alpaca_eval" / f"{model}.json").write_text(json.dumps(rows))
    (tmp_path / "gpteacher" / "g.json").write_text(json.dumps(
        [{"instruction": "write code", "input": "in C", "response": "int main ( ) { }"}]))
    (tmp_path / "codealpaca" / "c.json").write_text(json.dumps(
        [{"instruction": "sum a list", "input": "", "output": "sum ( xs )"}]))
    ds = data.build(tmp_path, WordTokenizer(), "words")
    assert len(ds.rows) == 62
    assert set(ds.models) == {"modelA", "modelB", data.GPTEACHER_MODEL, data.CODEALPACA_MODEL}
    g = next(r for r in ds.rows if r.model == data.GPTEACHER_MODEL)
    assert g.prompt == "write code\n\nin C" and g.output_tokens == 6 and g.input_tokens == 4
    # no prompt text is in two splits, although two models answered each alpaca_eval prompt
    by_prompt: dict[str, set[str]] = {}
    for r in ds.rows:
        by_prompt.setdefault(data.normalise(r.prompt), set()).add(r.split)
    assert all(len(s) == 1 for s in by_prompt.values())
    path = tmp_path / "ds.jsonl"
    ds.save(path)
    again = data.Dataset.load(path)
    assert again.rows == ds.rows and again.data_hash == ds.data_hash
    # the hash follows the data
    (tmp_path / "codealpaca" / "c.json").write_text(json.dumps(
        [{"instruction": "sum a list", "input": "", "output": "sum ( xs ) + 0"}]))
    assert data.build(tmp_path, WordTokenizer(), "words").data_hash != ds.data_hash


def test_baselines_and_table():
    rows = [data.Row(prompt=f"p{i}", model="m", output_tokens=(i % 10) * 10 + 1, input_tokens=2 ** (i % 6),
                     source="s", split="train") for i in range(200)]
    test = [data.Row(prompt=f"q{i}", model="m", output_tokens=(i % 10) * 10 + 1, input_tokens=2 ** (i % 6),
                     source="s", split="test") for i in range(50)]
    classes = {"m": labels.ModelClasses.fit([r.output_tokens for r in rows])}
    default = classes["m"]
    truth = evaluate.truth_of(test, classes, default)
    preds = [evaluate.history_baseline(rows, test, classes, default),
             evaluate.majority_baseline(rows, test, classes, default),
             evaluate.random_baseline(test, classes, default, seed=1)]
    table = evaluate.table(truth, preds)
    assert set(table) == {"m", "overall"}
    assert set(table["overall"]) == {"history", "majority", "random"}
    assert math.isnan(table["m"]["majority"]["kendall_tau"])
    assert 0 <= table["overall"]["random"]["accuracy"] <= 1
    text = evaluate.render(table)
    assert "== overall" in text and "history" in text and "tau_tok" in text
