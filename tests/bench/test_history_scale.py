"""bench/history_scale.py at a tiny size: the store it builds is one the readers accept (a
frame per step, complete, the run's counters as the worker keeps them), every read is timed
through the notebook API and the HTTP endpoint, and the last line carries every figure."""

from __future__ import annotations

import re

import duckdb

from analysis import registry
from bench.history_scale import STEP_WALL_S
from tests.bench import finite_positive, key_values, run_script

LAYERS, STEPS = 8, 200

NOTEBOOK_READS = ("runs", "report, whole run", "report, step range",
                  *(f"analysis {name}" for name in registry.ANALYSES), "grid", "plot",
                  "layer_stats slice")
HTTP_READS = ("GET /api/runs", "GET /api/grid", "GET /api/report",
              "GET /api/report, step range",
              *(f"GET /api/analysis/{name}" for name in registry.ANALYSES),
              "POST /api/query, slice")
TARGETED = {"report, whole run", "report, step range", "grid", "plot", "GET /api/grid",
            "GET /api/report", "GET /api/report, step range",
            *(f"analysis {name}" for name in registry.ANALYSES),
            *(f"GET /api/analysis/{name}" for name in registry.ANALYSES)}


def test_tiny_run_times_every_read_on_both_paths(tmp_path) -> None:
    db = tmp_path / "history.duckdb"
    out = run_script("history_scale", "--layers", str(LAYERS), "--steps", str(STEPS),
                     "--db", str(db), "--keep", timeout=120)
    lines = out.strip().splitlines()
    last = key_values(lines[-1])
    assert set(last) == {"report_s", "analysis_max_s", "grid_s", "plot_s", "peak_rss_gb"}, (
        lines[-1])
    values = {key: finite_positive(value) for key, value in last.items()}
    assert values["peak_rss_gb"] < 4.0  # a tiny store: the interpreter and its imports

    for via, reads in (("notebook", NOTEBOOK_READS), ("HTTP", HTTP_READS)):
        for read in reads:
            target = r"<= \d+ s\s*[│|]\s*(yes|NO)" if read in TARGETED else r"[│|]\s*[│|]"
            row = re.search(rf"[│|] {re.escape(read)}\s*[│|] {via}\s*[│|]\s*(\d+\.\d{{3}})\s*"
                            rf"[│|]\s*{target}", out)
            assert row is not None, (via, read, out)
    # The last line's figures are the table's: the HTTP grid and the notebook plot.
    grid = re.search(r"GET /api/grid\s*[│|] HTTP\s*[│|]\s*(\d+\.\d{3})", out)
    plot = re.search(r"[│|] plot\s*[│|] notebook\s*[│|]\s*(\d+\.\d{3})", out)
    assert grid is not None and plot is not None
    assert last["grid_s"] == grid.group(1) and last["plot_s"] == plot.group(1)
    for process in ("notebook", "server"):
        assert re.search(rf"peak RSS, {process} process.*\d+\.\d\d GB", out), out

    # The store is one the worker would have written: a complete frame per step whose
    # counts match its rows, and the run's counters after its last frame.
    con = duckdb.connect(str(db), read_only=True)
    try:
        stats, frames, complete, mismatched = con.execute(
            "SELECT (SELECT count(*) FROM layer_stats), (SELECT count(*) FROM frames), "
            "(SELECT count(*) FROM frames WHERE complete AND ranks_seen = [0] "
            "AND missing_ranks = []), "
            "(SELECT count(*) FROM frames AS f JOIN (SELECT step, count(*) AS n, "
            "count(*) FILTER (WHERE is_vanishing) AS v FROM layer_stats GROUP BY step) AS s "
            "USING (step) WHERE f.num_layers <> s.n OR f.vanishing_layers <> s.v)"
        ).fetchone()
        run = con.execute("SELECT frames, issue_frames, last_step, health, end_time "
                          "FROM runs").fetchall()
        last_health = con.execute("SELECT health FROM frames ORDER BY step DESC "
                                  "LIMIT 1").fetchone()
    finally:
        con.close()
    assert (stats, frames, complete, mismatched) == (LAYERS * STEPS, STEPS, STEPS, 0)
    # Layers 0-19 of the generator are vanishing: every frame is an issue frame.
    assert run == [(STEPS, STEPS, STEPS - 1, last_health[0], STEPS * STEP_WALL_S)]
