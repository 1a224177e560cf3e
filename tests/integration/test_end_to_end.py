"""End to end through a real Kafka broker into a real DuckDB file.

Three ranks send summaries of known gradients (with vanishing, exploding and NaN layers,
and layer names that break naive CSV). A worker consumes them; the stored frames, the
report and the exports are compared with values computed directly from the gradients.
An invalid message in the stream lands in the dead-letter topic while the rest is stored.
"""

from __future__ import annotations

import csv
import json
import threading
import time

import duckdb
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer

from analysis.export import export_csv, export_json
from analysis.report import build_report
from consumer.dlq import decode_headers
from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from producer import GradientProducer
from schemas.wire import GradientHealth

WORLD = 3
STEPS = 40
LAYERS = {  # name -> elements per rank
    "embed, tokens": 64,
    'attn."q"': 32,
    "ffn\nout": 48,
    "head ünï": 16,
}
NAN_STEP, NAN_RANK = 17, 2


def gradients(step: int, rank: int) -> dict[str, np.ndarray]:
    """Deterministic per-rank gradients: 'embed' vanishes, 'head' explodes on even steps
    after 30, one NaN on rank 2 at step 17."""
    rng = np.random.default_rng(step * 100 + rank)
    out = {}
    for i, (name, n) in enumerate(LAYERS.items()):
        g = rng.standard_normal(n).astype(np.float32) * np.float32(0.01 * (i + 1))
        if i == 0:  # mean |g| ~ 8e-9 < 1e-7, but 2.5e-7 of the largest layer: above float32
            g *= np.float32(1e-6)  # rounding level (1e-7 would be no gradient by construction)
        if i == 3 and step >= 30 and step % 2 == 0:
            g[0] = np.float32(5e3)
        out[name] = g
    if step == NAN_STEP and rank == NAN_RANK:
        out['attn."q"'][3] = np.nan
    return out


def expected_frame(step: int) -> dict[str, tuple[float, float, float, int]]:
    """(mean_abs, max_abs, norm, nonfinite) per layer from the concatenated gradients."""
    res = {}
    for name in LAYERS:
        g = np.concatenate([gradients(step, r)[name] for r in range(WORLD)]).astype(np.float64)
        finite = g[np.isfinite(g)]
        res[name] = (
            np.abs(finite).sum() / g.size,
            np.abs(finite).max(),
            np.sqrt((finite**2).sum()),
            int(g.size - finite.size),
        )
    return res


def start_worker(settings: ConsumerSettings) -> tuple[Worker, threading.Thread]:
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.wait_ready(60), f"worker did not join: {worker.error}"
    return worker, thread


def produce(bootstrap: str, topic: str, run_id: str, steps: range, start: bool, finish: bool):
    producers = [
        GradientProducer(run_id, rank=r, world_size=WORLD, bootstrap_servers=bootstrap,
                         topic=topic)
        for r in range(WORLD)
    ]
    numel = {name: n * WORLD for name, n in LAYERS.items()}
    for p in producers:
        # A later process of the same run announces it again; the worker checks that the
        # layer list agrees and keeps the first RunStarted.
        p.start_run(numel, config={"lr": 0.1, "resumed": not start})
    for step in steps:
        for rank, p in enumerate(producers):
            p.record_step(step, gradients(step, rank))
    for p in producers:
        if finish:
            p.finish_run()
        stats = p.close()
        assert stats.sent >= len(steps) and stats.dropped == 0 and stats.failed == 0


@pytest.fixture
def settings(kafka_bootstrap, tmp_path, unique_name) -> ConsumerSettings:
    return ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{unique_name}",
        dlq_topic=f"dlq-{unique_name}", group_id=f"grp-{unique_name}",
        db=str(tmp_path / "store.duckdb"), shard_timeout_s=60.0,
    )


