"""Mergeable statistics (schemas.stats): merging parts equals the whole, for every class.

The property test runs over the registry ``schemas.stats.STATISTICS``. Counts, extremes and
histograms must merge exactly; float sums up to rounding, within ``1e-12 * sum |x_i|`` of the
same statistic over |x| (Higham's bound for recursive summation, ``gamma_n sum |x_i|``, for
either order; see the module docstring of schemas.stats).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import schemas.stats
from schemas import wire
from schemas.stats import (
    STATISTICS,
    ExponentHistogram,
    GradientSums,
    LayerStatistic,
    PowerSums,
    SumOfSquares,
    WeightMoments,
)
from tests.schemas.stats.samples import assert_same, samples


@pytest.mark.parametrize("cls", STATISTICS, ids=lambda c: c.__name__)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample=samples())
def test_merged_parts_equal_the_whole(cls: type[LayerStatistic], sample) -> None:
    num_layers, x, layer, split = sample
    whole = cls.empty(num_layers)
    assert whole.update(x, layer) is whole
    bound = cls.empty(num_layers).update(np.abs(x), layer)
    a = cls.empty(num_layers).update(x[split], layer[split])
    b = cls.empty(num_layers).update(x[~split], layer[~split])
    a_before = a.copy()

    merged = a + b
    assert merged is not a and merged is not b
    assert_same(a, a_before)  # + leaves its operands alone
    assert_same(merged, whole, bound, x.size)
    in_place = a.copy()
    in_place += b
    assert_same(in_place, merged)

    # the neutral element, on either side
    assert_same(cls.empty(num_layers) + a, a)
    assert_same(a + cls.empty(num_layers), a)

    # one scalar-layer update per layer (the producer's path) gives the same statistic
    per_layer = cls.empty(num_layers)
    for i in range(num_layers):
        assert per_layer.update(x[layer == i], i) is per_layer
    assert_same(per_layer, whole, bound, x.size)
    assert_same(cls.from_layers([x[layer == i] for i in range(num_layers)]), per_layer)

    # stored / wire form round trip, sparse merge and selection, pooling
    assert_same(cls.from_columns(**whole.to_columns()), whole)
    spread = cls.empty(num_layers + 2)
    at = np.arange(num_layers)[::-1] + 1
    assert spread.merge_at(at, whole) is spread
    assert_same(spread.take(at), whole)
    assert_same(spread.take(np.array([0, num_layers + 1])), cls.empty(2))
    assert_same(whole.pooled(), cls.empty(1).update(x, np.zeros(x.size, np.int64)),
                bound.pooled(), x.size)


@pytest.mark.parametrize("cls", STATISTICS, ids=lambda c: c.__name__)
def test_merging_checks_class_and_layer_count(cls: type[LayerStatistic]) -> None:
    with pytest.raises(ValueError, match="layers"):
        cls.empty(2).__iadd__(cls.empty(3))
    other = GradientSums if cls is not GradientSums else PowerSums
    with pytest.raises(TypeError):
        cls.empty(2).merge_at(np.arange(2), other.empty(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        cls.empty(2).update(np.ones(3), 2)
    with pytest.raises(ValueError, match="shape"):
        cls.empty(2).update(np.ones(3), np.zeros(2, np.int64))


def test_doctests_run() -> None:
    """pytest is not run with --doctest-modules: run the examples of every module of the
    package here."""
    attempted = failed = 0
    for info in pkgutil.iter_modules(schemas.stats.__path__):
        module = importlib.import_module(f"schemas.stats.{info.name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        attempted += result.attempted
        failed += result.failed
    result = doctest.TestResults(failed, attempted)
    assert result.attempted > 10 and result.failed == 0


def test_saturate_clips_overflowing_sums() -> None:
    big = float(np.finfo(np.float64).max)
    g = GradientSums.empty(1).update(np.array([big, big])).saturate()
    assert g.sum_abs[0] == big and g.sum_sq[0] == big
    p = PowerSums.empty(1).update(np.array([-big, -big])).saturate()
    assert (p.s1[0], p.s2[0], p.s3[0], p.s4[0]) == (-big, big, -big, big)


def _message(layers: list[int], grads: list[np.ndarray], weights: list[np.ndarray],
             previous: list[np.ndarray], *, full: bool = True) -> tuple[wire.StepSummary, dict]:
    """A StepSummary built from the statistics of ``grads`` / ``weights`` (k layers)."""
    k = len(layers)
    grad, hist = GradientSums.empty(k), ExponentHistogram.empty(k)
    moments, update = WeightMoments.empty(k), SumOfSquares.empty(k)
    for i in range(k):
        grad.update(grads[i], i)
        hist.update(grads[i], i)
        moments.update(weights[i], i)
        update.update(weights[i] - previous[i], i)
    g, h, w = grad.to_columns(), hist.to_columns(), moments.to_columns()
    msg = wire.StepSummary(
        run_id="r", step=1, rank=0, world_size=1, wall_time=0.0, layer_indices=layers,
        numel=g["numel"].tolist(), sum_sq=g["sum_sq"].tolist(),
        nonfinite=g["nonfinite"].tolist(), nan=g["nan"].tolist(),
        sum_abs=g["sum_abs"].tolist() if full else None,
        max_abs=g["max_abs"].tolist() if full else None,
        exp_hist_offsets=h["offsets"].tolist(), exp_hist_columns=h["columns"].tolist(),
        exp_hist_counts=h["counts"].tolist(), weight_sum_sq=w["s2"].tolist(),
        update_sum_sq=update.sum_sq.tolist(), weight_sum=w["s1"].tolist(),
        weight_sum_cube=w["s3"].tolist(), weight_sum_quad=w["s4"].tolist(),
        weight_min=w["minimum"].tolist(), weight_max=w["maximum"].tolist(),
        weight_nonfinite=w["nonfinite"].tolist(),
        weight_exp_hist_offsets=w["hist_offsets"].tolist(),
        weight_exp_hist_columns=w["hist_columns"].tolist(),
        weight_exp_hist_counts=w["hist_counts"].tolist(),
    )
    return msg, {"grad": grad, "hist": hist, "moments": moments, "update": update}


def test_from_message_reads_back_what_was_sent() -> None:
    rng = np.random.default_rng(4)
    grads = [np.array([1.0, -2.0, np.nan, 0.0]), rng.standard_normal(50) * 1e-20]
    weights = [np.array([np.nan, np.inf, 0.5, -0.25]), rng.standard_normal(50)]
    previous = [w * 0.5 for w in weights]
    msg, sent = _message([3, 1], grads, weights, previous)
    assert_same(GradientSums.from_message(msg), sent["grad"])
    assert_same(ExponentHistogram.from_message(msg), sent["hist"])
    assert_same(WeightMoments.from_message(msg), sent["moments"])
    at = np.array([0, 2])
    into = WeightMoments.empty(3)
    assert into.merge_message(at, msg)
    assert_same(into, WeightMoments.empty(3).merge_at(at, sent["moments"]))
    assert_same(SumOfSquares.from_message(msg, "update_sum_sq"), sent["update"])
    norm = SumOfSquares.from_message(msg, "weight_sum_sq")
    assert norm.numel.tolist() == [4, 50]
    np.testing.assert_array_equal(norm.sum_sq, sent["moments"].power.s2)
    bare = msg.model_copy(update={
        name: None for name in (
            "exp_hist_offsets", "exp_hist_columns", "exp_hist_counts", "weight_sum_sq",
            "update_sum_sq", "weight_sum", "weight_sum_cube", "weight_sum_quad",
            "weight_min", "weight_max", "weight_nonfinite", "weight_exp_hist_offsets",
            "weight_exp_hist_columns", "weight_exp_hist_counts")})
    assert ExponentHistogram.from_message(bare) is None
    assert WeightMoments.from_message(bare) is None
    assert not WeightMoments.empty(2).merge_message(np.arange(2), bare)
    assert SumOfSquares.from_message(bare, "weight_sum_sq") is None
    with pytest.raises(ValueError, match="no sum of squares"):
        SumOfSquares.from_message(msg, "sum_sq")
    norms, _ = _message([0], grads[:1], weights[:1], previous[:1], full=False)
    assert not GradientSums.from_message(norms).has_abs().any()
    # a producer before schema 1.7 sends no NaN count: the NaN/Inf split of the layer with
    # a non-finite element is unknown; the all-finite layer has no NaN, known
    older = GradientSums.from_message(msg.model_copy(update={"nan": None}))
    assert older.has_nan().tolist() == [False, True]
    assert older.to_columns()["nan"].tolist() == [-1, 0]
    merged = GradientSums.from_message(msg) + older
    assert merged.has_nan().tolist() == [False, True]
    assert GradientSums.from_message(msg).to_columns()["nan"].tolist() == [1, 0]


