"""Messages larger than the cluster's limit: the producer splits a StepSummary into parts
that the worker merges, and the worker's dead-letter producer cuts oversized values.

The summaries topic is created with ``max.message.bytes`` = 64 KiB. With kafka-python's
idempotent producer one record refused as too large would fail every later send, so the
test checks that every step (oversized ones and normal ones after them) is stored with the
values computed directly from the gradients, and that the producer reports no failure.
"""

from __future__ import annotations

import threading

import duckdb
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from consumer.dlq import DLQ_RECORD_LIMIT, decode_headers
from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from producer import GradientProducer

WORLD = 2
LAYERS = 3000  # ~145 KB per rank in the binary form, ~210 KB as JSON: 3-4 parts of 64 KiB
ELEMENTS = 5
BIG_STEPS = range(0, 4)  # every layer: oversized
SMALL_STEPS = range(4, 8)  # 100 layers: one message
LIMIT = 64 * 1024


def gradients(step: int, rank: int, layers: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step * 10 + rank)
    return {f"layer{i:05d}": rng.standard_normal(ELEMENTS) * (1 + i % 7) for i in range(layers)}


def create_topic(bootstrap: str, name: str, max_bytes: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, 1, 1,
                                      topic_configs={"max.message.bytes": str(max_bytes)})])
    finally:
        admin.close()


@pytest.fixture
def settings(kafka_bootstrap, tmp_path, unique_name) -> ConsumerSettings:
    return ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{unique_name}",
        dlq_topic=f"dlq-{unique_name}", group_id=f"grp-{unique_name}",
        db=str(tmp_path / "store.duckdb"), shard_timeout_s=60.0,
        session_timeout_ms=45_000, group_instance_id=f"worker-{unique_name}",
    )


def run_worker(settings: ConsumerSettings) -> tuple[Worker, threading.Thread]:
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.wait_ready(60), f"worker did not join: {worker.error}"
    return worker, thread


@pytest.mark.parametrize("wire_format", ["binary", "json"])
def test_oversized_summaries_are_split_and_every_step_is_stored(settings, unique_name,
                                                                wire_format):
    create_topic(settings.bootstrap_servers, settings.topic, LIMIT)
    run_id = f"run-{unique_name}"
    worker, thread = run_worker(settings)
    try:
        producers = [GradientProducer(run_id, rank=r, world_size=WORLD, topic=settings.topic,
                                      bootstrap_servers=settings.bootstrap_servers,
                                      wire_format=wire_format)
                     for r in range(WORLD)]
        numel = {f"layer{i:05d}": ELEMENTS * WORLD for i in range(LAYERS)}
        for p in producers:
            p.start_run(numel)
        for step in [*BIG_STEPS, *SMALL_STEPS]:
            layers = LAYERS if step in BIG_STEPS else 100
            for rank, p in enumerate(producers):
                p.record_step(step, gradients(step, rank, layers))
        for p in producers:
            assert p.finish_run(60)
            stats = p.close()
            assert p.value_limit is not None and p.value_limit < LIMIT
            assert stats.failed == 0 and stats.dropped == 0 and p.oversized_dropped == 0
            # RunStarted, the parts of each big step, one per small step, RunFinished
            assert stats.sent >= 2 + 2 * len(BIG_STEPS) + len(SMALL_STEPS)
        assert worker.wait_for_runs([run_id], 150), (worker.error, worker.counters,
                                                    worker.merger and worker.merger.pending_count)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None and worker.counters.dead_letters == 0
    assert worker.merger is None or worker.merger.duplicates == 0

    con = duckdb.connect(settings.db, read_only=True)
    frames = con.execute("SELECT step, complete FROM frames WHERE run_id = ? ORDER BY step",
                         [run_id]).fetchall()
    assert frames == [(s, True) for s in [*BIG_STEPS, *SMALL_STEPS]]
    rows = con.execute(
        "SELECT s.step, s.layer_index, s.max_abs_grad, s.grad_norm FROM layer_stats s "
        "WHERE run_id = ? ORDER BY step, layer_index", [run_id]).fetchall()
    assert len(rows) == LAYERS * len(BIG_STEPS) + 100 * len(SMALL_STEPS)
    got = np.array([r[2:] for r in rows])
    want = []
    for step in [*BIG_STEPS, *SMALL_STEPS]:
        layers = LAYERS if step in BIG_STEPS else 100
        per_rank = [gradients(step, r, layers) for r in range(WORLD)]
        for i in range(layers):
            g = np.concatenate([pr[f"layer{i:05d}"] for pr in per_rank])
            want.append((np.abs(g).max(), np.sqrt((g**2).sum())))
    np.testing.assert_allclose(got, np.array(want), rtol=1e-6)


def test_dead_letter_of_an_oversized_value_is_cut_and_the_dlq_keeps_working(
    settings, unique_name
):
    create_topic(settings.bootstrap_servers, settings.topic, 4 * 1024 * 1024)
    worker, thread = run_worker(settings)
    try:
        raw = KafkaProducer(bootstrap_servers=settings.bootstrap_servers,
                            max_request_size=4 * 1024 * 1024)
        raw.send(settings.topic, key=b"k", value=b"{" + b"x" * (3 * 1024 * 1024))
        raw.send(settings.topic, key=b"k", value=b"not json either")
        raw.flush()
        raw.close()
        consumer = KafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                 group_id=None, auto_offset_reset="earliest",
                                 consumer_timeout_ms=60_000)
        tp = TopicPartition(settings.dlq_topic, 0)
        letters = []
        for _ in range(600):
            if consumer.partitions_for_topic(settings.dlq_topic):
                break
            threading.Event().wait(0.1)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        for record in consumer:
            letters.append(record)
            if len(letters) == 2:
                break
        consumer.close()
    finally:
        worker.stop()
        thread.join(30)
    assert len(letters) == 2
    big, small = letters
    assert decode_headers(big.headers)["truncated"] == "true"
    assert len(big.value) < DLQ_RECORD_LIMIT and big.value.startswith(b"{xxx")
    assert small.value == b"not json either" and "truncated" not in decode_headers(small.headers)


def test_split_parts_fit_and_a_layer_too_large_alone_is_dropped_and_counted() -> None:
    """The producer's splitting, without a broker: parts below the limit cover every layer
    once; with a limit below one layer's message every layer is dropped and counted."""
    from producer.summary import summarize
    from producer.transport.encoding import StepRecord
    from producer.transport.sender import Pending
    from schemas.wire import decode_message

    gp = GradientProducer("r", bootstrap_servers="127.0.0.1:9")
    try:
        grads = gradients(0, 0, 300)
        item = Pending("step", StepRecord(0, 1.0, np.arange(300), summarize(grads), None))
        sender = gp._sender
        sender.value_limit = 4000
        values = sender.encode(item)
        parts = [decode_message(v) for v in values]
        assert len(parts) > 3 and all(len(v) <= 4000 for v in values)
        assert {p.part_count for p in parts} == {len(parts)}
        assert sorted(i for p in parts for i in p.layer_indices) == list(range(300))
        sender.value_limit = 200  # below the header of any one-layer message
        assert sender.encode(item) == []
        assert gp.oversized_dropped == 300 and gp.stats().failed == 300
    finally:
        gp.close(timeout=0.1)
