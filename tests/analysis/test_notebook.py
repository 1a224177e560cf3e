"""The notebook API (:mod:`analysis.notebook`) on a crafted store in a real DuckDB file:
run resolution, the table flavours, the step and layer filters (checked against direct SQL
and :func:`fnmatch.fnmatchcase`), the values of the long tables, reports, HTML and figures."""

from __future__ import annotations

import base64
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from analysis.notebook import Run, RunReport, Store
from analysis.read.connect import StoreError
from analysis.registry import get
from analysis.report import GradientFlowSummary, build_report
from tests.analysis.crafted import write_history

ROOT = Path(__file__).resolve().parents[2]

NAMES = [
    "encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "decoder.<out>", "enc[0]",
    "a%b_c", "back\\slash", "Encoder.upper",
]
"""Layer names in model order, chosen to trip a careless glob -> SQL translation."""

STEPS = 30
EXPLODING_FROM = 20  # decoder.<out>: max |g| above the threshold from this step
NONFINITE_FROM = 25  # encoder.1.weight: NaN elements from this step
RANKS = 2


def _norms() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(norms, max_abs, nonfinite)``, float64 / float64 / int64 ``[L, T]``."""
    rng = np.random.default_rng(7)
    norms = rng.uniform(0.5, 2.0, (len(NAMES), STEPS))
    norms[NAMES.index("enc[0]")] = 1e-9  # vanishing
    max_abs = norms / 10.0
    max_abs[NAMES.index("decoder.<out>"), EXPLODING_FROM:] = 5e3
    nonfinite = np.zeros(norms.shape, np.int64)
    nonfinite[NAMES.index("encoder.1.weight"), NONFINITE_FROM:] = 3
    return norms, max_abs, nonfinite


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with runs ``demo-exploding-a``, ``demo-healthy-1``, ``demo-healthy-2``; the
    first has a per-rank local view (rank 1 NaN from step 24, rank 0 from 25) and alerts
    (one incident fired and resolved, one still firing)."""
    path = tmp_path_factory.mktemp("history") / "store.duckdb"
    norms, max_abs, nonfinite = _norms()
    write_history(path, norms, run_id="demo-exploding-a", names=NAMES, max_abs=max_abs,
                  nonfinite=nonfinite, world_size=RANKS,
                  numel=[64, 8, 64, 16, 32, 4, 4, 4])
    for run_id in ("demo-healthy-1", "demo-healthy-2"):
        write_history(path, np.ones((2, 10)), run_id=run_id)
    steps, ranks, layers = np.meshgrid(np.arange(STEPS), np.arange(RANKS),
                                       np.arange(len(NAMES)), indexing="ij")
    sum_sq = (1.0 + steps + 10.0 * ranks + 100.0 * layers).astype(np.float64)
    bad = (((ranks == 1) & (steps >= 24)) | ((ranks == 0) & (steps >= 25))).astype(np.int64)
    local = pa.table({
        "run_id": ["demo-exploding-a"] * sum_sq.size,
        "step": steps.ravel().astype(np.int64),
        "rank": ranks.ravel().astype(np.int32),
        "layer_index": layers.ravel().astype(np.int32),
        "numel": np.full(sum_sq.size, 4, np.int64),
        "sum_abs": 2.0 * np.sqrt(sum_sq.ravel()),
        "sum_sq": sum_sq.ravel(),
        "max_abs_grad": np.sqrt(sum_sq.ravel()),
        "nonfinite": bad.ravel(),
    })
    con = duckdb.connect(str(path))
    try:
        con.register("local_in", local)
        con.execute("INSERT INTO local_layer_stats BY NAME SELECT * FROM local_in")
        con.execute("""
            INSERT INTO alerts (alert_id, run_id, step, rule, severity, state, layers, ranks,
                                message, created_at, incident_id, first_step)
            VALUES ('a1', 'demo-exploding-a', 20, 'exploding', 'critical', 'firing',
                    ['decoder.<out>'], [0, 1], 'exploding', 1.0, 'i1', 20),
                   ('a2', 'demo-exploding-a', 22, 'exploding', 'critical', 'resolved',
                    ['decoder.<out>'], [0, 1], 'resolved', 2.0, 'i1', 20),
                   ('a3', 'demo-exploding-a', 25, 'nonfinite', 'critical', 'firing',
                    ['encoder.1.weight'], [0, 1], 'NaN', 3.0, 'i2', 25)
        """)
        con.execute("INSERT INTO run_ranks VALUES ('demo-exploding-a', 0, 29, 30, 0, 5.0), "
                    "('demo-exploding-a', 1, 29, 28, 2, 5.0)")
    finally:
        con.close()
    return path


