"""Seed 004 weight distribution analysis and weight drift, from the weight statistics the
producer sends with ``weight_stats=True`` (``GRADSTREAM_WEIGHT_STATS=1``; off by default).

The seed reads every weight; the telemetry carries, per layer and step, exactly mergeable
sums over the finite weights (``layer_stats``: ``weight_sum`` = sum w, ``weight_sum_sq``,
``weight_sum_cube``, ``weight_sum_quad``, ``weight_min``, ``weight_max``, ``weight_zeros``,
``weight_nonfinite`` and the base-2 exponent histogram of |w|), with ``numel -
weight_nonfinite`` finite weights. Everything here is computed from those, in SQL over
at most two steps plus one pass over the update norms in between.

Replicated parameters. Ranks merge like gradients: a tensor sharded over the ranks (FSDP)
is summed shard by shard into the whole tensor, while a data-parallel replica (DDP: every
rank holds the whole tensor) is summed once per rank, so a row then holds ``R`` identical
copies, ``R = numel / full numel`` (``numel`` of ``layer_stats`` against ``layers``). Every
sum is divided by ``R`` here, which gives one copy's statistics exactly (moments, count,
zero fraction, norms; the histogram's entropy does not change). A row of a sharded tensor
has ``R = 1``.

From the power sums ``S_k = sum w^k`` of ``n`` weights (central moments by the binomial
expansion): ``mean = S1 / n``, ``var = S2 / n - mean^2``, ``m3 = S3 / n - 3 mean S2 / n +
2 mean^3``, ``m4 = S4 / n - 4 mean S3 / n + 6 mean^2 S2 / n - 3 mean^4``; ``skewness = m3 /
std^3``, excess ``kurtosis = m4 / std^4 - 3`` (0 when std = 0, as in the seed). In float64
these are accurate while ``std / |mean|`` is not tiny (cancellation grows like
``(mean / std)^k``), which holds for trained weight tensors.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from analysis.analyses.render import ROWS_IN_TABLE, add_more_row, num, show_name, table
from analysis.analyses.stats import DEFAULT_ALPHA, max_normal_z
from analysis.store import StoreError, require_run, stats_params

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "WeightAnalysisReport",
    "WeightDistributionAnalysis",
    "WeightDriftAnalysis",
    "build_weight_analysis",
    "render_weights",
    "weight_statistics",
]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class WeightStatistics(_Model):
    """Distribution of a set of weights (seed 004 ``WeightStatistics``): ``mean``,
    ``std_dev`` (population), ``skewness``, excess ``kurtosis`` from the power sums (module
    docstring); ``min``, ``max`` of the finite weights; ``zero_fraction`` = exact zeros /
    finite weights; ``count``: finite weights.

    ``entropy``: Shannon entropy in bits of the distribution of |w| over base-2 exponent
    bins (the exponent histogram: one bin per binade [2^k, 2^(k+1)), plus exact zeros,
    underflow and overflow): ``-sum_k p_k log2 p_k``. 0 when every weight lies in one
    binade; each doubling of the number of binades used adds up to one bit. ``None``
    without a histogram. (The seed's ``log2(std)`` is a scale, not an entropy.)

    ``nonfinite``: NaN/Inf weights, which none of the other fields include (the seed's
    statistics would all be NaN). With no finite weight (``count = 0``) every statistic is
    NaN (``null`` in JSON).
    """

    mean: float
    std_dev: float
    skewness: float
    kurtosis: float
    entropy: float | None
    min: float
    max: float
    zero_fraction: float
    count: int
    nonfinite: int


class OutlierSeverity(StrEnum):
    """``Medium``: the extreme lies beyond what the largest |z| of the layer's own ``n``
    normal samples reaches with probability 1 - alpha; ``High``: beyond that bound even
    for all ``N`` weights of the model (:func:`analysis.analyses.stats.max_normal_z`)."""

    MEDIUM = "Medium"
    HIGH = "High"


class WeightOutlier(_Model):
    """An extreme weight of a layer (its min or max, ``side``) whose z-score
    ``|w - mean| / std`` exceeds the extreme-value bound of :class:`OutlierSeverity`.

    The seed tests every weight against ``|z| > 3``, which flags about 0.27 % of any
    normal tensor; the telemetry carries each layer's extremes, and a normal sample of n
    weights has a largest |z| near ``sqrt(2 ln n)``, so the bound grows with n. The
    seed's ``weight_index`` is left out: which element holds the extreme is not sent.
    """

    layer_index: int
    layer_name: str
    side: str
    value: float
    z_score: float
    severity: OutlierSeverity


class LayerWeightAnalysis(_Model):
    """One layer (seed 004 ``LayerWeightAnalysis``).

    ``health_score`` (seed 004 ``compute_weight_health_score``): 100, minus 20 if the
    layer has an outlier (the seed: ``|min|`` or ``|max| > 10``, a scale-dependent
    constant), minus 30 if ``zero_fraction > 0.5``, minus 15 if ``|skewness| > 2``, minus
    15 if ``kurtosis > 10``; at least 0. A layer with any NaN/Inf weight scores 0 (beyond
    the seed, whose statistics turn NaN there): the layer no longer computes anything.
    ``issues`` / ``recommendations``: one line per deduction.
    """

    layer_index: int
    layer_name: str
    statistics: WeightStatistics
    health_score: float
    issues: list[str]
    recommendations: list[str]


class DistributionHealthStatus(StrEnum):
    """Bands of the distribution health score (seed 004): Excellent >= 90, Good >= 75,
    Fair >= 60, Poor >= 40, Critical below."""

    EXCELLENT = "Excellent"
    GOOD = "Good"
    FAIR = "Fair"
    POOR = "Poor"
    CRITICAL = "Critical"


class DistributionHealth(_Model):
    """Seed 004 ``assess_distribution_health`` of the pooled statistics: 100, minus 25 if
    ``zero_fraction > 0.3``, minus 15 if ``|skewness| > 1``, minus 15 if ``kurtosis > 5``,
    minus 20 if any layer has an outlier (the seed: pooled ``|min|`` or ``|max| > 5``);
    0 (Critical) if any weight is NaN/Inf."""

    score: float
    status: DistributionHealthStatus


class WeightDistributionAnalysis(_Model):
    """Seed 004 ``WeightDistributionAnalysis`` at one step.

    ``overall_statistics`` pools the power sums, extremes, zeros and histograms of all
    layers (the exact statistics of all the model's weights; the seed averages the
    per-layer statistics, which mixes layers of any size with equal weight).
    ``layer_analyses`` and ``outlier_detection`` are in model order.
    """

    step: int
    layer_analyses: list[LayerWeightAnalysis]
    overall_statistics: WeightStatistics
    distribution_health: DistributionHealth
    outlier_detection: list[WeightOutlier]


class WeightDriftSeverity(StrEnum):
    """Orders of magnitude of the largest relative drift ``d``: Minimal ``d < 0.1 %``,
    Low ``d < 1 %``, Medium ``d < 10 %``, High otherwise."""

    MINIMAL = "Minimal"
    LOW = "Low"
    MEDIUM = "Medium"
    HIGH = "High"


class LayerWeightDrift(_Model):
    """How one layer's weights moved from step A to step B.

    - ``relative_norm_change``: ``(||w_B|| - ||w_A||) / ||w_A||``; its absolute value is a
      lower bound of the true relative drift ``||w_B - w_A|| / ||w_A||`` (reverse
      triangle inequality). ``None`` if ``||w_A|| = 0``.
    - ``mean_shift``: ``(mean_B - mean_A) / std_A`` (``None`` if ``std_A = 0``).
    - ``std_ratio``: ``std_B / std_A`` (``None`` if ``std_A = 0``).
    - ``relative_path_length``: ``sum_t ||w_t - w_prev|| / ||w_A||`` over the recorded
      steps in (A, B] (from ``update_sum_sq``): an upper bound of the true relative drift;
      ``None`` unless every such step of the layer carries an update norm.
    - ``mean_update_ratio``: mean over the recorded steps in (A, B] of the per-step
      update-to-weight ratio ``||w_t - w_prev|| / ||w_prev||`` (``update_to_weight``; a
      common rule of thumb puts healthy training near 1e-3, CS231n "Neural Networks 3");
      ``None`` without update norms.
    - ``stalled``: ``mean_update_ratio`` is below float32's machine epsilon 2^-23 (IEEE
      754 binary32): a typical element moves by less than one unit in the last place of
      its own float32 value per step, so the layer's weights barely train at all (what
      vanishing gradients do to the layers far from the loss).
    - ``nonfinite``: the layer has NaN/Inf weights at B; its other fields are then
      ``None`` (the norms, mean and std of a diverged tensor mean nothing).
    """

    layer_index: int
    layer_name: str
    relative_norm_change: float | None
    mean_shift: float | None
    std_ratio: float | None
    relative_path_length: float | None
    mean_update_ratio: float | None
    stalled: bool
    nonfinite: bool


class WeightDriftAnalysis(_Model):
    """Seed 004 ``WeightDriftAnalysis`` between two steps with weight statistics.

    With ``d_l = |relative_norm_change|`` per layer (layers with ``||w_A|| > 0`` and
    finite weights at B): ``mean_drift`` = mean of ``d_l``, ``max_drift`` = max,
    ``severity`` = :class:`WeightDriftSeverity` of ``max_drift``, High if any layer's
    weights became NaN/Inf; ``affected_layers``: model-order indices of the layers whose
    own ``d_l`` is Medium or High or whose weights became NaN/Inf (``affected_layer_names``
    their names); ``stalled_layers`` / ``stalled_layer_names``: the layers marked
    ``stalled`` (:class:`LayerWeightDrift`). The true drift needs the inner product of
    w_A and w_B, which per-layer sums do not carry; ``d_l`` and ``relative_path_length``
    bracket it.
    """

    from_step: int
    to_step: int
    mean_drift: float
    max_drift: float
    severity: WeightDriftSeverity
    affected_layers: list[int]
    affected_layer_names: list[str]
    stalled_layers: list[int]
    stalled_layer_names: list[str]
    layer_drifts: list[LayerWeightDrift]


class WeightAnalysisReport(_Model):
    """The weight distribution at the last step with weight statistics in the range, and
    the drift from the first such step to it (``None`` with a single such step).
    ``first_nonfinite_step``: the first step in the range at which some layer had NaN/Inf
    weights (``None`` if none did), with those layers in ``first_nonfinite_layers``
    (names, model order)."""

    run_id: str
    from_step: int | None
    to_step: int | None
    alpha: float
    first_nonfinite_step: int | None
    first_nonfinite_layers: list[str]
    distribution: WeightDistributionAnalysis
    drift: WeightDriftAnalysis | None


def weight_statistics(
    n: np.ndarray, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray, s4: np.ndarray
) -> dict[str, np.ndarray]:
    """Mean, std, skewness and excess kurtosis from power sums (module docstring).

    Args:
        n: float64 ``[K]`` finite weights per set; s1..s4: float64 ``[K]`` ``sum w^k``.

    Returns:
        ``{"mean", "std", "skewness", "kurtosis"}`` float64 ``[K]``; NaN for ``n = 0``;
        skewness 0 for ``n < 3`` or std 0, kurtosis 0 for ``n < 4`` or std 0 (seed).
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s1 / n
        e2, e3, e4 = s2 / n, s3 / n, s4 / n
        var = np.maximum(e2 - mean * mean, 0.0)
        m3 = e3 - 3.0 * mean * e2 + 2.0 * mean**3
        m4 = e4 - 4.0 * mean * e3 + 6.0 * mean**2 * e2 - 3.0 * mean**4
        std = np.sqrt(var)
        ok = std > 0
        skew = np.where(ok & (n >= 3), m3 / np.where(ok, std**3, 1.0), 0.0)
        kurt = np.where(ok & (n >= 4), m4 / np.where(ok, var * var, 1.0) - 3.0, 0.0)
    empty = ~(n > 0)
    return {
        "mean": np.where(empty, np.nan, mean),
        "std": np.where(empty, np.nan, std),
        "skewness": np.where(empty, np.nan, skew),
        "kurtosis": np.where(empty, np.nan, kurt),
    }


