"""The fast predictor tier (features + LightGBM) and the out-of-distribution evaluation (issue 17)."""
from __future__ import annotations

import numpy as np
import pytest

from polyserve.predictor.proxy import artifact, data, features, ood

lexical = pytest.importorskip("polyserve.predictor.proxy.lexical")
pytest.importorskip("lightgbm")
pytest.importorskip("sklearn")


def row(prompt: str, model: str, out: int, source: str = "a", split: str = "train") -> data.Row:
    return data.Row(prompt=prompt, model=model, output_tokens=out, input_tokens=len(prompt.split()), source=source,
                    split=split)


def test_lexical_features_read_what_sets_an_answers_length():
    names = list(features.LEXICAL_NAMES)
    f = dict(zip(names, features.lexical("List 5 ideas for a birthday party, in detail.", 12)))
    assert f["requested_items"] == 5 and f["kw_list"] == 1 and f["kw_detail"] == 1 and f["kw_list_head"] == 1
    g = dict(zip(names, features.lexical("In one word: is the sky blue?", 9)))
    assert g["kw_oneword"] == 1 and g["ends_question"] == 1 and g["questions"] == 1
    assert features.word_budget("summarise it in 100 words") == 100 and features.requested_items("ten examples") == 10
    code = "def f(x):\n    return x\n" * 300 + "\n\nWhy does this function fail?"
    h = dict(zip(names, features.lexical(code, 900)))
    assert h["code_keywords"] > 0 and h["ends_question"] == 1  # the question after long code survives the cut
    assert len(features.clip_text(code)) <= features.HEAD_CHARS + features.TAIL_CHARS + 1
    cjk = dict(zip(names, features.lexical("请写一首关于春天的诗", 10)))
    assert cjk["frac_cjk"] > 0.9 and cjk["frac_nonascii"] > 0.9
    assert len(features.lexical("", 0)) == len(names)


def test_group_ranks_and_prompt_targets():
    rows = [row("p1", "m", 10), row("p2", "m", 30), row("p3", "m", 20), row("p1", "n", 500), row("p2", "n", 100)]
    r = lexical.group_ranks(rows)
    assert list(r[:3]) == pytest.approx([1 / 6, 5 / 6, 3 / 6]) and list(r[3:]) == pytest.approx([0.75, 0.25])
    prompts, y, w = lexical.prompt_targets(rows)
    assert prompts == ["p1", "p2", "p3"] and list(w) == [2, 2, 1]
    assert y[0] == pytest.approx((1 / 6 + 0.75) / 2)


def test_ood_folds_hold_sources_prompts_and_models_out():
    rows = []
    for i in range(60):
        for m in ("m1", "m2", "m3", "m4"):
            rows.append(row(f"shared prompt {i}", m, 10 + i, source="a", split=data.split_of(f"shared prompt {i}")))
        rows.append(row(f"shared prompt {i}", "b-model", 5 + i, source="b", split=data.split_of(f"shared prompt {i}")))
        rows.append(row(f"own prompt {i}", "b-model", 5 + i, source="b", split=data.split_of(f"own prompt {i}")))
        rows.append(row(f"selfi {i}", "d1", i + 1, source="self_instruct", split="train"))
        for m in ("m1", "m2"):
            rows.append(row(f"a only {i}", m, 3 + i, source="a", split=data.split_of(f"a only {i}")))
    ds = data.Dataset(rows, "h", "t")
    fs = {f.name: f for f in ood.folds(ds, sources=("b", "self_instruct"), model_folds=2)}
    held = fs["source:b"]
    b_prompts = {data.normalise(r.prompt) for r in held.test}
    assert {r.source for r in held.test} == {"b"} and len(held.test) == 120
    assert not b_prompts & {data.normalise(r.prompt) for r in held.train + held.val}  # dedupe by text
    assert all(r.source != "self_instruct" for f in fs.values() for r in f.train + f.val)  # test only
    assert {r.source for r in fs["source:self_instruct"].test} == {"self_instruct"}
    for name in ("models:0", "models:1"):
        f = fs[name]
        assert not {r.model for r in f.test} & {r.model for r in f.train + f.val}
        assert {r.split for r in f.test} == {"test"}
    inn = fs["in"]
    assert not {r.prompt for r in inn.test} & {r.prompt for r in inn.train}


