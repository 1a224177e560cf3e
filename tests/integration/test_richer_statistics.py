"""Schema 1.1 richer statistics end to end: exponent histograms and weight/update norms
merge exactly across ranks into layer_stats; a 1.0 message is still stored."""

from __future__ import annotations

import json
import threading

import duckdb
import numpy as np
import pytest
from kafka import KafkaProducer

from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from producer import GradientProducer, summarize

WORLD = 2


def shard(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 * step + rank)
    return {
        "w": (rng.standard_normal(300) * 10.0 ** rng.uniform(-30, 2, 300)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
    }


def weights(step: int, rank: int) -> dict[str, np.ndarray]:
    return {k: np.full(v.shape, 1.0 + 0.1 * step + rank, np.float32)
            for k, v in shard(step, rank).items()}


def test_histograms_and_weight_norms_merge_across_ranks(kafka_bootstrap, tmp_path, unique_name):
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"rich-{unique_name}",
        dlq_topic=f"rich-dlq-{unique_name}", group_id=f"rich-{unique_name}",
        db=str(tmp_path / "rich.duckdb"),
    )
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    run_id = f"rich-{unique_name}"
    try:
        assert worker.wait_ready(60)
        producers = [
            GradientProducer(run_id, rank=r, world_size=WORLD, bootstrap_servers=kafka_bootstrap,
                             topic=settings.topic, exp_histogram=True, weight_stats=True)
            for r in range(WORLD)
        ]
        for p in producers:
            p.start_run({"w": 600, "b": 14})
        for step in range(3):
            for r, p in enumerate(producers):
                p.record_step(step, shard(step, r), weights=weights(step, r))
        for p in producers:
            p.finish_run()
            p.close()
        raw = KafkaProducer(bootstrap_servers=kafka_bootstrap)
        old = {"type": "step_summary", "schema_version": "1.0", "run_id": run_id, "step": 3,
               "rank": 0, "world_size": WORLD, "wall_time": 1.0, "layer_indices": [0],
               "numel": [300], "sum_abs": [1.0], "sum_sq": [1.0], "max_abs": [0.5],
               "nonfinite": [0]}
        raw.send(settings.topic, key=run_id.encode(), value=json.dumps(old).encode())
        raw.send(settings.topic, key=run_id.encode(),
                 value=json.dumps({**old, "rank": 1}).encode())
        raw.flush()
        raw.close()
        import time

        deadline = time.monotonic() + 30
        while worker.counters.frames < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.counters.dead_letters == 0
    con = duckdb.connect(settings.db, read_only=True)
    rows = con.execute(
        "SELECT step, layer_index, exp_hist_columns, exp_hist_counts, weight_sum_sq, "
        "update_sum_sq, update_to_weight FROM layer_stats WHERE run_id = ? "
        "ORDER BY step, layer_index", [run_id],
    ).fetchall()
    con.close()
    assert len(rows) == 7
    for step, layer, cols, counts, wsq, usq, ratio in rows:
        name = ["w", "b"][layer]
        if step == 3:  # schema 1.0 message: no richer statistics
            assert cols is None and wsq is None and ratio is None
            continue
        full = np.concatenate([shard(step, r)[name] for r in range(WORLD)])
        expected = summarize({name: full}, histogram=True).exp_hist[0]
        dense = np.zeros_like(expected)
        dense[cols] = counts
        assert dense.tolist() == expected.tolist()
        w = np.concatenate([weights(step, r)[name] for r in range(WORLD)]).astype(np.float64)
        assert wsq == pytest.approx(float(w @ w), rel=1e-12)
        if step == 0:
            assert usq is None and ratio is None
        else:
            prev = np.concatenate([weights(step - 1, r)[name] for r in range(WORLD)])
            delta = w - prev.astype(np.float64)
            assert usq == pytest.approx(float(delta @ delta), rel=1e-6)
            assert ratio == pytest.approx(np.sqrt(usq / wsq), rel=1e-12)


def test_norms_mode_and_weight_distribution_end_to_end(kafka_bootstrap, tmp_path, unique_name):
    """Schema 1.2: a norms-mode run stores NULL mean/max |g| and RMS-bounded flags; the
    weight distribution of two ranks is stored as the statistics of the whole tensor."""
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"norms-{unique_name}",
        dlq_topic=f"norms-dlq-{unique_name}", group_id=f"norms-{unique_name}",
        db=str(tmp_path / "norms.duckdb"),
    )
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    run_id = f"norms-{unique_name}"
    grads = {"big": np.full(10, 5000.0, np.float32), "tiny": np.full(10, 1e-9, np.float32)}
    rng = np.random.default_rng(0)
    w = {r: {"big": rng.standard_normal(10).astype(np.float32),
             "tiny": rng.standard_normal(10).astype(np.float32)} for r in range(WORLD)}
    try:
        assert worker.wait_ready(60)
        producers = [
            GradientProducer(run_id, rank=r, world_size=WORLD, bootstrap_servers=kafka_bootstrap,
                             topic=settings.topic, mode="norms", weight_stats=True)
            for r in range(WORLD)
        ]
        for p in producers:
            p.start_run({"big": 20, "tiny": 20})
        for r, p in enumerate(producers):
            p.record_step(0, grads, weights=w[r])
        for p in producers:
            p.finish_run()
            p.close()
        assert worker.wait_for_runs([run_id], 60)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.counters.dead_letters == 0
    con = duckdb.connect(settings.db, read_only=True)
    rows = con.execute(
        "SELECT layer_index, sum_abs, max_abs_grad, mean_abs_grad, grad_norm, is_vanishing, "
        "is_exploding, weight_sum, weight_sum_sq, weight_sum_cube, weight_sum_quad, "
        "weight_min, weight_max, weight_zeros, weight_nonfinite, weight_exp_hist_counts "
        "FROM layer_stats WHERE run_id = ? ORDER BY layer_index", [run_id],
    ).fetchall()
    con.close()
    assert len(rows) == 2
    for layer, (_idx, sabs, mx, mean, norm, van, exp, ws, wsq, wc, wq, lo, hi, zeros, bad,
                counts) in zip(["big", "tiny"], rows, strict=True):
        assert (sabs, mx, mean) == (None, None, None)
        g = np.concatenate([grads[layer]] * WORLD).astype(np.float64)
        assert norm == pytest.approx(float(np.sqrt(g @ g)), rel=1e-12)
        assert (van, exp) == ((False, True) if layer == "big" else (True, False))
        x = np.concatenate([w[r][layer] for r in range(WORLD)]).astype(np.float64)
        assert ws == pytest.approx(x.sum(), rel=1e-9, abs=1e-12)
        assert wsq == pytest.approx((x ** 2).sum(), rel=1e-12)
        assert wc == pytest.approx((x ** 3).sum(), rel=1e-9, abs=1e-12)
        assert wq == pytest.approx((x ** 4).sum(), rel=1e-12)
        assert (lo, hi) == (x.min(), x.max())
        assert (zeros, bad, sum(counts)) == (0, 0, 20)