@pytest.fixture(scope="module")
def store(store_path: Path) -> Store:
    return Store(store_path)


@pytest.fixture(scope="module")
def run(store: Store) -> Run:
    return store.run("demo-exploding-")


def _count(path: Path, where: str, params: list[object]) -> int:
    con = duckdb.connect(str(path), read_only=True)
    try:
        (n,) = con.execute(
            "SELECT count(*) FROM layer_stats s JOIN layers l USING (run_id, layer_index) "
            f"WHERE s.run_id = 'demo-exploding-a' AND {where}", params).fetchone()
    finally:
        con.close()
    return int(n)


def test_prefix_resolution(store: Store) -> None:
    """A unique prefix names its run; an ambiguous one lists the candidates; an unknown one
    lists the runs present."""
    assert store.run("demo-exploding-").run_id == "demo-exploding-a"
    assert store.run("demo-healthy-2").run_id == "demo-healthy-2"
    with pytest.raises(StoreError, match="ambiguous") as ambiguous:
        store.run("demo-healthy-")
    assert "'demo-healthy-1'" in str(ambiguous.value)
    assert "'demo-healthy-2'" in str(ambiguous.value)
    with pytest.raises(StoreError, match="unknown run 'nope'") as unknown:
        store.run("nope")
    assert "'demo-exploding-a'" in str(unknown.value)


def test_runs_lists_health_counts_and_alerts(store: Store) -> None:
    runs = store.runs().set_index("run_id")
    assert list(runs.index) == ["demo-exploding-a", "demo-healthy-1", "demo-healthy-2"]
    row = runs.loc["demo-exploding-a"]
    assert row["world_size"] == RANKS and row["num_layers"] == len(NAMES)
    assert (row["alerts"], row["open_alerts"]) == (2, 1)  # i1 fired and resolved, i2 open
    assert (row["ranks_finished"], row["dropped_summaries"]) == (2, 2)
    assert runs.loc["demo-healthy-1", "alerts"] == 0
    assert str(runs["frames"].dtype) == "int64"
    assert str(runs["first_nonfinite_step"].dtype) == "Int64"  # NULL for every run here


@pytest.mark.parametrize("method", ["layer_stats", "rank_stats", "frames", "alerts"])
def test_each_flavour_has_the_same_rows(run: Run, method: str) -> None:
    """as_="arrow" | "polars" | "pandas" return their own type with the same rows."""
    arrow = getattr(run, method)(as_="arrow")
    polars = getattr(run, method)(as_="polars")
    pandas = getattr(run, method)()
    assert isinstance(arrow, pa.Table)
    assert isinstance(polars, pl.DataFrame)
    assert isinstance(pandas, pd.DataFrame)
    assert arrow.num_rows > 0
    assert polars.equals(pl.from_arrow(arrow))
    assert list(pandas.columns) == arrow.column_names
    assert len(pandas) == arrow.num_rows
    assert pandas["step"].tolist() == arrow.column("step").to_pylist()
    assert pandas["run_id"].tolist() == arrow.column("run_id").to_pylist()


def test_runs_and_sql_flavours(store: Store) -> None:
    sql = "SELECT run_id, count(*) AS n FROM layer_stats GROUP BY run_id ORDER BY run_id"
    arrow = store.sql(sql, as_="arrow")
    assert store.sql(sql, as_="polars").equals(pl.from_arrow(arrow))
    assert store.sql(sql)["n"].tolist() == [len(NAMES) * STEPS, 20, 20]
    assert store.runs(as_="polars")["run_id"].to_list() == (
        store.runs(as_="arrow").column("run_id").to_pylist())
    with pytest.raises(ValueError, match="as_='numpy' is not a table type"):
        store.sql(sql, as_="numpy")  # type: ignore[arg-type]


