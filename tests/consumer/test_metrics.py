"""Prometheus metrics of a worker: scraped over HTTP while a real worker consumes from the
broker, and the lag computation against a real consumer position."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request

import duckdb
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumer.alerts.rules import RULES
from consumer.metrics import WorkerMetrics
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBOutput
from consumer.outputs.frames_topic import FramesTopicOutput
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from schemas.wire import GradientHealth, RunStarted, StepSummary, encode_message

LAYERS = 3
STEPS = 12
AGE_S = 100.0  # the summaries' wall time lies this far in the past


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    """Samples by name from http://127.0.0.1:port/metrics; None if nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for got, v in samples.get(name, []) if labels.items() <= got.items())


def step(run_id: str, s: int, rank: int, wall_time: float) -> bytes:
    return encode_message(StepSummary(
        run_id=run_id, step=s, rank=rank, world_size=2, wall_time=wall_time,
        layer_indices=list(range(LAYERS)), numel=[10] * LAYERS, sum_abs=[1.0] * LAYERS,
        sum_sq=[0.5] * LAYERS, max_abs=[0.25] * LAYERS, nonfinite=[0] * LAYERS,
    ))


def test_endpoint_reports_messages_rows_dead_letters_pending_latency_and_lag(
    kafka_bootstrap: str, tmp_path, unique_name: str
) -> None:
    port = free_port()
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"m-{unique_name}",
        dlq_topic=f"m-dlq-{unique_name}", alerts_topic=f"m-alerts-{unique_name}",
        group_id=f"m-{unique_name}", db=str(tmp_path / "m.duckdb"), shard_timeout_s=600.0,
        partitions=2, metrics_port=port,
    )
    run_id = f"run-{unique_name}"
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert worker.wait_ready(60), worker.error
        wall = time.time() - AGE_S
        values = [encode_message(RunStarted(run_id=run_id, rank=r, world_size=2,
                                            layer_names=["a", "b", "c"], numel=[20] * LAYERS,
                                            start_time=wall)) for r in range(2)]
        values += [step(run_id, s, r, wall) for s in range(STEPS) for r in range(2)]
        values.append(step(run_id, STEPS, 0, wall))  # rank 1 never reports: pending
        values += [b"{oops", encode_message(RunStarted(run_id=run_id, world_size=2,
                                                       layer_names=["a"], numel=[1],
                                                       start_time=wall)).replace(
            b'"schema_version":"1.', b'"schema_version":"7.')]
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
        for v in values:
            producer.send(settings.topic, key=run_id.encode(), value=v)
        producer.send(settings.topic, key=b"other", value=step("never-started", 0, 0, wall))
        producer.flush()
        producer.close()
        sent = len(values) + 1

        deadline = time.monotonic() + 60
        while True:
            samples = scrape(port)
            assert samples is not None, "the metrics endpoint does not answer"
            lags = samples.get("gradstream_consumer_lag", [])
            if (value(samples, "gradstream_messages_total") == sent and len(lags) == 2
                    and all(v == 0 for _, v in lags)
                    and value(samples, "gradstream_store_write_duration_seconds_count") > 0):
                break
            assert time.monotonic() < deadline, samples
            time.sleep(0.2)
        assert value(samples, "gradstream_frames_total", complete="true") == STEPS
        assert value(samples, "gradstream_frames_total", complete="false") == 0
        assert value(samples, "gradstream_layer_rows_total") == STEPS * LAYERS
        assert value(samples, "gradstream_dead_letters_total", reason="invalid") == 2
        assert value(samples, "gradstream_dead_letters_total", reason="unknown_run") == 1
        assert value(samples, "gradstream_pending_frames") == 1
        assert {labels["topic"] for labels, _ in lags} == {settings.topic}
        # Frame latency = now - producer wall time: about AGE_S for every frame.
        assert value(samples, "gradstream_frame_latency_seconds_count") == STEPS
        assert value(samples, "gradstream_frame_latency_seconds_bucket", le="64.0") == 0
        assert value(samples, "gradstream_frame_latency_seconds_bucket", le="128.0") == STEPS
        total_s = value(samples, "gradstream_frame_latency_seconds_sum")
        assert STEPS * AGE_S <= total_s <= STEPS * (AGE_S + 60)
        assert value(samples, "process_resident_memory_bytes") > 0
        # One run, not finished (rank 1 never sent RunFinished), healthy; every state listed.
        assert value(samples, "gradstream_runs", health="Healthy", finished="false") == 1
        assert value(samples, "gradstream_runs") == 1
        assert len(samples["gradstream_runs"]) == 2 * len(GradientHealth)
        # Every alert rule has its series, with the rule's severity.
        rules = {labels["rule"]: labels["severity"]
                 for labels, _ in samples["gradstream_firing_incidents"]}
        assert rules == {str(r.name): str(worker.alerts.engine.rules.rule(r.name).severity)
                         for r in RULES}
        # The DuckDB transactions were timed, none failed; no *_created series.
        assert value(samples, "gradstream_store_write_failures_total", output="duckdb") == 0
        assert value(samples, "gradstream_store_write_duration_seconds_bucket", output="duckdb",
                     le="+Inf") == value(samples, "gradstream_store_write_duration_seconds_count")
        assert not [name for name in samples if name.endswith("_created")]
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None
    assert scrape(port) is None, "the endpoint outlived the worker"


