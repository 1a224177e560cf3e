"""Gradient explosion analysis over crafted histories in a real DuckDB file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from analysis.analyses.explosion import build_explosion_analysis
from analysis.analyses.explosion.compute import classify_severity
from analysis.analyses.explosion.models import ExplosionSeverity, GradientExplosionAnalysis
from analysis.analyses.explosion.reference import classify_severity_reference, reference_action
from analysis.read.connect import StoreError
from tests.analysis.crafted import open_read, write_history

S = ExplosionSeverity


def explosion_of(path: Path, run: str = "r", **kw: object) -> GradientExplosionAnalysis:
    con = open_read(path)
    try:
        return build_explosion_analysis(con, run, **kw)  # type: ignore[arg-type]
    finally:
        con.close()


@pytest.mark.parametrize(
    ("ratio", "nonfinite", "expected"),
    [(1.5, False, S.LOW), (2.0, False, S.LOW), (3.0, False, S.MEDIUM), (5.0, False, S.MEDIUM),
     (6.0, False, S.HIGH), (10.0, False, S.HIGH), (11.0, False, S.CRITICAL),
     (0.5, True, S.CRITICAL)],
)
def test_severity_classes(ratio: float, nonfinite: bool, expected: ExplosionSeverity) -> None:
    assert classify_severity(ratio, nonfinite) is expected


def test_layers_above_the_threshold(tmp_path: Path) -> None:
    """Threshold 10 (the run's): layer 1 peaks at 30 (x3, Medium) at step 4 and is above
    the threshold at steps 4 and 6; layer 3 peaks at 120 (x12, Critical) at step 8."""
    norms = np.full((4, 10), 2.0)
    norms[1, 4], norms[1, 6] = 30.0, 15.0
    norms[3, 8] = 120.0
    path = write_history(tmp_path / "s.duckdb", norms, exploding_threshold=10.0,
                         names=["a", "b", "c", "d"])
    report = explosion_of(path)
    assert report.threshold == 10.0
    assert [(x.layer_name, x.layer_index) for x in report.exploding_layers] == [("b", 1),
                                                                                ("d", 3)]
    b, d = report.exploding_layers
    assert (b.gradient_norm, b.step, b.exploding_steps, b.first_step) == (30.0, 4, 2, 4)
    assert b.severity is S.MEDIUM and d.severity is S.CRITICAL
    assert (d.gradient_norm, d.step, d.nonfinite_steps) == (120.0, 8, 0)
    assert report.explosion_ratio == pytest.approx(0.5)
    assert report.max_gradient_norm == 120.0
    assert report.mean_gradient_norm == pytest.approx(norms.mean())
    assert report.std_gradient_norm == pytest.approx(norms.std())
    # ratio 0.5 is not above 0.5, but the max is above 10 x the threshold.
    assert report.overall_severity is S.CRITICAL
    assert report.first_explosion_step == 4
    # Largest whole-model norm before step 4: sqrt(4 * 2^2) = 4.
    assert report.clip_norm_suggestion == pytest.approx(4.0)
    assert any("4" in r and "step 4" in r for r in report.mitigation_recommendations)
    assert (report.steps, report.layers) == (10, 4)


def test_overall_severity_rules(tmp_path: Path) -> None:
    norms = np.full((10, 5), 1.0)
    norms[0, 2] = 25.0  # one layer of ten (ratio 0.1, not above), max 2.5 x threshold
    report = explosion_of(write_history(tmp_path / "s.duckdb", norms, exploding_threshold=10.0))
    assert report.overall_severity is S.MEDIUM  # max > 2 x threshold
    norms[1:4, 2] = 11.0  # four layers of ten: ratio 0.4 > 0.3
    report = explosion_of(write_history(tmp_path / "t.duckdb", norms, exploding_threshold=10.0))
    assert report.overall_severity is S.HIGH
    assert report.explosion_ratio == pytest.approx(0.4)


def test_custom_threshold_and_step_range(tmp_path: Path) -> None:
    norms = np.array([[1.0, 50.0, 1.0, 1.0], [1.0, 1.0, 1.0, 8.0]])
    path = write_history(tmp_path / "s.duckdb", norms)  # run threshold 1e3: nothing
    assert explosion_of(path).exploding_layers == []
    assert explosion_of(path).overall_severity is S.LOW
    report = explosion_of(path, threshold=5.0)
    assert [x.layer_index for x in report.exploding_layers] == [0, 1]
    late = explosion_of(path, threshold=5.0, from_step=2)
    assert [x.layer_index for x in late.exploding_layers] == [1]
    assert late.first_explosion_step == 3
    # Before step 3 (steps 2 only, in range): global norm sqrt(1 + 1).
    assert late.clip_norm_suggestion == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="threshold"):
        explosion_of(path, threshold=0.0)
    with pytest.raises(StoreError, match="no gradient rows"):
        explosion_of(path, from_step=50)


def test_nonfinite_gradients_are_critical(tmp_path: Path) -> None:
    bad = np.zeros((2, 6), np.int64)
    bad[0, 3] = 5
    report = explosion_of(write_history(tmp_path / "s.duckdb", np.ones((2, 6)), nonfinite=bad))
    (layer,) = report.exploding_layers
    assert layer.nonfinite_steps == 1 and layer.exploding_steps == 0
    assert layer.severity is S.CRITICAL and layer.first_step == 3
    assert "NaN/Inf" in layer.recommended_action
    assert report.overall_severity is S.CRITICAL
    assert report.first_explosion_step == 3
    assert report.clip_norm_suggestion == pytest.approx(math.sqrt(2))


def test_no_explosion(tmp_path: Path) -> None:
    report = explosion_of(write_history(tmp_path / "s.duckdb", np.ones((3, 4))))
    assert report.exploding_layers == [] and report.overall_severity is S.LOW
    assert report.first_explosion_step is None and report.clip_norm_suggestion is None
    assert "nothing to mitigate" in report.mitigation_recommendations[0]


# -- the reference's rules (rules="reference"), answers worked out by hand from its formulas


@pytest.mark.parametrize(
    ("norm", "mean", "expected"),
    [(10.0, 1.0, S.LOW), (10.1, 1.0, S.MEDIUM), (50.0, 1.0, S.MEDIUM), (50.1, 1.0, S.HIGH),
     (100.0, 1.0, S.HIGH), (100.1, 1.0, S.CRITICAL), (1.0, 0.0, S.CRITICAL)],
)
def test_reference_severity_against_the_running_mean(
    norm: float, mean: float, expected: ExplosionSeverity
) -> None:
    """``r = norm / (mean + 1e-8)``: > 10 Medium, > 50 High, > 100 Critical."""
    assert classify_severity_reference(norm, mean) is expected


@pytest.mark.parametrize(
    ("norm", "words"),
    [(100.5, "above 100"), (100.0, "above 10"), (10.5, "above 10"), (10.0, "above 5"),
     (5.5, "above 5"), (5.0, "watching")],
)
def test_reference_action_by_absolute_norm(norm: float, words: str) -> None:
    assert words in reference_action(norm)


def test_reference_rules_depend_on_model_order(tmp_path: Path) -> None:
    """Threshold 10, peaks 1, 1, 30, 1000 in model order. Reference: layer 2 against the
    running mean (1 + 1 + 30) / 3 = 10.67 -> r = 2.8, Low; layer 3 against 1032 / 4 =
    258 -> r = 3.9, Low. gradstream: 30 / 10 = 3 -> Medium, 1000 / 10 = 100 -> Critical.
    The overall severity is the same rule under both (max > 10 x threshold: Critical)."""
    norms = np.ones((4, 3))
    norms[2, 1], norms[3, 2] = 30.0, 1000.0
    path = write_history(tmp_path / "s.duckdb", norms, exploding_threshold=10.0)
    ours = explosion_of(path)
    ref = explosion_of(path, rules="reference")
    assert [x.severity for x in ours.exploding_layers] == [S.MEDIUM, S.CRITICAL]
    assert [x.severity for x in ref.exploding_layers] == [S.LOW, S.LOW]
    assert ref.rules == "reference" and ours.rules == "gradstream"
    assert "above 10" in ref.exploding_layers[0].recommended_action
    assert "above 100" in ref.exploding_layers[1].recommended_action
    assert ours.overall_severity is S.CRITICAL and ref.overall_severity is S.CRITICAL
    # ratio 2/4 = 0.5 > 0.3 and max 1000 > 100: all six reference lines.
    assert len(ref.mitigation_recommendations) == 6
    assert "below 1.0" in ref.mitigation_recommendations[3]


def test_reference_rules_many_small_layers(tmp_path: Path) -> None:
    """19 layers at 0.1 and one at 20 (threshold 10): reference r = 20 / (21.9 / 20) =
    18.3 -> Medium; gradstream 20 / 10 = 2, not above 2 -> Low. Reference
    recommendations: ratio 0.05, max 20 <= 100: only the two monitoring lines."""
    norms = np.full((20, 2), 0.1)
    norms[19, 1] = 20.0
    path = write_history(tmp_path / "s.duckdb", norms, exploding_threshold=10.0)
    assert explosion_of(path).exploding_layers[0].severity is S.LOW
    ref = explosion_of(path, rules="reference")
    assert ref.exploding_layers[0].severity is S.MEDIUM
    assert len(ref.mitigation_recommendations) == 2


def test_reference_rules_keep_nonfinite_layers_critical(tmp_path: Path) -> None:
    bad = np.zeros((2, 3), np.int64)
    bad[1, 2] = 1
    path = write_history(tmp_path / "s.duckdb", np.ones((2, 3)), nonfinite=bad)
    (layer,) = explosion_of(path, rules="reference").exploding_layers
    assert layer.severity is S.CRITICAL and "NaN/Inf" in layer.recommended_action
