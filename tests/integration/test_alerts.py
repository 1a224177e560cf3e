"""Alerting end to end: real Kafka broker, real DuckDB file, a real local HTTP webhook.

A NaN on one rank raises one firing event on the alerts topic, in the store and at the
webhook, naming the layer, rank and step, and one resolved event once the run is clean
again; a restarted worker does not fire it twice; a webhook that hangs does not slow the
frames; the demo's exploding scenario raises alerts that `gradstream alerts` lists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
from typer.testing import CliRunner

from consumer.alerts.feed import AlertFeed
from consumer.alerts.rows import read_alerts
from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from deploy.cli import app
from producer import GradientProducer
from schemas.alert import Alert, AlertRule, RunStatus
from tests.consumer.alerts.webhook_server import WebhookReceiver

WORLD = 3
LAYERS = {"embed": 64, "attn.q": 32, "ffn.out": 48, "head": 16}  # elements per rank


def gradients(step: int, rank: int, nan: set[tuple[int, int]]) -> dict[str, np.ndarray]:
    """Healthy gradients; a NaN in 'ffn.out' for every (step, rank) in ``nan``."""
    rng = np.random.default_rng(step * 100 + rank)
    out = {n: rng.standard_normal(k).astype(np.float32) * np.float32(0.01)
           for n, k in LAYERS.items()}
    if (step, rank) in nan:
        out["ffn.out"][5] = np.nan
    return out


def produce(bootstrap: str, topic: str, run_id: str, steps: range,
            nan: set[tuple[int, int]], *, start: bool = True, finish: bool = True,
            pace_s: float = 0.0) -> dict[int, float]:
    """Send every rank's summaries; returns step -> monotonic time of its first
    ``record_step`` call."""
    producers = [GradientProducer(run_id, rank=r, world_size=WORLD,
                                  bootstrap_servers=bootstrap, topic=topic)
                 for r in range(WORLD)]
    recorded = {}
    for p in producers:
        p.start_run({n: k * WORLD for n, k in LAYERS.items()})
    for p in producers:  # connected before the first step: latencies are steady-state
        assert p.flush(timeout=30)
    for step in steps:
        recorded[step] = time.monotonic()
        for rank, p in enumerate(producers):
            p.record_step(step, gradients(step, rank, nan))
        if pace_s:
            time.sleep(pace_s)
    for p in producers:
        if finish:
            p.finish_run()
        p.close()
    return recorded


def start_worker(settings: ConsumerSettings) -> tuple[Worker, threading.Thread]:
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.wait_ready(60), f"worker did not join: {worker.error}"
    return worker, thread


def read_topic(settings: ConsumerSettings) -> list[Alert | RunStatus]:
    feed = AlertFeed(settings, settings.alerts_topic, since=0)
    try:
        return feed.read_to_end()
    finally:
        feed.close()


@pytest.fixture
def settings(kafka_bootstrap, tmp_path, unique_name) -> ConsumerSettings:
    return ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{unique_name}",
        dlq_topic=f"dlq-{unique_name}", group_id=f"grp-{unique_name}",
        alerts_topic=f"alerts-{unique_name}", db=str(tmp_path / "store.duckdb"),
        shard_timeout_s=60.0,
        # only the rules this test is about (a spike or a stall would be real, but noise)
        alert_set=["grad_norm_spike.enabled=false", "stalled.enabled=false"],
    )


def test_nan_on_one_rank_reaches_topic_store_and_webhook_once(settings, unique_name):
    run_id = f"run-{unique_name}"
    with WebhookReceiver() as receiver:
        settings = settings.model_copy(update={"webhook_url": receiver.url})
        worker, thread = start_worker(settings)
        try:
            produce(settings.bootstrap_servers, settings.topic, run_id, range(20),
                    nan={(8, 2), (9, 2)})
            assert worker.wait_for_runs([run_id], 60), worker.error
            assert receiver.wait_for(3, 15), receiver.bodies
            # while the worker holds the store, `gradstream alerts` reads the topic
            listed = subprocess.run(
                [sys.executable, "-m", "deploy.cli", "alerts", "--db", settings.db,
                 "--bootstrap-servers", settings.bootstrap_servers,
                 "--alerts-topic", settings.alerts_topic, "--run", run_id],
                capture_output=True, text=True, timeout=120,
                env={**os.environ, "COLUMNS": "250"},
            )
        finally:
            worker.stop()
            thread.join(30)
    assert worker.error is None
    assert listed.returncode == 0, listed.stderr
    assert "reading the alerts topic" in listed.stderr
    assert "nonfinite" in listed.stdout and "run_health" in listed.stdout

    records = read_topic(settings)
    alerts = [r for r in records if isinstance(r, Alert)]
    assert sorted((a.rule.value, a.state.value, a.step) for a in alerts) == [
        ("nonfinite", "firing", 8), ("nonfinite", "resolved", 14),
        ("run_health", "firing", 8),
    ]
    nan_alert = next(a for a in alerts if a.rule is AlertRule.NONFINITE and a.step == 8)
    assert nan_alert.layers == ["ffn.out"] and nan_alert.ranks == [2]
    assert nan_alert.values["nonfinite_by_rank"] == {"2": ["ffn.out"]}
    assert nan_alert.values["layers"]["ffn.out"]["nonfinite"] == 1
    statuses = [r for r in records if isinstance(r, RunStatus)]
    assert statuses[-1].run_id == run_id and statuses[-1].finished
    assert statuses[-1].step == 19 and statuses[-1].health.value == "Critical"

    con = duckdb.connect(settings.db, read_only=True)
    stored = read_alerts(con, run_id=run_id)
    con.close()
    assert {a.alert_id for a in stored} == {a.alert_id for a in alerts}
    assert next(a for a in stored if a.alert_id == nan_alert.alert_id) == nan_alert

    posted = [Alert.model_validate(b["metadata"]["event_payload"]) for b in receiver.bodies]
    assert sorted(a.alert_id for a in posted) == sorted(a.alert_id for a in alerts)
    assert all(b["text"] and b["blocks"] for b in receiver.bodies)
    assert worker.alerts is not None
    summary = worker.alerts.summary()
    assert summary["webhook"]["delivered"] == 3 and summary["kafka"]["delivered"] == 3

    result = CliRunner().invoke(app, ["alerts", "--db", settings.db, "--run", run_id,
                                      "--json"])
    assert result.exit_code == 0, result.output
    listed_ids = [Alert.model_validate_json(line).alert_id
                  for line in result.output.splitlines() if line.strip()]
    assert sorted(listed_ids) == sorted(a.alert_id for a in alerts)

    watched = CliRunner().invoke(app, ["watch", "--bootstrap-servers",
                                       settings.bootstrap_servers, "--alerts-topic",
                                       settings.alerts_topic, "--duration", "3"],
                                 env={"COLUMNS": "200"})
    assert watched.exit_code == 0, watched.output
    assert run_id in watched.output and "finished" in watched.output
    assert "non-finite gradients" in watched.output


def test_follow_tails_new_alerts(settings, unique_name):
    run_id = f"run-{unique_name}"
    worker, thread = start_worker(settings)
    try:
        follower = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "alerts", "--follow", "--json",
             "--bootstrap-servers", settings.bootstrap_servers,
             "--alerts-topic", settings.alerts_topic, "--since", "600", "--count", "3",
             "--duration", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(3)
        produce(settings.bootstrap_servers, settings.topic, run_id, range(12),
                nan={(3, 0)})
        assert worker.wait_for_runs([run_id], 60), worker.error
        out, err = follower.communicate(timeout=90)
    finally:
        worker.stop()
        thread.join(30)
    events = [Alert.model_validate_json(line) for line in out.splitlines() if line.strip()]
    assert sorted((e.rule.value, e.state.value) for e in events) == [
        ("nonfinite", "firing"), ("nonfinite", "resolved"), ("run_health", "firing")], err


def test_restarted_worker_does_not_fire_an_open_incident_again(settings, unique_name):
    run_id = f"run-{unique_name}"
    worker, thread = start_worker(settings)
    produce(settings.bootstrap_servers, settings.topic, run_id, range(8), nan={(5, 1)},
            finish=False)
    deadline = time.monotonic() + 30
    while worker.counters.frames < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.stop()
    thread.join(30)
    produce(settings.bootstrap_servers, settings.topic, run_id, range(8, 16), nan=set(),
            start=False)
    worker, thread = start_worker(settings)
    try:
        assert worker.wait_for_runs([run_id], 60), worker.error
    finally:
        worker.stop()
        thread.join(30)
    con = duckdb.connect(settings.db, read_only=True)
    stored = read_alerts(con, run_id=run_id, rule="nonfinite")
    con.close()
    # fired once; the new worker counts 5 clear frames of its own (8..12) to resolve it
    assert [(a.state.value, a.step) for a in stored] == [("firing", 5), ("resolved", 12)]
    assert stored[0].incident_id == stored[1].incident_id


def collect_firing(feed: AlertFeed, arrivals: dict[int, float], stop: threading.Event) -> None:
    """Record the arrival time (monotonic) of each firing event, by step, until ``stop``."""
    while not stop.is_set():
        for record in feed.poll(50):
            if isinstance(record, Alert) and record.state.value == "firing":
                arrivals.setdefault(record.step, time.monotonic())


def test_hanging_webhook_does_not_slow_the_frames(settings, unique_name):
    """Alerts still reach the topic within a second and every frame is stored while the
    webhook holds each request open; the webhook's queue overflows and is counted."""
    run_id = f"run-{unique_name}"
    nan = {(s, (s // 3) % WORLD) for s in range(2, 60, 3)}  # 20 incidents, 1 step each
    steps = 62
    with WebhookReceiver(hang=True) as receiver:
        settings = settings.model_copy(update={
            "webhook_url": receiver.url, "webhook_timeout_s": 60.0, "alert_queue_size": 4,
            "alert_set": [*settings.alert_set, "nonfinite.resolve_after=1",
                          "run_health.enabled=false"],
        })
        worker, thread = start_worker(settings)
        feed = AlertFeed(settings, settings.alerts_topic, since=None)
        arrivals: dict[int, float] = {}
        stop = threading.Event()
        collector = threading.Thread(target=collect_firing, args=(feed, arrivals, stop))
        collector.start()
        try:
            recorded = produce(settings.bootstrap_servers, settings.topic, run_id,
                               range(steps), nan=nan, pace_s=0.02)
            assert worker.wait_for_runs([run_id], 30), worker.error
            stored_in = time.monotonic() - recorded[steps - 1]
            deadline = time.monotonic() + 10
            while len(arrivals) < len(nan) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            collector.join(10)
            feed.close()
            worker.stop()
            t0 = time.monotonic()
            thread.join(60)
            stop_s = time.monotonic() - t0
    assert sorted(arrivals) == sorted(s for s, _ in nan)
    latencies = [arrivals[s] - recorded[s] for s in arrivals]
    assert max(latencies) < 1.0, latencies
    assert stored_in < 5.0
    assert stop_s < 20.0  # the worker gives the webhook 5 s, then gives up
    assert worker.alerts is not None
    summary = worker.alerts.summary()["webhook"]
    assert summary["submitted"] == 40 and summary["delivered"] == 0
    assert summary["dropped"] >= 40 - 4 - 1
    assert receiver.requests >= 1


def test_demo_exploding_scenario_raises_alerts_that_gradstream_alerts_lists(
    kafka_bootstrap: str, tmp_path: Path,
) -> None:
    with WebhookReceiver() as receiver:
        result = CliRunner().invoke(app, [
            "demo", "--scenario", "exploding", "--ranks", "2", "--out", str(tmp_path),
            "--no-heatmap", "--bootstrap-servers", kafka_bootstrap,
            "--webhook", receiver.url,
        ])
        assert result.exit_code == 0, result.output
        assert "incident(s) fired" in result.output
        db = tmp_path / "demo.duckdb"
        con = duckdb.connect(str(db), read_only=True)
        stored = read_alerts(con)
        con.close()
        firing = {a.rule.value for a in stored if a.state.value == "firing"}
        assert {"exploding", "nonfinite", "run_health"} <= firing
        assert receiver.wait_for(len(stored), 15)
    posted = {Alert.model_validate(b["metadata"]["event_payload"]).alert_id
              for b in receiver.bodies}
    assert posted == {a.alert_id for a in stored}
    exploding = next(a for a in stored if a.rule is AlertRule.EXPLODING)
    assert exploding.layers and all(n.startswith("layers.") for n in exploding.layers)
    assert all(v["max_abs_grad"] is None or v["max_abs_grad"] > 1e3 or v["nonfinite"]
               for v in exploding.values["layers"].values())
    # the local view names where it started: some rank's own gradient crossed 1e3 no later
    # than the averaged one flagged for the streak
    origin = exploding.values["local_origin"]
    assert origin["ranks"] and set(origin["ranks"]) <= {0, 1}
    assert origin["step"] <= exploding.first_step
    assert f"first in {'rank' if len(origin['ranks']) == 1 else 'the local'}" in exploding.message

    listed = CliRunner().invoke(app, ["alerts", "--db", str(db)], env={"COLUMNS": "250"})
    assert listed.exit_code == 0, listed.output
    for rule in ("exploding", "nonfinite", "run_health"):
        assert rule in listed.output
    assert f"{len(stored)} alert event(s)" in listed.output
