"""The reference's values of layers with NaN/Inf gradient elements.

gradstream leaves non-finite elements out of the sums and the maximum and counts them
(``layer_stats.nonfinite``); the reference (trustformers-debug, module ``gradient_flow``)
sums every element in f64, so that its values of such a layer are:

- ``mean_abs_grad = sum |g| / n``: NaN when some element is NaN (NaN + x is NaN), else
  +inf when some element is +-Inf;
- ``max_abs_grad = fold(0.0, f64::max)`` over ``|g|``: ``f64::max`` ignores a NaN operand,
  so NaN elements never count; +inf when some element is +-Inf, else the finite maximum
  (0.0 for a layer of NaN only);
- ``grad_norm = sqrt(sum g*g)``: NaN when some element is NaN, else +inf when some element
  is +-Inf, else the finite norm (itself +inf when the float64 sum of squares overflowed);
- ``is_vanishing = mean < threshold``: false for both (NaN compares false, inf is not
  below); ``is_exploding = max > threshold``: true with an Inf element;
- ``flow_intensity = clamp(norm / top, 0, 1)`` where ``top`` is the step's largest norm
  with NaN norms ignored (``f64::max``), 0 when ``top`` is not above 0; ``clamp`` keeps a
  NaN, so a NaN norm, and an inf norm when ``top`` is inf (inf / inf), give a NaN
  intensity, and every finite norm of a step whose ``top`` is inf gives 0.

The sign of an Inf does not matter (only ``|g|`` and ``g*g`` enter), so the finite sums
and maximum, the count of non-finite elements and the count of NaN among them
(``layer_stats.nan``; Inf = ``nonfinite - nan``) determine every value.
:func:`reference_stats_sql` rebuilds them in SQL; rows without non-finite elements keep
their stored values, which are the reference's already (``consumer.frames``).

Used by the reference presentation styles (``export --style reference``, ``report
--heatmap-style reference``) and by the report's ``nonfinite_rule="reference"``
(``schemas.health.NONFINITE_VERDICTS``). A row with ``nonfinite > 0`` whose NaN count is
unknown (sent by an older producer: ``nan`` NULL, or a store without the column) cannot be
rebuilt: :func:`require_nan_split` raises a :class:`analysis.read.connect.StoreError` naming
the first such row rather than guessing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from analysis.read.connect import StoreError, has_column
from analysis.read.sql import STATS_SQL

if TYPE_CHECKING:
    import duckdb


def has_nan_column(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store's ``layer_stats`` has the ``nan`` column (an older store lacks
    it)."""
    return has_column(con, "layer_stats", "nan")


def reference_stats_sql(with_nan: bool = True) -> str:
    """:data:`analysis.read.sql.STATS_SQL` with the reference's values of the
    rows holding NaN/Inf elements (module doc): ``mean_abs_grad``, ``max_abs_grad``,
    ``grad_norm``, ``is_exploding`` replaced on those rows, ``flow_intensity`` on every
    row of a step holding one; every other row and column as stored. Same parameters as
    ``STATS_SQL`` (:func:`analysis.read.sql.stats_params`); use it as a CTE. Call
    :func:`require_nan_split` first: a row whose NaN count is unknown is taken here as
    holding only Inf elements.

    Args:
        with_nan: the store's ``layer_stats`` has the ``nan`` column
            (:func:`has_nan_column`); False reads every NaN count as unknown.
    """
    nan = "s0.nan" if with_nan else "NULL::BIGINT"
    return f"""
    SELECT * EXCLUDE (gs_nan, gs_inf, gs_bad, gs_top, gs_step_bad, gs_norm_ref) REPLACE (
        CASE WHEN gs_nan THEN 'nan'::DOUBLE WHEN gs_inf THEN 'inf'::DOUBLE
             ELSE mean_abs_grad END AS mean_abs_grad,
        CASE WHEN gs_inf THEN 'inf'::DOUBLE ELSE max_abs_grad END AS max_abs_grad,
        CASE WHEN gs_nan THEN 'nan'::DOUBLE WHEN gs_inf THEN 'inf'::DOUBLE
             ELSE grad_norm END AS grad_norm,
        is_exploding OR gs_inf AS is_exploding,
        CASE WHEN NOT gs_step_bad THEN flow_intensity
             WHEN NOT coalesce(gs_top > 0, false) THEN 0.0  -- no norm above 0 but NaN
             WHEN gs_nan THEN 'nan'::DOUBLE
             WHEN isnan(gs_norm_ref / gs_top) THEN 'nan'::DOUBLE
             ELSE least(greatest(gs_norm_ref / gs_top, 0.0), 1.0) END AS flow_intensity
    )
    FROM (
        SELECT *,
               max(gs_norm_ref) FILTER (WHERE NOT gs_nan) OVER (PARTITION BY step) AS gs_top,
               bool_or(gs_bad) OVER (PARTITION BY step) AS gs_step_bad
        FROM (
            SELECT *,
                   CASE WHEN gs_nan THEN 'nan'::DOUBLE WHEN gs_inf THEN 'inf'::DOUBLE
                        ELSE grad_norm END AS gs_norm_ref
            FROM (
                SELECT s0.*,
                       s0.nonfinite > 0 AS gs_bad,
                       s0.nonfinite > 0 AND coalesce({nan}, 0) > 0 AS gs_nan,
                       s0.nonfinite > coalesce({nan}, 0) AS gs_inf
                FROM ({STATS_SQL}) AS s0
            )
        )
    )
    """


def require_nan_split(con: duckdb.DuckDBPyConnection, params: dict[str, object],
                      what: str) -> None:
    """Refuse a step range holding a row with NaN/Inf elements whose NaN count is unknown.

    Args:
        con: a store connection. params: :func:`analysis.read.sql.stats_params` of the range.
        what: the output asked for, quoted in the error (``"export --style reference"``).

    Raises:
        StoreError: such a row exists; the message names the first (step, layer), says
            why (stored by an older version, or sent by an older producer) and what to
            do instead.
    """
    nan = "s.nan" if has_nan_column(con) else "NULL::BIGINT"
    row = con.execute(
        f"SELECT step, name, count(*) OVER () FROM ({STATS_SQL}) AS s "
        f"WHERE s.nonfinite > 0 AND {nan} IS NULL ORDER BY step, layer_index LIMIT 1",
        params,
    ).fetchone()
    if row is None:
        return
    step, name, count = row
    raise StoreError(
        f"{what}: run {params['run_id']!r} has {count} layer row(s) with NaN/Inf gradient "
        f"elements whose NaN count is unknown (first: step {step}, layer {name!r}): they "
        "were stored before wire schema 1.7 or sent by an older producer, so the reference "
        "implementation's values, in which a NaN and an Inf act differently, cannot be "
        "rebuilt. Use gradstream's presentation (the default style, --nonfinite-rule "
        "critical), or a step range without those rows."
    )
