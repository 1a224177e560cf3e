"""analysis.read.reader: the file reader and the endpoint reader give the same answers.

The same crafted store is read (1) directly, by :class:`FileReader`, and (2) through the
endpoint of a process that holds it: this test process opens the file read-write (as a
consumer worker does), serves it with the dashboard server on hardened read cursors of
its own instance, and advertises the sidecar; :func:`open_reader` then picks the
:class:`EndpointReader`. A third case serves the file read-only with
:class:`deploy.serve.ServedStore`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.read.connect import StoreError
from analysis.read.cursors import ReadCursors
from analysis.read.query import StoreHeldError
from analysis.read.reader import EndpointReader, FileReader, StoreReader, open_reader
from analysis.read.sidecar import new_token, read_sidecar, remove_sidecar, write_sidecar
from analysis.registry import ANALYSES
from tests.analysis.crafted import write_history

NAMES = ["embed", "block.0", "block,1 \"q\"", "head"]
STEPS = 30


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Two runs: ``run-a/1`` (4 layers x 30 steps, weights at steps 0 and 29, a NaN burst
    and an exploding layer) and ``run-b`` (2 layers x 5 steps)."""
    rng = np.random.default_rng(7)
    norms = np.exp(rng.normal(0, 1, (len(NAMES), STEPS)))
    norms[3, 12] = 5e3  # exploding (max |g| above the run's threshold)
    max_abs = norms.copy()
    nonfinite = np.zeros(norms.shape, np.int64)
    nonfinite[1, 20] = 3
    weights = {(i, s): rng.normal(0, 0.5, 64) for i in range(len(NAMES)) for s in (0, STEPS - 1)}
    weights[(2, 0)] = weights[(2, STEPS - 1)] = np.full(64, np.nan)  # NaN statistics
    db = write_history(tmp_path / "s.duckdb", norms, run_id="run-a/1", names=NAMES,
                       numel=[64] * len(NAMES), max_abs=max_abs, nonfinite=nonfinite,
                       weights=weights, exploding_threshold=1e3)
    write_history(db, np.ones((2, 5)), run_id="run-b", names=["x", "y"])
    return db


