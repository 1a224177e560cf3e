"""The reference implementation's own unit tests, ported to :mod:`tests.conformance.reference`,
plus checks of the Rust float semantics the port must reproduce (overflow, NaN in
``f64::max``, ``{:.8e}`` and serde_json float text, rounding of heatmap levels)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conformance.reference import (
    BLOCKS,
    GradientFlowAnimator,
    GradientHealth,
    classify_health,
    rust_exp,
    rust_json_float,
    rust_round,
)


def simple_grads(names: list[str], value: float) -> dict[str, list[float]]:
    return {n: [value] * 4 for n in names}


# -- the ten #[test] functions of the reference module ------------------------------------


def test_record_step_basic() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, simple_grads(["attn", "ffn"], 0.01))
    assert len(animator.frames) == 1
    assert len(animator.frames[0].layers) == 2


def test_rolling_window() -> None:
    animator = GradientFlowAnimator(3)
    for i in range(10):
        animator.record_step(i, simple_grads(["layer_a"], 0.1))
    assert len(animator.frames) == 3, "rolling window should cap at max_frames"
    assert [f.step for f in animator.frames] == [7, 8, 9]


def test_vanishing_detection() -> None:
    animator = GradientFlowAnimator(0, vanishing_threshold=1e-6)
    animator.record_step(0, {"shallow": [1e-8, 1e-8], "deep": [0.01, 0.01]})
    layers = {ly.name: ly for ly in animator.frames[0].layers}
    assert layers["shallow"].is_vanishing
    assert not layers["deep"].is_vanishing


def test_exploding_detection() -> None:
    animator = GradientFlowAnimator(0, exploding_threshold=100.0)
    animator.record_step(0, {"bad_layer": [500.0, 200.0], "ok_layer": [0.1, 0.1]})
    layers = {ly.name: ly for ly in animator.frames[0].layers}
    assert layers["bad_layer"].is_exploding
    assert not layers["ok_layer"].is_exploding


def test_flow_intensity_normalised() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"large": [1.0] * 10, "small": [0.001] * 10})
    for layer in animator.frames[0].layers:
        assert 0.0 <= layer.flow_intensity <= 1.0
    intensities = {ly.name: ly.flow_intensity for ly in animator.frames[0].layers}
    assert intensities == {"large": 1.0, "small": pytest.approx(0.001, rel=1e-12)}


def test_export_json() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, simple_grads(["a", "b"], 0.1))
    animator.record_step(1, simple_grads(["a", "b"], 0.05))
    frames = json.loads(animator.export_json())
    assert len(frames) == 2
    assert list(frames[0]["layers"][0]) == ["name", "mean_abs_grad", "max_abs_grad",
                                             "grad_norm", "is_vanishing", "is_exploding",
                                             "flow_intensity"]


def test_export_csv() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, simple_grads(["encoder"], 0.2))
    animator.record_step(1, simple_grads(["encoder"], 0.18))
    content = animator.export_csv()
    assert len(content.splitlines()) >= 3
    assert "step,layer,mean_abs_grad" in content


def test_to_ascii_animation_empty() -> None:
    assert "no gradient frames" in GradientFlowAnimator(0).to_ascii_animation()


def test_to_ascii_animation_nonempty() -> None:
    animator = GradientFlowAnimator(0)
    for i in range(5):
        animator.record_step(i, simple_grads(["embed", "attn"], 0.1 * i))
    out = animator.to_ascii_animation()
    assert "embed" in out and "attn" in out


def test_summary_report_healthy() -> None:
    animator = GradientFlowAnimator(0)
    for i in range(5):
        animator.record_step(i, simple_grads(["layer"], 0.1))
    summary = animator.summary_report()
    assert summary.overall_health is GradientHealth.HEALTHY
    assert summary.layers_with_vanishing_grads == []
    assert summary.layers_with_exploding_grads == []


# -- the f64 semantics the port relies on -------------------------------------------------


def test_squares_above_1e154_overflow_to_inf() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"big": [2e154, 1.0], "small": [1.0]})
    big, small = animator.frames[0].layers
    assert big.grad_norm == math.inf and big.mean_abs_grad == pytest.approx(1e154)
    assert big.is_exploding and not big.is_vanishing
    assert math.isnan(big.flow_intensity)  # inf / inf, kept by clamp
    assert small.flow_intensity == 0.0


def test_nan_element_is_ignored_by_max_but_poisons_sums() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"a": [float("nan"), 2.0], "b": [1.0]})
    a, b = animator.frames[0].layers
    assert a.max_abs_grad == 2.0
    assert math.isnan(a.mean_abs_grad) and math.isnan(a.grad_norm)
    assert not a.is_vanishing and not a.is_exploding
    assert b.flow_intensity == 1.0  # NaN norms do not enter the step's maximum
    assert animator.summary_report().overall_health is GradientHealth.HEALTHY


def test_summation_is_left_to_right_without_compensation() -> None:
    values = [1.0, 1e-16, 1e-16, 1e-16, 1e-16]
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"a": values})
    assert animator.frames[0].layers[0].mean_abs_grad == 1.0 / 5  # each 1e-16 is lost


@pytest.mark.parametrize(("x", "text"), [
    (0.01, "1.00000000e-2"), (1.0, "1.00000000e0"), (123.456, "1.23456000e2"),
    (1e-8, "1.00000000e-8"), (1e21, "1.00000000e21"), (0.0, "0.00000000e0"),
    (math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "NaN"),
    (123456788.5, "1.23456788e8"),  # an exact tie: ties to even
])
def test_rust_exp(x: float, text: str) -> None:
    assert rust_exp(x) == text


@pytest.mark.parametrize(("x", "text"), [
    (0.1, "0.1"), (1.0, "1.0"), (0.0, "0.0"), (1e-7, "1e-7"), (0.00001, "0.00001"),
    (1e16, "1e16"), (1e15, "1000000000000000.0"), (123456789.0, "123456789.0"),
    (1.5e300, "1.5e300"), (2.5e-9, "2.5e-9"), (1234.5, "1234.5"), (math.nan, "null"),
    (math.inf, "null"), (1 / 3, "0.3333333333333333"),
])
def test_serde_json_float(x: float, text: str) -> None:
    assert rust_json_float(x) == text


def test_round_half_away_from_zero() -> None:
    assert [rust_round(x) for x in (0.5, 1.5, 2.5, 3.5, 0.49999999999999994)] == [
        1.0, 2.0, 3.0, 4.0, 0.0]


def test_heatmap_levels_at_ties() -> None:
    """Intensities 1/8, 3/8, 5/8, 7/8 are halfway between two glyphs and round up."""
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"a": [8.0], "b": [1.0], "c": [3.0], "d": [5.0], "e": [7.0],
                             "f": [0.99]})
    rows = animator.to_ascii_animation().splitlines()[3:]
    assert [r[-1] for r in rows] == [BLOCKS[4], BLOCKS[1], BLOCKS[2], BLOCKS[3], BLOCKS[4],
                                     BLOCKS[0]]


def test_heatmap_layout() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"ab": [1.0], "é": [0.0]})
    text = animator.to_ascii_animation()
    # width = longest name in UTF-8 bytes (2); "layer" overflows it; padding counts chars
    assert text == (
        "Gradient Flow Animation (step \u2192 right, layer \u2193)\n"
        "layer  0\n" + "\u2500" * 5 + "\n"
        "ab  \u2588\n"
        " \u00e9   \n"
    )


def test_health_rule_at_the_ratio_ties() -> None:
    """0.1, 0.3 and 0.5 exactly are not above their thresholds (f64 division)."""
    def frames(issues: int, total: int, exploding: bool) -> GradientFlowAnimator:
        animator = GradientFlowAnimator(0)
        for step in range(total):
            bad = [5e3] if exploding else [1e-9]
            grads = {"x": bad if step < issues else [1.0]}
            animator.record_step(step, grads)
        return animator

    a = frames(5, 10, True)
    assert a.summary_report().overall_health is GradientHealth.PROBLEMS_DETECTED
    a = frames(6, 10, True)
    assert a.summary_report().overall_health is GradientHealth.CRITICAL
    a = frames(3, 10, False)
    assert a.summary_report().overall_health is GradientHealth.MINOR_ISSUES
    a = frames(4, 10, False)
    assert a.summary_report().overall_health is GradientHealth.PROBLEMS_DETECTED
    a = frames(1, 10, False)
    assert classify_health([], [], a.frames) is GradientHealth.HEALTHY  # 0.1 is not > 0.1
    b = frames(2, 10, False)
    assert classify_health([], [], b.frames) is GradientHealth.MINOR_ISSUES


def test_csv_and_json_bytes() -> None:
    animator = GradientFlowAnimator(0)
    animator.record_step(0, {"b": [3.0, -4.0], "a\t": [1e-9]})
    assert animator.export_csv() == (
        "step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding\n"
        "0,a\t,1.00000000e-9,1.00000000e-9,1.00000000e-9,1,0\n"
        "0,b,3.50000000e0,4.00000000e0,5.00000000e0,0,0\n"
    )
    text = animator.export_json()
    assert text.startswith('[\n  {\n    "step": 0,\n    "layers": [\n      {\n'
                           '        "name": "a\\t",\n        "mean_abs_grad": 1e-9,')
    assert text.endswith('        "flow_intensity": 1.0\n      }\n    ]\n  }\n]')
    assert json.loads(text)[0]["layers"][1]["grad_norm"] == 5.0
