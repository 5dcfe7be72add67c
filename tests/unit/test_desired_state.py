"""The desired-state file (`polyserve up --config`), the orphan rule and the supervisor's
backoff, without servers (issue 13)."""
from __future__ import annotations

import json

import pytest

from polyserve.cli.supervisor import INITIAL_BACKOFF_S, MAX_BACKOFF_S, RESET_AFTER_S, backoff
from polyserve.planner.reconcile import ConfigError, OrphanTracker, parse_desired_state

pytestmark = pytest.mark.unit

GOOD = """\
deployments:
  - id: chat
    model: sim-llama2-70b
    policy: aladdin
    scaler: {type: tracking, min_replicas: 0, max_replicas: 3}
    reasoning_parser: qwen3
  - model: org/other model
adapters:
  - name: sql
    path: sql-lora
    deployment: chat
"""


def test_parses_deployments_and_adapters(tmp_path):
    (tmp_path / "sql-lora").mkdir()
    (tmp_path / "sql-lora" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (tmp_path / "sql-lora" / "adapter_model.safetensors").write_bytes(b"x")
    got = parse_desired_state(GOOD, "d.yaml", tmp_path)
    chat, other = got.deployments
    assert (chat.id, chat.policy, chat.scaler.type, chat.scaler.max_replicas) == ("chat", "aladdin",
                                                                                "target_tracking", 3)
    assert (other.id, other.engine, other.scaler.min_replicas) == ("org-other-model", "sim", 1)
    assert (chat.reasoning_parser, other.reasoning_parser) == ("qwen3", "")
    [spec] = got.adapters
    assert (spec.name, spec.rank, spec.path) == ("sql", 8, str(tmp_path / "sql-lora"))


@pytest.mark.parametrize("text, expected", [
    ("deployments:\n  - model: m\n    scaler:\n      min_replicas: -1\n",
     "d.yaml:4: deployments[0].scaler.min_replicas: must be an integer >= 0 (got -1)"),
    ("deployments:\n  - model: m\n    engine: tpu\n", "d.yaml:3: deployments[0].engine: unknown engine 'tpu'"),
    ("deployments:\n  - id: a\n", "d.yaml:2: deployments[0].model: is required"),
    ("deployments:\n  - model: m\n    replicas: 2\n", "d.yaml:3: deployments[0].replicas: unknown field"),
    ("deployments:\n  - model: m\n    scaler: {type: hpa2}\n", "d.yaml:3: deployments[0].scaler.type: unknown scaler"),
    ("deployments:\n  - model: m\n    scaler: {min_replicas: 3, max_replicas: 2}\n",
     "deployments[0].scaler.min_replicas: must not exceed max_replicas"),
    ("deployments:\n  - {model: m}\n  - {model: m}\n", "d.yaml:3: deployments[1].id: deployment id 'm' is declared twice"),
    ("deployments:\n  - {model: m, policy: fastest}\n", "unknown dispatch policy 'fastest'"),
    ("deployments:\n  - {model: m, reasoning_parser: granite}\n",
     "deployments[0].reasoning_parser: unknown reasoning parser 'granite'"),
    ("adapters:\n  - {name: a, path: /nope, deployment: x}\n", "adapters[0].deployment: no deployment 'x'"),
    ("deployments: {model: m}\n", "d.yaml:1: deployments: must be a list"),
    ("deployments:\n  - model: [m\n", "d.yaml: not valid YAML"),
    ("models: []\n", "unknown field 'models'"),
])
def test_errors_name_the_field_and_line(text, expected):
    with pytest.raises(ConfigError) as err:
        parse_desired_state(text, "d.yaml")
    assert expected in str(err.value)


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_desired_state("deployments:\n  - model: m\n    engine: x\n    ttft_slo_ms: 0\n", "d.yaml")
    assert "engine" in str(err.value) and "d.yaml:4: deployments[0].ttft_slo_ms" in str(err.value)


def test_orphans_only_after_an_explicit_delete_or_the_grace():
    t = OrphanTracker(grace_s=100.0)
    assert t.observe({"a", "b"}, {"a", "b"}, now=0) == set()
    assert t.observe({"a"}, {"a", "b"}, now=1) == {"b"}  # seen, then gone: deleted
    t.reset()  # Redis lost its data
    assert t.observe(set(), {"a", "b"}, now=2) == set()  # an empty read stops nothing
    assert t.observe(set(), {"a", "b"}, now=50) == set()
    assert t.observe({"a"}, {"a", "b"}, now=60) == set()  # a re-applied: seen again; b waits out the grace
    assert t.observe({"a"}, {"a", "b"}, now=102) == {"b"}
    assert t.observe({"a"}, {"a"}, now=103) == set() and t.seen == {"a"}
    assert OrphanTracker(grace_s=0).observe(set(), {"x"}, now=1e9) == set()  # 0: never


def test_supervisor_backoff_doubles_to_the_cap_and_resets():
    delay, waits = INITIAL_BACKOFF_S, []
    for _ in range(9):
        wait, delay = backoff(delay, uptime=1.0)
        waits.append(wait)
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and waits[-1] == MAX_BACKOFF_S
    assert backoff(delay, uptime=RESET_AFTER_S) == (INITIAL_BACKOFF_S, 2 * INITIAL_BACKOFF_S)
