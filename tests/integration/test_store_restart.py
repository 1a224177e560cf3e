"""A restarted ``gradstream store`` writes again within seconds, even while the session of
the killed process is still open on the broker (it joins no consumer group)."""

from __future__ import annotations

import threading
import time

import duckdb
import numpy as np
from kafka import KafkaConsumer, KafkaProducer

from consumer.frames import MergedShards, compute_frame
from consumer.outputs.frames_topic import frame_to_message
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from consumer.topic_admin import ensure_topics
from schemas.wire import RunStarted, encode_message

STEPS = 20


def frame_message(step: int):
    merged = MergedShards.empty(2)
    merged.add(np.array([0, 1]), np.array([4, 6]), np.array([1.0, 2.0]), np.array([0.5, 1.5]),
               np.array([0.25, 0.75]), np.array([0, 0]))
    return frame_to_message(compute_frame(
        "restart", step, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
        ranks_seen=(0,), world_size=1, wall_time=float(step)))


def test_restarted_store_writes_within_five_seconds(kafka_bootstrap, tmp_path, unique_name):
    settings = StoreWriterSettings(bootstrap_servers=kafka_bootstrap,
                             frames_topic=f"restart-frames-{unique_name}",
                             alerts_topic=f"restart-alerts-{unique_name}",
                             dlq_topic=f"restart-dlq-{unique_name}",
                             group_id=f"restart-store-{unique_name}",
                             db=str(tmp_path / "store.duckdb"))
    ensure_topics(settings, [settings.frames_topic, settings.alerts_topic])
    # What a SIGKILLed store leaves behind on a broker when the store uses a consumer
    # group: a member of that group whose session is still open and that never rejoins.
    dead = KafkaConsumer(settings.frames_topic, bootstrap_servers=kafka_bootstrap,
                         group_id=settings.group_id)
    dead.poll(timeout_ms=5000)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    producer.send(settings.frames_topic, key=b"restart", value=encode_message(RunStarted(
        run_id="restart", world_size=1, layer_names=["a", "b"], numel=[4, 6], start_time=1.0)))
    for step in range(STEPS):
        producer.send(settings.frames_topic, key=b"restart",
                      value=encode_message(frame_message(step)))
    producer.flush()
    producer.close()
    store = StoreWriter(settings)
    thread = threading.Thread(target=store.run, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        while store.counters.frames < STEPS and time.monotonic() - started < 30:
            time.sleep(0.05)
        elapsed = time.monotonic() - started
    finally:
        store.stop()
        thread.join(30)
        dead.close()
    print(f"restarted store: {STEPS} frames read in {elapsed:.2f} s")
    assert store.error is None
    assert elapsed < 5.0
    con = duckdb.connect(settings.db, read_only=True)
    assert con.execute("SELECT count(*) FROM frames").fetchone()[0] == STEPS
