"""Issue 17: model names normalised in one place (core.model_names), the unseen-model class
scheme (core.length_classes) kept equal to the shipped artifact's, and every predictor source
(model, history, prior, gateway's local hint) answering in the same class scheme."""
from __future__ import annotations

import json

import pytest

from polyserve.core import length_classes, length_hint
from polyserve.core.model_names import ModelResolver, canonical, family, undated
from polyserve.predictor import policy
from polyserve.predictor.config import PredictorSettings
from polyserve.predictor.handlers import PredictHandlers, history_key
from polyserve.predictor.proxy import artifact, labels
from polyserve.proto import PredictRequest
from polyserve.shared.settings import load

pytestmark = pytest.mark.unit
SHIPPED = ["Meta-Llama-3-8B-Instruct", "Mistral-7B-Instruct-v0.2", "Qwen1.5-7B-Chat", "codealpaca-text-davinci-003",
           "gpt-3.5-turbo-0613", "gpteacher-gpt-4", "vicuna-7b-v1.5"]


def test_canonical_spellings_share_one_key():
    assert len({canonical(n) for n in ("gpt-3.5-turbo", "GPT-3.5-Turbo", "gpt-35-turbo", "gpt_3.5_turbo",
                                       "openai/gpt-3.5-turbo", "chatgpt")}) == 1
    assert canonical("llama-2-70b-chat") == canonical("Llama-2-70b-chat-hf") == \
        canonical("meta-llama/Llama-2-70b-chat-hf")
    assert canonical("meta-llama/Meta-Llama-3-8B-Instruct") == canonical("llama-3-8b-instruct")
    assert canonical("gpt-4") != canonical("gpt-3.5-turbo") and canonical("") == ""
    assert undated("gpt-4-turbo-2024-04-09") == canonical("gpt-4-turbo")
    assert undated("claude-3-5-sonnet-20240620") == canonical("claude-3-5-sonnet")
    assert undated("llama-2-70b") == canonical("llama-2-70b")  # no date: unchanged
    assert (family("Qwen1.5-7B-Chat"), family("meta-llama/Llama-2-7b"), family("gpt4_1106_preview")) == \
        ("qwen", "llama", "gpt")


def test_resolver_levels():
    r = ModelResolver(SHIPPED)
    cases = {"Qwen1.5-7B-Chat": ("Qwen1.5-7B-Chat", "exact"),
             "qwen1.5-7b-chat": ("Qwen1.5-7B-Chat", "exact"),
             "meta-llama/Meta-Llama-3-8B-Instruct": ("Meta-Llama-3-8B-Instruct", "exact"),
             "GPT-3.5-Turbo-0613": ("gpt-3.5-turbo-0613", "exact"),
             "gpt-3.5-turbo": ("gpt-3.5-turbo-0613", "version"),
             "gpt-35-turbo-1106": ("gpt-3.5-turbo-0613", "version"),
             "llama-3-8b-instruct": ("Meta-Llama-3-8B-Instruct", "exact"),
             "llama-3-70b-instruct": ("Meta-Llama-3-8B-Instruct", "family"),
             "Llama-2-70b-chat-hf": ("Meta-Llama-3-8B-Instruct", "family"),
             "vicuna-13b-v1.3": ("vicuna-7b-v1.5", "family"),
             "claude-2.1": (None, "unknown"), "mixtral-8x7b": (None, "unknown"), "": (None, "unknown")}
    for name, want in cases.items():
        got = r.resolve(name)
        assert (got.known, got.how) == want, name
    assert ModelResolver(SHIPPED, use_family=False).resolve("llama-3-70b-instruct").known is None


def test_unseen_scheme_is_a_per_model_geometric_mean():
    bounds, medians = length_classes.unseen_scheme([((10, 20), (5, 15, 40)), ((40, 80), (20, 60, 160))])
    assert bounds == pytest.approx((20, 40)) and medians == pytest.approx((10, 30, 80))
    with pytest.raises(ValueError):
        length_classes.unseen_scheme([])


