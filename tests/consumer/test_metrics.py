"""Prometheus metrics of a worker: scraped over HTTP while a real worker consumes from the
broker, and the lag computation against a real consumer position."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from consumer.metrics import WorkerMetrics
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from schemas.wire import RunStarted, StepSummary, encode_message

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
                    and all(v == 0 for _, v in lags)):
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
                                       {"reason": "invalid"}) is None
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
