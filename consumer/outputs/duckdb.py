"""The DuckDB output: frames, runs and consumed Kafka offsets, written in one transaction.

:class:`DuckDBOutput` is the :class:`consumer.outputs.base.Output` of a single-process
worker and of ``gradstream store``; :class:`DuckDBSink` owns the file. Rows are written in
bulk from Arrow tables, never row by row. A batch's frames replace what is stored for
their (run, step): the ``layer_stats`` rows of those keys are deleted, then the new rows
appended with a plain ``INSERT ... SELECT``, and ``frames`` rows are upserted on their
(run, step) key, each with its summary computed from the rows inserted with it
(:func:`schemas.frame_summary.summarize_frames`). So a rewritten frame (late shard,
replay after a crash) replaces the old rows, and a frame written twice appears once.
The next offset to consume per partition is written in the same transaction as the rows
it covers, so the store is exactly-once with respect to Kafka (README.md, "Tables").
Each transaction runs on a writer thread while the caller prepares the next batch
(``write_behind``); reads wait for it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa

from consumer.alerts.rows import load_active_incidents, write_alerts
from consumer.frames import GradientFrame, MergedShards
from consumer.outputs.base import (
    Batch,
    KnownState,
    Output,
    PartitionKey,
    RunState,
    commit_offsets,
)
from consumer.runs import RunInfo
from schemas.frame_summary import summarize_frames
from schemas.grid_rollup import refresh_rollup_sql
from schemas.rounding import rounding_rows_sql
from schemas.scalars import MEAN, RANK_AGGREGATES, RankScalars
from schemas.stats import (
    WEIGHT_POWER_SUMS,
    ExponentHistogram,
    GradientSums,
    SumOfSquares,
    WeightMoments,
)
from schemas.stats.csr import csr_from_dense, offsets_from_lengths
from schemas.tables import LAYER_STATS_COLUMNS, LOCAL_LAYER_STATS_COLUMNS, SCHEMA_DDL
from schemas.wire import EXP_HIST_BINS, LocalSummary, RunFinished, RunStarted

if TYPE_CHECKING:
    from consumer.runbook import RunBook
    from consumer.settings import LoopSettings

log = logging.getLogger("gradstream.consumer")


_REQUIRED_STATS = frozenset({
    "run_id", "step", "layer_index", "numel", "sum_sq", "nonfinite", "grad_norm",
    "flow_intensity", "is_vanishing", "is_exploding",
})
"""``layer_stats`` columns declared NOT NULL: always inserted."""


def _optional_floats(fs: list[GradientFrame], name: str) -> pa.Array:
    """float64 column of an optional per-layer field; NaN or absent -> NULL."""
    if all(getattr(f, name) is None for f in fs):  # the common case: no frame has it
        return pa.nulls(sum(len(f.layer_index) for f in fs), pa.float64())
    parts = [
        getattr(f, name) if getattr(f, name) is not None
        else np.full(len(f.layer_index), np.nan)
        for f in fs
    ]
    return pa.array(np.concatenate(parts), pa.float64(), from_pandas=True)


def _optional_ints(fs: list[GradientFrame], name: str) -> pa.Array:
    """int64 column of an optional per-layer count; negative or absent -> NULL."""
    if all(getattr(f, name) is None for f in fs):
        return pa.nulls(sum(len(f.layer_index) for f in fs), pa.int64())
    parts = [
        getattr(f, name) if getattr(f, name) is not None
        else np.full(len(f.layer_index), -1, np.int64)
        for f in fs
    ]
    values = np.concatenate(parts).astype(np.int64)
    return pa.array(values, pa.int64(), mask=values < 0)


def _weight_zeros(fs: list[GradientFrame]) -> pa.Array:
    """Exact-zero weights per layer (column 0 of the weight histogram); NULL if unknown."""
    if all(f.weight_exp_hist is None for f in fs):
        return pa.nulls(sum(len(f.layer_index) for f in fs), pa.int64())
    parts = [
        f.weight_exp_hist[:, 0] if f.weight_exp_hist is not None
        else np.full(len(f.layer_index), -1, np.int64)
        for f in fs
    ]
    values = np.concatenate(parts).astype(np.int64)
    return pa.array(values, pa.int64(), mask=values < 0)


def _histogram_columns(
    fs: list[GradientFrame], name: str = "exp_hist"
) -> tuple[pa.Array, pa.Array]:
    """Sparse exponent histograms (frame field ``name``) as (columns SMALLINT[], counts
    BIGINT[]) list columns; NULL for layers without a complete histogram."""
    total = sum(len(f.layer_index) for f in fs)
    if all(getattr(f, name) is None for f in fs):
        return (pa.nulls(total, pa.list_(pa.int16())), pa.nulls(total, pa.list_(pa.int64())))
    dense = np.concatenate([
        getattr(f, name) if getattr(f, name) is not None
        else np.full((len(f.layer_index), EXP_HIST_BINS), -1, np.int64)
        for f in fs
    ])
    valid = dense[:, 0] >= 0
    offsets, cols, counts = csr_from_dense(dense, keep=valid)
    list_offsets, mask = pa.array(offsets.astype(np.int32)), pa.array(~valid)
    return (
        pa.ListArray.from_arrays(list_offsets, pa.array(cols.astype(np.int16)), mask=mask),
        pa.ListArray.from_arrays(list_offsets, pa.array(counts), mask=mask),
    )


def _names_column(rows: list[RankScalars]) -> pa.Array:
    """The scalar name of every row of ``rows`` as a dictionary-encoded string column (one
    small dictionary, an int32 index a row, instead of a Python string a row)."""
    names = list(dict.fromkeys(n for r in rows for n in r.names))
    position = {n: i for i, n in enumerate(names)}
    index = np.concatenate([np.array([position[n] for n in r.names], np.int32)[r.name_index]
                            for r in rows])
    return pa.DictionaryArray.from_arrays(pa.array(index, pa.int32()),
                                          pa.array(names, pa.string()))


def _ranked_names(frame: GradientFrame) -> frozenset[str]:
    """The names of ``frame``'s per-rank scalars (their step values are the store's SQL
    aggregates, not the frame's)."""
    rows = frame.rank_scalars
    return frozenset(rows.names) if rows is not None and len(rows) else frozenset()


