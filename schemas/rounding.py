"""Layers whose gradient is zero up to floating-point rounding: "no gradient by construction".

Some parameters receive an exactly zero gradient, mathematically, at every step: the key
bias of a softmax attention (softmax is invariant to adding the same constant to every
score of a row, so the bias's gradient is a sum of terms that cancel exactly), a
parameter feeding only a zero-initialised layer at step 0, and so on. Computed in floating
point, such a gradient is not 0 but the rounding residue of that cancellation. The plain
threshold rule (trustformers-debug's ``gradient_flow`` module) flags it vanishing (mean |g|
below the threshold) at every step. This module recognises those layers from the data, so
that the report can say so: a *finding* ("gradient at rounding level since step 0: likely
zero by construction"), never a change of the verdict by itself. A magnitude test cannot
tell "zero by construction" from "vanishing from the first step" (a float64 run that
declares no dtype is judged as float32, so a layer at mean |g| = 2e-9 beside a layer at 0.5
passes it), so by default every layer counts, as in the reference. Layers leave the
verdict only explicitly: the run's ``ignore_layers`` (``schemas.health.match_layers``,
e.g. set from the model's structure by the Hugging Face adapter), or the documented
option "exclude layers at rounding level" (``--exclude-rounding-level``), which applies this
test and makes the report name the layers it left out.

Test at one frame (one step, all reported layers), for layer l:

- ``a_l``: the layer's gradient magnitude, ``mean_abs_grad`` where known, else the RMS
  ``sqrt(sum_sq / numel)`` (norms mode; ``consumer.frames``).
- ``u_l = eps(dtype_l) / 2``: the unit roundoff of the layer's gradient dtype (round to
  nearest: ``|fl(x) - x| <= u |x|``; Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., section 2.1). ``eps`` is ``numpy.finfo(dtype).eps`` for float16,
  float32 and float64, and 2^-7 for bfloat16 (8 significand bits); an unknown or missing
  dtype counts as float32 (:data:`DEFAULT_DTYPE`). For a lower-precision dtype that
  default is stricter (a smaller u), so an unknown dtype never adds a layer.
- ``A = max_k a_k``: the largest magnitude of the frame.

Layer l is **at rounding level** at that frame when all of:

1. ``nonfinite_l == 0`` (a NaN/Inf gradient is not zero) and ``A > 0`` (in an all-zero
   frame nothing carries signal to compare with);
2. ``a_l <= u_l * A``: the layer is below the rounding error of the step's largest
   gradient;
3. ``W_l >= u_l ** -0.5``, where ``W_l`` is the widest ratio between two consecutive
   magnitudes of the frame sorted in decreasing order, among those from ``A`` down to
   ``a_l`` (``x / 0 = inf`` for ``x > 0``, ``0 / 0 = 1``): the layer is *detached* from the
   layers that carry gradient.

Why condition 3. A rounding residue of an exactly cancelling sum of n terms t_k is at most
``gamma_n * sum |t_k|`` with ``gamma_n = n u / (1 - n u)`` (Higham, Lemma 3.1 and section
4.2), typically ``sqrt(n) u sum |t_k|``; the terms are products of the same activations
and upstream gradients that make the gradients of the neighbouring layers, so the residue
sits about ``1 / (c u)`` below them (``1 <= c <= n``) and leaves a wide gap in the sorted
magnitudes. A gradient that is genuinely small (vanishing through a deep stack) is the
continuation of the larger ones, each layer within a modest gain of the next, and leaves
no such gap however small it gets. The gap threshold ``u ** -0.5`` is the geometric middle
between "comparable" (ratio 1) and "one rounding unit apart" (ratio ``1 / u``): a residue
is detected while ``c <= u ** -0.5`` (float32: 4096, i.e. up to about 1.7e7 accumulated
terms at the typical ``sqrt(n)`` growth), and a chain of real gradients is never cut
unless two consecutive layers differ by more than that factor. Condition 2 alone is not
enough: the demo's 13-layer sigmoid stack (``deploy.demo``, float32) has its first layers
at 0.12 to 0.8 u of the largest layer at every step (a real gradient, vanishing), with no
gap wider than about 5 between consecutive layers. Measured on a config-built 2-layer BERT
(``BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
intermediate_size=37, vocab_size=99)``, float32, Hugging Face Trainer, 20 steps, batches
of 2 x 8 or 8 x 16 random tokens; ``tests/integration/test_no_gradient_by_construction.py``):
the key biases stay below 3.2e-4 u of the largest layer and at least 2.7e5 below the next
smallest layer; every other layer stays above 6 u of the largest.

A layer has **no gradient by construction** when it was at rounding level at every frame
of the run in which it was reported, from its first on. The first frame in which it is
not makes it an ordinary layer for the rest of the run (a layer that had a gradient and
then lost it is never excluded, even with the option). The consumer decides frame by
frame, in arrival order (:class:`consumer.health_tracker.RunHealthTracker`); the store's SQL
(:func:`rounding_rows_sql`) decides in step order; the two agree whenever frames are
finalised in step order (a late shard rewriting an earlier frame can differ at that
frame only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_DTYPE = "float32"
"""Dtype assumed for a layer whose gradient dtype was not sent (``RunStarted.dtypes`` is
optional) or is not in :data:`DTYPE_EPS`."""

DTYPE_EPS: dict[str, float] = {
    "float64": float(np.finfo(np.float64).eps),  # 2^-52
    "float32": float(np.finfo(np.float32).eps),  # 2^-23
    "float16": float(np.finfo(np.float16).eps),  # 2^-10
    "bfloat16": 2.0**-7,  # 8 significand bits (7 stored)
}
"""Machine epsilon (distance from 1.0 to the next larger number) per gradient dtype name,
as the producer writes it (``producer.adapters.torch.dtype_name``: ``torch.bfloat16`` ->
``"bfloat16"``; NumPy / JAX dtype names)."""


def unit_roundoff(dtypes: Sequence[str | None] | None, num_layers: int) -> np.ndarray:
    """Per-layer unit roundoff ``u_l = eps(dtype_l) / 2`` (module doc).

    Args:
        dtypes: L gradient dtype names (``RunStarted.dtypes`` / ``layers.dtype``), None
            entries or None for unknown.
        num_layers: L.

    Returns:
        float64[L]; unknown dtypes get :data:`DEFAULT_DTYPE`'s.

    Raises:
        ValueError: ``dtypes`` does not have L entries.
    """
    default = DTYPE_EPS[DEFAULT_DTYPE] / 2.0
    if dtypes is None:
        return np.full(num_layers, default)
    if len(dtypes) != num_layers:
        raise ValueError(f"dtypes has {len(dtypes)} entries for {num_layers} layers")
    return np.array([DTYPE_EPS.get(d, DTYPE_EPS[DEFAULT_DTYPE]) / 2.0 if d else default
                     for d in dtypes], dtype=np.float64)


def gradient_magnitude(mean_abs: np.ndarray, sum_sq: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Per-row magnitude ``a``: mean |g| where known, else the RMS (norms mode).

    Args:
        mean_abs: float64[n] mean |g| (NaN where unknown). sum_sq: float64[n] sum g^2.
        numel: int64[n] elements (> 0).

    Returns:
        float64[n], in gradient units.
    """
    return np.where(np.isnan(mean_abs), np.sqrt(sum_sq / numel), mean_abs)


