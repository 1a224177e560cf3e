"""Frame fields (mean |g|, norm, vanishing / exploding flags, flow intensity) and the
exactness of the cross-rank merge."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.frames import MergedShards, compute_frame
from producer.summary import summarize
from schemas.stats import GradientSums


def _frame_of(grads: dict[str, np.ndarray], van=1e-7, exp=1e3, ranks=(0,), world=1):
    s = summarize(grads)
    merged = MergedShards.empty(len(s))
    merged.add(np.arange(len(s)), s.numel, s.sum_abs, s.sum_sq, s.max_abs, s.nonfinite)
    return compute_frame("r", 0, merged, vanishing_threshold=van, exploding_threshold=exp,
                         ranks_seen=ranks, world_size=world, wall_time=0.0)


def test_seed_fields():
    f = _frame_of({"a": np.array([3.0, -4.0]), "b": np.array([1.0, 0.0])})
    assert f.mean_abs_grad.tolist() == [3.5, 0.5]
    assert f.max_abs_grad.tolist() == [4.0, 1.0]
    assert f.grad_norm.tolist() == [5.0, 1.0]
    assert f.flow_intensity.tolist() == [1.0, 0.2]


def test_vanishing_threshold_is_strict():
    # is_vanishing = mean_abs < threshold
    f = _frame_of({"at": np.array([1e-6, 1e-6]), "below": np.array([9.99e-7, 9.99e-7])},
                  van=1e-6)
    assert f.is_vanishing.tolist() == [False, True]


def test_exploding_threshold_is_strict():
    # is_exploding = max_abs > threshold
    f = _frame_of({"at": np.array([100.0, 1.0]), "above": np.array([100.001, 1.0])},
                  exp=100.0)
    assert f.is_exploding.tolist() == [False, True]


def test_seed_vanishing_and_exploding_detection():
    f = _frame_of({"shallow": np.array([1e-8, 1e-8]), "deep": np.array([0.01, 0.01])},
                  van=1e-6)
    assert f.is_vanishing.tolist() == [True, False]
    f = _frame_of({"bad_layer": np.array([500.0, 200.0]), "ok_layer": np.array([0.1, 0.1])},
                  exp=100.0)
    assert f.is_exploding.tolist() == [True, False]


def test_flow_intensity_zero_when_all_norms_zero():
    f = _frame_of({"a": np.zeros(3), "b": np.zeros(2)})
    assert f.flow_intensity.tolist() == [0.0, 0.0]
    assert f.is_vanishing.all()


def test_flow_intensity_normalised_in_unit_interval():
    f = _frame_of({"large": np.ones(10), "small": np.full(10, 1e-3)})
    assert f.flow_intensity.max() == 1.0 and (f.flow_intensity >= 0).all()


def test_nonfinite_layer_flagged_and_excluded_from_sums():
    f = _frame_of({"a": np.array([np.nan, 2.0]), "b": np.array([1.0, 1.0])})
    assert f.nonfinite.tolist() == [1, 0] and f.has_nonfinite
    assert f.max_abs_grad.tolist() == [2.0, 1.0]


def test_unreported_layers_are_left_out():
    merged = MergedShards.empty(3)
    merged.add(np.array([2]), np.array([4]), np.array([1.0]), np.array([1.0]),
               np.array([1.0]), np.array([0]))
    f = compute_frame("r", 5, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
                      ranks_seen=(1, 0), world_size=3, wall_time=2.0)
    assert f.layer_index.tolist() == [2]
    assert f.ranks_seen == (0, 1) and f.missing_ranks == (2,) and not f.complete


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 5000),
    st.integers(0, 2**31),
    st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_split_across_ranks_equals_unsplit(k, n, seed, dtype):
    """A tensor split across k ranks merges to the unsplit statistics (1e-12 relative)."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 3)).astype(dtype)
    whole = _frame_of({"w": g})
    cuts = np.sort(rng.integers(0, n + 1, size=k - 1))
    merged = MergedShards.empty(1)
    for part in np.split(g, cuts):
        if part.size == 0:
            continue
        s = summarize({"w": part})
        merged.add(np.array([0]), s.numel, s.sum_abs, s.sum_sq, s.max_abs, s.nonfinite)
    split = compute_frame("r", 0, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
                          ranks_seen=tuple(range(k)), world_size=k, wall_time=0.0)
    for name in ("mean_abs_grad", "grad_norm", "max_abs_grad"):
        assert getattr(split, name)[0] == pytest.approx(getattr(whole, name)[0], rel=1e-12)
    assert split.numel[0] == n


