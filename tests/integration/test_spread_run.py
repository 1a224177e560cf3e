"""One run spread over two scale-out workers (producers keyed ``partition_key="step"``),
exactly once across a worker SIGKILL, with the alert rules evaluated by the store writer in
step order.

Two real ``gradstream consume --frames-topic`` processes (static group membership, as
``tests/integration/test_chaos.py`` starts them) share a summaries topic of four
partitions; the run's step summaries are keyed ``run_id/step`` with the producer's own key
function (``producer.transport.kafka.record_key``), its RunStarted / RunFinished by run id.
One worker is SIGKILLed mid-run and restarted. The store writer (in this process) must
hold every frame complete, once, with the values ``compute_frame`` gives offline from the
sent summaries; neither worker may own the partitions of more than 60 % of the run's
steps; and a layer vanishing for exactly ``consecutive`` steps, whose frames reach the
store out of step order, must fire the ``vanishing`` alert once, at the streak's last step.
"""

from __future__ import annotations

import ast
import os
import sys
import threading
import time

import duckdb
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer

from consumer.frames import MergedShards, compute_frame
from consumer.health_tracker import RunHealthTracker
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from producer.transport.kafka import record_key
from schemas.alert import Alert, decode_alert_record
from schemas.rounding import gradient_magnitude
from schemas.wire import RunFinished, RunStarted, StepSummary, encode_message
from tests.integration.test_chaos import Process

WORLD = 2
LAYERS = 6
STEPS = 200
RUN = "spread"
STEP_INTERVAL_S = 0.04
"""Streaming lasts about STEPS * STEP_INTERVAL_S = 8 s."""
KILL_AT = 80
VANISHING = range(100, 110)
"""Layer 0 vanishes at exactly these steps: the rule's default ``consecutive`` (10) in a
row in step order, none if a later step is evaluated in between."""
MAX_SHARE = 0.6


def shard(step: int, rank: int) -> StepSummary:
    """Deterministic shard of (step, rank); layer 0 is below the vanishing threshold (1e-7)
    at the steps of ``VANISHING``."""
    rng = np.random.default_rng([step, rank])
    numel = np.full(LAYERS, 30 + rank)
    scale = np.full(LAYERS, 1e-2)
    if step in VANISHING:
        scale[0] = 1e-8
    sum_abs = rng.uniform(0.5, 1.0, LAYERS) * scale * numel
    return StepSummary(
        run_id=RUN, step=step, rank=rank, world_size=WORLD, wall_time=1.0 + step,
        layer_indices=list(range(LAYERS)), numel=numel.tolist(), sum_abs=sum_abs.tolist(),
        sum_sq=(sum_abs * scale).tolist(), max_abs=(scale * 2).tolist(),
        nonfinite=[0] * LAYERS,
    )


def offline(step: int):
    """The frame of ``step`` computed here from the shards."""
    merged = MergedShards.empty(LAYERS)
    for rank in range(WORLD):
        s = shard(step, rank)
        merged.add(np.arange(LAYERS), np.asarray(s.numel), np.asarray(s.sum_abs),
                   np.asarray(s.sum_sq), np.asarray(s.max_abs), np.asarray(s.nonfinite))
    return compute_frame(RUN, step, merged, vanishing_threshold=1e-7,
                         exploding_threshold=1e3, ranks_seen=tuple(range(WORLD)),
                         world_size=WORLD, wall_time=0.0)


def assignment(process: Process, topic: str) -> set[int]:
    """The summaries-topic partitions of the process's last ``assigned [...]`` log line."""
    lines = [line for line in process.log if "assigned [" in line]
    assert lines, f"{process.name} logged no assignment"
    pairs = ast.literal_eval(lines[-1][lines[-1].index("assigned [") + len("assigned "):])
    return {p for t, p in pairs if t == topic}


