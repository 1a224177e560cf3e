"""Weight distribution analysis and weight drift of a stored run, from the weight
statistics the producer sends with ``weight_stats=True`` (``GRADSTREAM_WEIGHT_STATS=1``;
off by default), as in trustformers-debug's ``WeightAnalyzer``, which reads every weight.

One module per concern:

- :mod:`analysis.analyses.weights.models`: the pydantic report models, with the formula of every
  field.
- :mod:`analysis.analyses.weights.load`: the SQL: the stored per-layer weight statistics of one
  step as a :class:`schemas.stats.WeightMoments` with each row's replica count, the update
  norms between two steps, the first NaN/Inf step.
- :mod:`analysis.analyses.weights.compute`: statistics, outliers and health at one step, drift
  between two steps, from the loaded statistics (no I/O); moments, entropy and zero
  fraction come from :meth:`schemas.stats.WeightMoments.get`.
- :mod:`analysis.analyses.weights.render`: the terminal tables.

Differences from the reference (listed in :mod:`analysis.analyses.weights.models` and
``analysis/REFERENCE_DIFFERENCES.md``): outlier bounds, extreme-value deductions, pooled
overall statistics and the histogram entropy; the option ``rules="reference"`` restores
the reference's. :class:`WeightHealth`, declared and never filled by the reference, is a
layer's score, issues and recommendations.

This module ties them together (:func:`build_weight_analysis`) and registers the analysis
(:data:`ANALYSIS`, options :class:`WeightOptions`). Cost: SQL over at most two steps plus
one aggregate of the update norms in between, then O(layers) in Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from analysis.analyses.weights.compute import distribution_at, drift_between
from analysis.analyses.weights.load import (
    fetch_step,
    first_nonfinite,
    require_weight_columns,
    update_paths,
    weight_step_range,
)
from analysis.analyses.weights.models import WeightAnalysisReport
from analysis.analyses.weights.render import render_weights
from analysis.blocks.rules import DEFAULT_RULES, Rules
from analysis.blocks.run_range import open_run_range
from analysis.blocks.significance import DEFAULT_ALPHA
from analysis.registry import Analysis

if TYPE_CHECKING:
    import duckdb



def build_weight_analysis(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    alpha: float = DEFAULT_ALPHA,
    rules: Rules = DEFAULT_RULES,
) -> WeightAnalysisReport:
    """Weight distribution at the last step with weight statistics in the range, and the
    drift since the first such step.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store` (or a read-only cursor).
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        alpha: significance level of the outlier bound, in (0, 1).
        rules: ``"gradstream"`` or ``"reference"`` (outliers, extreme values, overall
            statistics and entropy by the reference's rules; see
            :mod:`analysis.analyses.weights.models`).

    Returns:
        The :class:`WeightAnalysisReport`.

    Raises:
        StoreError: unknown run, invalid range, a store without the weight columns, or no
            weight statistics in the range (the message says how to turn them on).
        ValueError: ``alpha`` outside (0, 1).
    """
    params = open_run_range(con, run_id, from_step, to_step).params
    require_weight_columns(con)
    a, b = weight_step_range(con, params)
    last = fetch_step(con, run_id, b)
    distribution = distribution_at(b, last, alpha, rules)
    drift = (
        drift_between(a, b, fetch_step(con, run_id, a), last, update_paths(con, run_id, a, b))
        if a < b else None
    )
    nonfinite_step, nonfinite_layers = first_nonfinite(con, params)
    return WeightAnalysisReport(
        run_id=run_id, from_step=from_step, to_step=to_step, alpha=alpha,
        first_nonfinite_step=nonfinite_step, first_nonfinite_layers=nonfinite_layers,
        distribution=distribution, drift=drift, rules=rules,
    )


class WeightOptions(BaseModel):
    """Options of the weights analysis (``gradstream analyze --kind weights``,
    ``/api/analysis/weights``).

    - ``alpha``: significance level of the outlier bound, in (0, 1).
    - ``rules``: ``"gradstream"`` (default) or ``"reference"`` (the reference's outlier
      cut-offs, extreme-value constants, averaged overall statistics and ``log2 std``
      entropy; :mod:`analysis.blocks.rules`).
    """

    model_config = ConfigDict(frozen=True)

    alpha: float = Field(default=DEFAULT_ALPHA, gt=0.0, lt=1.0)
    rules: Rules = DEFAULT_RULES


def _build(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    options: WeightOptions,
) -> WeightAnalysisReport:
    """:func:`build_weight_analysis` with ``options``; raises what it raises."""
    return build_weight_analysis(con, run_id, from_step, to_step, options.alpha,
                                 options.rules)


ANALYSIS = Analysis(
    name="weights",
    help="Weight distribution (moments, entropy, outliers, health) and drift between the "
    "first and last steps with weight statistics (needs weight_stats=True in the producer).",
    options=WeightOptions,
    build=_build,
    render=render_weights,
)
"""The weights analysis's entry in :data:`analysis.registry.ANALYSES`."""