def test_core_unseen_bounds_match_the_shipped_artifact():
    """The gateway's and the no-artifact bounds are the shipped artifact's unseen-model classes."""
    meta = artifact.read_meta(artifact.default_dir("minilm"))
    u = meta.unseen_classes
    assert tuple(int(-(-b // 1)) for b in u.bounds) == length_classes.UNSEEN_BOUNDS
    assert tuple(round(m) for m in u.medians) == length_classes.UNSEEN_MEDIANS
    assert length_hint.CLASS_BOUNDS == policy.DEFAULT_CLASS_BOUNDS == length_classes.UNSEEN_BOUNDS
    for t in range(1, 2000, 7):  # whole-token lengths fall in the same class under either
        assert policy.length_class(t, u.bounds) == policy.length_class(t, length_classes.UNSEEN_BOUNDS)


def test_meta_resolves_names_and_decodes_unknown_models_with_unseen_classes(tmp_path):
    meta = artifact.read_meta(artifact.default_dir("minilm"))
    assert meta.model_index("gpt-3.5-turbo") == meta.models.index("gpt-3.5-turbo-0613") + 1
    assert meta.classes_for("GPT-3.5-TURBO") is meta.classes["gpt-3.5-turbo-0613"]
    assert meta.model_index("claude-2.1") == 0 and meta.classes_for("claude-2.1") is meta.unseen_classes
    # unknown-model class medians are on the scale of a typical training model, not the pooled answers
    assert meta.unseen_classes.tokens(2) > 1.5 * meta.default_classes.tokens(2)
    # a stored unseen scheme (new artifacts) round-trips and wins over the derived one
    d = meta.to_json()
    d["unseen_classes"] = {"bounds": [10, 20, 30, 40], "medians": [5, 15, 25, 35, 45], "count": 1}
    (tmp_path / artifact.META).write_text(json.dumps(d))
    again = artifact.read_meta(tmp_path)
    assert again.classes_for("unknown-model").bounds == (10, 20, 30, 40)
    assert artifact.Meta.from_json(again.to_json()).unseen_classes == again.unseen_classes


def test_history_and_prior_answer_in_the_artifacts_class_scheme():
    settings = load(PredictorSettings, "predictor", environ={})
    meta = artifact.read_meta(artifact.default_dir("minilm"))
    h = PredictHandlers(settings, stats=None, runner=None, meta=meta)
    assert h.class_bounds("Qwen1.5-7B-Chat") == meta.classes["Qwen1.5-7B-Chat"].bounds
    assert h.class_bounds("qwen1.5-7b-chat") == meta.classes["Qwen1.5-7B-Chat"].bounds
    assert h.class_bounds("someone-elses-model") == meta.unseen_classes.bounds
    assert PredictHandlers(load(PredictorSettings, "predictor", environ={"POLYSERVE_PREDICTOR_PROXY_ARTIFACT": ""}),
                           stats=None).class_bounds("x") == length_classes.UNSEEN_BOUNDS
    assert history_key("GPT-3.5-Turbo") == history_key("gpt-35-turbo") == "gpt35turbo"
    assert history_key("--") == "--"


async def test_prior_class_follows_the_models_percentiles():
    class Stats:
        async def get(self, model):
            assert model == "qwen157bchat"  # history read under the normalised name
            return policy.ModelStats()

    meta = artifact.read_meta(artifact.default_dir("minilm"))
    h = PredictHandlers(load(PredictorSettings, "predictor", environ={}), stats=Stats(), meta=meta)
    p = await h.predict(PredictRequest(request_id="q", model="qwen1.5-7B-chat", input_tokens=10))
    qwen = meta.classes["Qwen1.5-7B-Chat"]  # p25 = 175.5: the prior of 129 tokens is its class 0
    assert (p.source, p.tokens_estimate, p.length_class, p.num_classes) == ("prior", 129, 0, 5)
    assert p.length_class == int(qwen.classes([129])[0])


def test_local_hint_normalises_names_and_uses_unseen_bounds():
    local = length_hint.LocalLengths(min_samples=2)
    local.observe("GPT-3.5-Turbo", 10, 150)
    local.observe("gpt-35-turbo", 10, 150)
    assert local.estimate("gpt-3.5-turbo", 10) == (150, labels.classes_of([150], length_classes.UNSEEN_BOUNDS)[0],
                                                   "history")
    assert local.estimate("other", 10)[1:] == (1, "prior")  # 129 tokens: class 1 of 101/205/290/661
