"""Grafana dashboards (infra/grafana/dashboards/*.json) and the Prometheus scrape config
(infra/prometheus/prometheus.yml): structure, and every PromQL query names only metrics that
polyserve's services really export.

Exported metrics are collected by AST over services/ and shared/: every prometheus_client
Counter / Gauge / Histogram / Summary (or a custom collector's `...MetricFamily`) constructed
with a literal name, expanded to the series names the client exposes (Counter `x_total`;
Histogram `x_bucket`, `x_count`, `x_sum`; ...).
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "infra" / "grafana" / "dashboards").glob("*.json"))
PROMQL_FUNCTIONS = {
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "histogram_fraction",
    "clamp", "clamp_min", "clamp_max", "abs", "ceil", "floor", "round", "sqrt", "exp", "ln", "log2", "log10",
    "label_replace", "label_join", "vector", "scalar", "time", "timestamp", "absent", "absent_over_time",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
    "last_over_time", "changes", "resets", "sort", "sort_desc", "predict_linear", "label_values",
}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                   "offset", "inf", "nan"}


def exported_metrics() -> set[str]:
    """Series names exposed by the prometheus_client metrics defined in the services' code."""
    names: set[str] = set()
    for path in list((ROOT / "services").rglob("*.py")) + list((ROOT / "shared").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            kind = ast.unparse(node.func).rsplit(".", 1)[-1].removesuffix("MetricFamily")
            name = node.args[0].value
            if kind not in ("Counter", "Gauge", "Histogram", "Summary") or not isinstance(name, str):
                continue
            if kind == "Counter":
                base = name.removesuffix("_total")
                names |= {base + "_total", base + "_created"}
            elif kind == "Gauge":
                names.add(name)
            elif kind == "Histogram":
                names |= {name + s for s in ("_bucket", "_count", "_sum", "_created")}
            else:
                names |= {name, name + "_count", name + "_sum", name + "_created"}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (PromQL read just enough: strings, label
    matchers, ranges, grouping clauses, functions, keywords, numbers and $variables removed)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    found = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_KEYWORDS or word in PROMQL_FUNCTIONS:
            continue
        found.add(word)
    return found


def targets(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            out.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def test_metric_name_parser():
    assert metric_names('histogram_quantile(0.95, sum by (deployment, le) (rate(a_bucket{x="1"}[5m])))') == \
        {"a_bucket"}
    assert metric_names('sum(rate(b_total{s!~"2.."}[$__rate_interval])) / sum(c) > bool 0') == {"b_total", "c"}
    assert metric_names("label_values(polyserve_requests_total, deployment)") == {"polyserve_requests_total",
                                                                                   "deployment"}


def test_services_export_the_gateway_metrics():
    names = exported_metrics()
    assert {"polyserve_requests_total", "polyserve_ttft_seconds_bucket", "polyserve_request_seconds_count",
            "polyserve_inflight_requests", "polyserve_rejected_total"} <= names
    assert set(DASHBOARD_METRICS) <= names


# what issue 16 asks the dashboards to show, by the metric each needs (metrics.py, observe.py)
DASHBOARD_METRICS = {
    "polyserve_atgt_seconds_bucket": "ATGT percentiles and SLO attainment",
    "polyserve_queue_seconds_bucket": "queue time",
    "polyserve_worker_waiting": "queue lengths",
    "polyserve_workers": "worker count",
    "polyserve_scale_decisions_total": "scaler decisions",
    "polyserve_predictions_total": "predictor source mix",
    "polyserve_prediction_error_ratio_bucket": "predictor error",
    "polyserve_gpu_power_watts": "GPU power",
    "polyserve_gpu_sm_clock_mhz": "GPU clock",
    "polyserve_gpu_energy_per_output_token_joules": "energy per output token",
    "polyserve_lora_adapters": "LoRA tiers",
}


def test_overview_dashboard_plots_what_issue_16_asks_for():
    dash = json.loads((ROOT / "infra" / "grafana" / "dashboards" / "polyserve-overview.json").read_text())
    used = set().union(*(metric_names(expr) for _, expr in targets(dash)))
    assert set(DASHBOARD_METRICS) - used == set()
    titles = " ".join(p["title"] for p in dash["panels"])
    assert "ATGT SLO attainment" in titles and "$atgt_slo" in titles


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_dashboard_structure(path):
    dash = json.loads(path.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    assert isinstance(dash["panels"], list) and dash["panels"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        assert panel["type"] in ("row", "timeseries", "stat", "gauge", "table", "bargauge", "heatmap"), panel
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for t in panel["targets"]:
            assert t["expr"].strip() and t["datasource"] == panel["datasource"]
            for var in re.findall(r"\$(\w+)", t["expr"]):  # every $variable is defined or Grafana's
                assert var in variables or var.startswith("__"), (panel["title"], var)


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_every_query_names_only_metrics_the_services_export(path):
    dash = json.loads(path.read_text())
    exported = exported_metrics()
    label_values_args = {"deployment"}  # label names in label_values(metric, label)
    problems = []
    for title, expr in targets(dash):
        names = metric_names(expr)
        assert names, (title, expr)
        problems += [f"{title}: {n}" for n in names - exported - label_values_args]
    assert problems == []


def test_slo_bounds_are_histogram_buckets():
    """`le="$ttft_slo"` only matches a series when the value is a bucket bound as the client formats it."""
    from prometheus_client.utils import floatToGoString

    from polyserve.gateway import metrics

    bounds = {floatToGoString(b) for b in metrics._BUCKETS}
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] == "custom":
                values = var["query"].split(",")
                assert set(values) <= bounds, (var["name"], set(values) - bounds)
                assert var["current"]["value"] in values


def test_prometheus_scrapes_the_gateway_metrics_endpoint():
    cfg = yaml.safe_load((ROOT / "infra" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    static = jobs["polyserve-gateway"]
    assert static["metrics_path"] == "/metrics" and static["static_configs"][0]["targets"] == ["gateway:8000"]
    k8s = jobs["polyserve-gateway-k8s"]
    assert k8s["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["polyserve"]
    gateway_src = "".join(p.read_text() for p in (ROOT / "services" / "gateway").glob("*.py"))
    assert '"/metrics"' in gateway_src


def test_compose_offers_prometheus_and_grafana_as_an_optional_profile():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name in ("prometheus", "grafana"):
        assert doc["services"][name]["profiles"] == ["observability"]
    mounts = " ".join(doc["services"]["grafana"]["volumes"] + doc["services"]["prometheus"]["volumes"])
    assert "./infra/grafana/dashboards:" in mounts and "./infra/prometheus/prometheus.yml:" in mounts
    ds = yaml.safe_load((ROOT / "infra" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "polyserve-prometheus"
    provider = yaml.safe_load((ROOT / "infra" / "grafana" / "provisioning" / "dashboards" / "polyserve.yml")
                              .read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