def test_layer_stats_columns_dtypes_and_values(run: Run) -> None:
    df = run.layer_stats()
    norms, max_abs, nonfinite = _norms()
    assert len(df) == len(NAMES) * STEPS
    assert {c: str(df[c].dtype) for c in ("step", "layer_index", "numel", "nonfinite")} == (
        dict.fromkeys(("step", "layer_index", "numel", "nonfinite"), "int64"))
    for column in ("grad_norm", "rms_grad", "mean_abs_grad", "max_abs_grad", "sum_sq",
                   "flow_intensity", "weight_norm"):
        assert str(df[column].dtype) == "float64", column
    assert str(df["is_exploding"].dtype) == "bool"
    # step-major, model order within a step; names joined from `layers`
    assert df["step"].tolist() == np.repeat(np.arange(STEPS), len(NAMES)).tolist()
    assert df["layer"].tolist()[: len(NAMES)] == NAMES
    grid = df["grad_norm"].to_numpy().reshape(STEPS, len(NAMES)).T
    np.testing.assert_allclose(grid, norms, rtol=1e-12)
    numel = df["numel"].to_numpy().reshape(STEPS, len(NAMES))[0]
    np.testing.assert_allclose(df["rms_grad"], df["grad_norm"] / np.sqrt(df["numel"]),
                               rtol=1e-12)
    np.testing.assert_array_equal(numel, [64, 8, 64, 16, 32, 4, 4, 4])
    np.testing.assert_allclose(df["max_abs_grad"].to_numpy().reshape(STEPS, -1).T, max_abs)
    np.testing.assert_array_equal(df["nonfinite"].to_numpy().reshape(STEPS, -1).T, nonfinite)
    exploding = df[df["is_exploding"]]
    assert set(exploding["layer"]) == {"decoder.<out>"}
    assert exploding["step"].min() == EXPLODING_FROM
    assert df["weight_norm"].isna().all()  # no weight statistics were sent


@pytest.mark.parametrize("pattern", [
    "encoder.*", "*", "enc*", "encoder.?.weight", "[Ee]ncoder*", "[!e]*", "enc[[]0]",
    "a%b_c", "a_b%c", "back\\slash", "*.<out>", "x' OR '1'='1", "",
])
def test_layer_glob_matches_fnmatch(run: Run, pattern: str) -> None:
    """The pattern keeps exactly the layers fnmatch.fnmatchcase keeps: SQL wildcards (%, _)
    and quotes are literal, a backslash is literal as in fnmatch."""
    df = run.layer_stats(layers=pattern)
    expected = [n for n in NAMES if fnmatch.fnmatchcase(n, pattern)]
    assert sorted(set(df["layer"])) == sorted(expected)
    assert len(df) == len(expected) * STEPS


def test_layer_list_and_step_range_against_sql(run: Run, store_path: Path) -> None:
    df = run.layer_stats(steps=(5, 12), layers="encoder.*")
    assert len(df) == _count(store_path, "s.step BETWEEN 5 AND 12 AND l.name LIKE 'encoder.%'",
                             [])
    assert (df["step"].min(), df["step"].max()) == (5, 12)
    picked = run.layer_stats(steps=(None, 3), layers=["enc[0]", "a%b_c", "missing"])
    assert len(picked) == _count(store_path, "s.step <= 3 AND l.name IN (?, ?)",
                                 ["enc[0]", "a%b_c"]) == 8
    assert run.layer_stats(steps=(28, None))["step"].unique().tolist() == [28, 29]
    assert run.layer_stats(layers=[]).empty


@pytest.mark.parametrize("steps", [(5, 2), (-1, 3), (1, 2, 3), "1-2", (1.5, 3)])
def test_invalid_step_ranges_are_refused(run: Run, steps: object) -> None:
    with pytest.raises(StoreError):
        run.layer_stats(steps=steps)  # type: ignore[arg-type]


def test_rank_stats_per_rank_view(run: Run) -> None:
    """The local view: one row per (step, rank, layer), norms from sum_sq, the first
    non-finite step of each rank."""
    df = run.rank_stats(layers="encoder.0.*")
    assert len(df) == STEPS * RANKS * 2
    assert df[["step", "rank"]].drop_duplicates().shape[0] == STEPS * RANKS
    np.testing.assert_allclose(df["grad_norm"], np.sqrt(df["sum_sq"]), rtol=1e-12)
    np.testing.assert_allclose(df["mean_abs_grad"], df["sum_abs"] / df["numel"], rtol=1e-12)
    row = df[(df["step"] == 3) & (df["rank"] == 1) & (df["layer"] == "encoder.0.bias")]
    assert row["sum_sq"].item() == 1.0 + 3 + 10 + 100
    first_bad = df[df["nonfinite"] > 0].groupby("rank")["step"].min().to_dict()
    assert first_bad == {0: 25, 1: 24}


def test_frames_and_alerts(run: Run) -> None:
    frames = run.frames(steps=(10, 19))
    assert frames["step"].tolist() == list(range(10, 20))
    assert frames["complete"].all() and str(frames["num_layers"].dtype) == "int64"
    alerts = run.alerts()
    assert alerts["alert_id"].tolist() == ["a1", "a2", "a3"]
    assert alerts["state"].tolist() == ["firing", "resolved", "firing"]
    assert alerts.loc[0, "layers"].tolist() == ["decoder.<out>"]
    assert run.alerts(steps=(21, None))["alert_id"].tolist() == ["a2", "a3"]