def test_lag_is_end_offset_minus_position(kafka_bootstrap: str, unique_name: str) -> None:
    topic = f"lag-{unique_name}"
    ensure_topics(ConsumerSettings(bootstrap_servers=kafka_bootstrap, partitions=1), [topic])
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for i in range(10):
        producer.send(topic, value=b"%d" % i)
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None,
                             enable_auto_commit=False)
    metrics = WorkerMetrics(lag_interval_s=0.0)
    labels = {"topic": topic, "partition": "0"}
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 3)
        metrics.refresh_lag(consumer)  # nothing fetched yet: the end offset is asked for
        assert metrics.registry.get_sample_value("gradstream_consumer_lag", labels) == 7
        read = 0
        deadline = time.monotonic() + 30
        while read < 4 and time.monotonic() < deadline:
            records = consumer.poll(timeout_ms=500, max_records=4 - read)
            metrics.on_poll(records, consumer)
            read += sum(len(b) for b in records.values())
        assert read == 4
        assert metrics.registry.get_sample_value("gradstream_consumer_lag", labels) == 3
        assert metrics.registry.get_sample_value("gradstream_messages_total", labels) == 4
        consumer.assign([])
        metrics.refresh_lag(consumer)  # a partition no longer assigned has no series
        assert metrics.registry.get_sample_value("gradstream_consumer_lag", labels) is None
    finally:
        consumer.close()


def test_workers_in_one_process_keep_separate_figures() -> None:
    a, b = WorkerMetrics(lambda: 4), WorkerMetrics(lambda: 9)
    a.dead_letter("invalid")
    a.dead_letter("invalid")
    b.dead_letter("unknown_run")
    assert a.registry.get_sample_value("gradstream_dead_letters_total",
                                       {"reason": "invalid"}) == 2
    assert b.registry.get_sample_value("gradstream_dead_letters_total",
                                       {"reason": "invalid"}) == 0
    assert a.registry.get_sample_value("gradstream_pending_frames") == 4
    assert b.registry.get_sample_value("gradstream_pending_frames") == 9


def test_serve_is_off_without_a_port_and_names_a_taken_port() -> None:
    assert WorkerMetrics().serve(None) is None
    assert WorkerMetrics().serve(0) is None
    first = WorkerMetrics()
    port = free_port()
    assert first.serve(port, "127.0.0.1") == port
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*--metrics-port"):
            WorkerMetrics().serve(port, "127.0.0.1")
        assert scrape(port) is not None
    finally:
        first.close()
    assert scrape(port) is None


