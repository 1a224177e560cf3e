"""``Run.scalars`` (:mod:`analysis.notebook`) on a crafted run in a real DuckDB file: the wide
step table and the long per-rank table against the values written, the filters, the table
flavours, absent values against NaN, and an older store without the scalar tables."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from analysis.notebook import STEP_SCALAR_RENAMED, Store
from analysis.read.connect import StoreError
from tests.analysis import scalar_run as sr
from tests.analysis.crafted import drop_scalar_tables, write_history, write_scalars


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("notebook-scalars") / "store.duckdb"
    sr.write_scalar_run(path)
    write_history(path, np.ones((1, 3)), run_id="plain")
    write_history(path, np.ones((1, 3)), run_id="odd")
    write_scalars(path, "odd", [(0, "step", 7.0), (1, "loss", 1.5)])
    return path


@pytest.fixture(scope="module")
def store(store_path: Path) -> Store:
    return Store(store_path)


def test_wide_step_scalars_are_the_stored_values(store: Store) -> None:
    df = store.run("r").scalars()
    assert isinstance(df, pd.DataFrame)
    names = sorted({n for s in range(sr.STEPS) for n in sr.step_values(s)})
    assert list(df.columns) == ["step", *names]  # code-point order: "compute_time_s", ...
    assert str(df["step"].dtype) == "int64"
    assert all(str(df[n].dtype) == "float64" for n in names)
    assert df["step"].tolist() == list(range(sr.STEPS))
    for name in names:
        want = [sr.step_values(s).get(name, math.nan) for s in range(sr.STEPS)]
        np.testing.assert_array_equal(df[name].to_numpy(), np.asarray(want), err_msg=name)
    assert math.isnan(df.loc[sr.NAN_STEP, "loss"])  # one rank's NaN makes the step's NaN
    assert df.loc[sr.INF_STEP, "loss"] == math.inf
    assert df.loc[10, "compute_time_s"] == 0.5  # the slowest rank's
    assert df.loc[3, "tokens"] == 128.0 * (1 + 2 + 3)  # summed over the ranks


def test_absent_is_null_and_nan_is_kept_in_arrow(store: Store) -> None:
    table = store.run("r").scalars(as_="arrow")
    assert isinstance(table, pa.Table)
    ppl = table.column("eval:ppl")
    assert ppl.null_count == sr.STEPS - sr.STEPS // 10  # sent every 10th step
    loss = table.column("loss")
    assert loss.null_count == 0 and math.isnan(loss[sr.NAN_STEP].as_py())
    assert table.column("step_time_s")[0].as_py() is None  # measured from the second step
    polars = store.run("r").scalars(as_="polars")
    assert isinstance(polars, pl.DataFrame) and polars.equals(pl.from_arrow(table))


def test_filters(store: Store) -> None:
    run = store.run("r")
    df = run.scalars(steps=(10, 19), names="l*")
    assert list(df.columns) == ["step", "loss", "loss_scale", "lr"]
    assert df["step"].tolist() == list(range(10, 20))
    assert (df["loss_scale"] == 32768.0).all()
    exact = run.scalars(names=["lr", "nope"])
    assert list(exact.columns) == ["step", "lr"] and len(exact) == sr.STEPS
    assert list(run.scalars(names=[]).columns) == ["step"]
    with pytest.raises(StoreError, match="names must be a pattern"):
        run.scalars(names=[1])  # type: ignore[list-item]
    with pytest.raises(StoreError, match="after to_step"):
        run.scalars(steps=(5, 4))
    with pytest.raises(ValueError, match="as_='numpy' is not a table type"):
        run.scalars(as_="numpy")  # type: ignore[arg-type]


def test_per_rank_rows_long(store: Store) -> None:
    df = store.run("r").scalars(ranks=True)
    assert list(df.columns) == ["step", "rank", "name", "value"]
    assert [str(df[c].dtype) for c in ("step", "rank", "value")] == ["int64", "int64",
                                                                      "float64"]
    want = sorted((s, r, n, v) for s in range(sr.STEPS) for r in range(sr.WORLD)
                  for n, v in sr.rank_values(s, r).items())
    got = list(df.itertuples(index=False, name=None))
    assert [g[:3] for g in got] == [w[:3] for w in want]  # step, rank, name order
    np.testing.assert_array_equal(df["value"].to_numpy(), [w[3] for w in want])
    bad = df[(df.name == "loss") & ~np.isfinite(df.value)]
    assert list(zip(bad.step, bad["rank"], strict=True)) == [(sr.NAN_STEP, sr.NAN_RANK),
                                                             (sr.INF_STEP, sr.INF_RANK)]
    slow = df[df.name == "compute_time_s"].pivot(index="step", columns="rank", values="value")
    assert (slow.idxmax(axis=1).loc[list(sr.SLOW_STEPS)] == sr.SLOW_RANK).all()
    one = store.run("r").scalars(steps=(3, 3), names="loss", ranks=True, as_="polars")
    assert one["value"].to_list() == [sr.rank_loss(3, r) for r in range(sr.WORLD)]


def test_runs_without_scalars_and_a_scalar_named_step(store: Store) -> None:
    empty = store.run("plain").scalars()
    assert list(empty.columns) == ["step"] and len(empty) == 0
    assert list(store.run("plain").scalars(ranks=True).columns) == ["step", "rank", "name",
                                                                    "value"]
    odd = store.run("odd").scalars(as_="arrow")
    assert odd.column_names == ["step", "loss", STEP_SCALAR_RENAMED]
    assert odd.column(STEP_SCALAR_RENAMED).to_pylist() == [7.0, None]


def test_older_store_without_the_tables(tmp_path: Path) -> None:
    """A store written before the training scalars (never opened by a newer writer) has
    none: empty tables of the same columns, no error."""
    path = drop_scalar_tables(sr.write_scalar_run(tmp_path / "old.duckdb"))
    run = Store(path).run("r")
    wide, long = run.scalars(as_="arrow"), run.scalars(ranks=True, as_="arrow")
    assert wide.column_names == ["step"] and wide.num_rows == 0
    assert long.column_names == ["step", "rank", "name", "value"] and long.num_rows == 0
    assert long.schema.field("value").type == pa.float64()
    with pytest.raises(StoreError, match="unknown run"):
        Store(path).run("nope")