WEIGHT_COLUMNS: tuple[str, ...] = (
    "weight_sum", "weight_sum_sq", "weight_sum_cube", "weight_sum_quad", "weight_min",
    "weight_max", "weight_zeros", "weight_nonfinite", "weight_exp_hist_columns",
    "weight_exp_hist_counts", "update_sum_sq",
)
"""``layer_stats`` columns the weight analysis reads (schema 1.2, ``schemas.tables``)."""

_RANGE_SQL = """
    SELECT min(step), max(step) FROM layer_stats
    WHERE run_id = $run_id
      AND ($from_step IS NULL OR step >= $from_step)
      AND ($to_step IS NULL OR step <= $to_step)
      AND weight_sum IS NOT NULL
"""

_ENTROPY = (
    "CASE WHEN {c} IS NULL OR list_sum({c}) = 0 THEN NULL ELSE "
    "list_sum(list_transform({c}, lambda x: -(x / list_sum({c})) * log2(x / list_sum({c}))))"
    " END"
)

_REPLICAS = (
    "CASE WHEN {l}.numel > 0 AND {s}.numel >= {l}.numel AND {s}.numel % {l}.numel = 0 "
    "THEN ({s}.numel // {l}.numel)::DOUBLE ELSE 1.0 END"
)
"""Copies of the tensor merged into a ``layer_stats`` row (SQL over aliases ``s``/``l``):
``numel`` over the layer's full ``numel`` from ``RunStarted`` when that is a whole number,
else 1 (a sharded tensor, or a partial frame of one)."""

