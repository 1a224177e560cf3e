"""Housekeeping of a DuckDB store: bring what the writer keeps beside the rows up to date.

The DuckDB writer keeps, in the transaction that writes a frame's ``layer_stats`` rows,
two things derived from them that make reads of a long run cheap:

- the frame's summary in its ``frames`` row (:mod:`schemas.frame_summary`), from which a
  report is O(layers + frames) instead of a scan of every row;
- the grid rollup (:mod:`schemas.grid_rollup`), per layer over aligned blocks of steps,
  from which the heatmap reads a few blocks per column instead of every row.

A store written before these existed, or rows written by another program, has neither
for those frames. The readers notice it (``analysis.report.frames_summarise``,
``analysis.plots.grid._rollup_fresh``) and read the rows instead: the same answers,
slower. :func:`upgrade_store` gives such a store both, in four steps:

1. the current schema (:data:`schemas.tables.SCHEMA_DDL`: the summary columns and the
   rollup table are added where missing);
2. a summary for every ``frames`` row without one (:func:`~schemas.frame_summary.
   fill_frame_summaries`, whole frames a bounded chunk at a time);
3. the rollup rebuilt from the rows (:func:`~schemas.grid_rollup.fill_rollup`) for each run
   whose rollup does not hold every row of the run once per level;
4. a checkpoint, so that the next reader opens a compact file.

Each step is idempotent and each statement atomic: an upgrade interrupted at any point is
finished by running it again. It needs the store to itself (DuckDB lets one process open a
file for writing): stop the consumer that writes it first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import duckdb

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as the upgrade advances (for a progress bar)."""

_STALE_ROLLUP_SQL = """
    WITH stored AS (
        SELECT run_id, count(*) AS n FROM layer_stats {where} GROUP BY run_id),
    rolled AS (
        SELECT run_id, level, sum(rows) AS n FROM layer_stats_rollup {where}
        GROUP BY run_id, level)
    SELECT s.run_id FROM stored AS s
    WHERE (SELECT count(*) FROM rolled AS r
           WHERE r.run_id = s.run_id AND r.n = s.n) < $levels
    UNION
    SELECT DISTINCT r.run_id FROM rolled AS r
    WHERE r.run_id NOT IN (SELECT run_id FROM stored)
    ORDER BY 1
"""
"""The runs whose rollup does not stand for their rows: some level does not hold the run's
``layer_stats`` row count (a missing level holds none), or the run has rollup rows but no
``layer_stats`` rows left."""


@dataclass(frozen=True)
class UpgradeReport:
    """What :func:`upgrade_store` did.

    Attributes:
        summaries_filled: ``frames`` rows given a summary.
        runs_rolled_up: the runs whose rollup was rebuilt, in code-point order.
        rollup_rows: rollup rows those runs now hold (every level).
    """

    summaries_filled: int
    runs_rolled_up: tuple[str, ...]
    rollup_rows: int

    def summary(self) -> str:
        """One line for the terminal, e.g. ``"frame summaries: 100 frames filled; grid
        rollup: 2 runs rebuilt (4,352 rows)"``."""
        runs = len(self.runs_rolled_up)
        rollup = (f"{runs} run{'s' if runs != 1 else ''} rebuilt ({self.rollup_rows:,} rows)"
                  if runs else "up to date")
        filled = (f"{self.summaries_filled:,} frame{'s' if self.summaries_filled != 1 else ''}"
                  " filled" if self.summaries_filled else "up to date")
        return f"frame summaries: {filled}; grid rollup: {rollup}"


def stale_rollup_runs(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> list[str]:
    """The runs (only ``run_id`` if given) whose grid rollup does not stand for their
    ``layer_stats`` rows (:data:`_STALE_ROLLUP_SQL`), in code-point order.

    Raises:
        duckdb.Error: the store lacks ``layer_stats`` or the rollup table (run the DDL).
    """
    from schemas.grid_rollup import ROLLUP_LEVELS

    where = "" if run_id is None else "WHERE run_id = $run_id"
    params: dict[str, object] = {"levels": len(ROLLUP_LEVELS)}
    if run_id is not None:
        params["run_id"] = run_id
    return [r[0] for r in con.execute(_STALE_ROLLUP_SQL.format(where=where), params).fetchall()]


def upgrade_store(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                  progress: Progress | None = None) -> UpgradeReport:
    """Give a store's frames their summaries and its runs their grid rollup (module doc).

    Args:
        con: a writable connection to the store, held by no other process.
        run_id: only this run; None: every run.
        progress: called with ``(what, done, total)`` before and after each step and run.

    Returns:
        What was done (:class:`UpgradeReport`); an up-to-date store gives zeros.

    Raises:
        duckdb.Error: the file is not a gradstream store (no ``frames`` or ``layer_stats``)
            or a statement failed (the steps done so far stay done).
    """
    from schemas.frame_summary import fill_frame_summaries
    from schemas.grid_rollup import fill_rollup
    from schemas.tables import SCHEMA_DDL

    def tell(what: str, done: int, total: int) -> None:
        if progress is not None:
            progress(what, done, total)

    # 1. The current schema.
    tell("updating the schema", 0, len(SCHEMA_DDL))
    for statement in SCHEMA_DDL:
        con.execute(statement)
    # 2. Summaries of the frames without one.
    tell("summarising frames", 0, 1)
    filled = fill_frame_summaries(con, run_id)
    tell("summarising frames", 1, 1)
    # 3. The rollup of the runs it does not stand for.
    stale = stale_rollup_runs(con, run_id)
    rows = 0
    for done, run in enumerate(stale):
        tell(f"rolling up run {run}", done, len(stale))
        rows += fill_rollup(con, run)
    tell("rolling up runs", len(stale), len(stale))
    # 4. A compact file for the next reader.
    con.execute("CHECKPOINT")
    return UpgradeReport(filled, tuple(stale), rows)
