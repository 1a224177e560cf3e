"""The shipped monitoring against real services: a real Prometheus scrapes a real worker.

A worker (real Kafka broker, real DuckDB file) serves its metrics while a run streams
through it: two ranks whose gradients turn NaN in the last steps (the ``nonfinite``
incident fires and stays open: fewer clean steps follow than it needs to resolve; the run,
now Critical, opens a ``run_health`` incident too) and one unreadable record (a dead
letter). A real Prometheus (``/usr/bin/prometheus``, Debian's
package) scrapes the worker every second with the shipped alerting rules
(deploy/prometheus/gradstream-alerts.yml) loaded. Then:

- ``promtool check metrics`` finds no problem in the worker's real scrape;
- every query of every panel of the shipped Grafana dashboard
  (deploy/grafana/gradstream-dashboard.json), with Grafana's variables replaced by
  concrete values, returns data from Prometheus's HTTP API (``/api/v1/query``), and the
  figures of the run are the right ones (frames, dead letters, the open incident, the run's
  health, write latencies);
- every shipped rule is loaded and evaluates without error (``/api/v1/rules``), and the
  dead-letter alert fires for the record dead-lettered (``/api/v1/alerts``).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from kafka import KafkaProducer

from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from producer import GradientProducer
from tests.integration.alertmanager import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "gradstream-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "gradstream-alerts.yml"
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
JOB = "gradstream-worker"
"""The job name of the shipped scrape configurations (deploy/prometheus/prometheus.yml)."""

SCRAPE_INTERVAL_S = 1
"""Prometheus scrapes and evaluates the rules every second, so the test takes seconds."""

WORLD = 2
STEPS = 12
NAN_STEPS = (10, 11)
"""Rank 1's gradient holds a NaN at these steps: the ``nonfinite`` incident fires at step
10 and stays open (it resolves after ``resolve_after`` = 5 clean steps; none follow)."""
LAYERS = {"embed": 32, "attn.q": 16, "head": 8}  # elements per rank


class Prometheus:
    """A real Prometheus server on loopback: its config, TSDB and log in ``home``.

    Args:
        home: a fresh directory. target: ``host:port`` scraped as job :data:`JOB`.
        rules: rule files to load.
    """

    def __init__(self, home: Path, target: str, rules: list[Path]) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config = home / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                       "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "rule_files": [str(r) for r in rules],
            "scrape_configs": [{"job_name": JOB,
                                "static_configs": [{"targets": [target]}]}],
        }))
        self.home = home
        self.log = home / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it is ready (``/-/ready``)."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}",
                 f"--storage.tsdb.path={self.home / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_until("Prometheus to be ready", self._ready, 60)

    def _ready(self) -> bool:
        assert self.process is not None and self.process.poll() is None, (
            f"Prometheus exited: {self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready",
                                        timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 20 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def api(self, path: str, **params: str) -> Any:
        """``data`` of a Prometheus HTTP API v1 answer (``GET /api/v1/<path>``).

        Raises:
            AssertionError: the answer's status is not ``success``.
        """
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}" + (f"?{query}" if query else "")
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (``/api/v1/query``)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The value of a one-element instant vector; None when empty."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def worker(kafka_bootstrap: str, tmp_path: Path, unique_name: str) -> Iterator[Worker]:
    """A running worker writing DuckDB, serving metrics on a free port."""
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"ps-{unique_name}",
        dlq_topic=f"ps-dlq-{unique_name}", alerts_topic=f"ps-alerts-{unique_name}",
        group_id=f"ps-{unique_name}", db=str(tmp_path / "store.duckdb"), partitions=2,
        shard_timeout_s=60.0, metrics_port=free_port(),
        # only the rule this test is about (a spike or a stall would be real, but noise)
        alert_set=["grad_norm_spike.enabled=false", "stalled.enabled=false"],
    )
    w = Worker(settings)
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    try:
        assert w.wait_ready(60), f"worker did not join: {w.error}"
        yield w
    finally:
        w.stop()
        thread.join(30)
    assert w.error is None, w.error


@pytest.fixture
def prometheus(worker: Worker, tmp_path: Path) -> Iterator[Prometheus]:
    """A real Prometheus scraping ``worker`` with the shipped rules loaded."""
    server = Prometheus(tmp_path / "prometheus-home", f"127.0.0.1:{worker.metrics.port}",
                        [RULES])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def stream_run(settings: ConsumerSettings, run_id: str) -> None:
    """Every rank's summaries of a small run (NaN on rank 1 at :data:`NAN_STEPS`), then one
    unreadable record on the summaries topic (dead-lettered, error class ``invalid``)."""
    producers = [GradientProducer(run_id, rank=r, world_size=WORLD,
                                  bootstrap_servers=settings.bootstrap_servers,
                                  topic=settings.topic) for r in range(WORLD)]
    for p in producers:
        p.start_run({name: n * WORLD for name, n in LAYERS.items()})
    for step in range(STEPS):
        for rank, p in enumerate(producers):
            rng = np.random.default_rng(step * 10 + rank)
            grads = {name: rng.standard_normal(n).astype(np.float32) * np.float32(0.01)
                     for name, n in LAYERS.items()}
            if rank == 1 and step in NAN_STEPS:
                grads["attn.q"][2] = np.nan
            p.record_step(step, grads)
    for p in producers:
        p.finish_run()
        p.close()
    raw = KafkaProducer(bootstrap_servers=settings.bootstrap_servers)
    try:
        raw.send(settings.topic, key=b"garbage", value=b"{not a summary")
        raw.flush(30)
    finally:
        raw.close()


def dashboard_queries(window_s: int) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every target of every panel of the shipped
    dashboard, with Grafana's variables replaced as Grafana would for a dashboard showing
    the last ``window_s`` seconds, refreshed now, on a data source scraped every
    :data:`SCRAPE_INTERVAL_S`: ``$__range`` and ``$__rate_interval`` (here wider than
    Grafana's minimum of four scrape intervals: the whole window) the window,
    ``$__interval`` one scrape interval; a template variable takes its "All" value
    (``allValue``).

    Raises:
        AssertionError: a query uses a variable that the dashboard does not define.
    """
    board = json.loads(DASHBOARD.read_text())
    values = {"__range": f"{window_s}s", "__rate_interval": f"{window_s}s",
              "__interval": f"{SCRAPE_INTERVAL_S}s"}
    for var in board["templating"]["list"]:
        if var.get("includeAll"):
            values[var["name"]] = var["allValue"]

    def substitute(expr: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            assert name in values, f"{expr!r}: variable ${name} has no value"
            return values[name]

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)

    panels = [p for p in board["panels"] if p["type"] != "row"]
    return [(p["title"], t["refId"], substitute(t["expr"])) for p in panels
            for t in p["targets"]]