def _run_column(values: list[str], lengths: np.ndarray) -> pa.Array:
    """Dictionary-encoded string column repeating values[i] lengths[i] times."""
    indices = np.repeat(np.arange(len(values), dtype=np.int32), lengths)
    return pa.DictionaryArray.from_arrays(pa.array(indices), pa.array(values, pa.string()))


def _csr(tbl: pa.Table, columns: str, counts: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64[n+1], columns int64[nnz], counts int64[nnz]) of two non-null list
    columns of ``tbl``."""
    offsets = offsets_from_lengths(pc_list_lengths(tbl[columns]))
    flat_cols = np.asarray(pa.concat_arrays([c.flatten() for c in tbl[columns].chunks]),
                           np.int64)
    flat_counts = np.asarray(pa.concat_arrays([c.flatten() for c in tbl[counts].chunks]),
                             np.int64)
    return offsets, flat_cols, flat_counts


def _execute_with(con: duckdb.DuckDBPyConnection, tables: dict[str, pa.Table],
                  *statements: str) -> None:
    """Run ``statements`` in order on ``con`` with each Arrow table of ``tables`` registered
    under its name, for those statements only.

    Raises:
        duckdb.Error: a statement failed (the tables are unregistered all the same).
    """
    for name, table in tables.items():
        con.register(name, table)
    try:
        for statement in statements:
            con.execute(statement)
    finally:
        for name in tables:
            con.unregister(name)


def pc_list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """int64 lengths of the lists of a list column (nulls count 0)."""
    import pyarrow.compute as pc

    return np.asarray(pc.fill_null(pc.list_value_length(column), 0), np.int64)


def _stored_floats(tbl: pa.Table, name: str) -> np.ndarray:
    """float64 values of a column of ``tbl``, NaN where NULL."""
    return np.asarray(tbl[name].to_numpy(zero_copy_only=False), np.float64)


def _stored_ints(tbl: pa.Table, name: str) -> np.ndarray:
    """int64 values of a column of ``tbl``, 0 where NULL."""
    import pyarrow.compute as pc

    return np.asarray(pc.fill_null(tbl[name], 0).to_numpy(zero_copy_only=False), np.int64)


def _has(tbl: pa.Table, name: str) -> np.ndarray:
    """bool[k]: the column ``name`` is not NULL."""
    return ~np.asarray(tbl[name].is_null().to_numpy(zero_copy_only=False), bool)


def stored_sums(tbl: pa.Table) -> MergedShards:
    """The statistics of k stored ``layer_stats`` rows (the columns :meth:`DuckDBSink.load_sums`
    reads), aligned with the rows; each row counts as the whole of what was merged into it,
    and a NULL statistic covers none of its layer (``schemas.stats``, "Coverage").

    Returns:
        MergedShards over the k rows; an optional statistic is None when no row has it.
    """
    numel = _stored_ints(tbl, "numel")
    nonfinite = _stored_ints(tbl, "nonfinite")
    merged = MergedShards(GradientSums.from_columns(
        numel, _stored_floats(tbl, "sum_abs"), _stored_floats(tbl, "sum_sq"),
        _stored_floats(tbl, "max_abs_grad"), nonfinite,
        _stored_floats(tbl, "nan") if "nan" in tbl.column_names else None))
    has_hist = _has(tbl, "exp_hist_columns")
    if has_hist.any():
        merged.histogram = ExponentHistogram.from_columns(
            *_csr(tbl, "exp_hist_columns", "exp_hist_counts"), np.where(has_hist, nonfinite, 0))
    if _has(tbl, "weight_sum_sq").any():
        merged.weight_norm = SumOfSquares.from_columns(numel, _stored_floats(tbl, "weight_sum_sq"))
    if _has(tbl, "update_sum_sq").any():
        merged.update_norm = SumOfSquares.from_columns(numel, _stored_floats(tbl, "update_sum_sq"))
    if _has(tbl, "weight_sum").any():
        merged.weight_moments = WeightMoments.from_columns(
            numel, _stored_ints(tbl, "weight_nonfinite"),
            *_csr(tbl, "weight_exp_hist_columns", "weight_exp_hist_counts"),
            **{name: _stored_floats(tbl, column) for name, column in WEIGHT_POWER_SUMS.items()},
        )
    return merged


class DuckDBSink:
    """Owns the DuckDB file (DuckDB allows one writing process).

    Args:
        path: the database file; created with the gradstream tables if absent.
        write_behind: run each write's transaction on a writer thread (default), so the
            caller decodes and merges the next batch while DuckDB inserts this one (DuckDB
            releases the GIL while it executes). At most one
            write is in flight; reads (:attr:`con`, ``load_*``) and :meth:`close` wait for
            it, so they see every batch given to :meth:`write`. False: write in the
            calling thread.

    Raises:
        duckdb.IOException: the file is locked by another process (a running worker).
    """

    write_rollup: bool = True
    """Refresh the grid rollup (``schemas.grid_rollup``) with the frames written; False for a
    staging database whose tables are copied elsewhere (the Iceberg output), where readers
    then read the rows."""

    def __init__(self, path: str | Path, write_behind: bool = True) -> None:
        self.path = Path(path)
        if self.path.parent != Path(""):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._con = duckdb.connect(str(self.path))
        self.ignore_layers: tuple[str, ...] = ()
        """The writing process's own ``--ignore-layers`` patterns: recorded with each run it
        stores first (``runs.ignore_layers`` = the run's patterns, then these), so that the
        report applies what the live health applied."""
        for ddl in SCHEMA_DDL:
            self._con.execute(ddl)
        # The writer thread uses its own connection object to the same database instance.
        self._wcon = self._con.cursor() if write_behind else self._con
        self._writer = (ThreadPoolExecutor(1, thread_name_prefix="gradstream-sink")
                        if write_behind else None)
        self._pending: Future[None] | None = None
        self._failed: BaseException | None = None
        self.timed: Callable[[], AbstractContextManager[object]] = nullcontext
        """Wraps each transaction, from BEGIN to COMMIT or ROLLBACK, on the thread that
        runs it (:meth:`DuckDBOutput.timed_write <consumer.outputs.base.Output.timed_write>`
        for the store-write metrics); nothing by default."""

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The connection, once the write in flight (if any) has committed.

        Raises:
            duckdb.Error: the last write failed (see :meth:`wait`).
        """
        self.wait()
        return self._con

    def wait(self) -> None:
        """Block until the write in flight (if any) has committed.

        Raises:
            duckdb.Error: that write failed and was rolled back. The sink then refuses every
                later write with the same error: a later batch's offsets would pass the
                rows of the lost one (the caller restarts from the stored offsets).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as exc:
                self._failed = exc
        if self._failed is not None:
            raise self._failed

    def settled(self) -> bool:
        """True when no write is in flight (every batch given to :meth:`write` has
        committed); never blocks.

        Raises:
            duckdb.Error: as :meth:`wait`, once the failed write has finished.
        """
        if self._pending is not None and not self._pending.done():
            return False
        self.wait()
        return True

    def close(self) -> None:
        """Wait for the write in flight, checkpoint and close the file.

        Raises:
            duckdb.Error: the write in flight failed (the file is closed all the same).
        """
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._wcon.close()
            self._con.execute("CHECKPOINT")
            self._con.close()

    def read_cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to this sink's database instance, for readers on other threads
        (the dashboard of ``gradstream serve``); it sees committed rows. The caller closes
        it before :meth:`close`."""
        return self._con.cursor()

    # -- reads used on start-up and for late shards ---------------------------------------

    def load_runs(self) -> list[RunInfo]:
        """Every stored run with its layers (model order), their gradient dtypes
        (``RunInfo.dtypes`` None when no layer of the run has one) and its
        ``ignore_layers``."""
        runs = self.con.execute(
            "SELECT run_id, world_size, vanishing_threshold, exploding_threshold, "
            "coalesce(ignore_layers, []) FROM runs"
        ).fetchall()
        layers = self.con.execute(
            "SELECT run_id, list(name ORDER BY layer_index), list(numel ORDER BY layer_index), "
            "list(dtype ORDER BY layer_index) FROM layers GROUP BY run_id"
        ).fetchall()
        by_run = {r: (names, numel, dtypes) for r, names, numel, dtypes in layers}
        out = []
        for run_id, world, van, exp, ignore in runs:
            names, numel, dtypes = by_run.get(run_id, ([], [], []))
            out.append(RunInfo(run_id, world, tuple(names), np.asarray(numel, np.int64),
                               van, exp,
                               tuple(dtypes) if any(d is not None for d in dtypes) else None,
                               tuple(ignore)))
        return out

    def load_frames(self, run_id: str) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
        """(steps int64[F], complete bool[F], ranks_seen lists) of a run's stored frames."""
        tbl = self.con.sql(
            "SELECT step, complete, ranks_seen FROM frames WHERE run_id = $1 ORDER BY step",
            params=[run_id],
        ).to_arrow_table()
        return (
            tbl["step"].to_numpy().astype(np.int64),
            tbl["complete"].to_numpy(zero_copy_only=False).astype(bool),
            tbl["ranks_seen"].to_pylist(),
        )

    def load_flags(self, run_id: str, exclude_rounding: bool = False,
                   nonfinite_rule: str = "critical") -> dict[str, np.ndarray]:
        """A run's stored layer rows with a flag: step, layer_index, is_vanishing,
        is_exploding, nonfinite (arrays of equal length), as stored, and ``critical``: the
        rows the non-finite rule counts (``consumer.health_tracker.critical_rows``).

        With ``nonfinite_rule="reference"`` ``is_exploding`` is the reference
        implementation's (an Inf element, ``nonfinite > nan``, makes the row exploding)
        and ``critical`` holds only the non-finite rows whose NaN count is NULL (unknown
        split); with ``"critical"`` it is ``nonfinite > 0``.

        With ``exclude_rounding`` (:class:`consumer.health_tracker.RunHealthTracker`'s option, off
        by default), ``is_vanishing`` is False on the rows of a layer with no gradient by
        construction up to that step (``schemas.rounding``), as the tracker counted it:
        one windowed aggregate over the run's rows
        (:func:`schemas.rounding.rounding_rows_sql`). Layers excluded by ``ignore_layers``
        are left out by :meth:`consumer.health_tracker.RunHealthTracker.restored`, not here.
        """
        vanishing = "is_vanishing AND NOT no_gradient" if exclude_rounding else "is_vanishing"
        source = f"({rounding_rows_sql()})" if exclude_rounding else (
            "(SELECT * FROM layer_stats WHERE run_id = $run_id)")
        params = {"run_id": run_id, "to_step": None} if exclude_rounding else {
            "run_id": run_id}
        reference = nonfinite_rule == "reference"
        exploding = ("(is_exploding OR coalesce(nonfinite > nan, false))" if reference
                     else "is_exploding")
        critical = "(nonfinite > 0 AND nan IS NULL)" if reference else "nonfinite > 0"
        if exclude_rounding:  # the judged rows carry no NaN count: join it back
            source = (f"(SELECT z0.*, ls.nan FROM ({rounding_rows_sql()}) AS z0 "
                      "JOIN layer_stats AS ls ON ls.run_id = $run_id AND ls.step = z0.step "
                      "AND ls.layer_index = z0.layer_index)")
        tbl = self.con.sql(
            f"WITH z AS {source} "
            f"SELECT step, layer_index, {vanishing} AS is_vanishing, "
            f"{exploding} AS is_exploding, nonfinite > 0 AS nonfinite, "
            f"{critical} AS critical FROM z "
            f"WHERE ({vanishing}) OR {exploding} OR nonfinite > 0",
            params=params,
        ).to_arrow_table()
        return {
            name: tbl[name].to_numpy(zero_copy_only=False) for name in tbl.column_names
        }

    def load_gradient_state(self, run_id: str, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """The per-layer rounding state of a run's stored frames, for
        :meth:`consumer.health_tracker.RunHealthTracker.restored`.

        Args:
            run_id: the run. num_layers: L.

        Returns:
            ``(seen, ordinary)``, bool[L] each: the layer has a stored row; some stored row
            of it is above rounding level (``schemas.rounding``).
        """
        tbl = self.con.sql(
            f"WITH z AS ({rounding_rows_sql()}) "
            "SELECT layer_index, bool_or(NOT at_rounding) AS ordinary FROM z "
            "GROUP BY layer_index",
            params={"run_id": run_id, "to_step": None},
        ).to_arrow_table()
        idx = tbl["layer_index"].to_numpy().astype(np.int64)
        seen = np.zeros(num_layers, bool)
        ordinary = np.zeros(num_layers, bool)
        seen[idx] = True
        ordinary[idx] = tbl["ordinary"].to_numpy(zero_copy_only=False).astype(bool)
        return seen, ordinary

    def load_sums(self, run: RunInfo, step: int) -> MergedShards | None:
        """The stored merged sums of frame (run, step) over the run's layers
        (:func:`stored_sums`), or None if it is not stored."""
        tbl = self.con.sql(
            "SELECT layer_index, numel, sum_abs, sum_sq, max_abs_grad, nonfinite, nan, "
            "weight_sum_sq, update_sum_sq, exp_hist_columns, exp_hist_counts, weight_sum, "
            "weight_sum_cube, weight_sum_quad, weight_min, weight_max, weight_nonfinite, "
            "weight_exp_hist_columns, weight_exp_hist_counts "
            "FROM layer_stats WHERE run_id = $1 AND step = $2",
            params=[run.run_id, step],
        ).to_arrow_table()
        if tbl.num_rows == 0:
            return None
        idx = tbl["layer_index"].to_numpy().astype(np.int64)
        return MergedShards.empty(run.num_layers).merge_at(idx, stored_sums(tbl))

    def load_refusals(self) -> list[tuple[str, int, str]]:
        """(run id, rank, reason) of every stored refused rank (``refused_ranks``)."""
        rows = self.con.execute(
            "SELECT run_id, rank, reason FROM refused_ranks ORDER BY run_id, rank").fetchall()
        return [(str(run), int(rank), str(why)) for run, rank, why in rows]

    def load_frame_verdict(self, run_id: str, step: int) -> tuple[list[int], int]:
        """(refused ranks, number of layers whose pieces do not fit) of stored frame
        (run, step); ([], 0) when it is not stored or was stored before these columns."""
        row = self.con.execute(
            "SELECT refused_ranks, layout_violations FROM frames WHERE run_id = ? AND step = ?",
            [run_id, step],
        ).fetchone()
        if row is None:
            return [], 0
        return [int(r) for r in row[0] or ()], int(row[1] or 0)

    def load_offsets(self, group: str, topic: str) -> dict[int, int]:
        """partition -> next offset to consume, as stored for ``group`` and ``topic``."""
        rows = self.con.execute(
            "SELECT kafka_partition, next_offset FROM kafka_offsets "
            "WHERE consumer_group = ? AND topic = ?",
            [group, topic],
        ).fetchall()
        return {int(p): int(o) for p, o in rows}

    # -- the write ------------------------------------------------------------------------

    def write(self, batch: Batch, group: str) -> None:
        """Write a batch in one transaction (all of it or nothing).

        With write-behind, returns once the previous batch has committed and this one is
        handed to the writer thread (the caller must not change ``batch`` afterwards).

        Args:
            batch: rows and offsets to write.
            group: consumer group the offsets belong to.

        Raises:
            duckdb.Error: the transaction failed and was rolled back (with write-behind:
                the previous transaction, or any earlier one).
        """
        self.wait()
        if self._writer is None:
            self._write_now(batch, group)
        else:
            self._pending = self._writer.submit(self._write_now, batch, group)

    def _write_now(self, batch: Batch, group: str) -> None:
        with self.timed():
            self._transaction(batch, group)

    def _transaction(self, batch: Batch, group: str) -> None:
        con = self._wcon
        con.begin()
        try:
            if batch.runs_started:
                self._write_runs(batch.runs_started)
            if batch.frames:
                self._write_frames(list(batch.frames.values()))
            if batch.run_states:
                self._write_states(batch.run_states)
            if batch.runs_finished:
                self._write_finished(batch.runs_finished)
            if batch.local_summaries:
                self._write_local_summaries(batch.local_summaries)
            if batch.alerts:
                write_alerts(con, batch.alerts)
            if batch.refusals:
                con.executemany(  # a few rows per run at most, not per frame
                    "INSERT INTO refused_ranks VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                    [list(r) for r in batch.refusals],
                )
            if batch.offsets:
                keys = list(batch.offsets)
                offsets = pa.table({
                    "consumer_group": pa.array([group] * len(keys), pa.string()),
                    "topic": pa.array([k[0] for k in keys], pa.string()),
                    "kafka_partition": pa.array([k[1] for k in keys], pa.int32()),
                    "next_offset": pa.array(list(batch.offsets.values()), pa.int64()),
                })
                _execute_with(con, {"gs_offsets": offsets},
                              "INSERT OR REPLACE INTO kafka_offsets SELECT * FROM gs_offsets")
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def _write_runs(self, started: list[RunStarted]) -> None:
        runs = pa.table({
            "run_id": [m.run_id for m in started],
            "world_size": pa.array([m.world_size for m in started], pa.int32()),
            "num_layers": pa.array([len(m.layer_names) for m in started], pa.int32()),
            "vanishing_threshold": [m.vanishing_threshold for m in started],
            "exploding_threshold": [m.exploding_threshold for m in started],
            "host": [m.host for m in started],
            "start_time": [m.start_time for m in started],
            "config": [json.dumps(m.config, sort_keys=True, default=str) for m in started],
            "ignore_layers": pa.array(
                [list(dict.fromkeys([*m.ignore_layers, *self.ignore_layers])) or None
                 for m in started], pa.list_(pa.string())),
        })
        lengths = np.array([len(m.layer_names) for m in started])
        layers = pa.table({
            "run_id": _run_column([m.run_id for m in started], lengths),
            "layer_index": pa.array(
                np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
            ),
            "name": pa.array([n for m in started for n in m.layer_names], pa.string()),
            "numel": pa.array(np.concatenate([np.asarray(m.numel, np.int64) for m in started])),
            "dtype": pa.array(
                [d for m in started for d in (m.dtypes or [None] * len(m.layer_names))],
                pa.string(),
            ),
        })
        _execute_with(
            self._wcon, {"gs_runs": runs, "gs_layers": layers},
            "INSERT INTO runs (run_id, world_size, num_layers, vanishing_threshold, "
            "exploding_threshold, host, start_time, config, ignore_layers) SELECT run_id, "
            "world_size, num_layers, vanishing_threshold, exploding_threshold, host, "
            "start_time, config::JSON, ignore_layers FROM gs_runs ON CONFLICT DO NOTHING",
            "INSERT OR IGNORE INTO layers (run_id, layer_index, name, numel, dtype) "
            "SELECT run_id, layer_index, name, numel, dtype FROM gs_layers",
        )

    def _write_frames(self, frames: list[tuple[GradientFrame, str]]) -> None:
        fs = [f for f, _ in frames]
        lengths = np.array([len(f.layer_index) for f in fs])
        run_ids = [f.run_id for f in fs]

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(f, name) for f in fs])

        stats = pa.table({
            "run_id": _run_column(run_ids, lengths),
            "step": pa.array(np.repeat(np.array([f.step for f in fs], np.int64), lengths)),
            "layer_index": pa.array(cat("layer_index")),
            "numel": pa.array(cat("numel")),
            "sum_abs": pa.array(cat("sum_abs"), from_pandas=True),
            "sum_sq": pa.array(cat("sum_sq")),
            "max_abs_grad": pa.array(cat("max_abs_grad"), from_pandas=True),
            "nonfinite": pa.array(cat("nonfinite")),
            "mean_abs_grad": pa.array(cat("mean_abs_grad"), from_pandas=True),
            "grad_norm": pa.array(cat("grad_norm")),
            "flow_intensity": pa.array(cat("flow_intensity")),
            "is_vanishing": pa.array(cat("is_vanishing")),
            "is_exploding": pa.array(cat("is_exploding")),
            "weight_sum_sq": _optional_floats(fs, "weight_sum_sq"),
            "update_sum_sq": _optional_floats(fs, "update_sum_sq"),
            "update_to_weight": _optional_floats(fs, "update_to_weight"),
        })
        hist_columns, hist_counts = _histogram_columns(fs)
        stats = stats.append_column("exp_hist_columns", hist_columns)
        stats = stats.append_column("exp_hist_counts", hist_counts)
        for name in ("weight_sum", "weight_sum_cube", "weight_sum_quad", "weight_min",
                     "weight_max"):
            stats = stats.append_column(name, _optional_floats(fs, name))
        stats = stats.append_column("weight_zeros", _weight_zeros(fs))
        stats = stats.append_column("weight_nonfinite", _optional_ints(fs, "weight_nonfinite"))
        w_columns, w_counts = _histogram_columns(fs, "weight_exp_hist")
        stats = stats.append_column("weight_exp_hist_columns", w_columns)
        stats = stats.append_column("weight_exp_hist_counts", w_counts)
        stats = stats.append_column("nan", _optional_ints(fs, "nan"))
        now = time.time()
        frame_rows = pa.table({
            "run_id": pa.array(run_ids, pa.string()),
            "step": pa.array([f.step for f in fs], pa.int64()),
            "health": pa.array([h for _, h in frames], pa.string()),
            "num_layers": pa.array(lengths.astype(np.int32)),
            "vanishing_layers": pa.array([int(f.is_vanishing.sum()) for f in fs], pa.int32()),
            "exploding_layers": pa.array([int(f.is_exploding.sum()) for f in fs], pa.int32()),
            "nonfinite_layers": pa.array([int((f.nonfinite > 0).sum()) for f in fs], pa.int32()),
            "complete": pa.array([f.complete for f in fs], pa.bool_()),
            "ranks_seen": pa.array([list(f.ranks_seen) for f in fs], pa.list_(pa.int32())),
            "missing_ranks": pa.array([list(f.missing_ranks) for f in fs],
                                      pa.list_(pa.int32())),
            "wall_time": pa.array([f.wall_time for f in fs], pa.float64()),
            "finalized_at": pa.array(np.full(len(fs), now)),
            "refused_ranks": pa.array([sorted(f.refused_ranks) for f in fs],
                                      pa.list_(pa.int32())),
            "layout_violations": pa.array(
                [len(np.unique(f.layout_violations[:, 0])) for f in fs], pa.int32()),
        })
        nan = stats["nan"]
        summary = summarize_frames(
            lengths, cat("layer_index"), cat("numel"), cat("sum_sq"), cat("mean_abs_grad"),
            cat("nonfinite"),
            None if nan.null_count == len(nan) else nan.fill_null(-1).to_numpy(),
            cat("is_vanishing"), cat("is_exploding"))
        for name, column in summary.items():  # the frames' summaries (schemas.frame_summary)
            frame_rows = frame_rows.append_column(name, column)
        # Optional columns no frame of the batch has are left to their default (NULL)
        # instead of being converted and appended value by value.
        columns = [name for name in LAYER_STATS_COLUMNS
                   if stats[name].null_count < stats.num_rows or name in _REQUIRED_STATS]
        # A rewritten frame may report fewer layers than before: clear its old rows first.
        _execute_with(
            self._wcon, {"gs_stats": stats, "gs_frames": frame_rows},
            "DELETE FROM layer_stats USING (SELECT DISTINCT run_id, step FROM gs_frames) f "
            "WHERE layer_stats.run_id = f.run_id AND layer_stats.step = f.step",
            f"INSERT INTO layer_stats ({', '.join(columns)}) "
            f"SELECT {', '.join(columns)} FROM gs_stats",
            "INSERT OR REPLACE INTO frames BY NAME SELECT * FROM gs_frames",
            # the grid rollup's blocks holding the steps written (schemas.grid_rollup)
            *(refresh_rollup_sql("gs_frames", (f.step for f in fs)) if self.write_rollup
              else ()),
        )
        self._write_local([f for f in fs if f.local is not None and len(f.local)])
        self._write_scalars(fs)

    def _write_scalars(self, fs: list[GradientFrame]) -> None:
        """The frames' training scalars, appended: the per-rank rows and the step
        scalars with each per-rank name's step value (the frame's aggregate over its
        ranks, ``consumer.merge.frame_scalars``).

        A frame that may rewrite stored rows (``GradientFrame.rewrite``: a late rank, a
        frame the store receives again) first deletes the (run, step, rank) rows it
        carries; its step scalars keep the value stored first; and the step value of each
        per-rank name is recomputed in SQL over every rank stored for the step
        (``schemas.scalars.RANK_AGGREGATES``), since such a frame may carry only the late
        rank's rows."""
        ranked = [f for f in fs if f.rank_scalars is not None and len(f.rank_scalars)]
        stepped = [f for f in fs if f.scalars]
        if not ranked and not stepped:
            return
        tables: dict[str, pa.Table] = {}
        statements: list[str] = []
        if stepped:
            values = [{n: v for n, v in f.scalars.items()
                       if not (f.rewrite and n in _ranked_names(f))} for f in stepped]
            lengths = np.array([len(v) for v in values])
            tables["gs_step_scalars"] = pa.table({
                "run_id": _run_column([f.run_id for f in stepped], lengths),
                "step": pa.array(np.repeat([f.step for f in stepped], lengths), pa.int64()),
                "name": pa.array([n for v in values for n in v], pa.string()),
                "value": pa.array([x for v in values for x in v.values()], pa.float64()),
                "rewrite": pa.array(np.repeat([f.rewrite for f in stepped], lengths)),
            })
            # a new frame's values replace a replayed copy's; a rewrite keeps what is stored
            statements += [
                "INSERT OR REPLACE INTO step_scalars SELECT run_id, step, name, value "
                "FROM gs_step_scalars WHERE NOT rewrite",
                "INSERT OR IGNORE INTO step_scalars SELECT run_id, step, name, value "
                "FROM gs_step_scalars WHERE rewrite",
            ]
        if ranked:
            rows = [f.rank_scalars for f in ranked]
            lengths = np.array([len(r) for r in rows])  # type: ignore[arg-type]
            tables["gs_rank_scalars"] = pa.table({
                "run_id": _run_column([f.run_id for f in ranked], lengths),
                "step": pa.array(np.repeat([f.step for f in ranked], lengths), pa.int64()),
                "rank": pa.array(np.concatenate([r.rank for r in rows]).astype(np.int32)),
                "name": _names_column(rows),  # type: ignore[arg-type]
                "value": pa.array(np.concatenate([r.value for r in rows]), pa.float64()),
                "rewrite": pa.array(np.repeat([f.rewrite for f in ranked], lengths)),
            })
            if any(f.rewrite for f in ranked):
                aggregate = " ".join(f"WHEN '{name}' THEN {agg.sql}(r.value)"
                                     for name, agg in RANK_AGGREGATES.items())
                statements += [
                    "DELETE FROM rank_scalars USING (SELECT DISTINCT run_id, step, rank "
                    "FROM gs_rank_scalars WHERE rewrite) k WHERE rank_scalars.run_id = "
                    "k.run_id AND rank_scalars.step = k.step AND rank_scalars.rank = k.rank",
                    "INSERT INTO rank_scalars SELECT run_id, step, rank, name, value "
                    "FROM gs_rank_scalars",
                    "INSERT OR REPLACE INTO step_scalars SELECT r.run_id, r.step, r.name, "
                    f"CASE r.name {aggregate} ELSE {MEAN.sql}(r.value) END FROM rank_scalars r "
                    "JOIN (SELECT DISTINCT run_id, step FROM gs_rank_scalars WHERE rewrite) k "
                    "ON r.run_id = k.run_id AND r.step = k.step "
                    "GROUP BY r.run_id, r.step, r.name",
                ]
            else:
                statements.append("INSERT INTO rank_scalars SELECT run_id, step, rank, name, "
                                  "value FROM gs_rank_scalars")
        _execute_with(self._wcon, tables, *statements)

    def _write_local(self, fs: list[GradientFrame]) -> None:
        """Per-rank local view rows of ``fs``: a (run, step, rank) written again (replay,
        late rank) replaces its old rows."""
        if not fs:
            return
        parts = [f.local for f in fs if f.local is not None]
        lengths = np.array([len(p) for p in parts])

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])

        rows = pa.table({
            "run_id": _run_column([f.run_id for f in fs], lengths),
            "step": pa.array(np.repeat(np.array([f.step for f in fs], np.int64), lengths)),
            "rank": pa.array(cat("rank")),
            "layer_index": pa.array(cat("layer_index")),
            "numel": pa.array(cat("numel")),
            "sum_abs": pa.array(cat("sum_abs")),
            "sum_sq": pa.array(cat("sum_sq")),
            "max_abs_grad": pa.array(cat("max_abs")),
            "nonfinite": pa.array(cat("nonfinite")),
        })
        _execute_with(
            self._wcon, {"gs_local": rows},
            "DELETE FROM local_layer_stats USING (SELECT DISTINCT run_id, step, rank FROM "
            "gs_local) f WHERE local_layer_stats.run_id = f.run_id AND "
            "local_layer_stats.step = f.step AND local_layer_stats.rank = f.rank",
            f"INSERT INTO local_layer_stats ({', '.join(LOCAL_LAYER_STATS_COLUMNS)}) "
            f"SELECT {', '.join(LOCAL_LAYER_STATS_COLUMNS)} FROM gs_local",
        )

    def _write_local_summaries(self, messages: list[LocalSummary]) -> None:
        """The rows of flight-recorder LocalSummary messages, with their ``trigger`` and
        ``trigger_step``. A (run, step, rank, layer) written again (a replay, or the same
        row twice in the batch) keeps one row, the last one."""
        lengths = np.array([len(m.local_layer_indices) for m in messages])

        def cat(name: str, dtype: type) -> pa.Array:
            return pa.array(np.concatenate([np.asarray(getattr(m, name), dtype)
                                            for m in messages]))

        def each(values: list[Any], dtype: type) -> pa.Array:
            return pa.array(np.repeat(np.asarray(values, dtype), lengths))

        rows = pa.table({
            "run_id": _run_column([m.run_id for m in messages], lengths),
            "step": each([m.step for m in messages], np.int64),
            "rank": each([m.rank for m in messages], np.int32),
            "layer_index": cat("local_layer_indices", np.int32),
            "numel": cat("local_numel", np.int64),
            "sum_abs": cat("local_sum_abs", np.float64),
            "sum_sq": cat("local_sum_sq", np.float64),
            "max_abs_grad": cat("local_max_abs", np.float64),
            "nonfinite": cat("local_nonfinite", np.int64),
            "trigger": _run_column([m.trigger for m in messages], lengths),
            "trigger_step": each([m.trigger_step for m in messages], np.int64),
            "ord": pa.array(np.arange(int(lengths.sum()), dtype=np.int64)),
        })
        columns = ", ".join((*LOCAL_LAYER_STATS_COLUMNS, "trigger", "trigger_step"))
        _execute_with(
            self._wcon, {"gs_rlocal": rows},
            "DELETE FROM local_layer_stats USING (SELECT DISTINCT run_id, step, rank, "
            "layer_index FROM gs_rlocal) f WHERE local_layer_stats.run_id = f.run_id AND "
            "local_layer_stats.step = f.step AND local_layer_stats.rank = f.rank AND "
            "local_layer_stats.layer_index = f.layer_index",
            f"INSERT INTO local_layer_stats ({columns}) SELECT {columns} FROM gs_rlocal "
            "QUALIFY row_number() OVER (PARTITION BY run_id, step, rank, layer_index "
            "ORDER BY ord DESC) = 1",
        )

    def _write_states(self, states: dict[str, RunState]) -> None:
        ids = list(states)
        tbl = pa.table({
            "run_id": pa.array(ids, pa.string()),
            "health": pa.array([states[r].health for r in ids], pa.string()),
            "frames": pa.array([states[r].frames for r in ids], pa.int64()),
            "issue_frames": pa.array([states[r].issue_frames for r in ids], pa.int64()),
            "last_step": pa.array([states[r].last_step for r in ids], pa.int64()),
            "first_nonfinite_step": pa.array(
                [states[r].first_nonfinite_step for r in ids], pa.int64()
            ),
        })
        _execute_with(
            self._wcon, {"gs_states": tbl},
            "UPDATE runs SET health = s.health, frames = s.frames, issue_frames = "
            "s.issue_frames, last_step = s.last_step, first_nonfinite_step = "
            "s.first_nonfinite_step FROM gs_states s WHERE runs.run_id = s.run_id",
        )

    def _write_finished(self, finished: list[RunFinished]) -> None:
        tbl = pa.table({
            "run_id": pa.array([m.run_id for m in finished], pa.string()),
            "rank": pa.array([m.rank for m in finished], pa.int32()),
            "last_step": pa.array([m.last_step for m in finished], pa.int64()),
            "steps_recorded": pa.array([m.steps_recorded for m in finished], pa.int64()),
            "dropped": pa.array([m.dropped for m in finished], pa.int64()),
            "end_time": pa.array([m.end_time for m in finished], pa.float64()),
        })
        _execute_with(
            self._wcon, {"gs_finished": tbl},
            "INSERT OR REPLACE INTO run_ranks SELECT * FROM gs_finished",
            "UPDATE runs SET end_time = r.end_time FROM (SELECT run_id, max(end_time) AS "
            "end_time, count(*) AS n FROM run_ranks GROUP BY run_id) r "
            "WHERE runs.run_id = r.run_id AND r.n >= runs.world_size",
        )


