"""The demo and the `gradstream consume` process, through the real broker."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
from typer.testing import CliRunner

from analysis.report import build_report
from consumer.alerts.rows import read_alerts
from deploy.cli import app
from deploy.demo.scenarios import SCENARIOS
from deploy.demo.telemetry import RecordingTelemetry, load_recording
from deploy.demo.training import run_data_parallel
from producer import GradientProducer
from schemas.alert import AlertRule
from schemas.wire import GradientHealth


def _run_ids(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """Scenario name -> run id (``demo-<scenario>-<stamp>``) of the demo's runs."""
    runs = [r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()]
    return {next(n for n in SCENARIOS if r.startswith(f"demo-{n}-")): r for r in runs}


def test_demo_reports_each_scenario(kafka_bootstrap: str, tmp_path: Path) -> None:
    """`gradstream demo` trains the six scenarios through Kafka; the reports read back
    from DuckDB show healthy / vanishing early layers / exploding layers / NaN that started
    in the last rank's local gradient; the loss spike and the straggler fire their rules,
    naming the step and the layers whose gradient spiked, and the slow rank. Every rank
    sent the averaged gradient as a replica, counted once: ``layer_stats.numel ==
    layers.numel``; every run has its loss and learning rate at every step."""
    result = CliRunner().invoke(
        app,
        ["demo", "--ranks", "2", "--out", str(tmp_path), "--no-heatmap",
         "--bootstrap-servers", kafka_bootstrap],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(tmp_path / "demo.duckdb"), read_only=True)
    runs = _run_ids(con)
    assert set(runs) == {"healthy", "vanishing", "exploding", "bad-rank", "loss-spike",
                         "straggler"}
    healthy = build_report(con, runs["healthy"])
    vanishing = build_report(con, runs["vanishing"])
    exploding = build_report(con, runs["exploding"])
    bad_rank = build_report(con, runs["bad-rank"])
    (mismatched,) = con.execute(
        "SELECT count(*) FROM layer_stats s JOIN layers l USING (run_id, layer_index) "
        "WHERE s.numel <> l.numel").fetchone()
    (local_ranks,) = con.execute(
        "SELECT list(DISTINCT rank ORDER BY rank) FROM local_layer_stats").fetchone()
    scalars = dict(con.execute(
        "SELECT run_id, count(DISTINCT step) FILTER (WHERE name = 'loss') "
        "+ count(DISTINCT step) FILTER (WHERE name = 'lr') FROM step_scalars "
        "GROUP BY run_id").fetchall())
    frames = dict(con.execute("SELECT run_id, count(*) FROM frames GROUP BY run_id").fetchall())
    fired = {rule: (run, step, layers, ranks) for run, rule, step, layers, ranks in con.execute(
        "SELECT run_id, rule, step, layers, ranks FROM alerts WHERE state = 'firing' "
        "AND rule IN ('loss_spike', 'straggler')").fetchall()}
    con.close()
    assert scalars == {run: 2 * frames[run] for run in runs.values()}  # loss, lr: every step
    run, step, layers, _ = fired["loss_spike"]
    assert (run, step) == (runs["loss-spike"], SCENARIOS["loss-spike"].spike_step)
    assert layers  # the layers whose gradient spiked at or before it, earliest first
    run, step, _, ranks = fired["straggler"]
    straggler = SCENARIOS["straggler"]
    assert (run, ranks) == (runs["straggler"], [1])  # the last of 2 ranks
    # within the slow stretch (its 10th consecutive slow step unless a hiccup on a loaded
    # machine moved the count)
    assert straggler.slow_from_step <= step < straggler.slow_from_step + straggler.slow_steps
    assert mismatched == 0
    assert local_ranks == [0, 1]
    assert bad_rank.overall_health is GradientHealth.CRITICAL
    assert bad_rank.first_nonfinite_step == 20
    assert (bad_rank.first_bad_local_step, bad_rank.first_bad_local_ranks) == (20, [1])
    assert "NaN/Inf first in rank 1's local gradient at step 20" in result.output
    assert healthy.first_bad_local_step is None and vanishing.first_bad_local_step is None
    assert exploding.first_bad_local_step is not None and exploding.first_bad_local_exploding
    assert healthy.overall_health is GradientHealth.HEALTHY
    assert healthy.layers_with_vanishing_grads == healthy.layers_with_exploding_grads == []
    assert vanishing.layers_with_vanishing_grads[:2] == ["layers.0.weight", "layers.0.bias"]
    assert "layers.12.weight" not in vanishing.layers_with_vanishing_grads
    assert vanishing.overall_health is not GradientHealth.HEALTHY
    assert exploding.layers_with_exploding_grads
    assert exploding.overall_health is GradientHealth.CRITICAL
    for run_id in runs.values():
        assert (tmp_path / f"{run_id}.csv").stat().st_size > 0
        assert (tmp_path / f"{run_id}.json").stat().st_size > 0
    assert "Healthy" in result.output and "Critical" in result.output