def at_rounding_level(magnitude: np.ndarray, roundoff: np.ndarray,
                      nonfinite: np.ndarray) -> np.ndarray:
    """Which rows of one frame are at rounding level (module doc, conditions 1-3).

    Args:
        magnitude: float64[n] ``a`` of every row of the frame (:func:`gradient_magnitude`).
        roundoff: float64[n] unit roundoff ``u`` of each row's layer.
        nonfinite: int[n] NaN/Inf element counts.

    Returns:
        bool[n]. O(n) when no row passes condition 2, else O(n log n) (one sort).
    """
    n = magnitude.size
    out = np.zeros(n, bool)
    finite = np.isfinite(magnitude)
    if n == 0 or not finite.any():
        return out
    top = float(magnitude[finite].max())
    if not top > 0.0:
        return out
    candidate = finite & (nonfinite == 0) & (magnitude <= roundoff * top)
    if not candidate.any():
        return out
    order = np.argsort(-np.where(finite, magnitude, -np.inf), kind="stable")
    s = magnitude[order]
    above, below = s[:-1], s[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(below > 0, above / below, np.where(above > 0, np.inf, 1.0))
    widest = np.empty(n)
    widest[0] = 1.0
    widest[1:] = np.maximum.accumulate(gap)
    detached = np.empty(n)
    detached[order] = widest
    return candidate & (detached * np.sqrt(roundoff) >= 1.0)


def roundoff_sql(dtype_column: str) -> str:
    """SQL expression of ``u`` for a dtype column (same values as :func:`unit_roundoff`)."""
    whens = " ".join(f"WHEN '{name}' THEN {eps / 2.0!r}::DOUBLE"
                     for name, eps in DTYPE_EPS.items())
    return (f"CASE {dtype_column} {whens} "
            f"ELSE {DTYPE_EPS[DEFAULT_DTYPE] / 2.0!r}::DOUBLE END")


LARGEST_ROUNDOFF: float = max(DTYPE_EPS.values()) / 2.0
"""The largest ``u`` of any dtype (bfloat16's, 2^-8): a row above ``LARGEST_ROUNDOFF * A``
fails condition 2 whatever its layer's dtype."""

def magnitude_sql(table: str = "") -> str:
    """SQL of a row's magnitude ``a`` (:func:`gradient_magnitude`) over the ``layer_stats``
    columns of ``table`` (an alias, or "" for unqualified columns)."""
    t = f"{table}." if table else ""
    return f"coalesce({t}mean_abs_grad, sqrt({t}sum_sq / {t}numel))"


def gap_sql(window: str) -> str:
    """SQL of a row's ratio to the next larger magnitude of its frame (condition 3's
    consecutive ratio, ``x / 0 = inf`` for ``x > 0``, ``0 / 0 = 1``; NULL for the largest),
    over a column ``magnitude`` and the named ``window`` (one frame's rows ordered by
    ``magnitude DESC, layer_index``)."""
    return (f"CASE WHEN magnitude > 0 THEN lag(magnitude) OVER {window} / magnitude "
            f"WHEN lag(magnitude) OVER {window} > 0 THEN 'infinity'::DOUBLE ELSE 1.0 END")


def widest_gap_sql(frame: str) -> str:
    """SQL of ``W_l`` (condition 3): the widest ``gap`` from the frame's largest magnitude
    down to this row, the frame's rows being those of the same ``frame`` columns (e.g.
    ``"step"`` or ``"run_id, step"``)."""
    return (f"max(gap) OVER (PARTITION BY {frame} ORDER BY magnitude DESC, layer_index "
            "ROWS UNBOUNDED PRECEDING)")


def at_rounding_sql(magnitude: str, top: str, roundoff: str, widest: str,
                    nonfinite: str | None = "nonfinite") -> str:
    """SQL of the judgement of one row (module doc, conditions 1-3), NULL read as False.

    ``nonfinite=None`` leaves out condition 1 (``nonfinite = 0 AND top > 0``), for rows
    already known to meet it (the stored candidates of :mod:`schemas.frame_summary`).
    Every reader of the judgement builds it from this one expression, so that a judgement
    from stored inputs is the one :func:`rounding_rows_sql` makes.
    """
    first = "" if nonfinite is None else f"{nonfinite} = 0 AND {top} > 0 AND "
    return (f"coalesce({first}{magnitude} <= {roundoff} * {top} "
            f"AND {widest} * sqrt({roundoff}) >= 1.0, false)")


def rounding_rows_sql(with_dtype: bool = True, with_nan: bool | None = None) -> str:
    """SQL relation: one run's ``layer_stats`` rows up to a step, judged (module doc).

    Args:
        with_dtype: read ``layers.dtype``; False for a store whose ``layers`` table has
            no such column (every layer counts as float32).
        with_nan: also give the row's NaN count, ``nan``: True reads
            ``layer_stats.nan``; False gives NULL (a store without the column); None
            (default) leaves the column out.

    Parameters ``$run_id`` and ``$to_step`` (inclusive; NULL = the whole run). Columns:
    ``step``, ``layer_index``, ``is_vanishing``, ``is_exploding``, ``nonfinite``
    (as stored), ``magnitude`` (``a``), ``at_rounding`` (conditions 1-3 at that frame),
    ``first_step`` (the layer's first stored step) and ``no_gradient``: every frame of the
    layer up to and including this one was at rounding level (``step < s0`` where ``s0``
    is the layer's first step not at rounding level, or always when there is none). The
    frame of a row is the run's stored rows of that step. Cost: two window passes
    partitioned by step (a sort within each step) and one by layer, O(rows log L).
    """
    nan = "" if with_nan is None else (" s.nan," if with_nan else " NULL::BIGINT AS nan,")
    nan_out = "" if with_nan is None else " nan,"
    return f"""
    WITH gs_base AS (
        SELECT s.step, s.layer_index, s.is_vanishing, s.is_exploding, s.nonfinite,{nan}
               {magnitude_sql("s")} AS magnitude,
               {roundoff_sql("l.dtype" if with_dtype else "NULL")} AS roundoff
        FROM layer_stats AS s
        LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
        WHERE s.run_id = $run_id AND ($to_step IS NULL OR s.step <= $to_step)
    ),
    gs_gaps AS (
        SELECT *,
               max(magnitude) OVER (PARTITION BY step) AS top,
               {gap_sql("gs_w")} AS gap
        FROM gs_base
        WINDOW gs_w AS (PARTITION BY step ORDER BY magnitude DESC, layer_index)
    ),
    gs_judged AS (
        SELECT *,
               {at_rounding_sql("magnitude", "top", "roundoff", widest_gap_sql("step"))}
                   AS at_rounding
        FROM gs_gaps
    )
    SELECT step, layer_index, is_vanishing, is_exploding, nonfinite,{nan_out} magnitude,
           at_rounding,
           min(step) OVER (PARTITION BY layer_index) AS first_step,
           coalesce(step < min(step) FILTER (WHERE NOT at_rounding)
                               OVER (PARTITION BY layer_index), true) AS no_gradient
    FROM gs_judged
    """
