"""A stalled consumer is detected and recovers, with nothing lost or stored twice
(consumer.stall, ConsumerLoop's watchdog), against the real broker and real DuckDB files.

The tests inject the fault; detection and recovery are the loop's own code:

- a partition paused behind the loop's back (its consumer stops fetching it, as in
  dpkp/kafka-python#3131): the watchdog re-seeks and resumes it;
- a Kafka consumer whose fetcher returns nothing for any partition (a fault a seek does
  not cure): the watchdog re-seeks, then re-creates the consumer, for the worker (a group
  member) and for the store (assigns itself every partition).

Each checks the warning, the Prometheus counters, and that every record was read once and
every frame stored once: records read = records produced, one ``frames`` row per step,
``layers`` ``layer_stats`` rows per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from kafka import KafkaProducer

from consumer.frame_codec import frame_to_message
from consumer.frames import MergedShards, compute_frame
from consumer.loop import ConsumerLoop
from consumer.settings import ConsumerSettings
from consumer.store import Store
from consumer.store_settings import StoreSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from schemas.wire import RunFinished, RunStarted, StepSummary, encode_message

STEPS = 30
LAYERS = 3
STALL_TIMEOUT_S = 1.0
NUMEL = [4, 6, 8]


def summaries(run_id: str) -> list[bytes]:
    """One rank's run: RunStarted, STEPS step summaries, RunFinished (each step completes
    a frame at once: world size 1)."""
    out = [encode_message(RunStarted(run_id=run_id, world_size=1, start_time=1.0,
                                     layer_names=[f"l{i}" for i in range(LAYERS)],
                                     numel=NUMEL))]
    for step in range(STEPS):
        out.append(encode_message(StepSummary(
            run_id=run_id, step=step, rank=0, world_size=1, wall_time=1.0 + step,
            layer_indices=list(range(LAYERS)), numel=NUMEL,
            sum_abs=[0.5 * (step + 1 + i) for i in range(LAYERS)],
            sum_sq=[0.25 * (step + 1 + i) for i in range(LAYERS)],
            max_abs=[0.125 * (i + 1) for i in range(LAYERS)], nonfinite=[0] * LAYERS)))
    out.append(encode_message(RunFinished(run_id=run_id, rank=0, world_size=1,
                                          last_step=STEPS - 1, steps_recorded=STEPS,
                                          end_time=2.0)))
    return out


def frames_messages(run_id: str) -> list[bytes]:
    """What scale-out workers publish for the same run: RunStarted, STEPS merged frames."""
    out = [encode_message(RunStarted(run_id=run_id, world_size=1, start_time=1.0,
                                     layer_names=[f"l{i}" for i in range(LAYERS)],
                                     numel=NUMEL))]
    idx = np.arange(LAYERS)
    for step in range(STEPS):
        merged = MergedShards.empty(LAYERS)
        merged.add(idx, np.array(NUMEL), 0.5 * (step + 1 + idx), 0.25 * (step + 1 + idx),
                   0.125 * (idx + 1), np.zeros(LAYERS, dtype=np.int64))
        out.append(encode_message(frame_to_message(compute_frame(
            run_id, step, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
            ranks_seen=(0,), world_size=1, wall_time=1.0 + step))))
    return out


def worker_loop(kafka: str, tmp_path: Path, name: str) -> tuple[ConsumerLoop, str, list[bytes]]:
    """A single-process worker (group member, DuckDB output), its topic and its input."""
    settings = ConsumerSettings(
        bootstrap_servers=kafka, topic=f"stall-sum-{name}", dlq_topic=f"stall-dlq-{name}",
        alerts_topic=f"stall-alerts-{name}", group_id=f"stall-{name}",
        db=str(tmp_path / "worker.duckdb"), stall_timeout_s=STALL_TIMEOUT_S)
    return Worker(settings), settings.topic, summaries(f"run-{name}")


def store_loop(kafka: str, tmp_path: Path, name: str) -> tuple[ConsumerLoop, str, list[bytes]]:
    """The store (assigns itself every partition, DuckDB output), its topic, its input."""
    settings = StoreSettings(
        bootstrap_servers=kafka, frames_topic=f"stall-frames-{name}",
        alerts_topic=f"stall-alerts-{name}", dlq_topic=f"stall-dlq-{name}",
        group_id=f"stall-store-{name}", db=str(tmp_path / "store.duckdb"),
        stall_timeout_s=STALL_TIMEOUT_S)
    ensure_topics(settings, [settings.frames_topic, settings.alerts_topic])
    return Store(settings), settings.frames_topic, frames_messages(f"run-{name}")


@contextmanager
def running(loop: ConsumerLoop) -> Iterator[ConsumerLoop]:
    """Run ``loop`` on a thread until partitions are assigned; stop it on exit."""
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        assert loop.wait_ready(60), f"no partition assigned: {loop.error!r}"
        yield loop
    finally:
        loop.stop()
        thread.join(60)


def produce(kafka: str, topic: str, key: str, values: list[bytes]) -> None:
    """Send ``values`` with one key (one partition, in order) and wait for the acks."""
    producer = KafkaProducer(bootstrap_servers=kafka)
    for value in values:
        producer.send(topic, key=key.encode(), value=value)
    producer.flush()
    producer.close()


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             loop: ConsumerLoop) -> float:
    """Poll ``condition`` until true; return the seconds it took. Fails with ``what`` and
    the loop's counters on timeout."""
    started = time.monotonic()
    while not condition():
        assert loop.error is None, f"loop died: {loop.error!r}"
        assert time.monotonic() - started < timeout, (
            f"{what} not within {timeout:g} s; counters {loop.counters}")
        time.sleep(0.05)
    return time.monotonic() - started


