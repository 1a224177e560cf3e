"""The notebook API and the example notebook on stores written by the real pipeline: the
session's ``gradstream demo`` store, and a store that a ``gradstream consume`` process is
writing while it is read (through the process's read endpoint)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import nbformat
import numpy as np
import pandas as pd
import pytest
from nbclient import NotebookClient

from analysis import Store
from analysis.read.connect import StoreError
from analysis.report import GradientFlowSummary
from producer import GradientProducer
from schemas.wire import GradientHealth
from tests.integration.conftest import DEMO_RANKS, DEMO_STEPS

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "gradient_history.ipynb"

SNIPPET = """
from analysis import Store
store = Store(DB)            # a file, or whichever process writes it now
store.runs()                                # pandas DataFrame: one row per run, health, counts
run = store.run(PREFIX)          # unique prefix accepted
run.layer_stats(steps=(100, 200), layers="encoder.*")   # long DataFrame: step, layer, stats
run.frames(); run.alerts(); run.rank_stats()
run.report(); run.analyze("flow")           # the same pydantic models the CLI prints
run.plot()                                  # the heatmap figure (matplotlib)
store.sql("SELECT count(*) AS n FROM layer_stats")                     # read-only, one statement
"""
"""The snippet of the API's documentation, as written (store path and prefix bound)."""


def _run_snippet(db: Path, prefix: str) -> dict[str, object]:
    namespace: dict[str, object] = {"DB": str(db), "PREFIX": prefix}
    exec(compile(SNIPPET, "<snippet>", "exec"), namespace)
    return namespace


def test_snippet_runs_as_written_on_the_demo_store(demo_store: Path) -> None:
    names = _run_snippet(demo_store, "demo-exploding-")
    store, run = names["store"], names["run"]
    assert isinstance(store, Store)
    runs = store.runs().set_index("run_id")
    assert [r.split("-2")[0] for r in runs.index] == [
        "demo-bad-rank", "demo-exploding", "demo-healthy", "demo-loss-spike", "demo-straggler",
        "demo-vanishing"]
    assert (runs["frames"] == DEMO_STEPS).all()
    assert (runs["world_size"] == DEMO_RANKS).all()
    assert (runs["last_step"] == DEMO_STEPS - 1).all()
    health = runs["health"].to_dict()
    by_scenario = {r.split("-2")[0]: h for r, h in health.items()}
    assert by_scenario == {"demo-bad-rank": "Critical", "demo-exploding": "Critical",
                           "demo-healthy": "Healthy", "demo-loss-spike": "Healthy",
                           "demo-straggler": "Healthy", "demo-vanishing": "ProblemsDetected"}
    exploding = runs.loc[run.run_id]
    assert exploding["first_nonfinite_step"] == 21 and exploding["alerts"] > 0
    assert run.run_id.startswith("demo-exploding-")

    con = duckdb.connect(str(demo_store), read_only=True)
    try:
        (stats_rows,) = con.execute("SELECT count(*) FROM layer_stats WHERE run_id = ?",
                                    [run.run_id]).fetchone()
        (window_rows,) = con.execute(
            "SELECT count(*) FROM layer_stats s JOIN layers l USING (run_id, layer_index) "
            "WHERE run_id = ? AND step BETWEEN 15 AND 22 AND l.name LIKE 'layers.1.%'",
            [run.run_id]).fetchone()
        (local_rows,) = con.execute("SELECT count(*) FROM local_layer_stats WHERE run_id = ?",
                                    [run.run_id]).fetchone()
        (alert_rows,) = con.execute("SELECT count(*) FROM alerts WHERE run_id = ?",
                                    [run.run_id]).fetchone()
    finally:
        con.close()
    assert run.layer_stats(steps=(100, 200), layers="encoder.*").empty
    assert len(run.layer_stats()) == stats_rows
    window = run.layer_stats(steps=(15, 22), layers="layers.1.*")
    assert len(window) == window_rows == 8 * 2
    assert len(run.rank_stats()) == local_rows == stats_rows * DEMO_RANKS
    assert len(run.alerts()) == alert_rows
    assert len(run.frames()) == DEMO_STEPS
    report = run.report()
    assert isinstance(report, GradientFlowSummary)
    assert report.overall_health is GradientHealth.CRITICAL
    assert report.first_nonfinite_step == 21
    page = run._repr_html_()
    assert 'class="gradstream-health"' in page and ">Critical</span>" in page
    assert '<img src="data:image/png;base64,' in page
    assert "<code>layers.0.weight</code>" in page

    bad_rank = store.run("demo-bad-rank-")
    local = bad_rank.rank_stats()
    first_bad = local[local["nonfinite"] > 0].groupby("rank")["step"].min().to_dict()
    assert first_bad[DEMO_RANKS - 1] == 20  # the rank with the corrupted sample
    assert all(step > 20 for rank, step in first_bad.items() if rank != DEMO_RANKS - 1)