_STEP_SQL = f"""
    WITH r AS (
        SELECT s.*, l.name, {_REPLICAS.format(s="s", l="l")} AS replicas
        FROM layer_stats AS s
        LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
        WHERE s.run_id = $run_id AND s.step = $step AND s.weight_sum IS NOT NULL
    )
    SELECT layer_index,
           coalesce(name, 'layer[' || CAST(layer_index AS VARCHAR) || ']') AS name,
           (numel - coalesce(weight_nonfinite, 0))::DOUBLE / replicas AS n,
           weight_sum / replicas AS weight_sum, weight_sum_sq / replicas AS weight_sum_sq,
           weight_sum_cube / replicas AS weight_sum_cube,
           weight_sum_quad / replicas AS weight_sum_quad,
           weight_min, weight_max, coalesce(weight_zeros, 0)::DOUBLE / replicas AS zeros,
           coalesce(weight_nonfinite, 0)::DOUBLE / replicas AS nonfinite,
           {_ENTROPY.format(c="weight_exp_hist_counts")} AS entropy
    FROM r
    ORDER BY layer_index
"""

_POOLED_HIST_SQL = """
    WITH h AS (
        SELECT unnest(weight_exp_hist_columns) AS col, unnest(weight_exp_hist_counts) AS cnt
        FROM layer_stats
        WHERE run_id = $run_id AND step = $step AND weight_sum IS NOT NULL
    )
    SELECT sum(cnt)::DOUBLE FROM h GROUP BY col
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


_FIRST_NONFINITE_SQL = """
    WITH first AS (
        SELECT min(step) AS step FROM layer_stats
        WHERE run_id = $run_id AND weight_nonfinite > 0
          AND ($from_step IS NULL OR step >= $from_step)
          AND ($to_step IS NULL OR step <= $to_step)
    )
    SELECT first.step,
           list(coalesce(l.name, 'layer[' || CAST(s.layer_index AS VARCHAR) || ']')
                ORDER BY s.layer_index)
    FROM first
    JOIN layer_stats AS s ON s.run_id = $run_id AND s.step = first.step
    LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index
    WHERE s.weight_nonfinite > 0
    GROUP BY first.step