def by_label(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    """label value -> sample value of an instant vector."""
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def test_dashboard_queries_and_rules_on_a_real_scrape(worker: Worker, prometheus: Prometheus,
                                                      unique_name: str) -> None:
    started = time.monotonic()
    settings = worker.settings
    wait_until("the first scrape of the worker",
               lambda: prometheus.value(f'up{{job="{JOB}"}}') == 1, 60)

    run_id = f"run-{unique_name}"
    stream_run(settings, run_id)
    assert worker.wait_for_runs([run_id], 60), worker.error
    frames = f'sum(gradstream_frames_total{{job="{JOB}", complete="true"}})'
    wait_until("Prometheus to scrape the run's figures", lambda: (
        prometheus.value(frames) == STEPS
        and prometheus.value(f'sum(gradstream_dead_letters_total{{job="{JOB}"}})') == 1
        and prometheus.value(
            f'sum(gradstream_firing_incidents{{job="{JOB}", rule="nonfinite"}})') == 1), 60)

    # The worker's own scrape: no problem for promtool.
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics.port}/metrics",
                                timeout=5) as answer:
        scrape = answer.read()
    assert b"gradstream_store_write_duration_seconds_bucket" in scrape
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape,
                           capture_output=True, timeout=60, check=False)
    assert check.returncode == 0 and not check.stdout.strip(), (
        check.stdout.decode() + check.stderr.decode())

    # Every panel's queries return data; the run's figures are the right ones.
    window_s = math.ceil(time.monotonic() - started) + 2 * SCRAPE_INTERVAL_S
    results = {}
    for title, ref, expr in dashboard_queries(window_s):
        result = prometheus.query(expr)
        assert result, f"panel {title!r} query {ref} returns no data: {expr}"
        results[(title, ref)] = result
    assert by_label(results[("Workers and store up", "A")], "job") == {JOB: 1.0}
    lag = results[("Consumer lag per partition", "A")]
    assert {(r["metric"]["topic"], r["metric"]["partition"]) for r in lag} == {
        (settings.topic, "0"), (settings.topic, "1")}
    assert by_label(results[("Records read per second", "A")], "topic")[settings.topic] > 0
    frames_per_s = by_label(results[("Frames per second", "A")], "complete")
    assert frames_per_s["true"] > 0 and frames_per_s["false"] == 0
    assert by_label(results[("Layer rows per second", "A")], "job")[JOB] > 0
    assert by_label(results[("Dead letters per second", "A")], "reason")["invalid"] > 0
    assert by_label(results[("Dead letters in range", "A")], "reason")["invalid"] >= 1
    assert by_label(results[("Store write failures in range", "A")], "output") == {
        "duckdb": 0.0}
    firing = by_label(results[("Firing incidents by rule", "A")], "rule")
    assert {rule for rule, n in firing.items() if n} == {"nonfinite", "run_health"}, firing
    assert firing["nonfinite"] == firing["run_health"] == 1, firing
    assert {"stalled", "grad_norm_spike"} <= set(firing), firing  # disabled rules: 0
    in_progress = by_label(results[("Runs by health", "A")], "health")
    finished = by_label(results[("Runs by health", "B")], "health")
    assert sum(in_progress.values()) == 0, in_progress
    assert finished == {"Healthy": 0, "MinorIssues": 0, "ProblemsDetected": 0,
                        "Critical": 1}, finished
    for ref in ("A", "B", "C"):  # p50, p90, p99 of the DuckDB transactions
        (latency,) = results[("Store write latency", ref)]
        assert latency["metric"]["output"] == "duckdb"
        # NaN when Prometheus's samples in the window show no new write (a run this small
        # may be written between two scrapes); else within the histogram's buckets
        value = float(latency["value"][1])
        assert math.isnan(value) or 0 < value < 64, latency
    writes = prometheus.value(
        f'sum(gradstream_store_write_duration_seconds_count{{job="{JOB}", output="duckdb"}})')
    assert writes >= 1  # the worker's transactions were timed

    # The shipped rules: loaded, evaluated without error; the dead letter fires its alert.
    shipped = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
               for r in g["rules"]}
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr

    def rules_evaluated() -> dict[str, str]:
        loaded = {r["name"]: r["health"] for g in prometheus.api("rules")["groups"]
                  for r in g["rules"]}
        return loaded if loaded and all(h != "unknown" for h in loaded.values()) else {}

    loaded = wait_until("the rules to be evaluated", rules_evaluated, 30)
    assert set(loaded) == shipped
    assert set(loaded.values()) == {"ok"}, loaded

    def dead_letter_alert() -> list[dict[str, Any]]:
        return [a for a in prometheus.api("alerts")["alerts"]
                if a["labels"]["alertname"] == "GradstreamDeadLettersRising"
                and a["state"] == "firing"]

    (alert,) = wait_until("GradstreamDeadLettersRising to fire", dead_letter_alert, 30)
    assert alert["labels"]["reason"] == "invalid" and alert["labels"]["job"] == JOB
    assert "gradstream dlq" in alert["annotations"]["description"]
    firing_now = {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]
                  if a["state"] == "firing"}
    assert firing_now == {"GradstreamDeadLettersRising"}, firing_now
