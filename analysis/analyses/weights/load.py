"""SQL of the weight analysis: reads the per-layer weight sums of a run from the store.

The producer sends, with ``weight_stats=True`` (``GRADSTREAM_WEIGHT_STATS=1``; off by
default), per layer and step exactly mergeable sums over the finite weights
(``layer_stats``: ``weight_sum`` = sum w, ``weight_sum_sq``, ``weight_sum_cube``,
``weight_sum_quad``, ``weight_min``, ``weight_max``, ``weight_zeros``, ``weight_nonfinite``
and the base-2 exponent histogram of |w|), with ``numel - weight_nonfinite`` finite
weights, and the update norm ``update_sum_sq`` = ``||w_t - w_prev||^2``. The analysis
reads at most two steps of sums plus one aggregate of the update norms in between.

Replicated parameters. Ranks merge like gradients: a tensor sharded over the ranks (FSDP)
is summed shard by shard into the whole tensor, while a data-parallel replica (DDP: every
rank holds the whole tensor) is summed once per rank, so a row then holds ``R`` identical
copies, ``R = numel / full numel`` (``numel`` of ``layer_stats`` against ``layers``).
:func:`fetch_step` returns the stored sums as a :class:`schemas.stats.WeightMoments` with
``R`` per row, and :meth:`StepWeights.one_copy` divides every count and sum by ``R``
(:meth:`schemas.stats.LayerStatistic.per_copy`), which gives one copy's statistics exactly
(moments, count, zero fraction, histogram); the update norms are divided here in SQL. A
row of a sharded tensor has ``R = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from analysis.read.connect import StoreError
from analysis.read.sql import layer_name, step_range
from schemas.stats import WEIGHT_POWER_SUMS, WeightMoments, csr_from_lists

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "WEIGHT_COLUMNS",
    "StepWeights",
    "fetch_step",
    "first_nonfinite",
    "require_weight_columns",
    "update_paths",
    "weight_step_range",
]

WEIGHT_COLUMNS: tuple[str, ...] = (
    "weight_sum", "weight_sum_sq", "weight_sum_cube", "weight_sum_quad", "weight_min",
    "weight_max", "weight_nonfinite", "weight_exp_hist_columns",
    "weight_exp_hist_counts", "update_sum_sq",
)
"""``layer_stats`` columns the weight analysis reads (``schemas.tables``)."""

_RANGE_SQL = f"""
    SELECT min(step), max(step) FROM layer_stats
    WHERE run_id = $run_id AND {step_range()} AND weight_sum IS NOT NULL
"""

_REPLICAS = (
    "CASE WHEN {l}.numel > 0 AND {s}.numel >= {l}.numel AND {s}.numel % {l}.numel = 0 "
    "THEN ({s}.numel // {l}.numel)::DOUBLE ELSE 1.0 END"
)
"""Copies of the tensor merged into a ``layer_stats`` row (SQL over aliases ``s``/``l``):
``numel`` over the layer's full ``numel`` from ``RunStarted`` when that is a whole number,
else 1 (a sharded tensor, or a partial frame of one)."""

_STEP_SQL = f"""
    SELECT s.layer_index,
           {layer_name("s")} AS name,
           {_REPLICAS.format(s="s", l="l")} AS replicas,
           s.numel, coalesce(s.weight_nonfinite, 0) AS weight_nonfinite,
           s.weight_sum, s.weight_sum_sq, s.weight_sum_cube, s.weight_sum_quad,
           s.weight_min, s.weight_max, s.weight_exp_hist_columns, s.weight_exp_hist_counts
    FROM layer_stats AS s
    LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
    WHERE s.run_id = $run_id AND s.step = $step AND s.weight_sum IS NOT NULL
    ORDER BY s.layer_index
"""

_PATH_SQL = f"""
    SELECT s.layer_index, sum(sqrt(s.update_sum_sq / {_REPLICAS.format(s="s", l="l")})) AS path,
           count(*) FILTER (WHERE s.update_sum_sq IS NULL) AS missing,
           avg(s.update_to_weight) FILTER (WHERE isfinite(s.update_to_weight)) AS ratio
    FROM layer_stats AS s
    LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
    WHERE s.run_id = $run_id AND s.step > $a AND s.step <= $b
    GROUP BY s.layer_index
"""


_FIRST_NONFINITE_SQL = f"""
    WITH first AS (
        SELECT min(step) AS step FROM layer_stats
        WHERE run_id = $run_id AND weight_nonfinite > 0 AND {step_range()}
    )
    SELECT first.step, list({layer_name("s")} ORDER BY s.layer_index)
    FROM first
    JOIN layer_stats AS s ON s.run_id = $run_id AND s.step = first.step
    LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
    WHERE s.weight_nonfinite > 0
    GROUP BY first.step