"""

FLOAT32_EPSILON = 2.0**-23
"""Machine epsilon of IEEE 754 binary32: the relative spacing of float32 values at 1."""


def _fetch_step(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> dict[str, np.ndarray]:
    raw = con.sql(_STEP_SQL, params={"run_id": run_id, "step": step}).fetchnumpy()
    out: dict[str, np.ndarray] = {}
    for key, column in raw.items():
        if key == "name":
            out[key] = np.asarray(column.tolist(), dtype=object)
        elif np.ma.isMaskedArray(column):
            out[key] = column.astype(np.float64).filled(np.nan)
        else:
            out[key] = np.asarray(column, dtype=np.float64 if key != "layer_index" else np.int64)
    return out


def _issues(stats: WeightStatistics, outlier: bool) -> tuple[float, list[str], list[str]]:
    score, issues, recs = 100.0, [], []
    if stats.nonfinite:
        share = stats.nonfinite / (stats.nonfinite + stats.count)
        issues.append(f"{stats.nonfinite} weights ({share:.1%}) are NaN/Inf")
        recs.append("The weights diverged: resume from a checkpoint before the first "
                    "non-finite step with a lower learning rate or gradient clipping, and "
                    "skip optimiser steps whose gradients are not finite.")
        return 0.0, issues, recs
    if outlier:
        score -= 20
        issues.append("Extreme weight values beyond what the layer's distribution explains")
        recs.append("Add weight decay or weight clipping, and check the layer's updates.")
    if stats.zero_fraction > 0.5:
        score -= 30
        issues.append(f"{stats.zero_fraction:.0%} of the weights are exactly zero")
        recs.append("Lower the learning rate or change the activation; zeroed weights often "
                    "come from dead units or aggressive pruning.")
    if abs(stats.skewness) > 2:
        score -= 15
        issues.append(f"Highly skewed weight distribution (skewness {stats.skewness:.2g})")
        recs.append("Consider weight normalisation or a different initialisation.")
    if stats.kurtosis > 10:
        score -= 15
        issues.append(f"Heavy-tailed weight distribution (excess kurtosis {stats.kurtosis:.2g})")
        recs.append("Watch for gradient instability: a few large weights dominate.")
    return max(score, 0.0), issues, recs


def _distribution(
    con: duckdb.DuckDBPyConnection, run_id: str, step: int, alpha: float
) -> tuple[WeightDistributionAnalysis, dict[str, np.ndarray]]:
    data = _fetch_step(con, run_id, step)
    n = data["n"]
    moments = weight_statistics(n, data["weight_sum"], data["weight_sum_sq"],
                                data["weight_sum_cube"], data["weight_sum_quad"])
    total_n = float(n.sum())
    z_layer = max_normal_z(n, alpha)
    z_model = float(max_normal_z(total_n, alpha))
    layers, outliers = [], []
    for i in range(n.size):
        stats = _stats(
            moments["mean"][i], moments["std"][i], moments["skewness"][i],
            moments["kurtosis"][i], data["entropy"][i], data["weight_min"][i],
            data["weight_max"][i], data["zeros"][i], n[i], data["nonfinite"][i],
        )
        found = []
        if stats.std_dev > 0:
            for side, value in (("min", stats.min), ("max", stats.max)):
                z = abs(value - stats.mean) / stats.std_dev
                if z > z_layer[i]:
                    severity = OutlierSeverity.HIGH if z > z_model else OutlierSeverity.MEDIUM
                    found.append(WeightOutlier(
                        layer_index=int(data["layer_index"][i]), layer_name=data["name"][i],
                        side=side, value=value, z_score=z, severity=severity,
                    ))
        outliers += found
        score, issues, recs = _issues(stats, bool(found))
        layers.append(LayerWeightAnalysis(
            layer_index=int(data["layer_index"][i]), layer_name=data["name"][i],
            statistics=stats, health_score=score, issues=issues, recommendations=recs,
        ))
    pooled = weight_statistics(
        np.array([total_n]), *(np.array([data[k].sum()]) for k in
                              ("weight_sum", "weight_sum_sq", "weight_sum_cube",
                               "weight_sum_quad"))
    )
    hist = np.asarray(
        [r[0] for r in con.execute(_POOLED_HIST_SQL, {"run_id": run_id, "step": step}).fetchall()],
        dtype=np.float64,
    )
    overall = _stats(
        pooled["mean"][0], pooled["std"][0], pooled["skewness"][0], pooled["kurtosis"][0],
        _entropy(hist) if hist.size and not np.isnan(data["entropy"]).any() else math.nan,
        float(np.min(data["weight_min"], where=n > 0, initial=np.inf)),
        float(np.max(data["weight_max"], where=n > 0, initial=-np.inf)),
        float(data["zeros"].sum()), total_n, float(data["nonfinite"].sum()),
    )
    score = 100.0
    score -= 25 if overall.zero_fraction > 0.3 else 0
    score -= 15 if abs(overall.skewness) > 1 else 0
    score -= 15 if overall.kurtosis > 5 else 0
    score -= 20 if outliers else 0
    score = 0.0 if overall.nonfinite else score
    status = (
        DistributionHealthStatus.EXCELLENT if score >= 90
        else DistributionHealthStatus.GOOD if score >= 75
        else DistributionHealthStatus.FAIR if score >= 60
        else DistributionHealthStatus.POOR if score >= 40
        else DistributionHealthStatus.CRITICAL
    )
    return WeightDistributionAnalysis(
        step=step, layer_analyses=layers, overall_statistics=overall,
        distribution_health=DistributionHealth(score=score, status=status),
        outlier_detection=outliers,
    ), {**data, **moments}


def _entropy(counts: np.ndarray) -> float:
    """Shannon entropy (bits) of a histogram's counts."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum()) + 0.0


