"""The shipped monitoring files (deploy/prometheus/, deploy/grafana/) agree with promtool,
with the metrics the code exports and with the deployment manifests.

Nothing is started here but promtool (Debian's ``prometheus`` package, installed by
``make services``): the alerting rules pass ``promtool check rules`` and their unit tests
(``promtool test rules`` on tests/deploy/gradstream_alerts_test.yml: each alert fires on
the series it is about, after its ``for``, and not on the others), the example scrape
configurations pass ``promtool check config`` and scrape the services and ports of
deploy/docker-compose.yml and deploy/k8s, and every metric the dashboard and the rules
query is one that ``consumer.metrics.WorkerMetrics`` exports, with bounded labels. A real
Prometheus runs the dashboard's queries and the rules against a real worker in
tests/integration/test_prometheus_scrape.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from consumer.metrics import WorkerMetrics
from schemas.wire import GradientHealth

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "gradstream-alerts.yml"
RULE_TESTS = Path(__file__).with_name("gradstream_alerts_test.yml")
SCRAPE_CONFIGS = {
    "compose": DEPLOY / "prometheus" / "prometheus.yml",
    "k8s": DEPLOY / "prometheus" / "prometheus-kubernetes.yml",
}
DASHBOARD = DEPLOY / "grafana" / "gradstream-dashboard.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
PROMTOOL = "/usr/bin/promtool"
JOBS = {"gradstream-worker": "consume", "gradstream-store": "store"}
"""The job names the rules and the dashboard are written for -> the gradstream subcommand
each scrapes."""

BOUNDED_LABELS = {"topic", "partition", "complete", "reason", "action", "output", "health",
                  "finished", "rule", "severity", "le"}
"""Every label of a gradstream_* series: each takes a few values (no run, layer or rank)."""

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def promtool(*args: str) -> str:
    """Run promtool; its output. AssertionError with the output when it fails."""
    done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def rules() -> list[dict[str, Any]]:
    """The alerting rules of the shipped rule file."""
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exported() -> dict[str, set[str]]:
    """Sample name -> label names of every series a worker's metrics expose, with every
    labelled family given a child (the scrape-time gauges with figures)."""
    metrics = WorkerMetrics(
        runs=lambda: {(GradientHealth.CRITICAL.value, True): 1},
        incidents=lambda: [("nonfinite", "critical", 1)])
    metrics.watch_output("duckdb")
    metrics.messages.labels("gradstream.summaries", "0")
    metrics.lag.labels("gradstream.summaries", "0").set(0)
    metrics.stuck_partitions.labels("gradstream.summaries", "0")
    return {s.name: set(s.labels) for family in metrics.registry.collect()
            for s in family.samples}


def metric_names(expr: str) -> set[str]:
    """The gradstream_* metric names a PromQL expression selects."""
    return set(re.findall(r"\bgradstream_[a-z_]+\b", expr))


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    assert f"SUCCESS: {len(rules())} rules found" in promtool("check", "rules", str(RULES))
    promtool("test", "rules", str(RULE_TESTS))


def test_every_alert_is_unit_tested_and_labelled_with_a_severity() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert [str(RULES)] == [str((RULE_TESTS.parent / f).resolve()) for f in tests["rule_files"]]
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
             if t.get("exp_alerts")}
    shipped = {r["alert"] for r in rules()}
    assert tested == fired == shipped
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_example_scrape_configs_pass_promtool_and_load_the_rules() -> None:
    for path in SCRAPE_CONFIGS.values():
        promtool("check", "config", str(path))
        config = yaml.safe_load(path.read_text())
        assert [(path.parent / f).resolve() for f in config["rule_files"]] == [RULES]
        assert {job["job_name"] for job in config["scrape_configs"]} == set(JOBS), path


def _dns_targets(path: Path) -> dict[str, tuple[str, int]]:
    """job -> (name, port) of a scrape config whose jobs each have one DNS name or one
    static target."""
    out = {}
    for job in yaml.safe_load(path.read_text())["scrape_configs"]:
        if "dns_sd_configs" in job:
            (sd,) = job["dns_sd_configs"]
            (name,) = sd["names"]
            out[job["job_name"]] = (name, int(sd["port"]))
        else:
            ((target,),) = [s["targets"] for s in job["static_configs"]]
            host, _, port = target.rpartition(":")
            out[job["job_name"]] = (host, int(port))
    return out


def test_compose_scrape_config_targets_the_compose_services() -> None:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    targets = _dns_targets(SCRAPE_CONFIGS["compose"])
    for job, (name, port) in targets.items():
        assert name in services, f"{job}: no compose service {name!r}"
        service = services[name]
        assert service["command"][0] == JOBS[job], f"{job} scrapes {name!r}: {service['command']}"
        assert int(service["environment"]["GRADSTREAM_METRICS_PORT"]) == port, job


def test_kubernetes_scrape_config_targets_the_metrics_services() -> None:
    docs = [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]
    services = {(d["metadata"]["name"], d["metadata"]["namespace"]): d for d in docs
                if d["kind"] == "Service"}
    for job, (name, port) in _dns_targets(SCRAPE_CONFIGS["k8s"]).items():
        svc_name, namespace, rest = name.split(".", 2)
        assert rest == "svc.cluster.local", name
        service = services[(svc_name, namespace)]
        assert service["spec"]["clusterIP"] == "None", (
            f"{name}: only a headless Service's DNS name has one A record per pod")
        assert service["metadata"]["labels"]["app.kubernetes.io/component"] == (
            job.removeprefix("gradstream-")), job
        assert [p["port"] for p in service["spec"]["ports"]] == [port], job


def test_every_queried_metric_is_exported_with_bounded_labels() -> None:
    series = exported()
    queries = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    queries += [r["expr"] for r in rules()]
    used = set().union(*(metric_names(q) for q in queries))
    assert used, "no gradstream metric queried"
    missing = sorted(used - set(series))
    assert not missing, f"queried but not exported: {missing}"
    for name, labels in series.items():
        if name.startswith("gradstream_"):
            assert labels <= BOUNDED_LABELS, f"{name}: unbounded label(s) {labels - BOUNDED_LABELS}"


def test_dashboard_model() -> None:
    board = dashboard()
    (ds_input,) = board["__inputs"]
    assert (ds_input["name"], ds_input["type"], ds_input["pluginId"]) == (
        "DS_PROMETHEUS", "datasource", "prometheus")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (variables["DS_PROMETHEUS"]["type"], variables["DS_PROMETHEUS"]["query"]) == (
        "datasource", "prometheus")
    assert variables["job"]["datasource"] == DS
    titles = [p["title"] for p in board["panels"]]
    for wanted in ("Consumer lag per partition", "Frames per second", "Layer rows per second",
                   "Dead letters per second", "Firing incidents by rule",
                   "Store write latency", "Runs by health"):
        assert wanted in titles, wanted
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == DS, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DS, panel["title"]
            assert metric_names(target["expr"]) or "up{" in target["expr"], panel["title"]
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])
    quantiles = [t["expr"] for p in board["panels"] if p["title"] == "Store write latency"
                 for t in p["targets"]]
    assert [re.match(r"histogram_quantile\(([0-9.]+),", q).group(1) for q in quantiles] == [
        "0.5", "0.9", "0.99"]
    assert all("gradstream_store_write_duration_seconds_bucket" in q for q in quantiles)


def test_grafana_provisioning_examples() -> None:
    (source,) = yaml.safe_load(
        (PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus"
    scrape = yaml.safe_load(SCRAPE_CONFIGS["compose"].read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape  # $__rate_interval's base
    (provider,) = yaml.safe_load(
        (PROVISIONING / "dashboards" / "gradstream.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
