"""Exactly mergeable per-layer statistics of gradients and weights, vectorised over layers.

The one home of the sums that travel from a training rank to the store: a rank computes
them (``producer.summary``, ``producer.weights``) and sends them in a StepSummary, a worker
merges the ranks of a step (``consumer.merge``, ``consumer.frames``), the store keeps them
in ``layer_stats`` and reloads them to merge a late rank (``consumer.outputs.duckdb``), and
the frame fields and the weight analysis are derived from them.

Protocol. Every class follows River's statistics protocol (``river.stats.Var`` and its
siblings): ``update`` folds raw values in and returns the statistic itself, ``a += b``
merges ``b`` into ``a``, ``a + b`` returns a new merged statistic and ``get`` returns the
derived value(s). Unlike River's scalar statistics, one object holds one entry per layer:
arrays of length ``L`` (the run's layers in model order, or the ``k`` layers of one
message), and every operation is vectorised over the layers.

=====================  ======================================================================
class                  state per layer
=====================  ======================================================================
GradientSums           numel, abs_numel, sum |g|, sum g^2, max |g|, non-finite count
ExponentHistogram      counts per base-2 exponent bin (``EXP_HIST_BINS`` columns), non-finite
SumOfSquares           numel, sum x^2 (weight norm, update norm)
PowerSums              finite count, S1..S4 = sum x^k, min, max, non-finite count
WeightMoments          PowerSums + ExponentHistogram of the same weights
=====================  ======================================================================

Merge rules: counts and sums add, extremes take the min / max (the wire contract,
``schemas.wire``; each field declares its rule, :mod:`schemas.stats.base`). Counts,
extremes and histograms merge exactly; a float sum merged from parts equals the sum of the
whole up to rounding: recursive summation of n terms has an absolute error of at most
``gamma_(n-1) * sum |x_i|`` with ``gamma_n = n u / (1 - n u)``, ``u = 2^-53`` (Higham [1],
section 4.2), whatever the order, so two orders differ by at most twice that (below
``1e-12 * sum |x_i|`` up to about 4500 terms per sum; the property test
``tests/schemas/stats/test_properties.py`` checks this bound).

The derived values follow trustformers-debug (frame fields: its ``gradient_flow`` module;
weight moments, with skewness and kurtosis 0 for a constant set: its ``weight_analysis``
module).

Moments are carried as power sums S_k, which merge by plain addition
(:mod:`schemas.stats.power_sums`).

Coverage. Every statistic counts the elements it covers (``numel``, or finite plus
non-finite counts), so optional statistics need no shard bookkeeping: a merged optional
statistic of a layer is complete when it covers as many elements as the layer's
:class:`GradientSums` (a rank that did not send it leaves it short), and ``sum |g|`` /
``max |g|`` are known when ``abs_numel == numel`` (norms-mode shards send neither).

Construction: ``Cls.empty(L)``; ``Cls.from_columns(...)`` from aligned arrays as stored in
``layer_stats`` (NaN for a NULL float; ``to_columns`` is its inverse);
``Cls.from_message(message)`` from the ``k`` layers of a StepSummary or MergedFrame, aligned
with its ``layer_indices`` (None when the message does not carry the statistic; the sums of
squares take the field name, the histogram ``weights=True`` for the weights'); from raw
values, ``update(values, layer)`` or ``Cls.from_layers(arrays)`` (one array per layer).

Merging and reading: ``a.merge_at(layers, b)`` merges a ``k``-layer statistic into layers
``layers`` of an ``L``-layer one (``ExponentHistogram.merge_columns`` and
``WeightMoments.merge_message`` do the same from the sparse wire form); ``take`` selects
layers, ``pooled`` merges all layers into one, ``per_copy`` reads one of R identical
copies merged into a layer (a replicated tensor), ``state`` / ``exact_fields`` expose the
arrays for comparisons.

Modules: :mod:`~schemas.stats.base` (the protocol and the merge rules),
:mod:`~schemas.stats.csr` (the sparse histogram form), one module per statistic, and
:mod:`~schemas.stats.chunks` (float64 scratch chunks).

Adding a statistic: a module with a :class:`LayerStatistic` dataclass subclass (fields
declared with their merge rule, from which ``empty`` and the merges follow;
``_update_layer``, ``_update_elements``,
``from_columns``, ``to_columns``, ``from_message``, ``get``; a class docstring with
Parameters, Examples and References), exported here and listed in :data:`STATISTICS`.

References:
    [1] N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM,
        2002: section 3.1 (gamma_n), section 4.2 (recursive summation).
"""

from __future__ import annotations

from schemas.stats.base import MAX_DOUBLE, LayerStatistic, SummaryMessage
from schemas.stats.csr import csr_from_dense, csr_from_lists
from schemas.stats.exponent_histogram import (
    EXP_HIST_BINS,
    EXP_HIST_MAX,
    EXP_HIST_MIN,
    ExponentHistogram,
    exp_hist_column,
    exponent_lut,
)
from schemas.stats.gradient_sums import GradientSums, gradient_sums_of_layers
from schemas.stats.power_sums import WEIGHT_POWER_SUMS, PowerSums
from schemas.stats.sum_of_squares import SumOfSquares
from schemas.stats.weight_moments import WeightMoments

__all__ = [
    "EXP_HIST_BINS",
    "EXP_HIST_MAX",
    "EXP_HIST_MIN",
    "MAX_DOUBLE",
    "STATISTICS",
    "WEIGHT_POWER_SUMS",
    "ExponentHistogram",
    "GradientSums",
    "LayerStatistic",
    "PowerSums",
    "SumOfSquares",
    "SummaryMessage",
    "WeightMoments",
    "csr_from_dense",
    "csr_from_lists",
    "exp_hist_column",
    "exponent_lut",
    "gradient_sums_of_layers",
]

STATISTICS: tuple[type[LayerStatistic], ...] = (
    GradientSums, ExponentHistogram, SumOfSquares, PowerSums, WeightMoments,
)
"""Every mergeable statistic class (the property test runs over this registry)."""
