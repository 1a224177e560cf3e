"""The grid rollup: ``layer_stats`` pre-aggregated over aligned blocks of steps, per layer.

The layers x steps grid (``analysis.plots.grid.load_grid``) keeps, per cell, the maximum
gradient norm and flow intensity over a bin of consecutive recorded frames and the OR of
the row flags. Maximum and OR are associative and idempotent, so a bin's value is the
same whether it is taken over its rows or over any blocks of rows that together hold
exactly the bin's rows. The writer therefore also stores, per run and layer, those values
over aligned blocks of optimiser steps, in ``layer_stats_rollup``:

- a block of level ``L`` (:data:`ROLLUP_LEVELS`) is ``block = step >> L``: the steps
  ``[block * 2^L, (block + 1) * 2^L - 1]``, whichever of them were recorded (a run that
  records every 10th step has about 1.6 frames in a 16-step block);
- ``max_norm`` / ``max_flow``: the maximum ``grad_norm`` / ``flow_intensity`` of the
  layer's rows in the block (DuckDB's order: NaN above every number, as the grid's
  ``max`` over the rows); ``flags``: the OR of :func:`row_flag_bits_sql` over them;
  ``rows``: how many rows the block holds (the reader's consistency check).

Blocks are over step numbers, not frame ordinals, so a frame that arrives out of step
order changes only the blocks holding its step. The DuckDB writer refreshes, in the
transaction that writes a batch's frames, every block holding a step of the batch
(:func:`refresh_rollup_sql`): the finest level from the rows, each coarser level from the
blocks of the level below; a rewritten frame (a late rank) is refreshed the same way. A
store built by another program gets its rollup from :func:`fill_rollup`.

A grid bin covers a block when the block's steps lie inside the bin's (the bin owning
the steps from its first frame up to the next bin's first frame): the reader takes the
coarsest covered block at each step and reads the rows themselves only where no block is
covered (the bins' edges). It does so only when the store's ``layer_stats`` rows, the
rows its ``frames`` count and the rows each level holds are the same number (store-wide,
the row count from DuckDB's table metadata), and it checks that the rows it aggregated,
from blocks and rows, are the rows the range's frames list; otherwise it reads every row
(a store without the rollup or with runs not filled, an Iceberg store, rows written by
another program).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from schemas.flags import FLAG_EXPLODING, FLAG_NONFINITE, FLAG_VANISHING, predicate

if TYPE_CHECKING:
    import duckdb

ROLLUP_TABLE = "layer_stats_rollup"
"""The rollup's table (:data:`schemas.tables.CREATE_TABLES`)."""

ROLLUP_LEVELS: tuple[int, ...] = (4, 8, 12)
"""Block sizes ``2^L`` steps, finest first: 16, 256 and 4,096 steps. The finest sets the
rollup's size (about 1/16 of the rows, plus 1/16 of that per coarser level) and the
width of the bins' edges read from the rows (at most 15 steps each side of a bin); each
coarser level is 16 blocks of the one below, so that a bin of many frames (a long run on
a narrow picture) reads at most 15 blocks of each level each side, whatever its length."""

ROLLUP_DDL = f"""
    CREATE TABLE IF NOT EXISTS {ROLLUP_TABLE} (
        run_id      VARCHAR NOT NULL,
        level       UTINYINT NOT NULL,
        block       BIGINT NOT NULL,
        layer_index INTEGER NOT NULL,
        rows        BIGINT NOT NULL,
        max_norm    DOUBLE NOT NULL,
        max_flow    DOUBLE NOT NULL,
        flags       UTINYINT NOT NULL
    )
"""
"""The rollup table (module doc); unique on (run_id, level, block, layer_index) without
an index, as ``layer_stats``: a refresh deletes a block's rows, then inserts them."""


def row_flag_bits_sql(row: str = "") -> str:
    """A ``layer_stats`` row's FLAG_VANISHING | FLAG_EXPLODING | FLAG_NONFINITE bits
    (``schemas.flags``), an INTEGER SQL expression; a NULL flag counts as unset, as
    ``bool_or`` ignores NULL, so ``bit_or`` over rows gives "any row has the flag".

    Args:
        row: the table alias of the row (``""``: bare column names).
    """
    return " | ".join(
        f"CASE WHEN {predicate(name, row)} THEN {bit} ELSE 0 END"
        for name, bit in (("vanishing", FLAG_VANISHING), ("exploding", FLAG_EXPLODING),
                          ("nonfinite", FLAG_NONFINITE))
    )


def _from_rows(level: int, where: str) -> str:
    """INSERT of level ``level``'s blocks aggregated from ``layer_stats`` rows (``s``)
    meeting ``where``."""
    return f"""
    INSERT INTO {ROLLUP_TABLE}
    SELECT s.run_id, {level}, s.step >> {level} AS block, s.layer_index, count(*),
           max(s.grad_norm), max(s.flow_intensity), bit_or({row_flag_bits_sql("s")})
    FROM layer_stats AS s WHERE {where}
    GROUP BY s.run_id, block, s.layer_index
    """