def write_figures(metrics: WorkerMetrics, output: str) -> tuple[float, float, float]:
    """(writes observed, their total seconds, failures) of ``output``."""
    def get(name: str) -> float:
        got = metrics.registry.get_sample_value(name, {"output": output})
        assert got is not None, f"{name} has no series for output {output!r}"
        return got

    return (get("gradstream_store_write_duration_seconds_count"),
            get("gradstream_store_write_duration_seconds_sum"),
            get("gradstream_store_write_failures_total"))


def test_duckdb_transactions_are_timed_and_a_failed_one_counted(tmp_path) -> None:
    metrics = WorkerMetrics()
    output = DuckDBOutput(tmp_path / "w.duckdb", "g")
    metrics.watch_output(output.name)
    output.write_observer = metrics.observe_write
    assert write_figures(metrics, "duckdb") == (0, 0, 0)  # the series exist before a write
    try:
        began = time.perf_counter()
        output.write(Batch(offsets={("t", 0): 5}))
        assert output.settle(wait=True)
        elapsed = time.perf_counter() - began
        count, seconds, failures = write_figures(metrics, "duckdb")
        assert (count, failures) == (1, 0) and 0 < seconds <= elapsed
        # a rank that is no integer: DuckDB refuses the row, the transaction rolls back
        output.write(Batch(refusals=[("run", "not a rank", "why")]))  # type: ignore[list-item]
        with pytest.raises(duckdb.Error):
            output.settle(wait=True)
        count, _, failures = write_figures(metrics, "duckdb")
        assert (count, failures) == (2, 1)
    finally:
        with contextlib.suppress(duckdb.Error):  # close() re-raises the failed write
            output.close()


def test_frames_topic_writes_are_timed(kafka_bootstrap: str, unique_name: str) -> None:
    settings = ConsumerSettings(bootstrap_servers=kafka_bootstrap, partitions=1,
                                frames_topic=f"mf-{unique_name}",
                                runs_topic=f"mf-runs-{unique_name}")
    metrics = WorkerMetrics()
    output = FramesTopicOutput.from_settings(settings)
    metrics.watch_output(output.name)
    output.write_observer = metrics.observe_write
    try:
        output.write(Batch())
        output.write(Batch())
    finally:
        output.close()
    count, seconds, failures = write_figures(metrics, "frames_topic")
    assert (count, failures) == (2, 0) and seconds > 0


def test_runs_and_incidents_are_read_at_scrape_time() -> None:
    runs: list[dict[tuple[str, bool], int] | None] = [None]
    incidents: list[list[tuple[str, str, int]] | None] = [None]
    metrics = WorkerMetrics(runs=lambda: runs[-1], incidents=lambda: incidents[-1])
    families = {f.name: f for f in metrics.registry.collect()}
    assert families["gradstream_runs"].samples == []  # None: this process has no figures
    assert families["gradstream_firing_incidents"].samples == []
    runs.append({("Critical", True): 2, ("Healthy", False): 1})
    incidents.append([("nonfinite", "critical", 3), ("stalled", "warning", 0)])

    def get(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert get("gradstream_runs", health="Critical", finished="true") == 2
    assert get("gradstream_runs", health="Healthy", finished="false") == 1
    assert get("gradstream_runs", health="MinorIssues", finished="false") == 0
    assert get("gradstream_firing_incidents", rule="nonfinite", severity="critical") == 3
    assert get("gradstream_firing_incidents", rule="stalled", severity="warning") == 0
    runs.append({("Critical", True): 5})  # read again at the next scrape
    assert get("gradstream_runs", health="Critical", finished="true") == 5
    assert get("gradstream_runs", health="Healthy", finished="false") == 0


def test_dead_letter_series_start_at_zero_and_no_created_series() -> None:
    metrics = WorkerMetrics()
    for reason in ("invalid", "unknown_run", "conflicting_run", "refused_rank"):
        assert metrics.registry.get_sample_value("gradstream_dead_letters_total",
                                                 {"reason": reason}) == 0
    assert b"_created" not in generate_latest(metrics.registry)