def _stats(mean: float, std: float, skew: float, kurt: float, entropy: float, lo: float,
           hi: float, zeros: float, n: float, nonfinite: float) -> WeightStatistics:
    known = n > 0
    return WeightStatistics(
        mean=float(mean), std_dev=float(std), skewness=float(skew), kurtosis=float(kurt),
        entropy=None if math.isnan(entropy) or not known else float(entropy),
        min=float(lo) if known else math.nan, max=float(hi) if known else math.nan,
        zero_fraction=float(zeros / n) if known else math.nan, count=round(n),
        nonfinite=round(nonfinite),
    )


def _drift_class(d: float) -> WeightDriftSeverity:
    if d < 1e-3:
        return WeightDriftSeverity.MINIMAL
    if d < 1e-2:
        return WeightDriftSeverity.LOW
    if d < 1e-1:
        return WeightDriftSeverity.MEDIUM
    return WeightDriftSeverity.HIGH


def _drift(
    con: duckdb.DuckDBPyConnection, run_id: str, a: int, b: int, last: dict[str, np.ndarray]
) -> WeightDriftAnalysis:
    first = _fetch_step(con, run_id, a)
    first_m = weight_statistics(first["n"], first["weight_sum"], first["weight_sum_sq"],
                                first["weight_sum_cube"], first["weight_sum_quad"])
    paths = {
        int(index): (path, missing, ratio)
        for index, path, missing, ratio in con.execute(
            _PATH_SQL, {"run_id": run_id, "a": a, "b": b}
        ).fetchall()
    }
    at_b = {int(k): i for i, k in enumerate(last["layer_index"])}
    drifts, values, diverged = [], [], []
    for i, index in enumerate(first["layer_index"].tolist()):
        j = at_b.get(index)
        if j is None:
            continue
        name = first["name"][i]
        path, missing, ratio = paths.get(index, (None, 1, None))
        ratio = None if ratio is None or math.isnan(ratio) else float(ratio)
        stalled = ratio is not None and ratio < FLOAT32_EPSILON
        if last["nonfinite"][j] > 0 or first["nonfinite"][i] > 0:
            diverged.append((index, name))
            drifts.append(LayerWeightDrift(
                layer_index=index, layer_name=name, relative_norm_change=None,
                mean_shift=None, std_ratio=None, relative_path_length=None,
                mean_update_ratio=ratio, stalled=stalled, nonfinite=True,
            ))
            continue
        norm_a = math.sqrt(first["weight_sum_sq"][i])
        norm_b = math.sqrt(last["weight_sum_sq"][j])
        std_a = first_m["std"][i]
        change = (norm_b - norm_a) / norm_a if norm_a > 0 else None
        if change is not None:
            values.append((abs(change), index, name))
        drifts.append(LayerWeightDrift(
            layer_index=index, layer_name=name, relative_norm_change=change,
            mean_shift=(last["mean"][j] - first_m["mean"][i]) / std_a if std_a > 0 else None,
            std_ratio=last["std"][j] / std_a if std_a > 0 else None,
            relative_path_length=(
                path / norm_a if norm_a > 0 and missing == 0 and path is not None else None
            ),
            mean_update_ratio=ratio, stalled=stalled, nonfinite=False,
        ))
    magnitudes = np.array([v[0] for v in values])
    top = float(magnitudes.max()) if magnitudes.size else 0.0
    drifting = {index for d, index, _ in values
                if _drift_class(d) in (WeightDriftSeverity.MEDIUM, WeightDriftSeverity.HIGH)}
    drifting |= {index for index, _ in diverged}
    affected = [(x.layer_index, x.layer_name) for x in drifts if x.layer_index in drifting]
    stalled_layers = [(x.layer_index, x.layer_name) for x in drifts if x.stalled]
    return WeightDriftAnalysis(
        from_step=a, to_step=b,
        mean_drift=float(magnitudes.mean()) if magnitudes.size else 0.0,
        max_drift=top,
        severity=WeightDriftSeverity.HIGH if diverged else _drift_class(top),
        affected_layers=[x[0] for x in affected],
        affected_layer_names=[x[1] for x in affected],
        stalled_layers=[x[0] for x in stalled_layers],
        stalled_layer_names=[x[1] for x in stalled_layers],
        layer_drifts=drifts,
    )


