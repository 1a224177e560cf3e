"""Scale-out shape end to end: workers in one consumer group publish merged frames to the
frames topic; one store process writes DuckDB. A second worker joins mid-stream and later
leaves (two rebalances); the store must hold exactly the frames computed offline from the
same summaries: none missing, none duplicated, values equal. The workers' alert events
reach the store's alerts table through the alerts topic, each once."""

from __future__ import annotations

import threading
import time

import duckdb
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer

from consumer.frames import MergedShards, compute_frame
from consumer.health_tracker import RunHealthTracker
from consumer.settings import ConsumerSettings
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from consumer.worker import Worker
from schemas.alert import Alert, decode_alert_record
from schemas.rounding import gradient_magnitude
from schemas.wire import RunFinished, RunStarted, StepSummary, encode_message

WORLD = 2
LAYERS = 6
STEPS = 120
RUNS = 4


def shard(run: int, step: int, rank: int) -> StepSummary:
    """Deterministic shard; run 1 has a vanishing layer, run 2 an exploding one."""
    rng = np.random.default_rng([run, step, rank])
    numel = np.full(LAYERS, 50 + rank)
    scale = np.full(LAYERS, 1e-2)
    if run == 1:  # vanishing (< 1e-7), but above float32 rounding level of the 1e-2 layers
        scale[0] = 1e-8
    if run == 2 and step > STEPS // 2:
        scale[LAYERS - 1] = 1e4
    sum_abs = rng.uniform(0.5, 1.0, LAYERS) * scale * numel
    return StepSummary(
        run_id=f"run{run}", step=step, rank=rank, world_size=WORLD, wall_time=1.0 + step,
        layer_indices=list(range(LAYERS)), numel=numel.tolist(), sum_abs=sum_abs.tolist(),
        sum_sq=(sum_abs * scale).tolist(), max_abs=(scale * 2).tolist(),
        nonfinite=[0] * LAYERS,
    )


def offline(run: int, step: int):
    merged = MergedShards.empty(LAYERS)
    for rank in range(WORLD):
        s = shard(run, step, rank)
        merged.add(np.arange(LAYERS), np.asarray(s.numel), np.asarray(s.sum_abs),
                   np.asarray(s.sum_sq), np.asarray(s.max_abs), np.asarray(s.nonfinite))
    return compute_frame(f"run{run}", step, merged, vanishing_threshold=1e-7,
                         exploding_threshold=1e3, ranks_seen=tuple(range(WORLD)),
                         world_size=WORLD, wall_time=0.0)