def test_all_nan_layer_is_nonfinite_not_vanishing():
    f = _frame_of({"nan": np.full(4, np.nan), "tiny": np.full(4, 1e-9)})
    assert f.is_vanishing.tolist() == [False, True]
    assert f.nonfinite.tolist() == [4, 0] and f.mean_abs_grad[0] == 0.0


def _norms_frame(grads, van=1e-7, exp=1e3, full_ranks=()):
    """Frame of one shard per layer-dict rank; ranks not in full_ranks send norms only."""
    names = list(grads[0])
    merged = MergedShards.empty(len(names))
    for rank, g in enumerate(grads):
        s = summarize(g, norms_only=rank not in full_ranks)
        merged.add(np.arange(len(s)), s.numel, s.sum_abs, s.sum_sq, s.max_abs, s.nonfinite)
    return compute_frame("r", 0, merged, vanishing_threshold=van, exploding_threshold=exp,
                         ranks_seen=tuple(range(len(grads))), world_size=len(grads),
                         wall_time=0.0)


def test_norms_mode_flags_use_the_rms_bounds():
    # rms of "spike" = sqrt(2000^2 / 100) = 200 < 1e3 although max |g| = 2000: not flagged
    # (the bound is one-sided); rms of "big" = 2000 > 1e3: exploding for certain.
    spike = np.zeros(100)
    spike[0] = 2000.0
    grads = {"tiny": np.full(4, 1e-8), "edge": np.full(4, 1e-7), "spike": spike,
             "big": np.full(4, 2000.0)}
    f = _norms_frame([grads])
    assert np.isnan(f.mean_abs_grad).all() and np.isnan(f.max_abs_grad).all()
    assert np.isnan(f.sum_abs).all()
    assert f.grad_norm.tolist() == pytest.approx([2e-8, 2e-7, 2000.0, 4000.0])
    assert f.is_vanishing.tolist() == [True, False, False, False]
    assert f.is_exploding.tolist() == [False, False, False, True]
    full = _frame_of(grads)
    assert full.is_exploding.tolist() == [False, False, True, True]
    # Every norms-mode flag is one the full statistics raise too.
    assert not (f.is_vanishing & ~full.is_vanishing).any()
    assert not (f.is_exploding & ~full.is_exploding).any()


def test_mixed_modes_across_ranks_leave_abs_statistics_unknown():
    g = {"a": np.array([3.0, -4.0])}
    mixed = _norms_frame([g, g], full_ranks=(0,))
    assert np.isnan(mixed.mean_abs_grad[0]) and mixed.grad_norm[0] == pytest.approx(50 ** 0.5)
    full = _norms_frame([g, g], full_ranks=(0, 1))
    assert full.mean_abs_grad.tolist() == [3.5] and full.max_abs_grad.tolist() == [4.0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**31))
