"""Per-target class decoding of the fast tier (`calibrate`) and the multilingual keyword features."""
from __future__ import annotations

import numpy as np
import pytest

from polyserve.predictor.proxy import calibrate, features

pytest.importorskip("scipy")


def test_rank_calibrator_decodes_by_rank_among_the_models_own_predictions():
    rng = np.random.default_rng(0)
    ref = calibrate.reference_sample(rng.normal(0.5, 0.1, 5000))
    cal = calibrate.RankCalibrator((0.25, 0.5, 0.75, 0.99), ref, window=400, prior=30)
    # a new model whose traffic the score finds "short" on average: fixed cuts would put most in class 0
    shifted = rng.normal(0.3, 0.05, 2000)
    classes = [cal.classify("new-model", float(v)) for v in shifted]
    late = np.bincount(classes[1000:], minlength=5) / 1000
    assert abs(late[:4] - 0.25).max() < 0.06 and late[4] < 0.03  # its own quartiles, as the true classes
    early = np.bincount(classes[:20], minlength=5)
    assert early[0] >= 15  # before it has seen the model's traffic it leans on the validation reference
    # the order is kept at any state: a larger score never gets a smaller class
    lv = [cal.level("new-model", v) for v in (0.1, 0.25, 0.3, 0.35, 0.6)]
    assert lv == sorted(lv) and 0 <= lv[0] and lv[-1] <= 1
    # per model, by canonical name; `learn=False` leaves the state alone
    assert cal.level("NEW_MODEL", 0.3) == pytest.approx(cal.level("new-model", 0.3))
    key = next(iter(cal._recent))
    n = len(cal._recent[key][1])
    cal.classify("new-model", 0.3, learn=False)
    assert len(cal._recent[key][1]) == n == 400  # bounded by the window
    back = calibrate.RankCalibrator.from_json(cal.to_json())
    assert list(back.level_cuts) == pytest.approx(list(cal.level_cuts)) and back.window == 400


def test_rank_calibrator_bounds_the_models_it_tracks():
    cal = calibrate.RankCalibrator((0.25, 0.5, 0.75, 0.99), [0.0, 1.0], max_models=3)
    for m in ("a", "b", "c", "d"):
        cal.classify(m, 0.5)
    assert list(cal._recent) == ["b", "c", "d"]


def test_level_cuts_and_stream_classes():
    rng = np.random.default_rng(1)
    truth_len = rng.lognormal(5, 1, 800)
    score = np.log(truth_len) + rng.normal(0, 0.3, 800) + np.repeat([0.0, 2.0], 400)  # two groups, shifted
    keys = [("s", "a")] * 400 + [("s", "b")] * 400
    from polyserve.predictor.proxy import labels

    truth = np.concatenate([labels.classes_of(list(truth_len[i:i + 400]), labels.percentile_bounds(
        list(truth_len[i:i + 400]))) for i in (0, 400)])
    cuts = calibrate.fit_level_cuts(keys, score, truth)
    assert len(cuts) == 4 and list(cuts) == sorted(cuts)
    cal = calibrate.RankCalibrator(cuts, calibrate.reference_sample(score)).to_json()
    streamed = calibrate.stream_classes(keys, ["a"] * 400 + ["b"] * 400, score, cal, list(range(800)))
    fixed = np.searchsorted(np.quantile(score, (0.25, 0.5, 0.75, 0.99)), score, side="right")
    assert np.mean(streamed == truth) > np.mean(fixed == truth) + 0.1  # the group shift is decoded away


def test_keyword_groups_read_other_languages_and_dialogues():
    names = list(features.LEXICAL_NAMES)
    pl = dict(zip(names, features.lexical("Napisz krótki wiersz o wiośnie i wyjaśnij go.", 14)))
    assert pl["kw_write"] == 1 and pl["kw_story"] == 1 and pl["kw_brief"] == 1 and pl["kw_explain_head"] == 1
    assert pl["frac_latin_ext"] > 0
    zh = dict(zip(names, features.lexical("请详细解释一下量子计算的原理？", 15)))
    assert zh["kw_detail"] == 1 and zh["kw_explain"] == 1 and zh["ends_question"] == 1 and zh["questions"] == 1
    ru = dict(zip(names, features.lexical("Напиши короткий рассказ", 8)))
    assert ru["kw_write"] == 1 and ru["kw_brief"] == 1 and ru["frac_cyrillic"] > 0.9
    en = dict(zip(names, features.lexical("Write a list of ideas", 5)))
    assert en["kw_write"] == 1 and en["kw_list"] == 1 and en["frac_latin_ext"] == 0
    dialogue = ("Human: Tell me about dogs.\n\nAssistant: Dogs are mammals.\n\n"
                "Human: Explain in detail why?\n\nAssistant:")
    d = dict(zip(names, features.lexical(dialogue, 30)))
    # the last user turn is the instruction; the trailing assistant cue is not what the tail embeds
    assert d["kw_explain_head"] == 1 and d["kw_detail_head"] == 1 and d["ends_question"] == 1 and d["turns"] == 4
    assert features.last_user_turn(dialogue) == "Explain in detail why?"
    assert features.clip_text(dialogue).endswith("Explain in detail why?")
    assert features.last_user_turn("no dialogue here") is None


def test_consensus_tau_is_one_when_models_agree_and_skips_thin_sets():
    from polyserve.predictor.proxy import data, ood

    rows = [data.Row(prompt=f"p{i}", model=m, output_tokens=(i + 1) * k, input_tokens=3, source="s", split="test")
            for i in range(30) for m, k in (("a", 1), ("b", 3), ("c", 7))]
    rng = np.random.default_rng(0)
    rows += [data.Row(prompt=f"q{i}", model=m, output_tokens=int(rng.integers(1, 500)), input_tokens=3,
                      source="noisy", split="test") for m in ("a", "b", "c", "d") for i in range(60)]
    rows += [data.Row(prompt=f"r{i}", model="solo", output_tokens=i + 1, input_tokens=3, source="one", split="test")
             for i in range(30)]
    out = ood.consensus_tau(data.Dataset(rows, "h", "t"))
    assert out["s"] == pytest.approx(1.0) and "one" not in out  # a single-model set has no consensus
    assert abs(out["noisy"]) < 0.2  # models whose lengths are unrelated to each other