def build_weight_analysis(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    alpha: float = DEFAULT_ALPHA,
) -> WeightAnalysisReport:
    """Weight distribution at the last step with weight statistics in the range, and the
    drift since the first such step.

    Args:
        con: a connection from :func:`analysis.store.open_store`.
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        alpha: significance level of the outlier bound.

    Returns:
        The :class:`WeightAnalysisReport`.

    Raises:
        StoreError: unknown run, invalid range, or no weight statistics in the range (the
            message says how to turn them on).
    """
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
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
    a, b = con.execute(_RANGE_SQL, params).fetchall()[0]
    if b is None:
        raise StoreError(
            f"run {run_id!r} has no weight statistics in the step range: record them with "
            "GradientProducer(..., weight_stats=True) or GRADSTREAM_WEIGHT_STATS=1 and pass "
            "weights= to record_step"
        )
    distribution, last = _distribution(con, run_id, int(b), alpha)
    drift = _drift(con, run_id, int(a), int(b), last) if a < b else None
    first_bad = con.execute(_FIRST_NONFINITE_SQL, params).fetchall()
    return WeightAnalysisReport(
        run_id=run_id, from_step=from_step, to_step=to_step, alpha=alpha,
        first_nonfinite_step=int(first_bad[0][0]) if first_bad else None,
        first_nonfinite_layers=list(first_bad[0][1]) if first_bad else [],
        distribution=distribution, drift=drift,
    )