def test_truth_classes_tau_and_confusion():
    rows = [row(f"p{i}", "m", i + 1, source="s") for i in range(100)] + \
           [row(f"q{i}", "n", 10 * (i + 1), source="s") for i in range(100)]
    cls, keys = ood.truth_classes(rows)
    assert (cls[:100] == cls[100:]).all()  # each model's own percentiles: same classes at 10x the length
    assert np.bincount(cls).tolist() == [50, 50, 50, 48, 2]
    perfect = np.array([r.output_tokens for r in rows], dtype=float)
    s = ood.score(rows, perfect, cls)
    assert s.accuracy == 1 and s.tau == pytest.approx(1) and s.confusion.trace() == 200
    const = ood.score(rows, np.zeros(200), np.zeros(200, dtype=int))
    assert const.tau == 0 and const.accuracy == pytest.approx(0.25)  # a constant ranks nothing
    assert ood.row_normalised(s.confusion)[0] == [1.0, 0.0, 0.0, 0.0, 0.0]


needs_shipped = pytest.mark.skipif(not (artifact.default_dir() / artifact.META).is_file(),
                                   reason="no shipped lexical artifact")


@needs_shipped
def test_shipped_default_is_the_lexical_tier_with_its_measured_ood_confusion():
    meta = artifact.read_meta(artifact.default_dir())
    assert meta.kind == lexical.KIND
    conf = np.asarray(meta.ood_confusion)
    assert conf.shape == (5, 5) and np.allclose(conf.sum(axis=1), 1, atol=1e-3) and (conf >= 0).all()
    counts = np.asarray(meta.extra["ood"]["confusion_counts"])
    assert np.allclose(conf, counts / counts.sum(axis=1, keepdims=True), atol=1e-3)
    summary = meta.extra["ood"]["summary"]["OOD all (macro)"]["lexical"]
    assert summary["n"] == counts.sum() and 0 < summary["accuracy"] < 1
    from polyserve.core import length_classes

    # unknown models: the project-wide unseen-model scheme, as at the gateway and in the scheduler
    assert tuple(meta.unseen_classes.bounds) == length_classes.UNSEEN_BOUNDS
    assert tuple(meta.classes_for("never-heard-of-it").medians) == length_classes.UNSEEN_MEDIANS
    assert set(artifact.SHIPPED) == {"lexical", "minilm"}
    assert artifact.read_meta(artifact.default_dir("minilm")).kind == "minilm"


@needs_shipped
def test_shipped_lexical_predictor_orders_prompts_and_decodes_per_model():
    pred = lexical.LexicalPredictor.load(artifact.default_dir())
    prompts = ["Answer yes or no: is 7 a prime number?",
               "Write a detailed, 2000-word essay on the history of the Roman Empire, with an outline and sections."]
    (short, long), keys = pred.predict(prompts, ["gpt-3.5-turbo"] * 2)
    assert keys is None and short.value < long.value and short.length_class < long.length_class
    assert short.known_model and long.tokens == pred.meta.classes_for("gpt-3.5-turbo").tokens(long.length_class)
    unseen, _ = pred.predict(prompts[:1], ["brand-new-model"])
    assert not unseen[0].known_model and unseen[0].value == pytest.approx(short.value)
    assert unseen[0].tokens == pred.meta.unseen_classes.tokens(unseen[0].length_class)
    # the batch path and the single path agree
    batch, _ = pred.predict(prompts * 8, ["gpt-3.5-turbo"] * 16)
    assert [a.value for a in batch[:2]] == pytest.approx([short.value, long.value])
    with pytest.raises(ValueError):
        pred.predict(prompts, ["m"])


@needs_shipped
def test_minilm_artifact_is_refused_by_the_lexical_loader():
    with pytest.raises(artifact.ArtifactError):
        lexical.LexicalPredictor.load(artifact.default_dir("minilm"))


@needs_shipped
async def test_model_runner_serves_the_lexical_tier_in_one_batch():
    import asyncio

    from polyserve.predictor.proxy.runtime import ModelRunner

    runner = ModelRunner(str(artifact.default_dir()), max_batch=16, batch_wait_ms=5.0)
    await runner.start()
    try:
        assert runner.ready, runner.error
        prompts = [f"List {n} ideas for a weekend trip." for n in range(1, 17)]
        results = await asyncio.gather(*(runner.predict(p, "gpt-3.5-turbo", 5.0) for p in prompts))
        assert all(r.key is None and 0 <= r.length_class < 5 for r in results)
        assert max(r.batch_size for r in results) > 1  # micro-batched, one batch: no length buckets
        assert runner.batches < len(prompts)
    finally:
        await runner.stop()


