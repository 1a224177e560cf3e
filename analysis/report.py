"""Run summary (health, flagged layers, recommendations), computed from the store.

Semantics follow trustformers-debug's ``gradient_flow`` module (``summary_report``), the
reference. The reference keeps frames in memory and rescans them; here every figure is one
SQL aggregate over ``layer_stats`` (O(layers x steps), done by DuckDB), plus ``frames`` for
the partial-frame count and ``runs`` for the run's shape.

Every layer counts, as in the reference: a layer whose mean |g| stays below
the vanishing threshold is a vanishing layer and its frames are issue frames, whatever its
magnitude. Layers at floating-point rounding level in every frame from their first on
(``schemas.rounding``; e.g. the key bias of softmax attention, whose gradient is zero by
construction) are reported as a *finding* besides: it explains the vanishing flag and never
changes the verdict by itself. A layer leaves the verdict only explicitly, and the report
says which: the run's ``ignore_layers`` (``start_run(..., ignore_layers=...)``, recorded in
``runs.ignore_layers``) and the report's own ``ignore_layers`` (``gradstream report
--ignore-layers``) leave out the vanishing and exploding flags of the layers they match
(a NaN/Inf gradient still counts); ``exclude_rounding`` (``--exclude-rounding-level``, off
by default) leaves out the vanishing flag of the layers of the finding. The consumer's
incremental :mod:`consumer.health_tracker` applies the same rule. The row flags are those of
:mod:`schemas.flags`, which the analyses read too, and the explicit exclusion has one
definition (:func:`analysis.read.exclusion.run_exclusion`), which the analyses apply too
(:func:`analysis.blocks.gradient_arrays.load_history`, ``gradstream analyze --ignore-layers``):
``gradstream report`` and ``gradstream analyze`` list the same vanishing, exploding and
non-finite layers, with or without exclusions. Both name the excluded layers apart
(``layers_excluded``); the report says which setting excluded each (:func:`exclusion_rows`).

Two health figures, each with its window: the report classifies the frames of the step
range it is asked for; the consumer keeps its own live health in ``runs`` (``health``,
``frames``, ``issue_frames``, ``last_step``), over the last ``--max-frames`` frames when
``gradstream consume --max-frames N`` is used, else over every frame it has written. The
report states its window and, when the stored one differs, shows the live health with its
window too (:class:`LiveHealth`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from analysis.blocks.terminal import joined_names, names_text, summary_grid
from analysis.nonfinite import has_nan_column, require_nan_split
from analysis.presentation import LAYER_ORDERS, LayerOrder, check_choice
from analysis.read.connect import has_column, require_run
from analysis.read.exclusion import Exclusion, run_exclusion
from analysis.read.sql import layer_name, stats_params, step_range
from analysis.scalars import (
    TrainingScalars,
    loss_scale_text,
    loss_text,
    timing_text,
    training_scalars,
)
from schemas.health import HEALTH_COLOR, check_nonfinite_verdict, classify_health
from schemas.rounding import at_rounding_sql, rounding_rows_sql, roundoff_sql
from schemas.wire import GradientHealth

if TYPE_CHECKING:
    import duckdb

NAMES_IN_TEXT = 8
"""Layer names quoted in one recommendation before "... and N more"."""

NAMES_IN_TABLE = 10
"""Layer names shown per list in :func:`render_report` before "... and N more"."""

HEALTH_STYLE: dict[GradientHealth, str] = {
    health: f"bold {color}" for health, color in HEALTH_COLOR.items()
}
"""``rich`` style of each health in the report: its colour (:data:`schemas.health.HEALTH_COLOR`),
bold."""


class LiveHealth(BaseModel):
    """The run health the consumer stored in ``runs`` and the window it covers.

    The consumer classifies a run incrementally over its last ``max_frames`` frames (the
    highest steps; ``gradstream consume --max-frames N``, 0 = every frame) and writes the
    result with the window's counters into the ``runs`` row.

    - ``health``: ``runs.health``.
    - ``frames``: ``runs.frames``, frames in the window; ``issue_frames``:
      ``runs.issue_frames``, those with a vanishing, exploding or NaN/Inf layer.
    - ``last_step``: ``runs.last_step``, the highest step the consumer classified.
    - ``first_step``: the window's first step: the ``frames``-th highest step of the run's
      ``frames`` rows up to ``last_step`` (``None`` if the store holds fewer frames rows,
      e.g. rows deleted since).
    """

    model_config = ConfigDict(frozen=True)

    health: GradientHealth
    frames: int = Field(ge=1)
    issue_frames: int = Field(ge=0)
    first_step: int | None
    last_step: int


class GradientFlowSummary(BaseModel):
    """Summary of one run's gradient flow over the frames considered.

    Fields of the reference summary (``GradientFlowSummary``):

    - ``total_steps``: last step considered + 1 (0 with no frame).
    - ``layers_with_vanishing_grads`` / ``layers_with_exploding_grads``: layers with
      ``is_vanishing`` / ``is_exploding`` in at least one frame, in model order
      (``layers.layer_index``), or by name with ``build_report(..., order="name")`` (the
      reference's order); without the layers of ``layers_excluded``
      (and, with ``exclude_rounding``, a row's ``is_vanishing`` is left out while its
      layer has had no gradient by construction from its first frame up to that row's
      step, see ``layers_without_gradient``).
    - ``overall_health``: :func:`classify_health` of the data.
    - ``recommendations``: :func:`build_recommendations`.

    gradstream extras:

    - ``frames``: steps with at least one ``layer_stats`` row in the range; ``first_step``
      / ``last_step``: the smallest / largest of those steps (``None`` with no frame). The
      health above covers exactly these frames: its window.
    - ``live_health``: the consumer's own health of the run and its window, from the
      ``runs`` row (:class:`LiveHealth`); ``None`` while the consumer has classified no
      frame of it (``runs.frames = 0``). ``live_window_differs``: that window is not the
      report's (other frame count, first or last step): the consumer used
      ``--max-frames``, the report a step range, or frames arrived since.
    - ``issue_frames``: frames with any vanishing (as above), exploding or non-finite
      layer (a NaN/Inf gradient is an issue: its max |g| is inf, so the layer counts
      as exploding); ``issue_ratio = issue_frames / max(frames, 1)``.
    - ``nonfinite_rule``: how NaN/Inf gradients counted in the verdict
      (``schemas.health.NONFINITE_VERDICTS``). ``"critical"`` (default, gradstream's rule):
      a layer with NaN/Inf elements makes its frame an issue frame and the run Critical.
      ``"reference"``: the reference's verdict exactly: a layer with an Inf
      element (``nonfinite > nan``) is exploding (listed in
      ``layers_with_exploding_grads``), a layer with NaN only is no issue, and no rule
      makes the run Critical by itself (``layers_with_nonfinite_grads`` and the NaN/Inf
      recommendation stay, as facts). A range holding a non-finite row whose NaN count is
      unknown (``layer_stats.nan`` NULL) is refused (``analysis.nonfinite.require_nan_split``).
    - ``ignore_layers``: the patterns applied (the run's, then the report's own);
      ``layers_excluded``: the layers they match (model order), whose vanishing and
      exploding flags count nowhere here (:class:`analysis.read.exclusion.Exclusion`). Apart:
      ``run_ignore_layers`` (the run setting, ``runs.ignore_layers``) and
      ``report_ignore_layers`` (this report's ``--ignore-layers`` /
      ``GRADSTREAM_IGNORE_LAYERS``, those not already the run's);
      ``layers_excluded_by_run`` (a run pattern matches them) and
      ``layers_excluded_by_report`` (only a report pattern does).
      ``excluded_rounding_level``: the report was asked to leave out the vanishing flag
      of ``layers_without_gradient``.
    - ``findings``: sentences on what the data shows beyond the verdict, one per kind
      (:func:`build_findings`): today the layers of ``layers_without_gradient``.
    - ``layers_without_gradient``: layers with no gradient by construction (model order):
      at rounding level in every stored frame from their first up to the end of the range
      (``schemas.rounding``: mean |g|, or the RMS in norms mode, at most
      ``eps(dtype) / 2`` times the step's largest and detached from the layers carrying
      gradient by a gap of at least ``(eps(dtype) / 2) ** -0.5``); judged from the run's
      first frame whatever ``from_step``. ``no_gradient_since_step``: the earliest first
      step of those layers, or ``None``.
    - ``partial_frames``: ``frames`` rows in the range stored as partial: a rank missing,
      or pieces that do not fit their parameter. Why, counted per frame (a frame may have
      several reasons): ``partial_missing_ranks`` (some rank's data is missing),
      ``partial_refused_ranks`` (some missing rank sent data that was refused: its
      RunStarted was refused or its summary dead-lettered; ``frames.refused_ranks``),
      ``partial_misfit_pieces`` (some layer's pieces do not fit its parameter's size or
      shard layout; ``frames.layout_violations``). The last two are 0 for stores written
      before those columns.
    - ``ranks_finished``: ranks that sent RunFinished; ``dropped_summaries``: step
      summaries those ranks dropped because Kafka was unreachable and their queue was full
      (whole run: ``sum(run_ranks.dropped)``). Every recorded step of a finished rank is
      either stored (a frame) or counted here.
    - ``layers_with_nonfinite_grads``: layers with ``nonfinite > 0`` in at least one
      frame (model order); ``first_nonfinite_step``: the earliest such step, or ``None``.
    - ``world_size``, ``num_layers``: from the ``runs`` row.
    - ``from_step`` / ``to_step``: the inclusive range requested (``None`` = open).
    - ``first_bad_local_step``: from the per-rank local view (``local_layer_stats``,
      statistics of each rank's own gradient before the cross-rank reduction), the
      earliest step in the range at which some rank's local gradient of some layer had
      ``nonfinite > 0`` or ``max_abs_grad`` above the run's exploding threshold; ``None``
      when there is none or no local view was sent. ``first_bad_local_ranks``: the ranks
      bad at that step (ascending). ``first_bad_local_nonfinite`` /
      ``first_bad_local_exploding``: whether their bad rows at that step held NaN/Inf /
      a max |g| above the threshold. Under data parallelism every rank applies the same
      averaged gradient, so a NaN is everyone's; these say whose gradient it came from.
    - ``training``: the training scalars of the range (loss, loss scale, step and compute
      times, the slowest rank: :class:`analysis.scalars.TrainingScalars`); ``None`` when the
      run sent none in the range or the store predates them.
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    total_steps: int = Field(ge=0)
    layers_with_vanishing_grads: list[str]
    layers_with_exploding_grads: list[str]
    overall_health: GradientHealth
    recommendations: list[str]
    frames: int = Field(ge=0)
    issue_frames: int = Field(ge=0)
    issue_ratio: float = Field(ge=0.0, le=1.0)
    partial_frames: int = Field(ge=0)
    partial_missing_ranks: int = Field(default=0, ge=0)
    partial_refused_ranks: int = Field(default=0, ge=0)
    partial_misfit_pieces: int = Field(default=0, ge=0)
    ranks_finished: int = Field(default=0, ge=0)
    dropped_summaries: int = Field(default=0, ge=0)
    layers_with_nonfinite_grads: list[str]
    first_nonfinite_step: int | None
    world_size: int
    num_layers: int
    from_step: int | None = None
    to_step: int | None = None
    first_bad_local_step: int | None = None
    first_bad_local_ranks: list[int] = Field(default_factory=list)
    first_bad_local_nonfinite: bool = False
    first_bad_local_exploding: bool = False
    layers_without_gradient: list[str] = Field(default_factory=list)
    no_gradient_since_step: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    live_health: LiveHealth | None = None
    live_window_differs: bool = False
    ignore_layers: list[str] = Field(default_factory=list)
    layers_excluded: list[str] = Field(default_factory=list)
    run_ignore_layers: list[str] = Field(default_factory=list)
    report_ignore_layers: list[str] = Field(default_factory=list)
    layers_excluded_by_run: list[str] = Field(default_factory=list)
    layers_excluded_by_report: list[str] = Field(default_factory=list)
    excluded_rounding_level: bool = False
    findings: list[str] = Field(default_factory=list)
    nonfinite_rule: str = "critical"
    training: TrainingScalars | None = None


def _show_name(name: str) -> str:
    """A layer name as it appears in a sentence: verbatim when unambiguous, else repr()."""
    return name if name and name.isprintable() and "," not in name else repr(name)


def _name_list(names: list[str], limit: int = NAMES_IN_TEXT) -> str:
    return joined_names(names, limit, _show_name)


def build_recommendations(
    health: GradientHealth,
    vanishing: list[str],
    exploding: list[str],
    nonfinite: list[str] | None = None,
    first_nonfinite_step: int | None = None,
) -> list[str]:
    """Advice derived from the flagged layers and the health class.

    Same structure as the reference ``build_recommendations`` (wording is gradstream's): for
    vanishing layers, one line naming them (architecture / learning-rate advice) and one on
    initialisation; for exploding layers, one naming them (gradient clipping) and one on
    learning rate and optimiser; gradstream adds one line for non-finite gradients naming
    the layers and the first step; then exactly one line for the health class. At most
    ``NAMES_IN_TEXT`` names are quoted per line.

    Args:
        health: the run's class from :func:`classify_health`.
        vanishing: layers with vanishing gradients (model order).
        exploding: layers with exploding gradients (model order).
        nonfinite: layers with NaN/Inf gradient elements (model order).
        first_nonfinite_step: earliest step with a non-finite gradient, if any.

    Returns:
        The recommendations, most specific first, the health line last.
    """
    recs: list[str] = []
    if nonfinite:
        when = f", first at step {first_nonfinite_step}" if first_nonfinite_step is not None else ""
        recs.append(
            f"NaN/Inf gradients in {_name_list(nonfinite)}{when}. Any update taken from them "
            "corrupts the weights: check mixed-precision loss scaling, divisions by zero and "
            "logarithms of zero, and skip optimiser steps whose gradients are not finite."
        )
    if vanishing:
        recs.append(
            f"Vanishing gradients in {_name_list(vanishing)}: their mean |g| fell below the "
            "threshold. Skip connections, normalisation layers or a higher learning rate "
            "usually bring the signal back."
        )
        recs.append(
            "Review weight initialisation: a scheme matched to the activation (Kaiming/He "
            "for ReLU-like units, Xavier/Glorot for tanh or sigmoid) keeps early gradients "
            "from shrinking layer after layer."
        )
    if exploding:
        recs.append(
            f"Exploding gradients in {_name_list(exploding)}: their max |g| exceeded the "
            "threshold. Clip the global gradient norm before the optimiser step "
            "(e.g. torch.nn.utils.clip_grad_norm_)."
        )
        recs.append(
            "Lower the learning rate or lengthen its warm-up, and prefer an adaptive "
            "optimiser with decoupled weight decay (such as AdamW) for steadier updates."
        )
    recs.append(_HEALTH_LINE[health])
    return recs


def build_findings(
    no_gradient: list[str], since_step: int | None, excluded_rounding_level: bool = False,
    excluded: Exclusion | None = None,
) -> list[str]:
    """What the data shows beyond the verdict, as sentences.

    Layers at rounding level since their first frame (``schemas.rounding``) give one
    sentence naming them (at most ``NAMES_IN_TEXT``): their gradient looks zero by
    construction. They still count as vanishing layers (the reference rule) unless the
    report excludes them (``excluded_rounding_level``) or a run setting does.

    Args:
        no_gradient: layers with no gradient by construction (model order).
        since_step: the earliest first step of those layers.
        excluded_rounding_level: the report left their vanishing flag out.
        excluded: the layers excluded by ``ignore_layers`` (the sentence says whether
            those of the finding are, and by which setting).

    Returns:
        The findings (empty when there is none).
    """
    if not no_gradient:
        return []
    by_run = set(excluded.names_by_run) if excluded else set()
    by_report = set(excluded.names_by_given) if excluded else set()
    if all(n in by_run for n in no_gradient):
        counted = "excluded by the run setting ignore_layers"
    elif all(n in by_report for n in no_gradient):
        counted = "excluded by this report's --ignore-layers"
    elif all(n in by_run | by_report for n in no_gradient):
        counted = ("excluded by the run setting ignore_layers and this report's "
                   "--ignore-layers")
    elif excluded_rounding_level:
        counted = "left out of the verdict (exclude layers at rounding level)"
    else:
        counted = ("they count as vanishing, as in the reference; to leave them out, set "
                   "ignore_layers (start_run(..., ignore_layers=[...]), --ignore-layers "
                   "PATTERN, or the Hugging Face callback's ignore_attention_key_bias=True)")
    return [
        f"gradient at rounding level since step {since_step}: "
        f"{_name_list(no_gradient)}; likely zero by construction, e.g. a softmax "
        f"attention key bias ({counted})."
    ]


_HEALTH_LINE: dict[GradientHealth, str] = {
    GradientHealth.CRITICAL: (
        "Critical: training is unstable. Pause the run and find the cause before spending "
        "more compute on it."
    ),
    GradientHealth.PROBLEMS_DETECTED: (
        "Serious gradient problems: revisit network depth, normalisation and the "
        "learning-rate schedule."
    ),
    GradientHealth.MINOR_ISSUES: (
        "Minor gradient irregularities: keep an eye on them; no intervention is needed yet."
    ),
    GradientHealth.HEALTHY: "Gradient flow looks healthy; nothing to do.",
}

_SUMMARY_ROWS_SQL = f"""
    SELECT c.frames, c.issue_frames, c.last_step, c.first_nonfinite_step, c.first_step,
           p.layer_index,
           {layer_name("p")} AS name,
           p.vanishing, p.exploding, p.nonfinite, p.no_gradient, p.first_step
    FROM counts AS c
    LEFT JOIN (SELECT * FROM per_layer
               WHERE vanishing OR exploding OR nonfinite OR no_gradient) AS p ON true
    LEFT JOIN layers AS l ON l.run_id = $run_id AND l.layer_index = p.layer_index
    ORDER BY p.layer_index
"""
"""The rows of both summary statements (:func:`_summary_sql`, :func:`_summary_from_frames_sql`)
from their ``counts`` (one row: frames, issue_frames, last_step, first_nonfinite_step,
first_step) and ``per_layer`` (layer_index, vanishing, exploding, nonfinite, no_gradient,
first_step) relations: one row per listed layer in model order, or one with NULL layer
columns when none is listed."""


def _summary_sql(with_dtype: bool, with_nan: bool) -> str:
    """One statement for the layer lists and the frame counts of :func:`build_report`.

    Rows of the run up to ``$to_step`` are judged by
    :func:`schemas.rounding.rounding_rows_sql` (from the run's first frame, so that the
    no-gradient state at ``$from_step`` is the run's); the rows from ``$from_step`` on are
    aggregated per layer and per step. One row per layer with a flag or no gradient
    (model order), each carrying the frame counts (frames, issue_frames, last_step,
    first_nonfinite_step, first_step); one row with NULL layer columns when no layer is listed.
    Parameters besides the range: ``$excluded`` (INTEGER[], layer indices whose vanishing
    and exploding flags count nowhere) and ``$exclude_rounding`` (BOOLEAN: leave out the
    vanishing flag of rows with ``no_gradient``) and ``$reference`` (BOOLEAN: the
    reference's non-finite semantics, ``schemas.health.NONFINITE_VERDICTS``:
    a row with an Inf element, ``nonfinite > nan``, is exploding, and a NaN/Inf row is no
    issue by itself).

    Args:
        with_dtype: the store's ``layers`` table has the ``dtype`` column.
        with_nan: its ``layer_stats`` has the ``nan`` column.
    """
    return f"""
    WITH z AS MATERIALIZED ({rounding_rows_sql(with_dtype, with_nan)}),
    x AS (SELECT unnest($excluded::INTEGER[]) AS layer_index),
    s AS (
        SELECT step, layer_index, nonfinite, no_gradient, first_step,
               is_vanishing AND NOT excluded AND NOT ($exclude_rounding AND no_gradient)
                   AS vanishing,
               (is_exploding OR ($reference AND coalesce(nonfinite > nan, false)))
                   AND NOT excluded AS exploding
        FROM (SELECT *, layer_index IN (SELECT layer_index FROM x) AS excluded FROM z)
        WHERE $from_step IS NULL OR step >= $from_step
    ),
    per_layer AS (
        SELECT layer_index, bool_or(vanishing) AS vanishing,
               bool_or(exploding) AS exploding, bool_or(nonfinite > 0) AS nonfinite,
               bool_and(no_gradient) AS no_gradient, min(first_step) AS first_step
        FROM s GROUP BY layer_index
    ),
    f AS (
        SELECT step,
               bool_or(vanishing OR exploding OR (nonfinite > 0 AND NOT $reference)) AS issue,
               bool_or(nonfinite > 0) AS nonfinite
        FROM s GROUP BY step
    ),
    counts AS (
        SELECT count(*) AS frames, count(*) FILTER (WHERE issue) AS issue_frames,
               max(step) AS last_step,
               min(step) FILTER (WHERE nonfinite) AS first_nonfinite_step,
               min(step) AS first_step
        FROM f
    )
    {_SUMMARY_ROWS_SQL}"""


def _summary_from_frames_sql(with_dtype: bool, exclude_rounding: bool) -> str:
    """:func:`_summary_sql`'s rows from the frames' stored summaries
    (:mod:`schemas.frame_summary`) instead of the run's ``layer_stats`` rows.

    The same parameters and the same rows (the layer rows' last column, ``first_step``,
    is only given for layers without gradient, the one use :func:`build_report` makes of
    it). The frames of the run up to ``$to_step`` give the flagged rows (their layer
    indices) and the rows at rounding level (the stored candidates judged with the
    layer's dtype by :func:`schemas.rounding.at_rounding_sql`, the expression the full
    scan evaluates). For the layers at rounding level in some frame, which frames hold them
    decides ``no_gradient`` (the full scan's ``step < s0``, ``s0`` the first frame holding
    the layer above rounding level): a frame with ``num_layers = layer_index_max + 1``
    holds every layer up to ``layer_index_max``; only the rows of the other frames (partial
    frames of sharded or pipelined runs) are read from ``layer_stats``. Without
    ``exclude_rounding`` a frame's issue and the layers' flags come from its index lists
    as they are (the excluded layers filtered out of each list); with it, the vanishing
    flag of a row depends on its layer's ``s0``, so the lists are unnested into rows. Cost:
    O(frames + flagged rows), plus the ``layer_stats`` rows of frames not holding every
    layer up to their largest.

    Args:
        with_dtype: the store's ``layers`` table has the ``dtype`` column.
        exclude_rounding: the statement for a report with ``exclude_rounding`` (module
            doc; no ``$exclude_rounding`` parameter here).
    """
    roundoff = roundoff_sql("l.dtype" if with_dtype else "NULL")
    excluded = "lambda x: NOT list_contains($excluded::INTEGER[], x)"
    exploding = (f"list_filter(CASE WHEN $reference THEN list_concat(exploding_indices, "
                 f"inf_indices) ELSE exploding_indices END, {excluded})")
    if exclude_rounding:
        flags = " UNION ALL ".join(
            f"SELECT step, unnest({column}) AS layer_index, '{kind}' AS kind FROM fr_range"
            for column, kind in (("vanishing_indices", "v"), ("exploding_indices", "e"),
                                 ("nonfinite_indices", "n"), ("inf_indices", "i")))
        judged = f"""
    fl AS (
        SELECT step, layer_index, bool_or(kind = 'v') AS is_vanishing,
               bool_or(kind = 'e') AS is_exploding, bool_or(kind = 'n') AS nonfinite,
               bool_or(kind = 'i') AS inf
        FROM ({flags}) GROUP BY step, layer_index
    ),
    s AS (
        SELECT f.step, f.layer_index, f.nonfinite,
               f.is_vanishing AND NOT excluded AND NOT coalesce(
                   z.layer_index IS NOT NULL
                   AND (z.gradient_step IS NULL OR f.step < z.gradient_step), false)
                   AS vanishing,
               (f.is_exploding OR ($reference AND f.inf)) AND NOT excluded AS exploding
        FROM (SELECT *, list_contains($excluded::INTEGER[], layer_index) AS excluded
              FROM fl) AS f
        LEFT JOIN zl AS z ON z.layer_index = f.layer_index
    ),
    flagged AS (
        SELECT layer_index, bool_or(vanishing) AS vanishing, bool_or(exploding) AS exploding,
               bool_or(nonfinite) AS nonfinite
        FROM s GROUP BY layer_index
    ),
    f AS (
        SELECT step,
               bool_or(vanishing OR exploding OR (nonfinite AND NOT $reference)) AS issue,
               bool_or(nonfinite) AS nonfinite
        FROM s GROUP BY step
    ),"""
    else:
        judged = f"""
    lists AS (
        SELECT step, list_filter(vanishing_indices, {excluded}) AS v,
               {exploding} AS e, nonfinite_indices AS n
        FROM fr_range
    ),
    flagged AS (
        SELECT layer_index, bool_or(kind = 'v') AS vanishing,
               bool_or(kind = 'e') AS exploding, bool_or(kind = 'n') AS nonfinite
        FROM (SELECT DISTINCT unnest(v) AS layer_index, 'v' AS kind FROM lists
              UNION ALL SELECT DISTINCT unnest(e), 'e' FROM lists
              UNION ALL SELECT DISTINCT unnest(n), 'n' FROM lists)
        GROUP BY layer_index
    ),
    f AS (
        SELECT step, len(v) > 0 OR len(e) > 0 OR (len(n) > 0 AND NOT $reference) AS issue,
               len(n) > 0 AS nonfinite
        FROM lists
    ),"""
    return f"""
    WITH fr AS (
        SELECT * FROM frames
        WHERE run_id = $run_id AND ($to_step IS NULL OR step <= $to_step)
    ),
    fr_range AS (SELECT * FROM fr WHERE $from_step IS NULL OR step >= $from_step),
    rc AS (
        SELECT c.step, c.layer_index
        FROM (SELECT step, top_magnitude AS top, unnest(rounding_candidates) AS layer_index,
                     unnest(rounding_magnitudes) AS magnitude, unnest(rounding_gaps) AS widest
              FROM fr WHERE len(rounding_candidates) > 0) AS c
        LEFT JOIN layers AS l ON l.run_id = $run_id AND l.layer_index = c.layer_index
        WHERE {at_rounding_sql("c.magnitude", "c.top", roundoff, "c.widest", nonfinite=None)}
    ),
    rc_count AS (SELECT layer_index, count(*) AS n FROM rc GROUP BY layer_index),
    fd AS (
        SELECT step, layer_index_max AS m, num_layers = layer_index_max + 1 AS dense FROM fr
    ),
    sparse_rows AS (
        SELECT s.layer_index, s.step FROM layer_stats AS s
        WHERE s.run_id = $run_id AND s.step IN (SELECT step FROM fd WHERE NOT dense)
          AND s.layer_index IN (SELECT layer_index FROM rc_count)
    ),
    dense_groups AS (
        SELECT m, count(*) AS n, min(step) AS first_step,
               max(step) FILTER (WHERE $from_step IS NULL OR step >= $from_step)
                   AS last_in_range
        FROM fd WHERE dense GROUP BY m
    ),
    zr AS (
        SELECT layer_index, sum(n) AS n, min(first_step) AS first_step,
               max(last_in_range) AS last_in_range
        FROM (SELECT c.layer_index, g.n, g.first_step, g.last_in_range
              FROM rc_count AS c JOIN dense_groups AS g ON c.layer_index <= g.m
              UNION ALL
              SELECT layer_index, 1, step,
                     CASE WHEN $from_step IS NULL OR step >= $from_step THEN step END
              FROM sparse_rows)
        GROUP BY layer_index
    ),
    mixed AS (
        SELECT z.layer_index FROM zr AS z JOIN rc_count AS c USING (layer_index)
        WHERE z.n > c.n
    ),
    zg AS (
        SELECT p.layer_index, min(p.step) AS gradient_step
        FROM (SELECT x.layer_index, f.step FROM mixed AS x
              JOIN fd AS f ON f.dense AND x.layer_index <= f.m
              UNION ALL
              SELECT layer_index, step FROM sparse_rows
              WHERE layer_index IN (SELECT layer_index FROM mixed)) AS p
        ANTI JOIN rc AS r ON r.step = p.step AND r.layer_index = p.layer_index
        GROUP BY p.layer_index
    ),
    zl AS (
        SELECT z.layer_index, z.first_step, z.last_in_range, g.gradient_step
        FROM zr AS z LEFT JOIN zg AS g USING (layer_index)
    ),{judged}
    zero AS (
        SELECT layer_index, first_step FROM zl
        WHERE last_in_range IS NOT NULL
          AND (gradient_step IS NULL OR last_in_range < gradient_step)
    ),
    per_layer AS (
        SELECT coalesce(g.layer_index, z.layer_index) AS layer_index,
               coalesce(g.vanishing, false) AS vanishing,
               coalesce(g.exploding, false) AS exploding,
               coalesce(g.nonfinite, false) AS nonfinite,
               z.layer_index IS NOT NULL AS no_gradient, z.first_step
        FROM flagged AS g FULL JOIN zero AS z ON z.layer_index = g.layer_index
    ),
    counts AS (
        SELECT count(*) AS frames,
               (SELECT count(*) FROM f WHERE issue) AS issue_frames,
               max(step) AS last_step,
               (SELECT min(step) FROM f WHERE nonfinite) AS first_nonfinite_step,
               min(step) AS first_step
        FROM fr_range WHERE num_layers > 0
    )
    {_SUMMARY_ROWS_SQL}"""


def frames_summarise(con: duckdb.DuckDBPyConnection, run_id: str,
                     to_step: int | None) -> bool:
    """Whether the stored frame summaries (:mod:`schemas.frame_summary`) stand for the
    run's ``layer_stats`` rows up to ``to_step`` (None: all), so that a report may read
    them instead of the rows: the store has the summary columns, every ``frames`` row of
    the run up to ``to_step`` has its summary, and their layer counts (``num_layers``)
    add up to the ``layer_stats`` rows there (a store whose rows were written by another
    program, or before the summaries existed, is read row by row). Two aggregates,
    answered mostly from DuckDB's row-group statistics.
    """
    if not has_column(con, "frames", "layer_index_max"):
        return False
    bound = "" if to_step is None else " AND step <= $to_step"
    params: dict[str, object] = {"run_id": run_id}
    if to_step is not None:
        params["to_step"] = to_step
    row = con.execute(
        "SELECT count(*) FILTER (WHERE vanishing_indices IS NULL OR layer_index_max IS NULL "
        "AND num_layers > 0), "
        f"coalesce(sum(num_layers), 0) FROM frames WHERE run_id = $run_id{bound}", params,
    ).fetchone()
    stored = con.execute(
        f"SELECT count(*) FROM layer_stats WHERE run_id = $run_id{bound}", params,
    ).fetchone()
    assert row is not None and stored is not None  # aggregates
    return row[0] == 0 and row[1] == stored[0]


def _has_layer_dtype(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store's ``layers`` table has the ``dtype`` column (an older store's
    lacks it)."""
    return has_column(con, "layers", "dtype")


_LOCAL_ORIGIN_SQL = f"""
    SELECT s.step, list(DISTINCT s.rank ORDER BY s.rank) AS ranks,
           bool_or(s.nonfinite > 0) AS nonfinite,
           bool_or(s.max_abs_grad > r.exploding_threshold) AS exploding
    FROM local_layer_stats AS s JOIN runs AS r ON r.run_id = s.run_id
    WHERE s.run_id = $run_id
      AND {step_range("s")}
      AND (s.nonfinite > 0 OR s.max_abs_grad > r.exploding_threshold)
    GROUP BY s.step
    ORDER BY s.step
    LIMIT 1
"""
"""The earliest step with a bad local row (NaN/Inf, or max |g| above the run's exploding
threshold) and the ranks of that step's bad rows; no row when there is none."""

_RUN_SQL = f"""
    SELECT r.world_size, r.num_layers, r.health, r.frames, r.issue_frames, r.last_step,
           (SELECT count(*) FROM frames AS f
             WHERE f.run_id = $run_id AND NOT f.complete
               AND {step_range("f")}) AS partial_frames,
           (SELECT count(*) FROM run_ranks AS k WHERE k.run_id = $run_id) AS ranks_finished,
           (SELECT coalesce(sum(k.dropped), 0) FROM run_ranks AS k
             WHERE k.run_id = $run_id) AS dropped_summaries
    FROM runs AS r WHERE r.run_id = $run_id
"""

_LIVE_FIRST_STEP_SQL = """
    SELECT min(step) FROM (
        SELECT step FROM frames WHERE run_id = $run_id AND step <= $last_step
        ORDER BY step DESC LIMIT $frames
    ) HAVING count(*) = $frames
"""
"""First step of the consumer's health window: the ``$frames``-th highest stored frame up to
``$last_step`` (the consumer's tracker keeps the highest steps); no row when fewer are
stored."""


def build_report(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    *,
    ignore_layers: tuple[str, ...] = (),
    exclude_rounding: bool = False,
    order: LayerOrder = "model",
    nonfinite_rule: str = "critical",
    full_scan: bool = False,
) -> GradientFlowSummary:
    """Summarise one run from the store: flagged layers, health, recommendations.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run (see :func:`analysis.read.connect.resolve_run`).
        from_step: first optimiser step considered (inclusive), ``None`` = from the start.
        to_step: last optimiser step considered (inclusive), ``None`` = to the end.
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``
            (module doc; :func:`run_exclusion`).
        exclude_rounding: leave out the vanishing flag of layers with no gradient by
            construction (module doc; off by default, as in the reference).
        order: ``"model"`` (``layers.layer_index``) or ``"name"`` (code-point order, the
            reference's) for the vanishing, exploding and non-finite layer
            lists and the names quoted in the recommendations.
        nonfinite_rule: ``"critical"`` (default) or ``"reference"``: how NaN/Inf
            gradients count in the verdict (``GradientFlowSummary.nonfinite_rule``).
        full_scan: read the layer lists and frame counts from every ``layer_stats`` row
            of the run even where the frames' stored summaries stand for them
            (:func:`frames_summarise`); the result is the same (the report's tests
            compare both), only slower: O(rows) instead of O(frames + flagged rows).

    Returns:
        The :class:`GradientFlowSummary` of the frames in the range; field formulas are in
        its docstring. Four queries, plus a catalog look-up for ``layers.dtype`` and, when
        the consumer stored a live health, a top-N over the run's ``frames`` rows for its
        window's first step: the layer lists and frame counts (one windowed aggregate
        over the run's rows up to ``to_step``), the run row, the local view's first bad
        step (an older store without ``local_layer_stats`` has none); then the training
        scalars, one statement after catalog look-ups for their tables
        (:func:`analysis.scalars.training_scalars`).

    Raises:
        StoreError: unknown run or invalid step range; with ``nonfinite_rule="reference"``,
            a range holding NaN/Inf rows whose NaN count is unknown.
        ValueError: unknown ``order`` or ``nonfinite_rule``.
    """
    check_choice("order", order, LAYER_ORDERS)
    reference = check_nonfinite_verdict(nonfinite_rule) == "reference"
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    with_nan = has_nan_column(con)
    if reference:
        require_nan_split(con, params, "report --nonfinite-rule reference")
    vanishing: list[str] = []
    exploding: list[str] = []
    nonfinite: list[str] = []
    no_gradient: list[str] = []
    since: list[int] = []
    exclusion = run_exclusion(con, run_id, ignore_layers)
    arguments = {**params, "excluded": exclusion.layer_index, "reference": reference}
    if not full_scan and frames_summarise(con, run_id, to_step):
        summary_sql = _summary_from_frames_sql(_has_layer_dtype(con), exclude_rounding)
    else:
        summary_sql = _summary_sql(_has_layer_dtype(con), with_nan)
        arguments["exclude_rounding"] = exclude_rounding
    rows = con.execute(summary_sql, arguments).fetchall()
    for *_counts, index, name, is_van, is_exp, is_nf, is_zero, first_step in rows:
        if index is None:
            continue
        for flag, names in ((is_van, vanishing), (is_exp, exploding), (is_nf, nonfinite),
                            (is_zero, no_gradient)):
            if flag:
                names.append(name)
        if is_zero:
            since.append(first_step)
    if order == "name":
        for names in (vanishing, exploding, nonfinite):
            names.sort()
    run_row = con.execute(_RUN_SQL, params).fetchone()
    assert rows and run_row is not None  # aggregate / checked by require_run
    frames, issue_frames, last_step, first_nonfinite_step, first_step = rows[0][:5]
    world_size, num_layers, *stored, partial_frames, ranks_finished, dropped = run_row
    live = _live_health(con, run_id, *stored)
    health = classify_health(
        bool(vanishing), bool(exploding), issue_frames, frames,
        bool(nonfinite) and not reference,
    )
    return GradientFlowSummary(
        run_id=run_id,
        total_steps=0 if last_step is None else last_step + 1,
        layers_with_vanishing_grads=vanishing,
        layers_with_exploding_grads=exploding,
        overall_health=health,
        recommendations=build_recommendations(
            health, vanishing, exploding, nonfinite, first_nonfinite_step
        ),
        frames=frames,
        issue_frames=issue_frames,
        issue_ratio=issue_frames / max(frames, 1),
        partial_frames=partial_frames,
        **_partial_reasons(con, params),
        ranks_finished=ranks_finished,
        dropped_summaries=int(dropped),
        layers_with_nonfinite_grads=nonfinite,
        first_nonfinite_step=first_nonfinite_step,
        world_size=world_size,
        num_layers=num_layers,
        from_step=from_step,
        to_step=to_step,
        **_local_origin(con, params),
        layers_without_gradient=no_gradient,
        no_gradient_since_step=min(since) if since else None,
        **_exclusion_fields(exclusion),
        excluded_rounding_level=exclude_rounding,
        nonfinite_rule=nonfinite_rule,
        findings=build_findings(no_gradient, min(since) if since else None,
                                exclude_rounding, exclusion),
        first_step=first_step,
        last_step=last_step,
        live_health=live,
        live_window_differs=live is not None and (
            (live.frames, live.first_step, live.last_step) != (frames, first_step, last_step)
        ),
        training=training_scalars(con, params),
    )


def _live_health(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    health: str,
    frames: int,
    issue_frames: int,
    last_step: int | None,
) -> LiveHealth | None:
    """The ``runs`` row's health with its window (:class:`LiveHealth`), or None when the
    consumer has classified no frame of the run (``frames = 0`` or no ``last_step``).

    Raises:
        ValueError: ``health`` is not a :class:`GradientHealth` value.
    """
    if not frames or last_step is None:
        return None
    row = con.execute(
        _LIVE_FIRST_STEP_SQL, {"run_id": run_id, "last_step": last_step, "frames": frames}
    ).fetchone()
    return LiveHealth(
        health=GradientHealth(health), frames=frames, issue_frames=issue_frames,
        first_step=None if row is None else row[0], last_step=last_step,
    )


def _steps_text(first: int | None, last: int) -> str:
    return f"steps {first}..{last}" if first is not None else f"steps up to {last}"


def health_window_text(summary: GradientFlowSummary) -> str:
    """The window the report's health covers.

    Args:
        summary: from :func:`build_report`.

    Returns:
        ``"steps 0..199, 200 frames"`` (one frame: ``"1 frame"``), or ``"no frames"``.
    """
    if summary.last_step is None:
        return "no frames"
    noun = "frame" if summary.frames == 1 else "frames"
    return f"{_steps_text(summary.first_step, summary.last_step)}, {summary.frames} {noun}"


def live_health_text(summary: GradientFlowSummary) -> str | None:
    """The consumer's live health with its window, when that window is not the report's.

    Args:
        summary: from :func:`build_report`.

    Returns:
        ``"live health over the last 50 frames (steps 150..199): ProblemsDetected, 12
        issue frames"``, or None when the store holds no live health or it covers the
        report's window.
    """
    live = summary.live_health
    if live is None or not summary.live_window_differs:
        return None
    noun = "frame" if live.frames == 1 else "frames"
    return (
        f"live health over the last {live.frames} {noun} "
        f"({_steps_text(live.first_step, live.last_step)}): {live.health.value}, "
        f"{live.issue_frames} issue {'frame' if live.issue_frames == 1 else 'frames'}"
    )


def _partial_reasons(con: duckdb.DuckDBPyConnection,
                     params: dict[str, object]) -> dict[str, int]:
    """The partial frames of the range counted by reason: the summary's
    ``partial_missing_ranks``, ``partial_refused_ranks`` and ``partial_misfit_pieces`` (the
    last two 0 for a store without ``frames.refused_ranks`` / ``layout_violations``)."""
    known = has_column(con, "frames", "layout_violations")
    refused = "len(coalesce(f.refused_ranks, [])) > 0" if known else "false"
    misfit = "coalesce(f.layout_violations, 0) > 0" if known else "false"
    row = con.execute(
        f"""SELECT count(*) FILTER (WHERE len(f.missing_ranks) > 0),
                   count(*) FILTER (WHERE {refused}), count(*) FILTER (WHERE {misfit})
            FROM frames AS f WHERE f.run_id = $run_id AND NOT f.complete
              AND {step_range("f")}""",
        {k: params[k] for k in ("run_id", "from_step", "to_step")},
    ).fetchone()
    assert row is not None  # an aggregate
    return {"partial_missing_ranks": int(row[0]), "partial_refused_ranks": int(row[1]),
            "partial_misfit_pieces": int(row[2])}


def _local_origin(con: duckdb.DuckDBPyConnection, params: dict[str, object]) -> dict[str, Any]:
    """The summary's ``first_bad_local_step``, ``_ranks``, ``_nonfinite`` and ``_exploding``
    from :data:`_LOCAL_ORIGIN_SQL`: the step, its ranks, whether NaN/Inf and whether a max
    |g| above the threshold made it bad; none, no ranks and false without a bad local row
    or in a store without ``local_layer_stats``."""
    import duckdb

    try:
        row = con.execute(_LOCAL_ORIGIN_SQL, params).fetchone()
    except duckdb.CatalogException:
        row = None
    step, ranks, nonfinite, exploding = row if row is not None else (None, [], False, False)
    return {"first_bad_local_step": step, "first_bad_local_ranks": list(ranks),
            "first_bad_local_nonfinite": bool(nonfinite),
            "first_bad_local_exploding": bool(exploding)}


def _exclusion_fields(exclusion: Exclusion) -> dict[str, list[str]]:
    """The summary's exclusion fields (:class:`GradientFlowSummary`: ``ignore_layers``,
    ``layers_excluded``, and each apart by the setting that made it) of ``exclusion``."""
    return {
        "ignore_layers": exclusion.patterns,
        "layers_excluded": exclusion.names,
        "run_ignore_layers": exclusion.run_patterns,
        "report_ignore_layers": exclusion.given_patterns,
        "layers_excluded_by_run": exclusion.names_by_run,
        "layers_excluded_by_report": exclusion.names_by_given,
    }


def local_origin_text(summary: GradientFlowSummary) -> str | None:
    """The report's sentence on where bad gradients started, from the local view.

    Args:
        summary: from :func:`build_report`.

    Returns:
        ``"NaN/Inf first in rank 2's local gradient at step 20"`` (several ranks: "in the
        local gradients of ranks 0, 1"; an explosion: "max |g| above the exploding
        threshold first in ..."), or None without ``first_bad_local_step``.
    """
    if summary.first_bad_local_step is None:
        return None
    what = " or ".join(
        w for w, on in (("NaN/Inf", summary.first_bad_local_nonfinite),
                        ("max |g| above the exploding threshold",
                         summary.first_bad_local_exploding)) if on
    )
    ranks = summary.first_bad_local_ranks
    where = (f"rank {ranks[0]}'s local gradient" if len(ranks) == 1
             else f"the local gradients of ranks {', '.join(map(str, ranks))}")
    return f"{what} first in {where} at step {summary.first_bad_local_step}"


def _partial_why(summary: GradientFlowSummary) -> str:
    """Why the partial frames are partial, for the "frames" row, e.g. ": 3 missing a rank, 1
    with a rank's data refused" (only the reasons that occur; a frame may count twice)."""
    why = [f"{n} {text}" for n, text in (
        (summary.partial_missing_ranks, "missing a rank"),
        (summary.partial_refused_ranks, "with a rank's data refused"),
        (summary.partial_misfit_pieces, "with pieces that do not fit their parameter"),
    ) if n]
    return ": " + ", ".join(why) if why and summary.partial_frames else ""


def _names_cell(names: list[str], limit: int = NAMES_IN_TABLE) -> Text:
    return names_text(names, limit, _show_name)


EXCLUDED_BY_RUN = "by run setting"
"""Label of the layers a run's own ``ignore_layers`` excludes."""
EXCLUDED_BY_REPORT = "by this report's --ignore-layers"
"""Label of the layers only the report's own ``--ignore-layers`` excludes."""


def exclusion_rows(summary: GradientFlowSummary) -> dict[str, tuple[list[str], list[str]]]:
    """The "excluded" rows of a rendered report: label -> (patterns, layers), the run
    setting's first, then the report's own; a setting without patterns has no row. A
    layer both match is listed under the run setting only.

    A summary from a version without the split fields (only ``ignore_layers``) is shown
    under the run setting, as it was then.
    """
    run = summary.run_ignore_layers
    own = summary.report_ignore_layers
    if not run and not own and summary.ignore_layers:
        return {EXCLUDED_BY_RUN: (summary.ignore_layers, summary.layers_excluded)}
    rows: dict[str, tuple[list[str], list[str]]] = {}
    if run:
        rows[EXCLUDED_BY_RUN] = (run, summary.layers_excluded_by_run)
    if own:
        rows[EXCLUDED_BY_REPORT] = (own, summary.layers_excluded_by_report)
    return rows


def _bullets(lines: list[str]) -> Text:
    """``lines`` as a bulleted list, one per line (plain text, never parsed as markup)."""
    return Text("\n".join(f"• {line}" for line in lines))


@dataclass(frozen=True)
class SummaryRow:
    """One row of a rendered run summary (:func:`summary_rows`): ``label``, then ``text``,
    then the layer list ``names`` when it is not None ("none" when empty; at most
    ``NAMES_IN_TABLE`` names, then "... and N more"), then ``tail``. Every part is plain
    text: each renderer escapes it for its medium."""

    label: str
    text: str = ""
    names: list[str] | None = None
    tail: str = ""


def summary_rows(summary: GradientFlowSummary) -> list[SummaryRow]:
    """The rows every rendering of a summary shows after its health, in order: the live
    health when its window differs, the step range, counts, the flagged layer lists, the
    layers with no gradient, the exclusions (:func:`exclusion_rows`), where bad
    gradients started, and the training scalars ("loss", "loss scale", "step time":
    :mod:`analysis.scalars`); optional rows only when they apply. Used by :func:`render_report`
    (terminal) and :func:`analysis.notebook_html.report_html` (Jupyter)."""
    rows: list[SummaryRow] = []
    live = live_health_text(summary)
    if live is not None:
        rows.append(SummaryRow("live health", live.removeprefix("live health ")))
    if summary.from_step is not None or summary.to_step is not None:
        rows.append(SummaryRow("steps considered", (
            f"{'start' if summary.from_step is None else summary.from_step}"
            f" .. {'end' if summary.to_step is None else summary.to_step}")))
    rows += [
        SummaryRow("total steps", str(summary.total_steps)),
        SummaryRow("frames", (
            f"{summary.frames} ({summary.partial_frames} partial{_partial_why(summary)}, "
            f"world size {summary.world_size}; {summary.ranks_finished} ranks finished, "
            f"{summary.dropped_summaries} summaries dropped by producers)")),
        SummaryRow("issue frames",
                   f"{summary.issue_frames} ({summary.issue_ratio:.1%} of frames)"),
        SummaryRow("layers", str(summary.num_layers)),
        SummaryRow("vanishing", names=summary.layers_with_vanishing_grads),
        SummaryRow("exploding", names=summary.layers_with_exploding_grads),
    ]
    tail = ("" if summary.first_nonfinite_step is None
            else f" (first at step {summary.first_nonfinite_step})")
    if summary.nonfinite_rule == "reference" and summary.layers_with_nonfinite_grads:
        tail += " (reference rule: an Inf counts as exploding, a NaN as no issue)"
    rows.append(SummaryRow("non-finite", names=summary.layers_with_nonfinite_grads, tail=tail))
    if summary.layers_without_gradient:
        rows.append(SummaryRow(
            "no gradient", f"at rounding level since step {summary.no_gradient_since_step}: ",
            summary.layers_without_gradient,
            " (excluded: exclude layers at rounding level)"
            if summary.excluded_rounding_level else ""))
    for label, (patterns, names) in exclusion_rows(summary).items():
        shown = patterns[:NAMES_IN_TABLE]
        more = len(patterns) - len(shown)
        rows.append(SummaryRow("excluded", label + " " + ", ".join(map(repr, shown))
                               + (f" and {more} more patterns" if more else "") + ": ",
                               names))
    origin = local_origin_text(summary)
    if origin is not None:
        rows.append(SummaryRow("started in", origin))
    if summary.training is not None:
        for label, text in (("loss", loss_text(summary.training)),
                            ("loss scale", loss_scale_text(summary.training)),
                            ("step time", timing_text(summary.training))):
            if text is not None:
                rows.append(SummaryRow(label, text))
    return rows


def render_report(summary: GradientFlowSummary) -> RenderableType:
    """Terminal rendering of a summary: a key/value table and the recommendations.

    Layer names are printed as plain text (never parsed as rich markup); each layer list
    shows at most ``NAMES_IN_TABLE`` names followed by "... and N more". The health row
    names its window (:func:`health_window_text`), then come the rows of
    :func:`summary_rows`: a "live health" row when the consumer's stored health covers
    another window (:func:`live_health_text`); layers with no gradient by construction get
    their own row ("no gradient: at rounding level since step S: ...") and a "Findings"
    section, only when there are some; layers excluded by ``ignore_layers`` get an
    "excluded" row per setting (:func:`exclusion_rows`: "by run setting" and "by this
    report's --ignore-layers") naming its patterns and layers. Under
    ``nonfinite_rule="reference"`` the non-finite row says how those layers counted.

    Args:
        summary: from :func:`build_report`.

    Returns:
        A rich renderable (print it with ``rich.console.Console.print``).
    """
    table = summary_grid()
    health = summary.overall_health
    health_cell = Text(health.value, style=HEALTH_STYLE[health])
    health_cell.append(f" over {health_window_text(summary)}")
    table.add_row("health", health_cell)
    for row in summary_rows(summary):
        cell = Text(row.text)
        if row.names is not None:
            cell.append_text(_names_cell(row.names))
        cell.append(row.tail)
        table.add_row(row.label, cell)
    parts: list[RenderableType] = [table]
    if summary.findings:
        parts += [Text(""), Text("Findings", style="bold underline"),
                  _bullets(summary.findings)]
    title = Text("gradient flow: run ")
    title.append(_show_name(summary.run_id), style="bold")
    return Panel(
        Group(*parts, Text(""), Text("Recommendations", style="bold underline"),
              _bullets(summary.recommendations)),
        title=title,
        border_style=HEALTH_STYLE[health].removeprefix("bold "),
    )