class DuckDBOutput(Output):
    """Batches into a DuckDB file (:class:`DuckDBSink`): rows and offsets in one DuckDB
    transaction, committed on the sink's writer thread (write-behind); the offsets in
    DuckDB are the positions on restart, the Kafka commit only mirrors them for lag
    monitoring, once the transaction committed.

    Args:
        db: the DuckDB file (created if absent).
        group: the name the offsets are kept under (``kafka_offsets.consumer_group``).
        ignore_layers: the writing process's own ``--ignore-layers`` patterns
            (:attr:`DuckDBSink.ignore_layers`).

    Raises:
        duckdb.IOException: the file is locked by another process.
    """

    name = "duckdb"

    def __init__(self, db: str | Path, group: str, ignore_layers: Iterable[str] = ()) -> None:
        self.sink = DuckDBSink(db)
        self.sink.ignore_layers = tuple(ignore_layers)
        self.sink.timed = self.timed_write  # each transaction, on the writer thread
        self.group = group

    @classmethod
    def from_settings(cls, settings: LoopSettings) -> DuckDBOutput:
        """The output on ``settings.db``, offsets kept under ``settings.group_id``.

        Raises:
            duckdb.IOException: the file is locked by another process.
        """
        return cls(settings.db, settings.group_id, settings.ignore_layers)

    def describe(self) -> str:
        """The DuckDB file."""
        return str(self.sink.path)

    def on_open(self, hook: Callable[[Any], None]) -> None:
        """Call ``hook`` with the :class:`DuckDBSink` (a reader takes its cursor there)."""
        hook(self.sink)

    def restore(self, book: RunBook) -> KnownState:
        """Every stored run into ``book``; the stored frames, refused ranks and the
        incidents still firing.

        Raises:
            duckdb.Error: the file cannot be read.
        """
        frames = book.restore(self.sink)
        return KnownState(frames=frames, refusals=self.sink.load_refusals(),
                          incidents=load_active_incidents(self.sink.con))

    def load_sums(self, run: RunInfo, step: int) -> MergedShards | None:
        """The stored merged sums of (run, step) (:meth:`DuckDBSink.load_sums`)."""
        return self.sink.load_sums(run, step)

    def load_frame_verdict(self, run_id: str, step: int) -> tuple[list[int], int]:
        """As :meth:`DuckDBSink.load_frame_verdict`."""
        return self.sink.load_frame_verdict(run_id, step)

    def stored_offsets(self, topics: Iterable[str]) -> dict[PartitionKey, int]:
        """The offsets written with the rows, per (topic, partition)."""
        return {(topic, partition): offset for topic in topics
                for partition, offset in self.sink.load_offsets(self.group, topic).items()}

    def write(self, batch: Batch) -> None:
        """Rows and ``batch.offsets`` in one transaction.

        Raises:
            duckdb.Error: the transaction failed (rolled back).
        """
        self.sink.write(batch, self.group)

    def settle(self, wait: bool) -> bool:
        """Whether the sink's write in flight (write-behind) has committed; ``wait``: block
        until it has.

        Raises:
            duckdb.Error: that write failed (rolled back).
        """
        if wait:
            self.sink.wait()
            return True
        return self.sink.settled()

    def acknowledge(self, consumer: Any, offsets: dict[PartitionKey, int],
                    blocking: bool = True) -> None:
        """Mirror the stored offsets to Kafka (always asynchronously; a failure is only
        logged: DuckDB holds the positions)."""
        try:
            commit_offsets(consumer, offsets, sync=False)
        except Exception as exc:
            log.debug("offset commit to Kafka failed: %s", exc)

    def close(self) -> None:
        """Finish pending writes and close the file."""
        self.sink.close()