def synthetic_corpus() -> data.Dataset:
    """Three prompt sets x two models where the asked-for item count sets the answer length."""
    rows = []
    topics = ["cats", "rivers", "stars", "bread", "music", "chess", "trains", "clouds", "forests", "coins"]
    for src in ("s1", "s2", "s3"):
        for n in range(1, 13):
            for t in topics:
                prompt = f"[{src}] List {n} facts about {t}." if n % 2 else f"[{src}] Give {n} ideas about {t}."
                for m, scale in (("model-a", 10), ("model-b", 30)):
                    rows.append(row(prompt, f"{src}-{m}", scale * n + len(t), source=src, split=data.split_of(prompt)))
    return data.Dataset(rows, "synthetic", "t")


@needs_shipped
def test_ood_run_end_to_end_and_store_in_meta(tmp_path):
    import shutil

    from polyserve.predictor import cli

    ds = synthetic_corpus()
    out = ood.run(ds, sources=("s1", "s2"), model_folds=2, progress=False, static="raw")
    assert {"in", "source:s1", "source:s2"} <= set(out["folds"])
    lex = out["folds"]["source:s1"]["lexical"]
    assert lex.n == 240 and lex.tau > 0.5  # the item count carries over to an unseen prompt set
    assert out["folds"]["source:s1"]["history"].tau < lex.tau
    conf = ood.confusion_of(out)
    assert len(conf) == 5 and all(abs(sum(r) - 1) < 1e-3 for r in conf)
    shutil.copytree(artifact.default_dir(), tmp_path / "a")
    cli._store_ood(str(tmp_path / "a"), out)
    meta = artifact.read_meta(tmp_path / "a")
    assert meta.ood_confusion == conf and "OOD all (macro)" in meta.extra["ood"]["summary"]


def test_train_save_load_round_trip_serves_what_was_fitted(tmp_path):
    """The artifact stores the static table already projected: the loaded predictor computes the same
    features and scores as the fitted model, and decodes classes with the stored per-target calibration."""
    ds = synthetic_corpus()
    meta = lexical.train(ds, tmp_path / "a", static="raw", rounds=60)
    assert meta.extra["static"] == "raw" and meta.extra["calibration"]["level_cuts"]
    pred = lexical.LexicalPredictor.load(tmp_path / "a")
    assert pred.calibrator is not None
    prompts = [r.prompt for r in ds.rows if r.split == "test"][:12]
    answers, _ = pred.predict(prompts, ["s1-model-a"] * len(prompts))
    # the same fit in memory (training is deterministic): training-time features == serving-time features
    from polyserve.predictor.proxy import encoder as enc_mod

    enc_dir = enc_mod.resolve_encoder_dir(None)
    table = lexical.static_table(enc_dir, "raw")
    tr, va = [r for r in ds.rows if r.split == "train"], [r for r in ds.rows if r.split == "val"]
    pf = lexical.PromptFeatures.build([r.prompt for r in ds.rows], lexical.fast_tokenizer(enc_dir), table)
    fitted = lexical.fit(pf, table, tr, va, rounds=60)
    assert pred.matrix(prompts) == pytest.approx(fitted.matrix(pf, prompts), abs=1e-4)
    assert [a.value for a in answers] == pytest.approx(list(fitted.values(pf, [row(p, "m", 1) for p in prompts])),
                                                       abs=1e-6)
    assert all(0 <= a.length_class < 5 for a in answers)
    fixed = lexical.LexicalPredictor.load(tmp_path / "a", calibrate_classes=False)
    assert fixed.calibrator is None
    meta.extra["features"] = meta.extra["features"][:-1]  # trained on other features: refused, not mis-read
    artifact.write_meta(tmp_path / "a", meta)
    with pytest.raises(artifact.ArtifactError):
        lexical.LexicalPredictor.load(tmp_path / "a")


@needs_shipped
async def test_model_runner_calibrates_classes_unless_told_not_to():
    from polyserve.predictor.proxy.runtime import ModelRunner

    for calibrate_classes in (True, False):
        runner = ModelRunner(str(artifact.default_dir()), calibrate=calibrate_classes)
        await runner.start()
        try:
            assert runner.ready, runner.error
            cal = runner.predictor.calibrator
            assert (cal is not None) == calibrate_classes
            if cal is not None:
                assert not cal._recent  # the warm-up prediction is not counted as traffic
                await runner.predict("List 5 ideas for a weekend trip.", "gpt-3.5-turbo", 5.0)
                assert sum(len(s) for _, s in cal._recent.values()) == 1
        finally:
            await runner.stop()
