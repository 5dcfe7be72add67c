"""The `hf` engine on checkpoints of other architectures than its own random Llama: tiny
random models of transformers' GPT-2, Falcon, BLOOM and Qwen2 classes, saved as local
checkpoints. Each serves greedy requests that match transformers' own `generate()` token for
token, alone and inside a continuous batch.

They cover the three ways an architecture can differ from Llama for this engine:
* no sdpa attention at all (BLOOM's ALiBi): loaded with eager attention instead of refused;
* attention not dispatched through transformers' `AttentionInterface` (Falcon): the ragged KV
  layout cannot route its attention, so the engine falls back to the padded layout;
* a tokenizer whose end-of-sequence id lies past the model's logits (here: a Qwen2 tokenizer
  that adds `<|endoftext|>` to a vocabulary the model was not resized for): that id is left
  out instead of failing every request.
"""
from __future__ import annotations

import asyncio
import copy
import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from polyserve.proto import SamplingParams  # noqa: E402
from polyserve.worker.engine import Delta, EngineRequest  # noqa: E402
from polyserve.worker.engines.hf import HfEngine  # noqa: E402
from polyserve.worker.engines.hf_model import fallback_tokenizer  # noqa: E402
from polyserve.worker.engines.hf_text import IncrementalDetokenizer  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.torch]

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
ARCHS = {  # name: (config class, model class, config fields, (layout, attention) the engine must pick)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2),
             ("ragged", "polyserve_ragged")),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
               ("padded", "sdpa")),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_layer=2, n_head=4), ("padded", "eager")),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, num_key_value_heads=2, intermediate_size=128,
                                                      **SMALL), ("ragged", "polyserve_ragged")),
}
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a"]
TOKENS = 10


def _checkpoint(root, name: str) -> str:
    cfg_cls, model_cls, fields, _ = ARCHS[name]
    tok = fallback_tokenizer()
    config = getattr(transformers, cfg_cls)(vocab_size=len(tok), bos_token_id=tok.cls_token_id,
                                            eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    out = root / name
    model.save_pretrained(str(out))
    copy.deepcopy(tok).save_pretrained(str(out))
    return str(out)


async def _greedy(engine: HfEngine, rid: str, prompt: str) -> str:
    text = ""
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0))
    async for ev in engine.generate(req):
        if isinstance(ev, Delta):
            text += ev.text
    return text


def _reference(engine: HfEngine, prompt: str) -> str:
    """transformers' own greedy `generate()`, detokenized as the engine detokenizes."""
    b = engine._bundle
    ids = b.encode(prompt)
    with torch.inference_mode():
        out = b.model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                               pad_token_id=b.tokenizer.pad_token_id)
    det = IncrementalDetokenizer(b.tokenizer, ids)
    return "".join(det.add(int(t)) for t in out[0, len(ids):]) + det.flush()


@pytest.mark.parametrize("name", list(ARCHS))
async def test_other_architectures_serve_greedy_requests_as_transformers_generates_them(tmp_path, name):
    path = _checkpoint(tmp_path, name)
    engine = HfEngine(types.SimpleNamespace(model="", model_path=path, device="cpu", dtype="float32", max_waiting=8,
                                            max_batch=8, kv_capacity_tokens=1 << 16, max_input_len=256,
                                            kv_layout="ragged"))
    await engine.start()
    try:
        assert (engine._batch.layout, engine._bundle.model.config._attn_implementation) == ARCHS[name][3]
        assert engine.model_card()["kv_layout"] == ARCHS[name][3][0]
        alone = [await _greedy(engine, f"a{i}", p) for i, p in enumerate(PROMPTS)]
        together = await asyncio.gather(*(_greedy(engine, f"b{i}", p) for i, p in enumerate(PROMPTS)))
        assert together == alone
        assert alone == [_reference(engine, p) for p in PROMPTS]
    finally:
        await engine.stop()


def test_a_tokenizer_id_past_the_models_logits_is_left_out_of_the_end_ids(tmp_path):
    from polyserve.worker.engines.hf_model import load_bundle
    bundle = load_bundle("", _checkpoint(tmp_path, "qwen2"))
    width = bundle.model.get_output_embeddings().weight.shape[0]
    assert len(bundle.tokenizer) > width  # the tokenizer added <|endoftext|> past the model's vocabulary
    assert bundle.eos_ids and all(i < width for i in bundle.eos_ids)


@pytest.mark.parametrize("cold_start", ["cpu_assisted", "on_demand"])
async def test_a_lora_adapter_on_gpt2s_conv1d_layers_serves_as_peft_computes_it(tmp_path, cold_start):
    """GPT-2's attention projection `c_attn` is a transformers `Conv1D` (weight stored (in, out), no
    `in_features`): adapters for it are made, checked and served, CPU-assisted or on the device."""
    from peft import PeftModel

    from polyserve.worker.lora import create_random_adapter
    path = _checkpoint(tmp_path, "gpt2")
    adapter = create_random_adapter(path, 8, tmp_path / "a8", seed=3, targets=("c_attn",), strength=2.0)
    engine = HfEngine(types.SimpleNamespace(model="", model_path=path, device="cpu", dtype="float32", max_waiting=8,
                                            max_batch=8, kv_capacity_tokens=1 << 16, max_input_len=256,
                                            lora_cold_start=cold_start))
    await engine.start()
    try:
        await engine.load_adapter("a8", str(adapter))
        text = {}
        for name in (None, "a8"):
            text[name] = ""
            req = EngineRequest(f"r{name}", PROMPTS[0], SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS,
                                                                       temperature=0), adapter=name)
            async for ev in engine.generate(req):
                if isinstance(ev, Delta):
                    text[name] += ev.text
        b = engine._bundle
        peft = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(path), str(adapter)).eval()
        ids = b.encode(PROMPTS[0])
        with torch.inference_mode():
            out = peft.generate(input_ids=torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                do_sample=False, pad_token_id=b.tokenizer.pad_token_id)
        det = IncrementalDetokenizer(b.tokenizer, ids)
        assert text["a8"] == "".join(det.add(int(t)) for t in out[0, len(ids):]) + det.flush()
        assert text["a8"] != text[None]  # the adapter changes what the model says
    finally:
        await engine.stop()