def test_run_through_broker_into_duckdb_report_and_exports(settings, tmp_path, unique_name):
    run_id = f"run-{unique_name}"
    worker, thread = start_worker(settings)
    try:
        produce(settings.bootstrap_servers, settings.topic, run_id, range(STEPS), True, False)
        raw = KafkaProducer(bootstrap_servers=settings.bootstrap_servers)
        raw.send(settings.topic, key=run_id.encode(), value=b'{"type": "step_summary", oops')
        raw.send(settings.topic, key=run_id.encode(),
                 value=json.dumps({"type": "step_summary", "schema_version": "1.0",
                                   "run_id": run_id, "step": -4}).encode())
        raw.flush()
        raw.close()
        produce(settings.bootstrap_servers, settings.topic, run_id, range(STEPS, STEPS + 5),
                False, True)
        assert worker.wait_for_runs([run_id], 60), worker.error
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None
    assert worker.counters.dead_letters == 2

    con = duckdb.connect(settings.db, read_only=True)
    rows = con.execute(
        "SELECT s.step, l.name, s.mean_abs_grad, s.max_abs_grad, s.grad_norm, s.nonfinite, "
        "s.is_vanishing, s.is_exploding FROM layer_stats s JOIN layers l USING "
        "(run_id, layer_index) WHERE run_id = ? ORDER BY step, layer_index", [run_id],
    ).fetchall()
    total = STEPS + 5
    assert len(rows) == total * len(LAYERS)
    for step, name, mean, mx, norm, bad, van, exp in rows:
        e_mean, e_max, e_norm, e_bad = expected_frame(step)[name]
        assert mean == pytest.approx(e_mean, rel=1e-12)
        assert mx == pytest.approx(e_max, rel=1e-12)
        assert norm == pytest.approx(e_norm, rel=1e-12)
        assert bad == e_bad
        assert van == (e_mean < 1e-7) and exp == (e_max > 1e3)

    frames = con.execute(
        "SELECT count(*), bool_and(complete), max(step) FROM frames WHERE run_id = ?",
        [run_id],
    ).fetchone()
    assert frames == (total, True, total - 1)
    nan_frame = con.execute(
        "SELECT health, nonfinite_layers FROM frames WHERE run_id = ? AND step = ?",
        [run_id, NAN_STEP],
    ).fetchone()
    assert nan_frame == ("Critical", 1)
    run = con.execute(
        "SELECT health, frames, first_nonfinite_step, end_time IS NOT NULL FROM runs "
        "WHERE run_id = ?", [run_id],
    ).fetchone()
    assert run == ("Critical", total, NAN_STEP, True)

    report = build_report(con, run_id)
    assert report.total_steps == total
    assert report.ranks_finished == WORLD and report.dropped_summaries == 0
    assert report.overall_health is GradientHealth.CRITICAL
    assert report.layers_with_vanishing_grads == ["embed, tokens"]
    assert report.layers_with_exploding_grads == ["head ünï"]
    assert any("NaN" in r or "non-finite" in r.lower() for r in report.recommendations)

    csv_path = tmp_path / "out" / "frames.csv"
    export_csv(con, run_id, csv_path)
    with csv_path.open(newline="", encoding="utf-8") as fh:
        table = list(csv.reader(fh))
    assert table[0] == ["step", "layer", "mean_abs_grad", "max_abs_grad", "grad_norm",
                        "is_vanishing", "is_exploding"]
    assert len(table) == 1 + total * len(LAYERS)
    by_key = {(int(r[0]), r[1]): r for r in table[1:]}
    e_mean, e_max, e_norm, _ = expected_frame(33)["ffn\nout"]
    row = by_key[(33, "ffn\nout")]
    assert float(row[2]) == pytest.approx(e_mean, rel=1e-8)
    assert float(row[4]) == pytest.approx(e_norm, rel=1e-8)
    assert by_key[(32, "head ünï")][6] == "1" and by_key[(33, "head ünï")][6] == "0"

    json_path = tmp_path / "out" / "frames.json"
    export_json(con, run_id, json_path)
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert [f["step"] for f in data] == list(range(total))
    names = [layer["name"] for layer in data[0]["layers"]]
    assert names == sorted(LAYERS)  # the reference export orders a frame's layers by name
    top = max(layer["flow_intensity"] for layer in data[5]["layers"])
    assert top == pytest.approx(1.0)
    con.close()

    dlq = KafkaConsumer(settings.dlq_topic, bootstrap_servers=settings.bootstrap_servers,
                        auto_offset_reset="earliest", consumer_timeout_ms=10_000)
    letters = [decode_headers(m.headers) for m in dlq]
    dlq.close()
    assert len(letters) == 2
    assert "Invalid JSON" in letters[0]["reason"]
    assert "step" in letters[1]["reason"] and letters[1]["source_topic"] == settings.topic


def test_restart_resumes_from_stored_offsets_exactly_once(settings, unique_name):
    """A worker stopped mid-run and restarted stores every frame exactly once."""
    run_id = f"run-{unique_name}"
    worker, thread = start_worker(settings)
    produce(settings.bootstrap_servers, settings.topic, run_id, range(20), True, False)
    deadline = time.monotonic() + 30
    while worker.counters.frames < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.stop()
    thread.join(30)
    assert worker.counters.frames == 20

    # Half of step 20's ranks arrive while no worker runs; the rest after the restart.
    produce(settings.bootstrap_servers, settings.topic, run_id, range(20, 30), False, True)
    worker, thread = start_worker(settings)
    try:
        assert worker.wait_for_runs([run_id], 60), worker.error
    finally:
        worker.stop()
        thread.join(30)
    assert worker.counters.frames == 10  # only the new steps were processed
    con = duckdb.connect(settings.db, read_only=True)
    count, distinct, rows = con.execute(
        "SELECT count(*), count(DISTINCT step), (SELECT count(*) FROM layer_stats "
        "WHERE run_id = ?) FROM frames WHERE run_id = ?", [run_id, run_id],
    ).fetchone()
    assert (count, distinct, rows) == (30, 30, 30 * len(LAYERS))
    assert con.execute("SELECT frames FROM runs WHERE run_id = ?", [run_id]).fetchone() == (30,)
    con.close()