def test_spread_run_two_workers_sigkill_exactly_once(kafka_bootstrap, tmp_path, unique_name):
    topics = {name: f"spread-{name}-{unique_name}"
              for name in ("summaries", "frames", "dlq", "alerts", "runs")}
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
               GRADSTREAM_TOPIC=topics["summaries"], GRADSTREAM_FRAMES_TOPIC=topics["frames"],
               GRADSTREAM_DLQ_TOPIC=topics["dlq"], GRADSTREAM_ALERTS_TOPIC=topics["alerts"],
               GRADSTREAM_RUNS_TOPIC=topics["runs"], GRADSTREAM_PARTITIONS="4",
               GRADSTREAM_GROUP_ID=f"spread-{unique_name}", GRADSTREAM_SHARD_TIMEOUT_S="5",
               GRADSTREAM_SESSION_TIMEOUT_MS="10000")
    workers = [Process(f"worker{i}", [sys.executable, "-m", "deploy.cli", "consume"],
                       dict(env, GRADSTREAM_GROUP_INSTANCE_ID=f"spread-{unique_name}-{i}"))
               for i in range(2)]
    for w in workers:
        w.start()
    db = tmp_path / "store.duckdb"
    store = StoreWriter(StoreWriterSettings(
        bootstrap_servers=kafka_bootstrap, frames_topic=topics["frames"],
        alerts_topic=topics["alerts"], group_id="spread-store", db=str(db),
        reorder_delay_s=2.0))
    store_thread = threading.Thread(target=store.run, daemon=True)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)
    partition_of: dict[int, int] = {}
    try:
        for w in workers:  # both members: the group's four partitions are split
            w.wait_for("assigned [(")
        deadline = time.monotonic() + 30
        while not all(len(assignment(w, topics["summaries"])) == 2 for w in workers):
            assert time.monotonic() < deadline, [w.log[-5:] for w in workers]
            time.sleep(0.1)
        store_thread.start()
        assert store.wait_ready(60)
        for rank in range(WORLD):
            producer.send(topics["summaries"], key=record_key(RUN, "step"),
                          value=encode_message(RunStarted(
                              run_id=RUN, rank=rank, world_size=WORLD,
                              layer_names=[f"l{i}" for i in range(LAYERS)],
                              numel=[61] * LAYERS, start_time=1.0)))
        for step in range(STEPS):
            futures = [producer.send(topics["summaries"], key=record_key(RUN, "step", step),
                                     value=encode_message(shard(step, rank)))
                       for rank in range(WORLD)]
            producer.flush()
            parts = {f.get(timeout=10).partition for f in futures}
            assert len(parts) == 1, "the ranks of one step must share a partition"
            partition_of[step] = parts.pop()
            if step == KILL_AT:
                workers[0].kill()
                time.sleep(0.3)
                workers[0].start()
            time.sleep(STEP_INTERVAL_S)
        for rank in range(WORLD):
            producer.send(topics["summaries"], key=record_key(RUN, "step"),
                          value=encode_message(RunFinished(
                              run_id=RUN, rank=rank, world_size=WORLD,
                              last_step=STEPS - 1, end_time=2.0)))
        producer.flush()
        assert store.wait_for_runs([RUN], 60), "the store did not see the run finish"
        time.sleep(0.5)  # the resolution of the vanishing incident follows its frames
        for w in workers:
            assert w.terminate() == 0, "\n".join(w.log[-20:])
    finally:
        producer.close()
        store.stop()
        store_thread.join(60)
        for w in workers:
            if w.popen is not None and w.popen.poll() is None:
                w.kill()
            (tmp_path / f"{w.name}.log").write_text("\n".join(w.log))
    assert store.error is None
    assert store.counters.reordered > 0, "no frame arrived out of step order"

    # The steps spread: each worker owned two partitions, neither most of the steps.
    owned = [assignment(w, topics["summaries"]) for w in workers]
    assert owned[0].isdisjoint(owned[1]) and len(owned[0] | owned[1]) == 4
    shares = [sum(partition_of[s] in mine for s in range(STEPS)) / STEPS for mine in owned]
    print(f"worker step shares {shares}")
    assert max(shares) <= MAX_SHARE, shares

    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT step, layer_index, numel, sum_abs, sum_sq, max_abs_grad, mean_abs_grad, "
        "grad_norm, flow_intensity, is_vanishing, is_exploding FROM layer_stats "
        "WHERE run_id = ? ORDER BY step, layer_index", [RUN]).fetchall()
    frames = con.execute("SELECT step, complete FROM frames WHERE run_id = ?",
                         [RUN]).fetchall()
    health = con.execute("SELECT health FROM runs WHERE run_id = ?", [RUN]).fetchone()
    stored_alerts = con.execute("SELECT alert_id, rule, state, step, first_step FROM alerts "
                                "WHERE run_id = ?", [RUN]).fetchall()
    con.close()
    dead = KafkaConsumer(topics["dlq"], bootstrap_servers=kafka_bootstrap,
                         auto_offset_reset="earliest", consumer_timeout_ms=2000)
    dead_letters = list(dead)
    dead.close()
    assert not dead_letters, [d.value[:200] for d in dead_letters]

    # Exactly once, complete, equal to the offline frames.
    assert sorted(s for s, _ in frames) == list(range(STEPS))
    assert all(complete for _, complete in frames)
    assert len(rows) == STEPS * LAYERS
    got = {(r[0], r[1]): r[2:] for r in rows}
    tracker = RunHealthTracker(LAYERS, 0)
    for step in range(STEPS):
        f = offline(step)
        tracker.update(step, f.layer_index, f.is_vanishing, f.is_exploding, f.nonfinite,
                       gradient_magnitude(f.mean_abs_grad, f.sum_sq, f.numel))
        for i in range(LAYERS):
            row = got[(step, i)]
            assert row[0] == int(f.numel[i])
            assert row[1:7] == pytest.approx(
                (f.sum_abs[i], f.sum_sq[i], f.max_abs_grad[i], f.mean_abs_grad[i],
                 f.grad_norm[i], f.flow_intensity[i]), rel=1e-12), (step, i)
            assert row[7:] == (bool(f.is_vanishing[i]), bool(f.is_exploding[i])), (step, i)
    assert health == (tracker.health.value,)

    # The streak rule, evaluated by the store writer in step order: fired once, at the
    # streak's tenth step, and resolved; published on the alerts topic as stored.
    vanishing = sorted((state, step, first) for _, rule, state, step, first in stored_alerts
                       if rule == "vanishing")
    assert [v for v in vanishing if v[0] == "firing"] == [
        ("firing", VANISHING[-1], VANISHING[-1])], vanishing
    assert [v[0] for v in vanishing] == ["firing", "resolved"], vanishing
    reader = KafkaConsumer(topics["alerts"], bootstrap_servers=kafka_bootstrap,
                           auto_offset_reset="earliest", consumer_timeout_ms=3000)
    published = {a.alert_id for a in (decode_alert_record(r.value) for r in reader)
                 if isinstance(a, Alert)}
    reader.close()
    assert published == {a for a, *_ in stored_alerts}
    assert len(stored_alerts) == len({a for a, *_ in stored_alerts})