"""


def require_weight_columns(con: duckdb.DuckDBPyConnection) -> None:
    """Check that the store's ``layer_stats`` has every column of :data:`WEIGHT_COLUMNS`.

    Raises:
        StoreError: some are missing (a store written before weight statistics existed);
            the message names them and says how to add them.
    """
    present = {
        row[0] for row in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = 'layer_stats' "
            "AND database_name = current_database()"
        ).fetchall()
    }
    missing = [c for c in WEIGHT_COLUMNS if c not in present]
    if missing:
        raise StoreError(
            "this store was written before weight distribution statistics existed (missing "
            f"layer_stats columns: {', '.join(missing)}); a current `gradstream consume` "
            "adds them when it opens the store"
        )


def weight_step_range(con: duckdb.DuckDBPyConnection, params: dict[str, object]) -> tuple[int, int]:
    """First and last step with weight statistics in the range.

    Args:
        con: connection or cursor on the store.
        params: ``{"run_id", "from_step", "to_step"}`` from
            :func:`analysis.read.sql.stats_params` (inclusive bounds, ``None`` = open).

    Returns:
        ``(first, last)`` optimiser steps, ``first <= last``.

    Raises:
        StoreError: no step in the range has weight statistics (the message says how to
            record them).
    """
    first, last = con.execute(_RANGE_SQL, params).fetchall()[0]
    if last is None:
        raise StoreError(
            f"run {params['run_id']!r} has no weight statistics in the step range: record "
            "them with GradientProducer(..., weight_stats=True) or GRADSTREAM_WEIGHT_STATS=1 "
            "and pass weights= to record_step"
        )
    return int(first), int(last)


@dataclass(frozen=True, slots=True)
class StepWeights:
    """The stored weight statistics of every layer with weight statistics at one step, in
    model order (``L`` layers).

    Attributes:
        layer_index: int64[L] layer indices.
        name: object[L] layer names (str; ``layer[i]`` when the layer has no name).
        replicas: float64[L] copies of the tensor merged into each row, ``R >= 1``
            (module docstring).
        moments: the rows' weight distributions as stored (``R`` copies of a replicated
            tensor), :class:`schemas.stats.WeightMoments` over ``L`` layers.
    """

    layer_index: np.ndarray
    name: np.ndarray
    replicas: np.ndarray
    moments: WeightMoments

    def one_copy(self) -> WeightMoments:
        """The statistics of one copy of each tensor: every count and sum divided by
        :attr:`replicas` (:meth:`schemas.stats.LayerStatistic.per_copy`; float64 counts,
        for reading with ``get``, ``pooled`` and the parts' arrays, not for merging)."""
        return self.moments.per_copy(self.replicas)


def fetch_step(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> StepWeights:
    """The stored weight statistics of every layer with weight statistics at ``step``.

    Reads ``numel``, ``weight_nonfinite``, the power sums ``weight_sum`` ..
    ``weight_sum_quad``, ``weight_min``, ``weight_max`` and the exponent histogram list
    columns of ``layer_stats`` with each row's replica count, and builds one
    :class:`schemas.stats.WeightMoments` over the rows.

    Returns:
        The :class:`StepWeights` (no layer when none has weight statistics at ``step``).

    Raises:
        StoreError: rows whose exponent histogram disagrees with their finite weight count
            (the wire and the worker never store such rows).
    """
    raw = con.sql(_STEP_SQL, params={"run_id": run_id, "step": step}).fetchnumpy()

    def floats(key: str) -> np.ndarray:
        column = raw[key]
        if np.ma.isMaskedArray(column):
            return column.astype(np.float64).filled(np.nan)
        return np.asarray(column, dtype=np.float64)

    hist_offsets, hist_columns = csr_from_lists(raw["weight_exp_hist_columns"].tolist())
    _, hist_counts = csr_from_lists(raw["weight_exp_hist_counts"].tolist())
    try:
        moments = WeightMoments.from_columns(
            np.asarray(raw["numel"], np.int64), np.asarray(raw["weight_nonfinite"], np.int64),
            hist_offsets, hist_columns, hist_counts,
            **{name: floats(column) for name, column in WEIGHT_POWER_SUMS.items()},
        )
    except ValueError as exc:
        raise StoreError(
            f"run {run_id!r} has inconsistent weight statistics at step {step}: {exc}"
        ) from exc
    return StepWeights(
        layer_index=np.asarray(raw["layer_index"], np.int64),
        name=np.asarray(raw["name"].tolist(), dtype=object),
        replicas=np.asarray(raw["replicas"], np.float64),
        moments=moments,
    )


def update_paths(
    con: duckdb.DuckDBPyConnection, run_id: str, a: int, b: int
) -> dict[int, tuple[float | None, int, float | None]]:
    """Per layer, the updates recorded at the steps in ``(a, b]``.

    Returns:
        ``layer_index -> (path, missing, ratio)``: ``path`` = sum of the update norms
        ``||w_t - w_prev||`` of one copy of the tensor (``None`` if no step has one);
        ``missing`` = steps without an update norm; ``ratio`` = mean of the finite
        ``update_to_weight`` ratios (``None`` or NaN without any). Layers without rows in
        the range are absent.
    """
    return {
        int(index): (path, missing, ratio)
        for index, path, missing, ratio in con.execute(
            _PATH_SQL, {"run_id": run_id, "a": a, "b": b}
        ).fetchall()
    }


def first_nonfinite(
    con: duckdb.DuckDBPyConnection, params: dict[str, object]
) -> tuple[int | None, list[str]]:
    """The first step in the range at which some layer had NaN/Inf weights.

    Args:
        con: connection or cursor on the store.
        params: as for :func:`weight_step_range`.

    Returns:
        ``(step, layer names in model order)``, or ``(None, [])`` if no layer had any.
    """
    rows = con.execute(_FIRST_NONFINITE_SQL, params).fetchall()
    if not rows:
        return None, []
    return int(rows[0][0]), list(rows[0][1])
