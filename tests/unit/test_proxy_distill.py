"""The distilled static token table (`distill`): every token through the encoder once, alone."""
from __future__ import annotations

import numpy as np
import pytest

from polyserve.predictor.proxy import distill

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_bert(path):
    """A 1-layer BERT with a 40-token WordPiece vocabulary, random weights (seeded)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(str(path))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    transformers.BertModel(cfg).eval().save_pretrained(str(path))
    return path, len(vocab)


def test_distilled_rows_are_the_encoder_output_of_each_token_alone(tmp_path):
    path, vocab = tiny_bert(tmp_path / "enc")
    table = distill.distilled_table(path, batch=16)
    assert table.shape == (vocab, 16) and np.isfinite(table).all()
    model = transformers.BertModel.from_pretrained(str(path)).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[2, 7, 3]])).last_hidden_state.mean(dim=1)[0].numpy()
    assert table[7] == pytest.approx(out, abs=1e-5)  # [CLS] w2 [SEP], mean-pooled
    assert not np.allclose(table[7], table[8])


def test_combined_table_weighs_both_halves_alike_and_is_cached(tmp_path):
    raw = np.random.default_rng(0).normal(0, 5.0, (10, 4)).astype(np.float32)
    dist = np.random.default_rng(1).normal(0, 0.1, (10, 3)).astype(np.float32)
    c = distill.combined(raw, dist)
    assert c.shape == (10, 7)
    assert np.linalg.norm(c[:, :4], axis=1).mean() == pytest.approx(1, rel=1e-5)
    assert np.linalg.norm(c[:, 4:], axis=1).mean() == pytest.approx(1, rel=1e-5)
    path, vocab = tiny_bert(tmp_path / "enc")
    first = distill.cached_combined(path, tmp_path / "cache")
    assert first.shape == (vocab, 32) and len(list((tmp_path / "cache").glob("distilled-*.npy"))) == 1
    assert np.array_equal(distill.cached_combined(path, tmp_path / "cache"), first)