def test_rebalance_keeps_results_identical_to_offline(kafka_bootstrap, tmp_path, unique_name):
    topic, frames_topic = f"so-{unique_name}", f"so-frames-{unique_name}"
    common = dict(bootstrap_servers=kafka_bootstrap, topic=topic, frames_topic=frames_topic,
                  dlq_topic=f"so-dlq-{unique_name}", alerts_topic=f"so-alerts-{unique_name}",
                  runs_topic=f"so-runs-{unique_name}", group_id=f"so-{unique_name}",
                  shard_timeout_s=2.0, partitions=4)
    store = StoreWriter(StoreWriterSettings(
        bootstrap_servers=kafka_bootstrap, frames_topic=frames_topic,
        alerts_topic=common["alerts_topic"], group_id=f"so-store-{unique_name}",
        db=str(tmp_path / "store.duckdb")))
    first = Worker(ConsumerSettings(**common))
    second = Worker(ConsumerSettings(**common))
    threads = [threading.Thread(target=p.run, daemon=True) for p in (first, store)]
    for t in threads:
        t.start()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)

    def send(message) -> None:
        producer.send(topic, key=message.run_id.encode(), value=encode_message(message))

    try:
        assert first.wait_ready(60) and store.wait_ready(60)
        for run in range(RUNS):
            for rank in range(WORLD):
                send(RunStarted(run_id=f"run{run}", rank=rank, world_size=WORLD,
                                layer_names=[f"l{i}" for i in range(LAYERS)],
                                numel=[101] * LAYERS, start_time=1.0))
        joined = left = False
        second_thread = threading.Thread(target=second.run, daemon=True)
        for step in range(STEPS):
            for run in range(RUNS):
                for rank in range(WORLD):
                    send(shard(run, step, rank))
            if step == STEPS // 3 and not joined:
                producer.flush()
                second_thread.start()
                assert second.wait_ready(60)
                joined = True
            if step == 2 * STEPS // 3 and not left:
                producer.flush()
                time.sleep(1.0)
                second.stop()
                second_thread.join(60)
                left = True
            if step % 20 == 0:
                producer.flush()
        for run in range(RUNS):
            for rank in range(WORLD):
                send(RunFinished(run_id=f"run{run}", rank=rank, world_size=WORLD,
                                 last_step=STEPS - 1, end_time=2.0))
        producer.flush()
        deadline = time.monotonic() + 120
        run_ids = [f"run{r}" for r in range(RUNS)]
        while not store.runs_done(run_ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.runs_done(run_ids), "the store did not see every run finish"
        assert second.counters.frames > 0, "the joining worker took no partition"
    finally:
        producer.close()
        for process in (first, second, store):
            process.stop()
        for t in threads:
            t.join(60)
    assert first.error is None and second.error is None and store.error is None
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    rows = con.execute(
        "SELECT run_id, step, layer_index, numel, sum_abs, sum_sq, max_abs_grad, "
        "mean_abs_grad, grad_norm, flow_intensity, is_vanishing, is_exploding "
        "FROM layer_stats ORDER BY run_id, step, layer_index"
    ).fetchall()
    frames = con.execute("SELECT run_id, step, complete FROM frames").fetchall()
    health = dict(con.execute("SELECT run_id, health FROM runs").fetchall())
    stored_alerts = con.execute("SELECT alert_id, run_id, rule FROM alerts").fetchall()
    con.close()
    reader = KafkaConsumer(common["alerts_topic"], bootstrap_servers=kafka_bootstrap,
                           auto_offset_reset="earliest", consumer_timeout_ms=5000)
    published = [m for m in (decode_alert_record(r.value) for r in reader)
                 if isinstance(m, Alert)]
    reader.close()
    assert {a.alert_id for a in published} == {a for a, _, _ in stored_alerts}
    assert len(stored_alerts) == len({a for a, _, _ in stored_alerts})
    assert any(run == "run2" and rule == "exploding" for _, run, rule in stored_alerts)
    got = {(r[0], r[1], r[2]): r[3:] for r in rows}
    expected = {}
    for run in range(RUNS):
        for step in range(STEPS):
            f = offline(run, step)
            for i in range(LAYERS):
                expected[(f"run{run}", step, i)] = (
                    int(f.numel[i]), f.sum_abs[i], f.sum_sq[i], f.max_abs_grad[i],
                    f.mean_abs_grad[i], f.grad_norm[i], f.flow_intensity[i],
                    bool(f.is_vanishing[i]), bool(f.is_exploding[i]),
                )
    lost = len(expected.keys() - got.keys())
    duplicated = len(rows) - len(got) + len(got.keys() - expected.keys())
    print(f"lost={lost} duplicated={duplicated}")
    assert lost == 0 and duplicated == 0
    assert len(frames) == RUNS * STEPS and all(c for _, _, c in frames)
    for key, want in expected.items():
        assert got[key][0] == want[0]
        assert got[key][1:6] == pytest.approx(want[1:6], rel=1e-12), key
        assert got[key][6:] == want[6:], key
    for run in range(RUNS):  # run health as one tracker over the offline frames gives it
        tracker = RunHealthTracker(LAYERS, 0)
        for step in range(STEPS):
            f = offline(run, step)
            tracker.update(step, f.layer_index, f.is_vanishing, f.is_exploding, f.nonfinite,
                           gradient_magnitude(f.mean_abs_grad, f.sum_sq, f.numel))
        assert health[f"run{run}"] == tracker.health.value
    assert health["run0"] == "Healthy" and health["run2"] != "Healthy"
