"""Gradient-flow network analysis (per-layer flow, flow network, regions, dead zones),
computed from the stored history of a run, as the reference (trustformers-debug,
``gradient_debugger::visualization``) defines it.

:func:`build_flow_visualization` loads the run once (:func:`load_history`) and
:mod:`.compute` derives every section with NumPy passes over the ``layers x steps``
arrays, O(layers x steps) in total. The report models and the formula of every field are
in :mod:`.models`; the terminal tables in :mod:`.render`.

Differences from the reference (with reasons in ``analysis/REFERENCE_DIFFERENCES.md``;
the option ``rules="reference"`` restores those marked R, with the reference's own
cut-offs, from :mod:`analysis.analyses.flow.reference`):

- Placeholders computed from data: ``direction_vector = [norm]`` (left out: needs gradient
  vectors), ``connectivity = number of layers`` (node degree), edges between hash-order
  neighbours (consecutive layers in backpropagation order), ``criticality_score 0.8`` and
  ``optimization_potential 0.6`` (share of gradient lost along the path; share of the
  parameters on it), ``affected_parameters 1000`` (sum of the layers' ``numel``).
- (R) ``FlowDirection``: turning-point test and a t-test on the slope over the temporal
  window, instead of the sign of ``latest - oldest`` over the last three samples.
- (R) ``stability_score``: ``1 / (1 + std / mean)`` over the window instead of ``1 / (1 +
  variance)`` of the last five samples.
- (R) ``NodeType``: position in the backpropagation chain and Tukey fences on the edges'
  per-element log gains, instead of ``bottleneck_score > 0.8`` / ``flow rate > 1`` /
  ``sum of norms < 0.01`` / ``any norm > 10``.
- (R) ``FlowEdge`` and ``EdgeType``: per-element gain between the two layers (geometric
  mean, consistency, zero fraction) and cut-offs Blocked >= 1/2 zero, Intermittent
  consistency < 1/2, Strong gain >= 1, instead of the mean of the two layers' flow rates
  and consistencies with cut-offs 1.0 / 0.8, 0.1 / 0.3, 0.6 and a fall-through to Blocked.
- (R) ``network_connectivity``: share of edges not Blocked instead of ``edges / (n (n -
  1))``.
- Critical paths: stretches of non-Strong edges, product of gains (reference: one
  "main path" of all layers, sum of strengths, constant scores).
- (R) Vanishing and exploding regions, dead zones: the run's own per-step flags (the rule
  of health, report and alerts), at least half of the steps, adjacent layers merged,
  severities in orders of magnitude, instead of one region per layer at mean norm < 1e-5
  (Critical < 1e-7), max norm > 100 (Critical > 1000), norms < 1e-8 in more than half of
  the samples.
- ``flow_consistency``: a zero sample followed by a non-zero one is an infinite change
  (the reference's ``+ 1e-8`` gives 1e8, the same consistency to eight digits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from analysis.analyses.flow.compute import flow_from_history
from analysis.analyses.flow.models import (
    ColorScheme,
    GradientFlowVisualization,
    GradientVisualizationConfig,
)
from analysis.analyses.flow.render import render_flow
from analysis.blocks.gradient_arrays import load_history
from analysis.blocks.rules import DEFAULT_RULES, Rules
from analysis.blocks.significance import DEFAULT_ALPHA
from analysis.read.exclusion import split_patterns
from analysis.registry import Analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb


def build_flow_visualization(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    config: GradientVisualizationConfig | None = None,
    ignore_layers: Sequence[str] = (),
) -> GradientFlowVisualization:
    """The gradient-flow network analysis (``generate_visualization``) over one run's stored
    history.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        config: window, significance level, colour scheme, sections; the reference defaults.
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``: the
            layers of the report's exclusion have no vanishing, exploding or dead flag here
            (:func:`analysis.blocks.gradient_arrays.load_history`).

    Returns:
        The :class:`GradientFlowVisualization`.

    Raises:
        StoreError: unknown run, invalid step range, or no gradient rows in the range.
    """
    history = load_history(con, run_id, from_step, to_step, ignore_layers)
    return flow_from_history(history, config)


class FlowOptions(BaseModel):
    """Options of the flow analysis (``gradstream analyze --kind flow``, ``/api/analysis/flow``).

    - ``window``: samples per layer behind the flow directions and stability scores
      (``temporal_window`` of :class:`GradientVisualizationConfig`), >= 1.
    - ``alpha``: significance level of the direction tests, in (0, 1).
    - ``color_scheme``: colours of the tables and of the report's palette.
    - ``rules``: ``"gradstream"`` (default) or ``"reference"``: the reference's flow
      directions, stability scores, node and edge types, connectivity, regions and dead
      zones (see the module docstring).
    - ``ignore_layers``: comma-separated layer-name patterns excluded besides the run's
      own ``ignore_layers`` (as ``gradstream report --ignore-layers``: the matched layers'
      vanishing, exploding and dead flags count nowhere, NaN/Inf still does;
      :func:`analysis.read.exclusion.run_exclusion`).
    """

    model_config = ConfigDict(frozen=True)

    window: int = Field(default=GradientVisualizationConfig().temporal_window, ge=1)
    alpha: float = Field(default=DEFAULT_ALPHA, gt=0.0, lt=1.0)
    color_scheme: ColorScheme = ColorScheme.DEFAULT
    rules: Rules = DEFAULT_RULES
    ignore_layers: str = ""


def _build(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    options: FlowOptions,
) -> GradientFlowVisualization:
    """:func:`build_flow_visualization` with the config made from ``options`` (other
    config fields at their defaults). Raises what that function raises."""
    config = GradientVisualizationConfig(
        temporal_window=options.window, alpha=options.alpha, color_scheme=options.color_scheme,
        rules=options.rules,
    )
    return build_flow_visualization(con, run_id, from_step, to_step, config,
                                    split_patterns(options.ignore_layers))


ANALYSIS = Analysis(
    name="flow",
    help="Gradient flow network, vanishing and exploding regions, dead zones and critical "
    "paths.",
    options=FlowOptions,
    build=_build,
    render=render_flow,
)
"""The flow analysis's entry in :data:`analysis.registry.ANALYSES`."""