def metric(loop: ConsumerLoop, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample of the loop's registry over the labels not given."""
    total = 0.0
    for family in loop.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total


def assert_stored_once(db: str, run_id: str) -> None:
    """Every step's frame once, every layer row once."""
    con = duckdb.connect(db, read_only=True)
    try:
        frames = con.execute("SELECT count(*), count(DISTINCT step) FROM frames "
                             "WHERE run_id = ?", [run_id]).fetchone()
        rows = con.execute("SELECT count(*), count(DISTINCT (step, layer_index)) "
                           "FROM layer_stats WHERE run_id = ?", [run_id]).fetchone()
    finally:
        con.close()
    assert frames == (STEPS, STEPS)
    assert rows == (STEPS * LAYERS, STEPS * LAYERS)


def test_paused_partition_is_detected_and_re_sought(
        kafka_bootstrap: str, tmp_path: Path, unique_name: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Every partition of a worker paused behind its back: the waiting one is reported
    after the stall timeout, re-sought and resumed; every record is then read once and
    every frame stored once, without re-creating the consumer."""
    caplog.set_level(logging.INFO, logger="gradstream.consumer")
    worker, topic, values = worker_loop(kafka_bootstrap, tmp_path, unique_name)
    run_id = f"run-{unique_name}"
    with running(worker):
        consumer = worker._consumer
        consumer.pause(*consumer.assignment())  # the fault: fetching stops
        produce(kafka_bootstrap, topic, run_id, values)
        took = wait_for(lambda: worker.runs_done([run_id]), 30, "the run stored", worker)
        # The run's messages are written at the loop's next flush.
        wait_for(lambda: worker.counters.writes > 0 and not worker._batch, 10,
                 "the batch written", worker)
        wait_for(lambda: any("moves again" in r.getMessage() for r in caplog.records), 10,
                 "the recovery logged at the next check", worker)
        stalls = metric(worker, "gradstream_consumer_stalls_total", topic=topic)
        seeks = metric(worker, "gradstream_consumer_stall_recoveries_total", action="seek")
        recreates = metric(worker, "gradstream_consumer_stall_recoveries_total",
                           action="recreate")
        read = metric(worker, "gradstream_messages_total", topic=topic)
        same_consumer = worker._consumer is consumer
    print(f"paused partition: stored {took:.2f} s after producing (stall timeout "
          f"{STALL_TIMEOUT_S:g} s); stalls={stalls:g} seeks={seeks:g} recreates={recreates:g}")
    assert worker.error is None
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "stalled partition" in r.getMessage()]
    assert warnings and f"stalled partition {topic}[" in warnings[0]
    assert f"end offset {len(values)} ({len(values)} records waiting)" in warnings[0]
    assert "re-seeking" in warnings[0]
    assert (stalls, seeks, recreates) == (1, 1, 0)
    assert same_consumer
    assert took >= STALL_TIMEOUT_S  # nothing was read before the watchdog acted
    assert read == len(values)  # each record read once
    assert worker.counters.frames == STEPS
    assert_stored_once(worker.settings.db, run_id)


@pytest.mark.parametrize("make_loop", [worker_loop, store_loop], ids=["worker", "store"])
def test_consumer_that_fetches_nothing_is_re_created(
        kafka_bootstrap: str, tmp_path: Path, unique_name: str,
        caplog: pytest.LogCaptureFixture, make_loop: Any) -> None:
    """A consumer whose fetcher returns nothing (a seek does not cure it): after the stall
    timeout a re-seek, after another the consumer is re-created, re-joins (worker) or
    re-assigns (store) and reads on from the stored offsets. Half of the run is produced
    and stored before the fault, so the new consumer must start at the stored offsets:
    every record read once, every frame stored once."""
    caplog.set_level(logging.INFO, logger="gradstream.consumer")
    loop, topic, values = make_loop(kafka_bootstrap, tmp_path, unique_name)
    run_id = f"run-{unique_name}"
    half = len(values) // 2
    with running(loop):
        produce(kafka_bootstrap, topic, run_id, values[:half])
        wait_for(lambda: metric(loop, "gradstream_messages_total", topic=topic) == half
                 and loop.counters.writes > 0 and not loop._batch, 30,
                 "the first half stored", loop)
        broken = loop._consumer
        broken._fetcher.fetch_records = lambda *args, **kwargs: ({}, True)  # the fault
        produce(kafka_bootstrap, topic, run_id, values[half:])
        took = wait_for(lambda: metric(loop, "gradstream_messages_total", topic=topic)
                        == len(values) and loop.counters.frames == STEPS, 60,
                        "every record read", loop)
        wait_for(lambda: not loop._batch and loop.output is not None
                 and loop.output.settle(wait=False), 10, "the batch written", loop)
        stalls = metric(loop, "gradstream_consumer_stalls_total", topic=topic)
        seeks = metric(loop, "gradstream_consumer_stall_recoveries_total", action="seek")
        recreates = metric(loop, "gradstream_consumer_stall_recoveries_total",
                           action="recreate")
        replaced = loop._consumer is not broken
        time.sleep(2 * STALL_TIMEOUT_S)  # no further stall once read to the end
        later = metric(loop, "gradstream_consumer_stall_recoveries_total")
    print(f"{type(loop).__name__.lower()} with a fetcher returning nothing: read "
          f"{took:.2f} s after producing (stall timeout {STALL_TIMEOUT_S:g} s); "
          f"stalls={stalls:g} seeks={seeks:g} recreates={recreates:g}")
    assert loop.error is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("a re-seek did not help: re-creating the Kafka consumer" in m
               for m in messages)
    assert any("Kafka consumer re-created" in m for m in messages)
    assert (stalls, seeks, recreates) == (1, 1, 1)
    assert later == seeks + recreates
    assert replaced
    assert took >= 2 * STALL_TIMEOUT_S
    assert loop.counters.frames == STEPS  # each frame made once
    assert_stored_once(loop.settings.db, run_id)
