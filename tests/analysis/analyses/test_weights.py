"""Weight distribution and drift from weight statistics in a real DuckDB file."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import numpy as np
import pytest

from analysis.analyses.weights import build_weight_analysis
from analysis.analyses.weights.models import (
    DistributionHealthStatus,
    OutlierSeverity,
    WeightAnalysisReport,
    WeightDriftSeverity,
)
from analysis.blocks.significance import max_normal_z
from analysis.read.connect import StoreError
from schemas.stats import PowerSums
from tests.analysis.crafted import open_read, write_history


def weights_of(path: Path, run: str = "r", **kw: object) -> WeightAnalysisReport:
    con = open_read(path)
    try:
        return build_weight_analysis(con, run, **kw)  # type: ignore[arg-type]
    finally:
        con.close()


def central(w: np.ndarray) -> tuple[float, float, float, float]:
    """Population mean, std, skewness, excess kurtosis, directly from the weights."""
    mean = w.mean()
    d = w - mean
    m2 = (d**2).mean()
    return mean, math.sqrt(m2), (d**3).mean() / m2**1.5, (d**4).mean() / m2**2 - 3


def store(tmp_path: Path, layers: list[np.ndarray], name: str = "s.duckdb",
          steps: int = 1, at: tuple[int, ...] = (0,), **kw: object) -> Path:
    norms = np.ones((len(layers), steps))
    weights = {(i, t): w for t in at for i, w in enumerate(layers)}
    numel = [w.size for w in layers]
    return write_history(tmp_path / name, norms, numel=numel, weights=weights, **kw)


def test_statistics_from_power_sums_by_hand(tmp_path: Path) -> None:
    """w = 0, 0.5, 0.75, 2, 3: mean 1.25, var 13.8125/5 - 1.5625 = 1.2; binades {0},
    [0.5, 1) x 2, [2, 4) x 2 -> entropy -(0.2 log2 0.2 + 2 x 0.4 log2 0.4) bits."""
    w = np.array([0.0, 0.5, 0.75, 2.0, 3.0])
    report = weights_of(store(tmp_path, [w]))
    s = report.distribution.layer_analyses[0].statistics
    _, _, skew, kurt = central(w)
    assert (s.mean, s.std_dev) == pytest.approx((1.25, math.sqrt(1.2)))
    assert (s.skewness, s.kurtosis) == pytest.approx((skew, kurt))
    assert s.entropy == pytest.approx(-(0.2 * math.log2(0.2) + 0.8 * math.log2(0.4)))
    assert (s.min, s.max, s.zero_fraction, s.count) == (0.0, 3.0, 0.2, 5)
    assert report.distribution.step == 0 and report.drift is None


def test_moments_from_stored_power_sums_match_numpy() -> None:
    """Sets of 50, 2 and 0 values and a constant set, read back from their stored power
    sums (``PowerSums.from_columns``, as the analysis reads them): NumPy's central moments
    where defined; skewness 0 below 3 values, both 0 for a constant set, NaN for an empty
    one."""
    rng = np.random.default_rng(7)
    sets = [rng.gamma(2.0, 1.5, 50) - 1.0, np.array([1.0, 3.0]), np.array([]), np.full(6, 2.5)]
    n = np.array([w.size for w in sets])
    sums = [np.array([(w**k).sum() for w in sets]) for k in (1, 2, 3, 4)]
    lo = [w.min() if w.size else 0.0 for w in sets]
    hi = [w.max() if w.size else 0.0 for w in sets]
    m = PowerSums.from_columns(n, *sums, lo, hi, np.zeros(4, np.int64)).get()
    mean, std, skew, kurt = central(sets[0])
    assert (m["mean"][0], m["std_dev"][0]) == pytest.approx((mean, std), rel=1e-12)
    assert (m["skewness"][0], m["kurtosis"][0]) == pytest.approx((skew, kurt), rel=1e-9)
    assert (m["mean"][1], m["std_dev"][1], m["skewness"][1], m["kurtosis"][1]) == (
        2.0, 1.0, 0.0, 0.0)
    assert all(np.isnan(m[k][2]) for k in ("mean", "std_dev", "skewness", "kurtosis"))
    assert (m["std_dev"][3], m["skewness"][3], m["kurtosis"][3]) == (0.0, 0.0, 0.0)


def test_one_binade_has_zero_entropy(tmp_path: Path) -> None:
    report = weights_of(store(tmp_path, [np.array([1.0, 1.25, 1.5, 1.75])]))
    assert report.distribution.layer_analyses[0].statistics.entropy == 0.0


def test_health_score_deductions(tmp_path: Path) -> None:
    """Zero-heavy [0 x 8, 1, -1]: kurtosis 2, 80 % zeros -> 70. Skewed [0 x 9, 10]: skew
    8/3, kurtosis 657/81 - 3, 90 % zeros -> 55. Neither extreme is an outlier (z <=
    3 < the bound for 10 normal samples)."""
    zero_heavy = np.r_[np.zeros(8), 1.0, -1.0]
    skewed = np.r_[np.zeros(9), 10.0]
    report = weights_of(store(tmp_path, [zero_heavy, skewed]))
    first, second = report.distribution.layer_analyses
    assert first.statistics.kurtosis == pytest.approx(2.0)
    assert first.health_score == 70
    assert first.issues == ["80% of the weights are exactly zero"]
    assert second.statistics.skewness == pytest.approx(8 / 3)
    assert second.statistics.kurtosis == pytest.approx(657 / 81 - 3)
    assert second.health_score == 55
    assert len(second.issues) == len(second.recommendations) == 2
    assert report.distribution.outlier_detection == []


def test_outliers_from_extreme_value_bounds(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    clean = rng.normal(0.0, 1.0, 100_000)
    base = rng.normal(0.0, 1.0, 999)

    def with_extreme(z_target: float) -> np.ndarray:
        lo, hi = 0.0, 100.0  # z of the added value grows with it: bisect
        for _ in range(100):
            v = (lo + hi) / 2
            w = np.r_[base, v]
            z = (v - w.mean()) / w.std()
            lo, hi = (v, hi) if z < z_target else (lo, v)
        return np.r_[base, (lo + hi) / 2]

    medium, high = with_extreme(4.8), with_extreme(20.0)
    total = clean.size + medium.size + high.size
    assert max_normal_z(1000) < 4.8 < max_normal_z(total)
    report = weights_of(store(tmp_path, [clean, medium, high]))
    outliers = report.distribution.outlier_detection
    assert [(o.layer_index, o.side, o.severity) for o in outliers] == [
        (1, "max", OutlierSeverity.MEDIUM), (2, "max", OutlierSeverity.HIGH)]
    assert outliers[0].z_score == pytest.approx(4.8, rel=1e-6)
    assert outliers[0].value == pytest.approx(medium.max())
    healths = [x.health_score for x in report.distribution.layer_analyses]
    assert healths[0] == 100 and healths[1] <= 80 and healths[2] <= 80


def test_pooled_statistics_equal_those_of_all_weights(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    layers = [rng.normal(0.1, 0.5, 300), rng.laplace(0.0, 2.0, 700), np.zeros(50)]
    report = weights_of(store(tmp_path, layers))
    everything = np.concatenate(layers)
    o = report.distribution.overall_statistics
    mean, std, skew, kurt = central(everything)
    assert (o.mean, o.std_dev, o.skewness, o.kurtosis) == pytest.approx((mean, std, skew, kurt))
    assert (o.min, o.max) == (everything.min(), everything.max())
    assert o.zero_fraction == pytest.approx(50 / 1050)
    _, exponents = np.frexp(np.abs(everything[everything != 0]))
    _, counts = np.unique(np.r_[exponents, np.full(50, -999)], return_counts=True)
    p = counts / counts.sum()
    assert o.entropy == pytest.approx(-(p * np.log2(p)).sum())
    health = report.distribution.distribution_health
    assert health.score == 100 - (15 if kurt > 5 else 0) - (15 if abs(skew) > 1 else 0) - (
        20 if report.distribution.outlier_detection else 0)
    assert health.status in DistributionHealthStatus


def test_replicated_layers_count_one_copy(tmp_path: Path) -> None:
    """Layer 0 is a data-parallel replica merged from 3 ranks (its row holds 3 copies,
    numel 3 x 40), layer 1 a single copy: per-layer and pooled statistics, the pooled
    exponent histogram (hence its entropy) included, are those of one copy of each."""
    rng = np.random.default_rng(8)
    a = np.r_[np.zeros(8), rng.normal(0.0, 4.0, 32)]
    b = rng.normal(0.0, 1e-3, 30)
    path = store(tmp_path, [np.tile(a, 3), b])
    con = duckdb.connect(str(path))
    try:
        con.execute("UPDATE layers SET numel = 40 WHERE layer_index = 0")
    finally:
        con.close()
    report = weights_of(path)
    first, second = (x.statistics for x in report.distribution.layer_analyses)
    assert (first.count, first.zero_fraction, second.count) == (40, 0.2, 30)
    assert (first.mean, first.std_dev) == pytest.approx(central(a)[:2])
    o = report.distribution.overall_statistics
    everything = np.r_[a, b]
    assert o.count == 70 and o.zero_fraction == pytest.approx(8 / 70)
    assert (o.mean, o.std_dev, o.skewness, o.kurtosis) == pytest.approx(central(everything))
    _, exponents = np.frexp(np.abs(everything[everything != 0]))
    _, counts = np.unique(np.r_[exponents, np.full(8, -999)], return_counts=True)
    p = counts / counts.sum()
    assert o.entropy == pytest.approx(-(p * np.log2(p)).sum())


def test_drift_between_two_steps(tmp_path: Path) -> None:
    """Layer 0 is scaled by 1.2 (norm +20 %: High) with recorded update norms; layer 1 does
    not move; layer 2 moves by 0.5 % but one of its update norms is missing."""
    rng = np.random.default_rng(2)
    w0, w1, w2 = rng.normal(0.2, 1.0, 500), rng.normal(0.0, 0.1, 200), rng.normal(0, 1, 100)
    weights = {(0, 0): w0, (1, 0): w1, (2, 0): w2,
               (0, 5): 1.2 * w0, (1, 5): w1, (2, 5): 1.005 * w2}
    update = np.full((3, 6), 1e-4)
    update[:, 0] = np.nan
    update[0, 1:] = [1.0, 4.0, 9.0, 16.0, 25.0]  # path 1 + 2 + 3 + 4 + 5 = 15
    update[2, 3] = np.nan
    path = write_history(tmp_path / "s.duckdb", np.ones((3, 6)), numel=[500, 200, 100],
                         weights=weights, update_sum_sq=update)
    report = weights_of(path)
    assert report.distribution.step == 5
    drift = report.drift
    assert drift is not None and (drift.from_step, drift.to_step) == (0, 5)
    first, second, third = drift.layer_drifts
    assert first.relative_norm_change == pytest.approx(0.2)
    mean, std, _, _ = central(w0)
    assert first.mean_shift == pytest.approx(0.2 * mean / std)
    assert first.std_ratio == pytest.approx(1.2)
    assert first.relative_path_length == pytest.approx(15 / np.linalg.norm(w0))
    assert second.relative_norm_change == pytest.approx(0.0, abs=1e-12)
    assert second.relative_path_length == pytest.approx(5 * 1e-2 / np.linalg.norm(w1))
    assert third.relative_norm_change == pytest.approx(0.005)
    assert third.relative_path_length is None
    assert drift.max_drift == pytest.approx(0.2)
    assert drift.mean_drift == pytest.approx((0.2 + 0.0 + 0.005) / 3)
    assert drift.severity is WeightDriftSeverity.HIGH
    assert drift.affected_layers == [0] and drift.affected_layer_names == ["layer0"]
    early = weights_of(path, to_step=4)  # only step 0 has weights up to here
    assert early.distribution.step == 0 and early.drift is None


def test_missing_weight_statistics_say_how_to_get_them(tmp_path: Path) -> None:
    path = write_history(tmp_path / "s.duckdb", np.ones((2, 3)))
    with pytest.raises(StoreError, match="weight_stats=True"):
        weights_of(path)
    with pytest.raises(StoreError, match="unknown run"):
        weights_of(path, run="other")


def test_stalled_layers_move_below_float32_resolution(tmp_path: Path) -> None:
    """Per-step update-to-weight ratios of 1e-8 (below 2^-23 ~ 1.2e-7) and 1e-6: only the
    first layer is stalled, and its mean ratio is the recorded one."""
    rng = np.random.default_rng(5)
    w = [rng.normal(0, 1, 300), rng.normal(0, 1, 300)]
    ratios = np.array([1e-8, 1e-6])
    norms_sq = np.array([np.sum(x**2) for x in w])
    update = np.repeat((ratios**2 * norms_sq)[:, None], 4, axis=1)
    update[:, 0] = np.nan
    path = store(tmp_path, w, steps=4, at=(0, 1, 2, 3), update_sum_sq=update)
    drift = weights_of(path).drift
    assert drift is not None
    first, second = drift.layer_drifts
    assert first.mean_update_ratio == pytest.approx(1e-8)
    assert second.mean_update_ratio == pytest.approx(1e-6)
    assert (first.stalled, second.stalled) == (True, False)
    assert drift.stalled_layers == [0] and drift.stalled_layer_names == ["layer0"]


def test_nonfinite_weights_are_critical(tmp_path: Path) -> None:
    """Layer 1 gets 3 NaN/Inf weights at step 2: its statistics cover the finite ones,
    its health and the distribution's are 0 (Critical), the drift marks it diverged and
    the report names the first such step and layer."""
    rng = np.random.default_rng(6)
    a, b = rng.normal(0, 1, 200), rng.normal(0, 1, 100)
    bad = b.copy()
    bad[[3, 50, 70]] = [np.nan, np.inf, -np.inf]
    weights = {(0, 0): a, (1, 0): b, (0, 2): a, (1, 2): bad, (0, 3): a, (1, 3): bad}
    path = write_history(tmp_path / "s.duckdb", np.ones((2, 4)), numel=[200, 100],
                         weights=weights)
    report = weights_of(path)
    assert report.first_nonfinite_step == 2 and report.first_nonfinite_layers == ["layer1"]
    healthy, broken = report.distribution.layer_analyses
    assert healthy.health_score == 100 and broken.health_score == 0
    assert broken.statistics.nonfinite == 3 and broken.statistics.count == 97
    finite = bad[np.isfinite(bad)]
    assert broken.statistics.mean == pytest.approx(finite.mean())
    assert report.distribution.overall_statistics.nonfinite == 3
    assert report.distribution.distribution_health.status is DistributionHealthStatus.CRITICAL
    drift = report.drift
    assert drift is not None
    assert [x.nonfinite for x in drift.layer_drifts] == [False, True]
    assert drift.layer_drifts[1].relative_norm_change is None
    assert drift.severity is WeightDriftSeverity.HIGH and drift.affected_layers == [1]
    assert weights_of(path, to_step=1).first_nonfinite_step is None


# -- the reference's rules (rules="reference"), answers worked out by hand from its formulas


def test_reference_rules_by_hand(tmp_path: Path) -> None:
    """One spike among n - 1 zeros has z = sqrt(n - 1), skewness (n - 2) / sqrt(n - 1),
    excess kurtosis (n^2 - 3n + 3) / (n - 1) - 3.

    A = [0 x 11, 12]: z = sqrt(11) = 3.32 > 3 -> Medium; |max| 12 > 10 (-20), zeros
    11/12 (-30), skewness 10 / sqrt(11) = 3.02 (-15), kurtosis 111/11 - 3 = 7.1 (no
    deduction): 35. std sqrt(11): entropy log2 sqrt(11).
    B = [0 x 26, 1]: z = sqrt(26) = 5.10 > 5 -> High; zeros (-30), skewness 25 / sqrt(26)
    (-15), kurtosis 651/26 - 3 = 22.0 (-15): 40. std sqrt(26) / 27 < 1: entropy 0.
    Overall = averages: zeros (11/12 + 26/27) / 2 > 0.3 (-25), skewness > 1 (-15),
    kurtosis > 5 (-15), max 12 > 5 (-20): 25, Critical.
    """
    a = np.r_[np.zeros(11), 12.0]
    b = np.r_[np.zeros(26), 1.0]
    path = store(tmp_path, [a, b])
    ref = weights_of(path, rules="reference")
    assert ref.rules == "reference"
    la, lb = ref.distribution.layer_analyses
    assert [(o.layer_index, o.side, o.severity) for o in ref.distribution.outlier_detection] == [
        (0, "max", OutlierSeverity.MEDIUM), (1, "max", OutlierSeverity.HIGH)]
    assert [o.z_score for o in ref.distribution.outlier_detection] == pytest.approx(
        [math.sqrt(11), math.sqrt(26)])
    assert la.health_score == 35 and lb.health_score == 40
    assert la.statistics.entropy == pytest.approx(math.log2(math.sqrt(11)))
    assert lb.statistics.entropy == 0.0
    o = ref.distribution.overall_statistics
    assert o.mean == pytest.approx((1.0 + 1 / 27) / 2)
    assert o.zero_fraction == pytest.approx((11 / 12 + 26 / 27) / 2)
    assert o.skewness == pytest.approx((10 / math.sqrt(11) + 25 / math.sqrt(26)) / 2)
    assert o.kurtosis == pytest.approx((111 / 11 - 3 + 651 / 26 - 3) / 2)
    assert (o.min, o.max, o.count) == (0.0, 12.0, 39)
    assert ref.distribution.distribution_health.score == 25
    assert ref.distribution.distribution_health.status is DistributionHealthStatus.CRITICAL
    ours = weights_of(path)
    assert ours.rules == "gradstream"
    # gradstream's entropy is that of the exponent histogram: A has 11 zeros and one
    # value in [8, 16).
    p = 11 / 12
    assert ours.distribution.layer_analyses[0].statistics.entropy == pytest.approx(
        -(p * math.log2(p) + (1 - p) * math.log2(1 - p)))


def test_reference_overall_extremes_start_from_zero(tmp_path: Path) -> None:
    """The reference folds min and max from a zero-initialised accumulator: one layer
    [6, 7] has overall min 0 (pooled: 6) and max 7 > 5 (-20 under the reference)."""
    path = store(tmp_path, [np.array([6.0, 7.0])])
    ref = weights_of(path, rules="reference").distribution
    ours = weights_of(path).distribution
    assert (ref.overall_statistics.min, ref.overall_statistics.max) == (0.0, 7.0)
    assert (ours.overall_statistics.min, ours.overall_statistics.max) == (6.0, 7.0)
    assert ref.distribution_health.score == 80 and ours.distribution_health.score == 100


def test_weight_health_is_the_layers_score_issues_and_recommendations() -> None:
    from analysis.analyses.weights.compute import weight_health
    from analysis.analyses.weights.models import WeightHealth, WeightStatistics

    stats = WeightStatistics(mean=0.0, std_dev=1.0, skewness=0.0, kurtosis=0.0, entropy=1.0,
                             min=-11.0, max=2.0, zero_fraction=0.6, count=10, nonfinite=0)
    ref = weight_health(stats, outlier=False, rules="reference")
    assert isinstance(ref, WeightHealth)
    assert ref.score == 50 and len(ref.issues) == len(ref.recommendations) == 2
    ours = weight_health(stats, outlier=False)
    assert ours.score == 70 and len(ours.issues) == 1
    bad = stats.model_copy(update={"nonfinite": 1})
    assert weight_health(bad, outlier=False, rules="reference").score == 0


@pytest.mark.parametrize(
    ("score", "status"),
    [(100, "Excellent"), (90, "Excellent"), (89.9, "Good"), (75, "Good"), (74.9, "Fair"),
     (60, "Fair"), (59.9, "Poor"), (40, "Poor"), (39.9, "Critical"), (0, "Critical")],
)
def test_distribution_status_bands_are_the_references(score: float, status: str) -> None:
    """Kept under both rules: Excellent >= 90, Good >= 75, Fair >= 60, Poor >= 40."""
    from analysis.analyses.weights.compute import distribution_status

    assert distribution_status(score).value == status
