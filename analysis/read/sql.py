"""SQL fragments shared by every query of the store, written once: one run's statistics in
a step range (:data:`STATS_SQL`, bound with :func:`stats_params`), the inclusive
step-range filter (:func:`step_range`), the layer-name expression (:func:`layer_name`) and
step bucketing (:func:`step_buckets`)."""

from __future__ import annotations

from analysis.read.connect import check_step_range


def step_range(table: str = "") -> str:
    """The inclusive step-range filter on ``<table>.step``: ``$from_step``/``$to_step``
    bind the bounds, ``NULL`` meaning open (:func:`stats_params`).

    Args:
        table: the table alias qualifying ``step`` (``""``: unqualified).

    Returns:
        A boolean SQL expression, to ``AND`` into a ``WHERE`` clause.
    """
    column = f"{table}.step" if table else "step"
    return (f"($from_step IS NULL OR {column} >= $from_step) "
            f"AND ($to_step IS NULL OR {column} <= $to_step)")


def layer_name(table: str, names: str = "l") -> str:
    """The layer's name from ``layers`` (alias ``names``, LEFT JOINed), or ``layer[i]``
    from ``<table>.layer_index`` when the run recorded no name for it.

    Returns:
        A VARCHAR SQL expression.
    """
    return (f"coalesce({names}.name, "
            f"'layer[' || CAST({table}.layer_index AS VARCHAR) || ']')")


def step_buckets(source: str, max_buckets: str) -> str:
    """Step bucketing: the distinct steps of relation ``source`` numbered in order and put,
    ``k`` consecutive steps at a time, into at most ``$<max_buckets>`` buckets
    (``k = ceil(n_frames / $<max_buckets>)``, at least 1).

    Args:
        source: a relation (CTE) with a ``step`` column.
        max_buckets: the name of the named parameter binding the bucket count (> 0).

    Returns:
        Common table expressions to follow ``WITH ... ,``: ``steps(step, col, n_frames)``,
        ``k(k)`` and ``bucketed(step, bucket, n_frames, k)`` (``bucket = col // k``, from 0).
    """
    return f"""
    steps AS (
        SELECT step,
               row_number() OVER (ORDER BY step) - 1 AS col,
               count(*) OVER () AS n_frames
        FROM (SELECT DISTINCT step FROM {source})
    ),
    k AS (SELECT coalesce(max(ceil(n_frames / ${max_buckets})::BIGINT), 1) AS k FROM steps),
    bucketed AS (
        SELECT steps.step, steps.col // k.k AS bucket, steps.n_frames, k.k
        FROM steps, k
    )"""


STATS_SQL = f"""
    SELECT s.*, {layer_name("s")} AS name
    FROM layer_stats AS s
    LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
    WHERE s.run_id = $run_id AND {step_range("s")}
"""
"""Relation of one run's ``layer_stats`` rows in an inclusive step range, with the layer
``name`` joined from ``layers`` (``layer[i]`` if the name is missing). Bind it with
:func:`stats_params`; use it as a CTE."""


def stats_params(
    run_id: str, from_step: int | None = None, to_step: int | None = None
) -> dict[str, object]:
    """Named parameters for :data:`STATS_SQL` and :func:`step_range` (``$run_id``,
    ``$from_step``, ``$to_step``).

    Raises:
        StoreError: invalid step range (see
            :func:`analysis.read.connect.check_step_range`).
    """
    check_step_range(from_step, to_step)
    return {"run_id": run_id, "from_step": from_step, "to_step": to_step}
