"""The training-scalars section of the run summary (:class:`TrainingScalars`), computed by
DuckDB from ``step_scalars`` and ``rank_scalars`` in one statement.

What the producers send beside the gradients (``schemas.scalars``): per rank the loss,
tokens, samples, step and compute times; per step the learning rates and the AMP loss
scale. The store keeps each per-rank scalar's value for the step (the mean loss, the slowest
rank's times, ``schemas.scalars.RANK_AGGREGATES``) in ``step_scalars`` and the ranks' own
values in ``rank_scalars`` (``schemas.tables``). The section summarises, over the report's
step range: the loss (first, last and lowest finite value with their steps, the steps whose
loss is NaN/Inf and the ranks whose own loss was at the first of them), the loss-scale
decreases (AMP's dynamic loss scaling backs off by lowering the scale when a step's
gradients overflow: PyTorch ``torch.amp.GradScaler``), the median step and compute times,
and the rank with the highest median compute time against the median of the other ranks'
medians (a straggler: under data parallelism every rank waits for it at the all-reduce).

A store written before the training-scalar tables existed, and never opened by a newer
writer, lacks them: it has no section (:func:`training_scalars` returns ``None``), as does
a run whose producers sent no scalar in the range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from analysis.read.connect import has_table
from analysis.read.sql import step_range
from schemas.scalars import COMPUTE_TIME, LOSS, LOSS_SCALE, STEP_TIME

if TYPE_CHECKING:
    import duckdb

SCALAR_TABLES = ("step_scalars", "rank_scalars")
"""The tables of the training scalars (``schemas.tables``), created together."""


class TrainingScalars(BaseModel):
    """A run's training scalars over the report's step range (every figure from the rows
    of ``step_scalars`` / ``rank_scalars`` in ``[from_step, to_step]``).

    - ``steps``: steps with at least one step scalar; ``names``: the scalar names present
      (code-point order).
    - ``loss_steps``: steps with a ``loss`` (the step's value: the mean over the ranks
      that sent one). ``first_loss`` / ``last_loss`` and ``first_loss_step`` /
      ``last_loss_step``: the finite loss of the earliest / latest such step;
      ``min_loss`` / ``min_loss_step``: the lowest finite loss and the earliest step
      holding it (``None`` without a finite loss).
    - ``nonfinite_loss_steps``: steps whose loss is NaN or +-Inf;
      ``first_nonfinite_loss_step``: the earliest (``None`` without);
      ``first_nonfinite_loss_ranks``: the ranks whose own loss (``rank_scalars``) was
      NaN/Inf at that step (ascending; empty when no rank row says so).
    - ``loss_scale_decreases``: steps whose ``loss_scale`` is below that of the previous
      step holding one (each is a backoff of AMP's dynamic loss scaling after an
      overflow); ``last_loss_scale``: the latest value (``None`` without a loss scale).
    - ``median_step_time_s`` / ``median_compute_time_s``: medians over the steps of the
      step's ``step_time_s`` / ``compute_time_s`` (each the slowest rank's, seconds);
      finite values only; ``None`` without.
    - ``ranks_timed``: ranks with a finite ``compute_time_s``; ``slowest_rank``: the rank
      with the highest median ``compute_time_s`` (the lowest rank on a tie; ``None``
      without); ``slowest_rank_compute_time_s``: that median, seconds;
      ``other_ranks_compute_time_s``: the median of the other ranks' medians (``None``
      with one rank timed); ``slowest_rank_ratio`` = slowest / others (``None`` when the
      others' median is not positive).
    """

    model_config = ConfigDict(frozen=True)

    steps: int = Field(ge=0)
    names: list[str]
    loss_steps: int = Field(default=0, ge=0)
    first_loss: float | None = None
    first_loss_step: int | None = None
    last_loss: float | None = None
    last_loss_step: int | None = None
    min_loss: float | None = None
    min_loss_step: int | None = None
    nonfinite_loss_steps: int = Field(default=0, ge=0)
    first_nonfinite_loss_step: int | None = None
    first_nonfinite_loss_ranks: list[int] = Field(default_factory=list)
    loss_scale_decreases: int = Field(default=0, ge=0)
    last_loss_scale: float | None = None
    median_step_time_s: float | None = None
    median_compute_time_s: float | None = None
    ranks_timed: int = Field(default=0, ge=0)
    slowest_rank: int | None = None
    slowest_rank_compute_time_s: float | None = None
    other_ranks_compute_time_s: float | None = None
    slowest_rank_ratio: float | None = None


_TRAINING_SQL = f"""
    WITH s AS (
        SELECT step, name, value FROM step_scalars
        WHERE run_id = $run_id AND {step_range()}
    ),
    loss AS (SELECT step, value, isfinite(value) AS finite FROM s WHERE name = '{LOSS}'),
    loss_agg AS (
        SELECT count(*) AS loss_steps,
               arg_min(value, step) FILTER (WHERE finite) AS first_loss,
               min(step) FILTER (WHERE finite) AS first_loss_step,
               arg_max(value, step) FILTER (WHERE finite) AS last_loss,
               max(step) FILTER (WHERE finite) AS last_loss_step,
               min(value) FILTER (WHERE finite) AS min_loss,
               count(*) FILTER (WHERE NOT finite) AS nonfinite_loss_steps,
               min(step) FILTER (WHERE NOT finite) AS first_nonfinite_loss_step
        FROM loss
    ),
    min_step AS (
        SELECT min(l.step) AS min_loss_step FROM loss AS l, loss_agg AS a
        WHERE l.finite AND l.value = a.min_loss
    ),
    scale AS (
        SELECT step, value, value < lag(value) OVER (ORDER BY step) AS decreased
        FROM s WHERE name = '{LOSS_SCALE}'
    ),
    scale_agg AS (
        SELECT count(*) FILTER (WHERE decreased) AS loss_scale_decreases,
               arg_max(value, step) AS last_loss_scale
        FROM scale
    ),
    step_agg AS (
        SELECT count(DISTINCT step) AS steps,
               coalesce(list(DISTINCT name ORDER BY name), []) AS names,
               median(value) FILTER (WHERE name = '{STEP_TIME}' AND isfinite(value))
                   AS median_step_time_s,
               median(value) FILTER (WHERE name = '{COMPUTE_TIME}' AND isfinite(value))
                   AS median_compute_time_s
        FROM s
    ),
    per_rank AS (
        SELECT rank, median(value) AS med FROM rank_scalars
        WHERE run_id = $run_id AND {step_range()} AND name = '{COMPUTE_TIME}'
          AND isfinite(value)
        GROUP BY rank
    ),
    slowest AS (SELECT rank, med FROM per_rank ORDER BY med DESC, rank LIMIT 1),
    others AS (
        SELECT median(p.med) AS med FROM per_rank AS p, slowest AS w WHERE p.rank <> w.rank
    ),
    bad_ranks AS (
        SELECT coalesce(list(DISTINCT k.rank ORDER BY k.rank), []) AS ranks
        FROM rank_scalars AS k, loss_agg AS a
        WHERE k.run_id = $run_id AND k.name = '{LOSS}'
          AND k.step = a.first_nonfinite_loss_step AND NOT isfinite(k.value)
    )
    SELECT t.steps, t.names, a.loss_steps, a.first_loss, a.first_loss_step, a.last_loss,
           a.last_loss_step, a.min_loss, m.min_loss_step, a.nonfinite_loss_steps,
           a.first_nonfinite_loss_step, b.ranks AS first_nonfinite_loss_ranks,
           c.loss_scale_decreases, c.last_loss_scale, t.median_step_time_s,
           t.median_compute_time_s,
           (SELECT count(*) FROM per_rank) AS ranks_timed,
           w.rank AS slowest_rank, w.med AS slowest_rank_compute_time_s,
           o.med AS other_ranks_compute_time_s,
           CASE WHEN o.med > 0 THEN w.med / o.med END AS slowest_rank_ratio
    FROM step_agg AS t, loss_agg AS a, min_step AS m, scale_agg AS c, bad_ranks AS b,
         others AS o
    LEFT JOIN slowest AS w ON true
"""
"""One row of :class:`TrainingScalars`' fields (same names), for ``$run_id`` in the inclusive
range ``$from_step`` / ``$to_step`` (``NULL`` = open)."""


def training_scalars(con: duckdb.DuckDBPyConnection,
                     params: dict[str, object]) -> TrainingScalars | None:
    """The training-scalars section of a run's summary.

    Args:
        con: a read-only connection or cursor of the store.
        params: ``run_id``, ``from_step``, ``to_step``
            (:func:`analysis.read.sql.stats_params`).

    Returns:
        The :class:`TrainingScalars` of the range (one statement); ``None`` when the run
        has no step scalar in it, or the store has no training-scalar tables (written
        before them and never opened by a newer writer since).
    """
    if not all(has_table(con, table) for table in SCALAR_TABLES):
        return None
    result = con.execute(_TRAINING_SQL, {k: params[k] for k in ("run_id", "from_step",
                                                                 "to_step")})
    names = [d[0] for d in result.description]
    (row,) = result.fetchall()  # one row (aggregates); fetchall leaves no pending result
    fields = dict(zip(names, row, strict=True))
    if not fields["steps"]:
        return None
    return TrainingScalars.model_validate(fields)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.5g}"


def loss_text(training: TrainingScalars) -> str | None:
    """The summary's "loss" row, e.g. ``"first 2.31 (step 0), last 0.118 (step 99), min
    0.112 (step 87); NaN/Inf at 3 steps, first at step 21 (ranks 2)"``, or None when no
    step had a loss."""
    if not training.loss_steps:
        return None
    parts = []
    if training.first_loss is not None:
        parts.append(
            f"first {_number(training.first_loss)} (step {training.first_loss_step}), "
            f"last {_number(training.last_loss)} (step {training.last_loss_step}), "
            f"min {_number(training.min_loss)} (step {training.min_loss_step})")
    else:
        parts.append("no finite value")
    if training.nonfinite_loss_steps:
        ranks = training.first_nonfinite_loss_ranks
        who = (f" ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))})"
               if ranks else "")
        noun = "step" if training.nonfinite_loss_steps == 1 else "steps"
        parts.append(f"NaN/Inf at {training.nonfinite_loss_steps} {noun}, first at step "
                     f"{training.first_nonfinite_loss_step}{who}")
    return "; ".join(parts)


def loss_scale_text(training: TrainingScalars) -> str | None:
    """The "loss scale" row, e.g. ``"2 decreases (overflow backoffs), last 1024"``, or None
    without a loss scale."""
    if training.last_loss_scale is None:
        return None
    n = training.loss_scale_decreases
    return (f"{n} {'decrease' if n == 1 else 'decreases'} (overflow backoffs), last "
            f"{_number(training.last_loss_scale)}")


def timing_text(training: TrainingScalars) -> str | None:
    """The "step time" row, e.g. ``"median 0.212 s; compute median 0.4 s (slowest rank per
    step); slowest rank 1: median compute 0.4 s against 0.101 s on the other ranks
    (3.96x)"``, or None without any time."""
    parts = []
    if training.median_step_time_s is not None:
        parts.append(f"median {_number(training.median_step_time_s)} s")
    if training.median_compute_time_s is not None:
        parts.append(f"compute median {_number(training.median_compute_time_s)} s "
                     "(slowest rank per step)")
    if training.slowest_rank is not None and training.other_ranks_compute_time_s is not None:
        ratio = ("" if training.slowest_rank_ratio is None
                 else f" ({training.slowest_rank_ratio:.3g}x)")
        parts.append(
            f"slowest rank {training.slowest_rank}: median compute "
            f"{_number(training.slowest_rank_compute_time_s)} s against "
            f"{_number(training.other_ranks_compute_time_s)} s on the other ranks{ratio}")
    return "; ".join(parts) or None