def _pct(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.1%}"


_STATUS_STYLE = {
    DistributionHealthStatus.EXCELLENT: "green", DistributionHealthStatus.GOOD: "green",
    DistributionHealthStatus.FAIR: "yellow", DistributionHealthStatus.POOR: "dark_orange",
    DistributionHealthStatus.CRITICAL: "bold red",
}


def render_weights(report: WeightAnalysisReport) -> RenderableType:
    """The weight analysis as terminal tables: pooled statistics and health, per-layer
    statistics, outliers and the drift.

    Args:
        report: from :func:`build_weight_analysis`.

    Returns:
        A rich renderable.
    """
    dist = report.distribution
    o = dist.overall_statistics
    head = Text("weight analysis of run ", style="bold")
    head.append(show_name(report.run_id))
    head.append(f"  (step {dist.step}, {len(dist.layer_analyses)} layers)", style="dim")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    status = dist.distribution_health.status
    grid.add_row("distribution health", Text(f"{status.value} ({dist.distribution_health.score:g})",
                                             style=_STATUS_STYLE[status]))
    grid.add_row("all weights", f"mean {num(o.mean)}, std {num(o.std_dev)}, skew "
                 f"{num(o.skewness)}, kurtosis {num(o.kurtosis)}, entropy {num(o.entropy)} bits, "
                 f"range [{num(o.min)}, {num(o.max)}], zeros {_pct(o.zero_fraction)}")
    if report.first_nonfinite_step is not None:
        names = report.first_nonfinite_layers
        grid.add_row("NaN/Inf weights", Text(
            f"first at step {report.first_nonfinite_step} in "
            f"{', '.join(show_name(n) for n in names[:5])}"
            + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            + f"; {o.nonfinite} at step {dist.step}", style="bold red"))
    layers = table("layers (model order)", ["layer", "health", "mean", "std", "skew", "kurt",
                                            "zeros"], [False] + [True] * 6)
    extremes = table("extremes and entropy (model order)", ["layer", "min", "max",
                                                            "entropy (bits)", "issues"],
                     [False, True, True, True, False])
    for x in dist.layer_analyses[:ROWS_IN_TABLE]:
        s = x.statistics
        layers.add_row(show_name(x.layer_name), f"{x.health_score:g}", num(s.mean),
                       num(s.std_dev), num(s.skewness), num(s.kurtosis),
                       _pct(s.zero_fraction))
        extremes.add_row(show_name(x.layer_name), num(s.min), num(s.max), num(s.entropy),
                         "; ".join(x.issues) or "-")
    add_more_row(layers, len(dist.layer_analyses), ROWS_IN_TABLE)
    add_more_row(extremes, len(dist.layer_analyses), ROWS_IN_TABLE)
    parts: list[RenderableType] = [head, grid, layers, extremes]
    if dist.outlier_detection:
        out = table("outliers", ["layer", "side", "value", "z", "severity"],
                    [False, False, True, True, False])
        for w in dist.outlier_detection[:ROWS_IN_TABLE]:
            out.add_row(show_name(w.layer_name), w.side, num(w.value), num(w.z_score),
                        w.severity.value)
        add_more_row(out, len(dist.outlier_detection), ROWS_IN_TABLE)
        parts.append(out)
    if report.drift is not None:
        d = report.drift
        diverged = sum(x.nonfinite for x in d.layer_drifts)
        finite = len(d.layer_drifts) - diverged
        summary = [f"{diverged} layers with NaN/Inf weights"] if diverged else []
        if finite:
            summary.append(f"max {d.max_drift:.3%}, mean {d.mean_drift:.3%}")
        drift = table(f"weight drift, step {d.from_step} -> {d.to_step}: {d.severity.value} "
                      f"({'; '.join(summary)})",
                      ["layer", "norm change", "mean shift", "std ratio", "path",
                       "update/weight per step", "state"],
                      [False, True, True, True, True, True, False])
        for x in d.layer_drifts[:ROWS_IN_TABLE]:
            change, path = x.relative_norm_change, x.relative_path_length
            state = "NaN/Inf" if x.nonfinite else "stalled" if x.stalled else "-"
            drift.add_row(show_name(x.layer_name),
                          "-" if change is None else f"{change:+.3%}",
                          num(x.mean_shift), num(x.std_ratio),
                          "-" if path is None else f"{path:.3%}", num(x.mean_update_ratio),
                          state)
        add_more_row(drift, len(d.layer_drifts), ROWS_IN_TABLE)
        parts.append(drift)
        if d.stalled_layer_names:
            names = d.stalled_layer_names
            parts.append(Text(
                f"stalled (updates below float32 resolution): "
                f"{', '.join(show_name(n) for n in names[:8])}"
                + (f" and {len(names) - 8} more" if len(names) > 8 else ""), style="yellow"))
    return Group(*parts)