def test_weight_distribution_merges_exactly_across_ranks(ranks, seed):
    from producer.weights import summarize_weights
    from schemas.stats import WeightMoments

    rng = np.random.default_rng(seed)
    parts = [rng.standard_normal(int(rng.integers(1, 50))).astype(np.float32) for _ in range(ranks)]
    parts[0][0] = 0.0
    dist = WeightMoments.empty(1)
    for p in parts:
        dist += summarize_weights({"w": p}).moments
    whole = summarize_weights({"w": np.concatenate(parts)})
    x = np.concatenate(parts).astype(np.float64)
    assert dist.power.s1[0] == pytest.approx(x.sum(), rel=1e-9, abs=1e-9)
    assert dist.power.s3[0] == pytest.approx((x ** 3).sum(), rel=1e-9, abs=1e-9)
    assert dist.power.s4[0] == pytest.approx((x ** 4).sum(), rel=1e-12)
    assert dist.power.minimum[0] == x.min() and dist.power.maximum[0] == x.max()
    assert dist.exp_hist.counts[0].tolist() == whole.exp_hist[0].tolist()
    assert dist.exp_hist.counts[0, 0] >= 1  # the exact zero


def test_weight_extremes_ignore_shards_without_finite_weights():
    """A shard whose weights are all NaN sends min = max = 0.0 (no finite weight); merged
    with another shard it must not pull the extremes to 0."""
    from producer.weights import summarize_weights

    merged = MergedShards.empty(1)
    for w in (np.array([np.nan, np.nan], np.float32), np.array([1.0, 2.0], np.float32)):
        s = summarize_weights({"w": w})
        merged.merge_at(np.array([0]), MergedShards(
            GradientSums.from_columns([2], [0.0], [0.0], [0.0], [0]),
            weight_moments=s.moments))
    f = compute_frame("r", 0, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
                      ranks_seen=(0, 1), world_size=2, wall_time=0.0)
    assert (f.weight_min[0], f.weight_max[0], f.weight_nonfinite[0]) == (1.0, 2.0, 2)


@pytest.mark.parametrize("case", ["pipeline", "shared_layers", "mixed", "with_options"])
def test_queued_messages_merge_bit_for_bit_as_one_at_a_time(case: str) -> None:
    """``merge_message`` queues the gradient sums and merges them on the first read, in
    one batch when the messages cover distinct layers: the sums equal, bit for bit, those
    of merging every message in arrival order (``merge_at`` of ``from_message``), for
    pipeline stages (distinct layers, out of order), shards of shared layers (FSDP: the
    same layers in every message), a mix of norms-mode and NaN-count messages, and
    messages carrying optional statistics; reading in the middle merges what came so far."""
    from schemas.wire import StepSummary

    rng = np.random.default_rng(7)
    layers_total, stages = 24, 6
    messages = []
    for rank in rng.permutation(stages):
        layers = (np.arange(layers_total) if case == "shared_layers"
                  else np.arange(rank * 4, rank * 4 + 4))
        k = len(layers)
        fields = dict(run_id="r", step=0, rank=int(rank), world_size=stages, wall_time=0.0,
                      layer_indices=layers, numel=rng.integers(1, 1000, k),
                      sum_abs=rng.random(k) * 1e3, sum_sq=rng.random(k) * 1e5,
                      max_abs=rng.random(k), nonfinite=np.zeros(k, np.int64))
        if case == "mixed" and rank % 3 == 1:
            fields["sum_abs"] = fields["max_abs"] = None
        if case == "mixed" and rank % 3 == 2:
            fields["nonfinite"] = np.ones(k, np.int64)
            fields["nan"] = np.ones(k, np.int64)
        if case == "with_options":
            fields["weight_sum_sq"] = rng.random(k)
        messages.append(StepSummary(**fields))
    queued = MergedShards.empty(layers_total)
    one_by_one = GradientSums.empty(layers_total)
    for i, message in enumerate(messages):
        queued.merge_message(message)
        one_by_one.merge_at(np.asarray(message.layer_indices),
                            GradientSums.from_message(message))
        if i == 2:  # a read in the middle merges what is queued
            assert np.array_equal(queued.numel, one_by_one.numel)
    for name, _, mine in queued.gradient._fields():
        theirs = getattr(one_by_one, name)
        assert np.array_equal(mine, theirs, equal_nan=True), name
    if case == "with_options":
        assert np.array_equal(queued.weight_norm.numel, one_by_one.numel)
