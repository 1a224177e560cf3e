"""Explicit exclusion and the reference rule end to end: real producers, the real broker, a
real worker and DuckDB file.

- A float64 run that declares no dtypes (float32 assumed) with one layer at mean |g| =
  2e-9 in every step, beside layers near 0.5: it looks like float32 rounding (a finding),
  but the verdict is the reference's: vanishing in every frame, ProblemsDetected, the
  layer listed, the vanishing alert fired.
- A run excluding a layer by ``start_run(..., ignore_layers=...)`` consumed by a worker with
  its own ``ignore_layers``: both recorded with the run, the run Healthy with no vanishing
  alert, and the report names both excluded layers.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np

from analysis.report import build_report
from consumer.settings import ConsumerSettings
from producer import GradientProducer
from schemas.alert import AlertRule
from schemas.wire import GradientHealth
from tests.integration.test_end_to_end import start_worker

STEPS = 12
LAYERS = {"embed": 256, "attn.key.bias": 32, "block.0": 128, "tiny": 64, "head": 64}


def gradients(step: int) -> dict[str, np.ndarray]:
    """float64 gradients: |g| = 2e-9 for "tiny", 1e-13 for the key bias (both below the
    vanishing threshold 1e-7 at every step), random of scale ~0.1 to 0.5 elsewhere."""
    rng = np.random.default_rng(step)
    out = {}
    for i, (name, n) in enumerate(LAYERS.items()):
        sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
        if name == "tiny":
            out[name] = 2e-9 * sign
        elif name == "attn.key.bias":
            out[name] = 1e-13 * sign
        else:
            out[name] = rng.uniform(0.1, 0.5, n) * sign * (i + 1) / len(LAYERS)
    return out


def send(bootstrap: str, topic: str, run_id: str, **start: object) -> None:
    producer = GradientProducer(run_id, bootstrap_servers=bootstrap, topic=topic)
    producer.start_run(LAYERS, **start)  # type: ignore[arg-type]
    for step in range(STEPS):
        producer.record_step(step, gradients(step))
    producer.finish_run()
    stats = producer.close()
    assert stats.sent >= STEPS and stats.dropped == 0 and stats.failed == 0


def test_reference_rule_and_explicit_exclusions(kafka_bootstrap: str, tmp_path: Path,
                                                unique_name: str) -> None:
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{unique_name}",
        dlq_topic=f"dlq-{unique_name}", alerts_topic=f"alerts-{unique_name}",
        group_id=f"grp-{unique_name}", db=str(tmp_path / "store.duckdb"), shard_timeout_s=60.0,
        group_instance_id=f"grp-{unique_name}-0", session_timeout_ms=45000,
        ignore_layers=["*.key.bias"],
    )
    plain, excluding = f"f64-{unique_name}", f"excl-{unique_name}"
    worker, thread = start_worker(settings)
    try:
        send(kafka_bootstrap, settings.topic, plain)
        send(kafka_bootstrap, settings.topic, excluding, ignore_layers=["tiny"])
        assert worker.wait_for_runs([plain, excluding], 120), (
            f"runs not finished: worker error {worker.error!r}, {worker.counters}")
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None

    con = duckdb.connect(settings.db, read_only=True)
    try:
        runs = {r: con.execute(
            "SELECT health, frames, issue_frames, ignore_layers FROM runs WHERE run_id = ?",
            [r]).fetchone() for r in (plain, excluding)}
        dtypes = {d for (d,) in con.execute("SELECT DISTINCT dtype FROM layers").fetchall()}
        alerts = {r: {(rule, layers) for rule, layers in con.execute(
            "SELECT rule, list_sort(layers)::VARCHAR FROM alerts WHERE run_id = ? AND "
            "rule = ? AND state = 'firing'", [r, AlertRule.VANISHING.value]).fetchall()}
            for r in (plain, excluding)}
        reports = {r: build_report(con, r) for r in (plain, excluding)}
    finally:
        con.close()

    assert dtypes == {None}  # the NumPy path declares no dtype: float32 is assumed
    # Default: the reference rule. The worker's own pattern excludes the key bias, and is
    # recorded with the run; "tiny" counts in every frame.
    report = reports[plain]
    assert runs[plain] == (GradientHealth.PROBLEMS_DETECTED.value, STEPS, STEPS,
                           ["*.key.bias"])
    assert report.layers_with_vanishing_grads == ["tiny"]
    assert (report.frames, report.issue_frames) == (STEPS, STEPS)
    assert report.overall_health is GradientHealth.PROBLEMS_DETECTED
    assert report.layers_excluded == ["attn.key.bias"]
    assert "tiny" in report.layers_without_gradient  # looks like float32 rounding: a finding
    assert alerts[plain] and all("tiny" in layers and "attn.key.bias" not in layers
                                 for _, layers in alerts[plain])
    # The run's own ignore_layers and the worker's: both recorded, Healthy, both named.
    report = reports[excluding]
    assert runs[excluding] == (GradientHealth.HEALTHY.value, STEPS, 0, ["tiny", "*.key.bias"])
    assert report.layers_with_vanishing_grads == []
    assert report.overall_health is GradientHealth.HEALTHY
    assert report.ignore_layers == ["tiny", "*.key.bias"]
    assert report.layers_excluded == ["attn.key.bias", "tiny"]
    assert alerts[excluding] == set()