def _kernel_spec(root: Path) -> str:
    """Write a Jupyter kernel spec for this interpreter under ``root/kernels``; its name."""
    name = "gradstream-test-python"
    spec = root / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gradstream tests", "language": "python",
    }))
    return name


def test_notebook_executes_on_the_demo_store(
    demo_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committed notebook has no outputs; executed on the demo store (path from
    GRADSTREAM_DB) every cell runs, the run renders as HTML with its badge, matplotlib
    figures come out as PNGs after the heatmap was drawn, and the per-rank cell names the
    bad rank."""
    committed = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(committed)
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)

    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("GRADSTREAM_DB", str(demo_store))
    kernel = _kernel_spec(tmp_path / "jupyter")
    NotebookClient(committed, kernel_name=kernel, timeout=300,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    outputs = [o for c in committed.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any('class="gradstream-health"' in page and "data:image/png;base64," in page
               for page in html)
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) >= 4  # layer norms, per-rank norms, run comparison, the heatmap figure
    per_rank = next(page for page in html if "bad-rank run" in page)
    cells = re.findall(r"<td>([^<]*)</td>", per_rank)
    assert "20" in cells


def test_snippet_while_consume_writes_the_store(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A real `gradstream consume` holds the DuckDB file; the API reads through its endpoint
    while more steps stream in, and gives the rows the file holds once it stopped."""
    db = tmp_path / "live.duckdb"
    topic = f"history-{unique_name}"
    run_id = f"live-{unique_name}"
    layers = {"encoder.0.weight": 6, "encoder.0.bias": 2, "head.weight": 4}
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "consume", "--db", str(db), "--topic", topic,
         "--dlq-topic", f"{topic}-dlq", "--group", f"g-{unique_name}", "--read-port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    drain = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    drain.start()

    def grads(step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(step)
        out = {name: rng.normal(0, 0.1, n).astype(np.float32) for name, n in layers.items()}
        if step >= 20:
            out["head.weight"][0] = np.nan
        return out

    def wait_for(store: Store, frames: int) -> pd.DataFrame:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            runs = store.runs()
            if len(runs) and int(runs["frames"].iloc[0]) >= frames:
                return runs
            time.sleep(0.3)
        raise AssertionError(f"{frames} frames not stored in time: {''.join(lines)[-3000:]}")

    try:
        with GradientProducer(run_id, bootstrap_servers=kafka_bootstrap, topic=topic) as gp:
            gp.start_run(layers)
            for step in range(30):
                gp.record_step(step, grads(step))
            deadline = time.monotonic() + 90
            store = None
            while store is None and time.monotonic() < deadline:
                try:
                    store = Store(db)
                except StoreError:
                    time.sleep(0.3)
            assert store is not None, "".join(lines)[-3000:]
            assert store.via.startswith("gradstream consume (pid"), store.via
            wait_for(store, 30)

            more = threading.Thread(target=lambda: [gp.record_step(s, grads(s))
                                                    for s in range(30, 60)])
            more.start()  # steps stream in while the snippet reads
            names = _run_snippet(db, "live-")
            more.join(30)
            run = names["run"]
            assert run.run_id == run_id
            window = run.layer_stats(steps=(5, 10), layers="encoder.*")
            assert len(window) == 6 * 2
            assert window["layer"].unique().tolist() == ["encoder.0.weight", "encoder.0.bias"]
            report = run.report(steps=(0, 29))
            assert report.overall_health is GradientHealth.CRITICAL
            assert report.first_nonfinite_step == 20
            assert '<img src="data:image/png;base64,' in run._repr_html_()
            gp.finish_run()
        wait_for(store, 60)
        live = run.layer_stats()
        live_frames = run.frames()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        drain.join(10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert not Path(f"{db}.serve.json").exists()
    after = Store(db)
    assert after.via == "read-only file"
    stored = after.run(run_id).layer_stats()
    assert len(live) == len(stored) == 60 * len(layers)
    pd.testing.assert_frame_equal(live, stored)
    assert live_frames["step"].tolist() == list(range(60))