def test_report_is_the_cli_model_and_renders_html(run: Run, store_path: Path) -> None:
    report = run.report()
    assert isinstance(report, RunReport) and isinstance(report, GradientFlowSummary)
    con = duckdb.connect(str(store_path), read_only=True)
    try:
        expected = build_report(con, "demo-exploding-a")
        ranged = build_report(con, "demo-exploding-a", 0, 15)
        flow = get("flow").run(con, "demo-exploding-a", None, None, {})
    finally:
        con.close()
    assert report.model_dump() == expected.model_dump()
    assert run.report(steps=(0, 15)).model_dump() == ranged.model_dump()
    assert run.analyze("flow").model_dump() == flow.model_dump()
    page = report._repr_html_()
    assert 'class="gradstream-health"' in page and ">Critical</span>" in page
    assert "<code>decoder.&lt;out&gt;</code>" in page and "<out>" not in page
    assert "<code>enc[0]</code>" in page  # vanishing
    match = re.search(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert match is not None
    assert base64.b64decode(match.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    assert run._repr_html_().count('class="gradstream-health"') == 1


def test_analyze_rejects_unknown_names_and_options(run: Run) -> None:
    with pytest.raises(StoreError, match="no analysis 'nope'"):
        run.analyze("nope")
    with pytest.raises(StoreError, match="window"):
        run.analyze("enhanced", window=0)


def test_plot_returns_the_heatmap_figure_and_keeps_the_backend(run: Run) -> None:
    """The figure is the heatmap of `gradstream plot` with live axes (heatmap and colour bar);
    the matplotlib backend in use before (here svg, in Jupyter the inline one) is in use
    after, and pyplot holds no new figure."""
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    before = matplotlib.get_backend()
    plt.switch_backend("svg")
    try:
        open_before = plt.get_fignums()
        figure = run.plot(width_px=1000)
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == open_before
    finally:
        plt.switch_backend(before)
    assert isinstance(figure, Figure)
    width, height = figure.get_size_inches() * figure.dpi
    assert round(width) == 1000 and height > 200
    heatmap_axes, colour_bar = figure.axes[:2]
    assert run.run_id in heatmap_axes.get_title(loc="left")
    assert "log10 gradient L2 norm" in colour_bar.get_ylabel()
    with pytest.raises(StoreError, match="no gradient frame"):
        run.plot(steps=(500, 600))


def test_sql_is_read_only_and_one_statement(store: Store) -> None:
    with pytest.raises(StoreError, match=r"read-only|refused"):
        store.sql("DELETE FROM runs")
    with pytest.raises(StoreError, match="one SQL statement"):
        store.sql("SELECT 1; SELECT 2")
    value = store.sql("SELECT count(*) AS n FROM layers WHERE name = $name",
                      {"name": "a%b_c"})["n"].item()
    assert value == 1


def test_store_holds_no_file_between_calls(store_path: Path, store: Store) -> None:
    """Between calls nothing is open: a writer can take the file."""
    store.runs()
    assert store.via == "read-only file"
    con = duckdb.connect(str(store_path))  # read-write: fails while a reader holds it
    con.close()
    assert len(store.runs()) == 3


def test_with_block_holds_one_reader(store_path: Path) -> None:
    """Inside `with store:` every call shares one reader (the file stays open, a writer
    cannot take it); at the end of the block it is released."""
    store = Store(store_path)
    with store:
        assert len(store.runs()) == 3
        assert store.run("demo-exploding-").layer_stats(steps=(0, 0)).shape[0] == len(NAMES)
        with pytest.raises(duckdb.Error):
            duckdb.connect(str(store_path))
        with pytest.raises(RuntimeError, match="already held"), store:
            pass
    duckdb.connect(str(store_path)).close()


def test_missing_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "absent.duckdb")


def test_package_import_stays_lazy() -> None:
    """`import analysis` loads neither DuckDB nor pandas; `analysis.Store` loads the notebook."""
    probe = (
        "import sys, analysis\n"
        "assert not any(m.split('.')[0] in ('duckdb', 'pandas', 'pyarrow') or "
        "m == 'analysis.notebook' for m in sys.modules), sorted(sys.modules)\n"
        "from analysis import Store\n"
        "assert Store.__module__ == 'analysis.notebook'\n"
        "try:\n    analysis.Nope\nexcept AttributeError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "has no attribute 'Nope'" in result.stdout
