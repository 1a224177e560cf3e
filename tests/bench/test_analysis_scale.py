"""bench/analysis_scale.py at a tiny size: the store it builds with the project's DDL takes
its rows (a schema change that breaks the build fails here), every analysis runs on it,
and the figures are printed."""

from __future__ import annotations

import re

import duckdb

from tests.bench import finite_positive, key_values, run_script

LAYERS, STEPS = 30, 40


def test_tiny_run_builds_the_store_and_times_every_analysis(tmp_path) -> None:
    db = tmp_path / "scale.duckdb"
    out = run_script("analysis_scale", "--layers", str(LAYERS), "--steps", str(STEPS),
                     "--slices", "10", "20", "--repeats", "1", "--db", str(db), "--keep")
    lines = out.strip().splitlines()
    for name in ("flow network", "enhanced", "explosion", "weights + drift"):
        row = re.search(rf"{re.escape(name)}\s*[│|]\s*(\d+\.\d\d)\s*[│|]\s*(yes|NO)", out)
        assert row is not None, (name, out)
    assert "reference port, 10 layers" in out and "reference port, 20 layers" in out
    assert re.search(r"scaling exponent .*gradstream -?\d+\.\d\d, reference port -?\d+\.\d\d",
                     " ".join(out.split()))
    last = key_values(lines[-1])
    assert set(last) == {"enhanced_analysis_s", "rows"}, lines[-1]
    assert int(last["rows"]) == LAYERS * STEPS
    finite_positive(last["enhanced_analysis_s"])

    # The store holds what the docstring says: every row, every layer with its dtype, the
    # vanishing input layers flagged, one dead layer.
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows, layers, typed = con.execute(
            "SELECT (SELECT count(*) FROM layer_stats), (SELECT count(*) FROM layers), "
            "(SELECT count(*) FROM layers WHERE dtype = 'float32')").fetchone()
        vanishing = con.execute(
            "SELECT count(DISTINCT layer_index) FROM layer_stats WHERE is_vanishing").fetchone()
        dead = con.execute("SELECT count(DISTINCT layer_index) FROM layer_stats "
                           "WHERE grad_norm = 0").fetchone()
    finally:
        con.close()
    assert rows == LAYERS * STEPS and layers == typed == LAYERS
    assert vanishing[0] >= 20  # layers 0-19 carry 1e-7 x the norm, plus the dead one
    assert dead[0] == 1


def test_reference_port_compares_every_layer_with_every_other() -> None:
    """The O(L^2 x T) port the scaling curve times: one detail entry per layer, one
    interaction per pair, ranks from the per-layer means."""
    import numpy as np

    from bench import reference_enhanced_port as port

    histories = {f"l{i}": np.full(8, 10.0 ** (i - 2)) for i in range(4)}
    result = port.generate_enhanced_analysis(histories)
    assert list(result["details"]) == list(histories)
    assert len(result["interactions"]) == 4 * 3 // 2
    ranks = {name: d["compare"]["rank"] for name, d in result["details"].items()}
    assert ranks == {"l3": 1, "l2": 2, "l1": 3, "l0": 4}  # largest mean ranks first
    assert result["groups"] == {"high": ["l3"], "medium": ["l1", "l2"], "low": ["l0"]}
