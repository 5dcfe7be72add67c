"""A tiny end-to-end training run: probe, two phases, artifact written, loaded and used (CPU, seconds)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from polyserve.predictor.proxy import artifact, data, encoder, labels, train  # noqa: E402
from polyserve.predictor.proxy.infer import ProxyPredictor  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]  # torch: builds torch models


def tiny_dataset() -> data.Dataset:
    """Two models; 'essay' prompts get long answers, 'yes or no' prompts short ones."""
    rows = []
    for i in range(40):
        long = i % 2 == 0
        prompt = f"write a detailed essay about topic {i}" if long else f"answer yes or no: is {i} even"
        for model, scale in (("alpha", 1), ("beta", 3)):
            out = (300 + 7 * i if long else 3 + i % 5) * scale
            rows.append(data.Row(prompt=prompt, model=model, output_tokens=out, input_tokens=8, source="t",
                                 split="val" if i % 5 == 0 else "train"))
    return data.Dataset(rows, data_hash="tiny", tokenizer=encoder.DEFAULT_ENCODER)


def test_train_writes_a_small_artifact_that_loads_and_predicts(tmp_path):
    cfg = train.TrainConfig(max_length=32, lora_rank=2, batch_size=8, phase1_epochs=1, phase2_epochs=3,
                            probe_epochs=2, threads=1, progress=False)
    meta = train.train(tiny_dataset(), cfg, tmp_path / "a")
    assert meta.pooling in ("cls", "mean") and set(meta.extra["pooling_probe"]) == {"cls", "mean"}
    assert meta.models == ["alpha", "beta"] and meta.data_hash == "tiny"
    assert meta.extra["phase1"]["steps"] == 4 and meta.extra["phase2"]["best_epoch"] >= 0
    assert artifact.size_bytes(tmp_path / "a") < 1_000_000
    # class bounds are per model: beta's answers are three times longer
    assert meta.classes["beta"].bounds[1] > 2 * meta.classes["alpha"].bounds[1]
    # the unknown-model row is decoded with the unseen-model classes, stored at training (issue 17):
    # per class the geometric mean of the models' own classes, not the classes of the pooled answers
    stored = artifact.read_meta(tmp_path / "a").unseen_classes
    assert stored == labels.ModelClasses.unseen([meta.classes["alpha"], meta.classes["beta"]])
    assert stored.medians[2] == pytest.approx((meta.classes["alpha"].medians[2]
                                               * meta.classes["beta"].medians[2]) ** 0.5)

    pred = ProxyPredictor.load(tmp_path / "a")
    answers, keys = pred.predict(["write a detailed essay about rivers", "answer yes or no: is 3 even"],
                                 ["alpha", "somebody-else"])
    assert [a.known_model for a in answers] == [True, False]
    for a, mc in zip(answers, (meta.classes["alpha"], meta.unseen_classes)):
        assert 0 <= a.length_class < 5 and a.tokens == mc.tokens(a.length_class)
    assert keys.shape == (2, pred.dim) and abs(float((keys[0] ** 2).sum()) - 1) < 1e-4

    # serving folds the adapter into the weights without peft: the same weights as peft's merge
    from polyserve.predictor.proxy import model as M

    _, _, lora = artifact.load(tmp_path / "a")
    enc_dir = str(encoder.resolve_encoder_dir())
    ours = M.load_merged_encoder(enc_dir, meta.lora_rank, lora).state_dict()
    peft_merged = M.load_encoder(enc_dir, meta.lora_rank, lora, meta.lora_targets).merge_and_unload().state_dict()
    assert set(ours) == set(peft_merged)
    assert max(float((ours[k] - peft_merged[k]).abs().max()) for k in ours) < 1e-6
    base = M.load_merged_encoder(enc_dir, 1, {}).state_dict()  # no adapter: the published weights
    assert any(float((ours[k] - v).abs().max()) > 0 for k, v in base.items())

    bad = artifact.read_meta(tmp_path / "a")
    bad.tokenizer_fingerprint = "0" * 16
    (tmp_path / "b").mkdir()
    artifact.save(tmp_path / "b", bad, {}, None)
    with pytest.raises(artifact.ArtifactError, match="tokenizer"):
        ProxyPredictor.load(tmp_path / "b")
    with pytest.raises(artifact.ArtifactError, match="no predictor artifact"):
        ProxyPredictor.load(tmp_path / "absent")