def _from_blocks(level: int, below: int, where: str) -> str:
    """INSERT of level ``level``'s blocks aggregated from level ``below``'s (``r``) meeting
    ``where``."""
    return f"""
    INSERT INTO {ROLLUP_TABLE}
    SELECT r.run_id, {level}, r.block >> {level - below} AS parent, r.layer_index,
           sum(r.rows), max(r.max_norm), max(r.max_flow), bit_or(r.flags)
    FROM {ROLLUP_TABLE} AS r WHERE r.level = {below} AND {where}
    GROUP BY r.run_id, parent, r.layer_index
    """


def _ranges(blocks: set[int]) -> list[tuple[int, int]]:
    """``blocks`` as ascending runs of consecutive numbers ``(first, last)``."""
    out: list[tuple[int, int]] = []
    for block in sorted(blocks):
        if out and block == out[-1][1] + 1:
            out[-1] = (out[-1][0], block)
        else:
            out.append((block, block))
    return out


def _within(column: str, ranges: list[tuple[int, int]], shift: int) -> str:
    """SQL: ``column`` lies in one of the block ``ranges`` scaled by ``2^shift`` (ranges of
    constants: DuckDB skips the row groups whose min/max statistics miss them all)."""
    return "(" + " OR ".join(
        f"{column} BETWEEN {a << shift} AND {((b + 1) << shift) - 1}" for a, b in ranges) + ")"


def refresh_rollup_sql(keys: str, steps: Iterable[int]) -> tuple[str, ...]:
    """The statements that recompute every rollup block holding one of ``keys``' steps
    from the stored rows, to run in order in the transaction that wrote the rows, after
    them: per level, finest first, the blocks are deleted and inserted again, the finest
    from ``layer_stats``, each coarser one from the level below.

    Args:
        keys: a relation (registered table name) with columns ``run_id``, ``step``: the
            (run, step) frames written or rewritten.
        steps: the steps of ``keys``: each statement is bounded by the step ranges of the
            affected blocks, so that DuckDB reads only the row groups that may hold them
            (a batch of new frames and a late rank's frame far back read two places).

    Returns:
        Two statements per level of :data:`ROLLUP_LEVELS` (they raise ``duckdb.Error`` on
        a store without the rollup table: run ``schemas.tables.SCHEMA_DDL`` first).
    """
    written = set(steps)
    statements: list[str] = []
    below: int | None = None
    for level in ROLLUP_LEVELS:
        ranges = _ranges({step >> level for step in written})
        blocks = f"(SELECT DISTINCT run_id, step >> {level} AS block FROM {keys})"
        statements.append(
            f"DELETE FROM {ROLLUP_TABLE} AS r USING {blocks} AS k "
            f"WHERE r.level = {level} AND {_within('r.block', ranges, 0)} "
            "AND r.run_id = k.run_id AND r.block = k.block")
        if below is None:
            statements.append(_from_rows(level, (
                f"{_within('s.step', ranges, level)} "
                f"AND (s.run_id, s.step >> {level}) IN (SELECT run_id, block FROM {blocks})")))
        else:
            shift = level - below
            statements.append(_from_blocks(level, below, (
                f"{_within('r.block', ranges, shift)} "
                f"AND (r.run_id, r.block >> {shift}) IN (SELECT run_id, block FROM {blocks})")))
        below = level
    return tuple(statements)


def fill_rollup(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> int:
    """Rebuild the rollup of a run (None: every run) from its ``layer_stats`` rows: for a
    store built by another program or before the rollup existed (the DuckDB writer keeps
    it itself, :func:`refresh_rollup_sql`).

    Args:
        con: a writable connection to a store (the rollup table is created when missing).
        run_id: only this run; None: every run.

    Returns:
        The number of rollup rows of the run(s) (every level).

    Raises:
        duckdb.Error: the store has no ``layer_stats`` table.
    """
    con.execute(ROLLUP_DDL)
    params = {} if run_id is None else {"run_id": run_id}

    def only(alias: str) -> str:
        return "true" if run_id is None else f"{alias}.run_id = $run_id"

    con.execute(f"DELETE FROM {ROLLUP_TABLE} AS r WHERE {only('r')}", params)
    below: int | None = None
    for level in ROLLUP_LEVELS:
        if below is None:
            con.execute(_from_rows(level, only("s")), params)
        else:
            con.execute(_from_blocks(level, below, only("r")), params)
        below = level
    row = con.execute(f"SELECT count(*) FROM {ROLLUP_TABLE} AS r WHERE {only('r')}",
                      params).fetchone()
    return 0 if row is None else int(row[0])