class Writer:
    """This process holds ``db`` read-write and serves it, as a writing process does."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.con = duckdb.connect(str(db))
        self.cursors = ReadCursors.from_connection(self.con.cursor(), db)
        self.token = new_token()
        self.server = DashboardServer(Dashboard(self.cursors, self.token, query_timeout_s=30.0),
                                      "127.0.0.1", 0)
        self.server.start()
        write_sidecar(db, self.server.url, self.token, writer=True, command="consume")

    def close(self) -> None:
        remove_sidecar(self.db)
        self.server.stop()
        self.cursors.close()
        self.con.close()


@pytest.fixture
def readers(store: Path) -> Iterator[tuple[StoreReader, StoreReader, Writer]]:
    """(file reader, endpoint reader, the writer): the file reader reads a copy made
    before the writer opened the store (a file cannot be open read-only and read-write at
    once), so both see the same rows."""
    copy = store.with_name("copy.duckdb")
    copy.write_bytes(store.read_bytes())
    direct = FileReader(copy)
    writer = Writer(store)
    try:
        served = open_reader(store)
        yield direct, served, writer
        served.close()
    finally:
        direct.close()
        writer.close()


def test_open_reader_picks_the_path(store: Path) -> None:
    with open_reader(store) as reader:
        assert isinstance(reader, FileReader) and reader.via == "read-only file"
        assert reader.timeout_s == 60.0
    writer = Writer(store)
    try:
        with open_reader(store, timeout_s=5) as reader:
            assert isinstance(reader, EndpointReader)
            assert reader.via == f"gradstream consume (pid {os.getpid()}) at {writer.server.url}"
            assert reader.timeout_s == 5.0
            assert reader.run_ids() == ["run-a/1", "run-b"]
    finally:
        writer.close()


def test_a_held_store_without_endpoint_says_what_to_do(store: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
         "print('ready', flush=True); time.sleep(60)", str(store)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert read_sidecar(store) is None
        with pytest.raises(StoreHeldError, match="answers no reads") as caught:
            open_reader(store)
        assert isinstance(caught.value, StoreError)
        assert "s.duckdb.serve.json" in str(caught.value)
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(StoreError, match="does not exist"):
        open_reader(store.with_name("missing.duckdb"))


def test_tables_and_runs_agree(readers) -> None:  # type: ignore[no-untyped-def]
    direct, served, _writer = readers
    sql = ("SELECT step, layer_index, grad_norm, is_exploding, exp_hist_counts "
           "FROM layer_stats WHERE run_id = $run AND step >= $from ORDER BY step, layer_index")
    params = {"run": "run-a/1", "from": 10}
    a, b = direct.sql(sql, params), served.sql(sql, params)
    assert a.num_rows == (STEPS - 10) * len(NAMES)
    assert a.schema.equals(b.schema) and a.equals(b)
    empty = direct.sql("SELECT 1 AS x WHERE false")
    assert empty.num_rows == 0 and served.sql("SELECT 1 AS x WHERE false").equals(empty)
    for reader in (direct, served):
        assert reader.run_ids() == ["run-a/1", "run-b"]
        assert reader.resolve_run("run-b") == "run-b"
        assert reader.resolve_run("run-a") == "run-a/1"  # a unique prefix
        with pytest.raises(StoreError, match=r"ambiguous.*'run-a/1', 'run-b'"):
            reader.resolve_run("run-")
        with pytest.raises(StoreError, match="unknown run 'zz'; runs in the store"):
            reader.resolve_run("zz")
        with pytest.raises(StoreError, match="2 runs, choose one"):
            reader.resolve_run(None)


def test_reports_and_heatmaps_agree(readers) -> None:  # type: ignore[no-untyped-def]
    direct, served, _writer = readers
    for steps in ((None, None), (5, 20)):
        a, b = direct.report("run-a/1", *steps), served.report("run-a/1", *steps)
        assert type(a) is type(b) and a.model_dump_json() == b.model_dump_json()
        assert direct.heatmap("run-a/1", 12, *steps) == served.heatmap("run-a/1", 12, *steps)
    summary = served.report("run-a/1")
    assert "head" in summary.layers_with_exploding_grads
    assert summary.total_steps == STEPS


@pytest.mark.parametrize("name", list(ANALYSES))
def test_every_analysis_agrees(readers, name: str) -> None:  # type: ignore[no-untyped-def]
    direct, served, _writer = readers
    options = {"alpha": "0.05"} if name in ("enhanced", "weights") else {}
    a = direct.analysis(name, "run-a/1", None, None, options)
    b = served.analysis(name, "run-a/1", None, None, options)
    assert type(a) is type(b)
    assert a.model_dump_json() == b.model_dump_json()
    if name == "weights":  # NaN statistics survive the trip as NaN, not None
        z = b.model_dump()["distribution"]["layer_analyses"][2]["statistics"]
        assert math.isnan(z["mean"])


def test_analysis_errors_agree(readers) -> None:  # type: ignore[no-untyped-def]
    direct, served, _writer = readers
    for reader in (direct, served):
        with pytest.raises(StoreError, match="no analysis 'nope'"):
            reader.analysis("nope", "run-a/1")
        with pytest.raises(StoreError, match="explosion has no option window"):
            reader.analysis("explosion", "run-a/1", options={"window": "3"})
        with pytest.raises(StoreError, match="invalid flow options: window"):
            reader.analysis("flow", "run-a/1", options={"window": "0"})
        with pytest.raises(StoreError, match="unknown run 'zz'"):
            reader.analysis("flow", "zz")
        with pytest.raises(StoreError, match="from_step 9 is after to_step 2"):
            reader.report("run-a/1", 9, 2)


def test_grids_agree(readers) -> None:  # type: ignore[no-untyped-def]
    direct, served, _writer = readers
    for args in ((1000, 400, None, None), (7, 3, 2, 25)):
        a, b = direct.grid("run-a/1", *args), served.grid("run-a/1", *args)
        for field in ("row_first_layer", "row_last_layer", "col_first_step", "col_last_step",
                      "col_frames", "flags"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
            assert getattr(a, field).dtype == getattr(b, field).dtype, field
        for field in ("max_norm", "max_flow"):
            assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), field
        assert (a.row_labels, a.steps_per_col, a.layers_per_row, a.n_frames, a.n_layers) == (
            b.row_labels, b.steps_per_col, b.layers_per_row, b.n_frames, b.n_layers)
        assert a.caption() == b.caption()
    assert served.grid("run-a/1", 7, 3).shape == (2, 6)  # 30 frames in bins of 5
    with pytest.raises(StoreError, match="max_steps"):
        served.grid("run-a/1", 0)


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl", "parquet"])
def test_exports_agree(readers, tmp_path: Path, fmt: str) -> None:  # type: ignore[no-untyped-def]
    direct, served, _writer = readers
    fractions: list[float | None] = []
    a = direct.export("run-a/1", fmt, tmp_path / "a" / f"x.{fmt}", 3, 17, "model")
    b = served.export("run-a/1", fmt, tmp_path / "b" / f"x.{fmt}", 3, 17, "model",
                      fractions.append)
    assert a == b == (15 if fmt == "json" else 15 * len(NAMES))
    if fmt == "parquet":
        assert pq.read_table(tmp_path / "a" / "x.parquet").equals(
            pq.read_table(tmp_path / "b" / "x.parquet"))
    else:
        assert (tmp_path / "a" / f"x.{fmt}").read_bytes() == (
            tmp_path / "b" / f"x.{fmt}").read_bytes()
    assert fractions and fractions[-1] == 1.0
    assert not (tmp_path / "b" / f"x.{fmt}.part").exists()
    with pytest.raises(StoreError, match="unknown run 'zz'"):
        served.export("zz", fmt, tmp_path / "c" / f"x.{fmt}")
    assert not (tmp_path / "c" / f"x.{fmt}").exists()


def test_the_writer_keeps_writing_while_served(readers) -> None:  # type: ignore[no-untyped-def]
    """Reads on the writer's hardened instance do not stop it: it inserts from a registered
    Arrow table (as the consumer's sink does), the endpoint sees the committed rows, and
    it checkpoints its file."""
    _direct, served, writer = readers
    before = served.sql("SELECT count(*) AS n FROM layer_stats").column("n")[0].as_py()
    rows = pa.table({"run_id": ["run-b"] * 2, "step": [5, 5], "layer_index": pa.array(
        [0, 1], pa.int32()), "numel": [100, 100], "sum_sq": [1.0, 1.0], "nonfinite": [0, 0],
        "grad_norm": [1.0, 1.0], "flow_intensity": [1.0, 1.0], "is_vanishing": [False] * 2,
        "is_exploding": [False] * 2})
    writer.con.register("new_rows", rows)
    writer.con.execute("INSERT INTO layer_stats BY NAME SELECT * FROM new_rows")
    writer.con.execute("CHECKPOINT")
    after = served.sql("SELECT count(*) AS n FROM layer_stats").column("n")[0].as_py()
    assert after == before + 2


def test_served_store_answers_like_the_file(store: Path) -> None:
    """``gradstream serve --no-consume`` (:class:`deploy.serve.ServedStore`) is an endpoint
    too; its reports equal the file reader's."""
    from deploy.serve import ServedStore

    served_store = ServedStore(store, port=0)
    url = served_store.start()
    try:
        info = read_sidecar(store)
        assert info is not None and info.url == url
        endpoint = EndpointReader(store, info)
        with FileReader(store) as direct:
            assert endpoint.report("run-b").model_dump_json() == (
                direct.report("run-b").model_dump_json())
            assert endpoint.sql("SELECT count(*) AS n FROM runs").column("n").to_pylist() == [2]
    finally:
        served_store.stop()