def test_demo_bad_rank_names_the_rank_where_nan_started(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """bad-rank on 3 ranks: rank 2's shard holds a NaN sample from step 20. Frames are the
    averaged gradient (one replica), the local rows are stored per rank, and the report and
    the nonfinite alert name rank 2 at step 20 although every rank's update is NaN. The
    local view is each rank's flight recorder (the default): nothing before the first
    trigger, rank 2's NaN at step 20 sends its buffer (every step so far: 32 > 20); from
    step 21 every rank's gradient is NaN, so every rank sends every step from then on."""
    sc = SCENARIOS["bad-rank"]
    result = CliRunner().invoke(
        app,
        ["demo", "--ranks", "3", "--scenario", "bad-rank", "--out", str(tmp_path / "demo"),
         "--no-heatmap", "--bootstrap-servers", kafka_bootstrap],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    line = "NaN/Inf first in rank 2's local gradient at step 20"
    assert line in result.output
    con = duckdb.connect(str(tmp_path / "demo" / "demo.duckdb"), read_only=True)
    (run,) = _run_ids(con).values()
    report = build_report(con, run)
    names = [n for (n,) in con.execute(
        "SELECT name FROM layers WHERE run_id = ? ORDER BY layer_index", [run]).fetchall()]
    stats = con.execute(
        "SELECT step, layer_index, numel, grad_norm, nonfinite FROM layer_stats "
        "WHERE run_id = ? ORDER BY step, layer_index", [run]).fetchnumpy()
    local = con.execute(
        "SELECT step, rank, layer_index, sum_sq, nonfinite, trigger, trigger_step "
        "FROM local_layer_stats WHERE run_id = ? ORDER BY step, rank, layer_index",
        [run]).fetchnumpy()
    alerts = read_alerts(con, run_id=run, rule="nonfinite", state="firing")
    con.close()

    assert (report.first_bad_local_step, report.first_bad_local_ranks) == (20, [2])
    assert report.first_bad_local_nonfinite and not report.first_bad_local_exploding
    assert report.first_nonfinite_step == 20
    (alert,) = alerts
    assert alert.rule is AlertRule.NONFINITE and alert.step == 20
    assert alert.ranks == [0, 1, 2]  # every rank sent the NaN averaged gradient
    assert line in alert.message
    assert alert.values["local_origin"] == {"step": 20, "ranks": [2]}

    # the same deterministic training in-process, recorded: what every rank applied and
    # each rank's local gradient
    rec_dir = tmp_path / "rec"
    rec_dir.mkdir()
    run_data_parallel("bad-rank", 3, None, functools.partial(RecordingTelemetry, rec_dir))
    recs = [load_recording(rec_dir, r) for r in range(3)]
    steps, num_layers = sc.steps, len(names)
    assert recs[0].layer_names == names
    shape = (steps, num_layers)
    norm = np.stack([np.linalg.norm(recs[0].grads[n].reshape(steps, -1).astype(np.float64),
                                    axis=1) for n in names], axis=1)
    nan_count = np.stack([(~np.isfinite(recs[0].grads[n].reshape(steps, -1))).sum(axis=1)
                          for n in names], axis=1)
    numel = np.asarray(recs[0].layer_numel)
    # frames: one replica of the averaged gradient
    np.testing.assert_array_equal(stats["numel"].reshape(shape), np.broadcast_to(numel, shape))
    np.testing.assert_array_equal(stats["nonfinite"].reshape(shape), nan_count)
    np.testing.assert_allclose(stats["grad_norm"].reshape(shape)[:20], norm[:20], rtol=1e-6)
    # local view: one row per (step, rank, layer), each rank's own gradient
    local_shape = (steps, 3, num_layers)
    assert len(local["step"]) == steps * 3 * num_layers
    np.testing.assert_array_equal(local["rank"].reshape(local_shape)[:, :, 0],
                                  np.broadcast_to(np.arange(3), (steps, 3)))
    local_norm = np.stack([np.stack([
        np.linalg.norm(rec.local[n].reshape(steps, -1).astype(np.float64), axis=1)
        for n in names], axis=1) for rec in recs], axis=1)
    np.testing.assert_allclose(np.sqrt(local["sum_sq"].reshape(local_shape))[:20],
                               local_norm[:20], rtol=1e-6)
    assert not np.allclose(local_norm[:20, 0], norm[:20], rtol=1e-3)  # frames are not local
    local_nan = local["nonfinite"].reshape(local_shape).sum(axis=2)  # (step, rank)
    assert (local_nan[:20] == 0).all()
    assert (local_nan[20] > 0).tolist() == [False, False, True]
    assert (local_nan[21:] > 0).all()
    # the recorder: no trigger before step 20; rank 2's rows up to it came with that trigger
    assert set(local["trigger"].tolist()) == {"nonfinite"}
    assert local["trigger_step"].min() == 20
    up_to_20 = (local["rank"] == 2) & (local["step"] <= 20)
    assert (local["trigger_step"][up_to_20] == 20).all()
    assert (local["trigger_step"][local["step"] >= 21] == local["step"][local["step"] >= 21]).all()


def test_consume_process_stops_cleanly_on_sigterm(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """`gradstream consume` stores what it read, then exits 0 on SIGTERM."""
    db = tmp_path / "worker.duckdb"
    topic = f"cli-{unique_name}"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "GRADSTREAM_DB": str(db)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "consume", "--topic", topic,
         "--dlq-topic", f"{topic}-dlq", "--group", f"g-{unique_name}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        with GradientProducer(f"run-{unique_name}", bootstrap_servers=kafka_bootstrap,
                              topic=topic) as gp:
            gp.start_run({"w": 3})
            for step in range(10):
                gp.record_step(step, {"w": np.array([1.0, -2.0, 3.0], np.float32)})
            gp.finish_run()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("finished (health" in x for x in lines):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out and "worker stopped" in out
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM frames").fetchone() == (10,)
    con.close()
