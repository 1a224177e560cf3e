"""gradstream end to end against the executable reference (:mod:`tests.conformance.reference`).

Every case goes through the real path (producer SDK -> Kafka -> worker -> DuckDB -> reader:
report, CSV and JSON exports, ASCII heatmap; :mod:`tests.conformance.harness`) and through the
reference, and every difference fails the case, naming the field. Named cases pin the
scenarios where gradstream's own rules could part from the reference: layers vanishing from
step 0, a float64 run without declared dtypes, a single layer, every threshold and ratio
tie, heatmap level ties, values near float64 overflow, 5000 layers, shards and replicas sent
out of order, the rolling window. A Hypothesis test draws random runs (layers, steps, ranks,
layouts, dtypes, windows, magnitudes across both thresholds, NaN/Inf elements, send orders).

Values are dyadic (integer mantissas times a power of two) wherever the case allows, so every
sum is exact in any order and values, flags and CSV bytes must be identical; the float64
case with 2e-9 compares values to 1e-12.

NaN/Inf: gradstream's own presentation leaves non-finite elements out of the sums and the
maximum, counts them (``nonfinite``, and the NaN among them, ``nan``: wire schema 1.7) and
rates such a run Critical; the reference lets a NaN poison the mean and the norm (its
``f64::max`` ignores NaN), counts an Inf as exploding and can rate a NaN-only run Healthy.
The suite runs with the documented options that give the reference's semantics (the worker's
and the report's non-finite rule ``reference``; the reference styles, which rebuild the
reference's values from the finite sums and the NaN and Inf counts,
``analysis.nonfinite``), and compares the NaN/Inf cases like every other: no departure.
:func:`test_nonfinite_gradstream_default` pins gradstream's own default behaviour on the
same gradients.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conformance.harness import Case, Pipeline, reference_of

RNG_MANTISSA = 1 << 15
"""Integer mantissas are drawn in [-2^15, 2^15]: sums of a few thousand stay exact."""


def dyadic(rng: np.random.Generator, n: int, exponent: int,
           dtype: type = np.float64) -> np.ndarray:
    """n values ``m * 2**exponent`` with integer m in [-2^15, 2^15] (exact in float32 too)."""
    m = rng.integers(-RNG_MANTISSA, RNG_MANTISSA + 1, n)
    return (m.astype(np.float64) * 2.0**exponent).astype(dtype)


def constant_case(label: str, values: dict[str, list[list[float]]], **kw: object) -> Case:
    """A case from explicit values: ``values[layer][i]`` is the gradient at step i."""
    layers = list(values)
    steps = len(next(iter(values.values())))
    grads = [{n: np.asarray(values[n][i], dtype=np.float64) for n in layers}
             for i in range(steps)]
    return Case(label, layers, grads, list(range(steps)), **kw)  # type: ignore[arg-type]


def assert_conforms(pipeline: Pipeline, case: Case) -> None:
    diffs = pipeline.run(case)
    assert not diffs, f"{len(diffs)} difference(s) from the reference:\n" + "\n".join(diffs[:40])


# -- named cases ------------------------------------------------------------------------------


def _tiny_case(label: str, tiny_steps: int, steps: int) -> Case:
    rng = np.random.default_rng(7)
    layers = ["embed", "attn.k_bias", "ffn"]  # model order; by name: attn.k_bias first
    grads = []
    for i in range(steps):
        tiny = -40 if i < tiny_steps else -12  # mean |g| ~ 1.5e-8 < 1e-7, then ~ 4
        grads.append({"embed": dyadic(rng, 16, -10, np.float32),
                      "attn.k_bias": dyadic(rng, 8, tiny, np.float32),
                      "ffn": dyadic(rng, 24, -12, np.float32)})
    return Case(label, layers, grads, list(range(steps)), declare_dtypes=True)


def test_layer_vanishing_from_step_0_in_every_frame(pipeline: Pipeline) -> None:
    """Reference: issue ratio 1 -> ProblemsDetected, the layer listed as vanishing."""
    assert_conforms(pipeline, _tiny_case("tiny-every-step", 6, 6))


def test_layer_vanishing_from_step_0_then_recovering(pipeline: Pipeline) -> None:
    """Reference: 1 issue frame of 10 -> MinorIssues, the layer listed."""
    assert_conforms(pipeline, _tiny_case("tiny-step-0-only", 1, 10))


def test_float64_run_without_dtypes_with_a_layer_at_2e_9(pipeline: Pipeline) -> None:
    """float64 gradients, no ``dtypes=``: a layer at mean |g| = 2e-9 in every step."""
    rng = np.random.default_rng(11)
    steps = 5
    grads = [{"w": rng.standard_normal(32) * 0.01, "b": np.full(4, 2e-9),
              "head": rng.standard_normal(8)} for _ in range(steps)]
    case = Case("float64-2e-9-undeclared", ["w", "b", "head"], grads, list(range(steps)),
                exact=False)
    assert_conforms(pipeline, case)


def test_single_layer(pipeline: Pipeline) -> None:
    rng = np.random.default_rng(3)
    grads = [{"only": dyadic(rng, 5, -8)} for _ in range(4)]
    assert_conforms(pipeline, Case("single-layer", ["only"], grads, [0, 1, 2, 3]))


def test_thresholds_are_strict(pipeline: Pipeline) -> None:
    """mean |g| exactly 1e-7 is not vanishing, one ulp below is; max |g| exactly 1e3 is not
    exploding, one ulp above is (and a negative element counts by its magnitude)."""
    below = math.nextafter(1e-7, 0.0)
    above = math.nextafter(1e3, math.inf)
    case = constant_case("threshold-ties", {
        "at_vanishing": [[1e-7]] * 3,
        "below_vanishing": [[below]] * 3,
        "at_exploding": [[-1e3]] * 3,
        "above_exploding": [[1.0], [-above], [1.0]],
    })
    assert_conforms(pipeline, case)


@pytest.mark.parametrize(("issues", "exploding"), [
    (1, False),  # ratio 0.1 exactly: not above 0.1
    (2, False),
    (3, False),  # 0.3 exactly: not above 0.3
    (4, False),
    (5, True),   # 0.5 exactly with an exploding layer: ProblemsDetected, not Critical
    (6, True),
])
def test_issue_ratio_ties(pipeline: Pipeline, issues: int, exploding: bool) -> None:
    bad = [2.0**11] if exploding else [2.0**-30]
    case = constant_case(f"ratio-{issues}/10-{'exploding' if exploding else 'vanishing'}", {
        "x": [bad if i < issues else [1.0] for i in range(10)],
        "y": [[0.5]] * 10,
    })
    assert_conforms(pipeline, case)


def test_flow_intensity_level_ties(pipeline: Pipeline) -> None:
    """Intensities 1/8, 3/8, 5/8, 7/8 lie halfway between two heatmap glyphs."""
    case = constant_case("flow-level-ties", {
        "top": [[8.0]] * 2, "l1": [[1.0]] * 2, "l3": [[3.0]] * 2, "l5": [[5.0]] * 2,
        "l7": [[7.0]] * 2, "low": [[0.5]] * 2, "zero": [[0.0]] * 2,
    })
    assert_conforms(pipeline, case)


def test_float64_near_overflow(pipeline: Pipeline) -> None:
    """Squares above ~1.8e308 overflow: the reference's norm is inf (and the step's
    intensities inf/inf = NaN for that layer, 0 for the others), never a capped number."""
    case = constant_case("float64-overflow", {
        "near": [[1.3e154, 1.0]] * 2,       # square 1.69e308: still finite
        "over": [[2e154, 1.0], [1.0, 1.0]],  # square 4e308: inf at step 0
        "small": [[1.0, 0.5]] * 2,
    })
    assert_conforms(pipeline, case)


NAN, INF = math.nan, math.inf


def _nan_inf_case() -> Case:
    """A NaN in one layer at step 0, a +Inf in another at step 2 (and a -Inf with a NaN in
    a third at step 3), finite elsewhere."""
    return constant_case("nan-inf", {
        "ok": [[1.0, 2.0]] * 4,
        "has_nan": [[NAN, 2.0], [1.0, 0.5], [1.0, 0.5], [1.0, 0.5]],
        "has_inf": [[1.0, 0.5], [1.0, 0.5], [INF, 1.0], [1.0, 0.5]],
        "both": [[0.25, 0.5], [0.25, 0.5], [0.25, 0.5], [-INF, NAN]],
    })


def test_nonfinite_gradients(pipeline: Pipeline) -> None:
    """NaN and Inf elements under the reference's options (module docstring): a NaN makes
    mean and norm NaN (max ignores it), an Inf makes mean, max and norm inf and the layer
    exploding, NaN and Inf together NaN; the step's intensities follow (NaN for a NaN
    norm, inf / inf = NaN, finite / inf = 0)."""
    assert_conforms(pipeline, _nan_inf_case())


def test_nan_only_run_is_healthy_as_in_the_reference(pipeline: Pipeline) -> None:
    """A layer of NaN only in every step: the reference's mean and norm are NaN (never
    below the threshold), its max 0 (NaN ignored): no flag, no issue frame, Healthy."""
    case = constant_case("nan-only", {
        "ok": [[1.0, 0.5]] * 3, "all_nan": [[NAN, NAN]] * 3, "w": [[0.25, 0.125]] * 3,
    })
    assert_conforms(pipeline, case)


def test_step_whose_every_norm_is_nan_or_zero(pipeline: Pipeline) -> None:
    """No norm above 0 once the NaN norms are ignored (the reference's ``f64::max`` fold
    from 0): every intensity of that step is 0, the NaN layers' too."""
    case = constant_case("all-nan-step", {
        "a": [[NAN, 1.0], [1.0, 2.0]], "b": [[0.0, NAN], [0.5, 0.5]], "z": [[0.0, 0.0]] * 2,
    })
    assert_conforms(pipeline, case)


@pytest.mark.parametrize(("layout", "ranks"), [("shards", 2), ("replicas", 2), ("hsdp", 4)])
def test_nonfinite_pieces_merge_their_nan_and_inf_counts(pipeline: Pipeline, layout: str,
                                                        ranks: int) -> None:
    """The NaN and Inf of a layer held in different pieces (ranks) add up, a replica's
    counts once; sent out of order."""
    case = constant_case(f"nan-inf-{layout}-{ranks}", {
        "a": [[NAN, 1.0, 2.0, INF], [1.0, 1.0, 2.0, 2.0], [0.5, NAN, NAN, 0.5]],
        "b": [[0.5, 0.25, 0.5, 0.25], [-INF, 0.5, 0.5, 1.0], [0.5, 0.5, 0.5, 0.5]],
    }, ranks=ranks, layout=layout, send_seed=7)
    assert_conforms(pipeline, case)


def test_nonfinite_gradstream_default(gradstream_pipeline: Pipeline) -> None:
    """gradstream's own documented behaviour on the NaN/Inf gradients (the default
    non-finite rule ``critical`` and the default presentation): non-finite elements are
    left out of the sums and the maximum and counted (NaN apart), the run is Critical, live
    and in the report; the reference's options on the same store give the reference's
    verdict."""
    case = _nan_inf_case()
    run_id = f"conf-default-{uuid.uuid4().hex[:8]}"
    gradstream_pipeline.send(case, run_id)
    got = gradstream_pipeline.observe(case, run_id)
    row = got.rows[(0, "has_nan")]
    assert (row["nonfinite"], row["nan"]) == (1, 1)
    assert row["mean_abs_grad"] == 1.0 and row["grad_norm"] == 2.0  # (0 + 2) / 2, sqrt(4)
    assert row["max_abs_grad"] == 2.0 and not row["is_exploding"]
    row = got.rows[(2, "has_inf")]
    assert (row["nonfinite"], row["nan"]) == (1, 0)
    assert row["max_abs_grad"] == 1.0 and not row["is_exploding"]
    assert (got.rows[(3, "both")]["nonfinite"], got.rows[(3, "both")]["nan"]) == (2, 1)
    rep = got.report
    assert rep.overall_health.value == "Critical" and got.live_health == "Critical"
    assert rep.layers_with_nonfinite_grads == ["both", "has_inf", "has_nan"]
    assert rep.layers_with_exploding_grads == [] and rep.issue_frames == 3
    assert rep.nonfinite_rule == "critical"
    reference = gradstream_pipeline.reader.report(run_id, order="name",
                                                  nonfinite_rule="reference")
    want = reference_of(case).summary_report()
    assert reference.overall_health.value == want.overall_health.value == "ProblemsDetected"
    assert reference.layers_with_exploding_grads == want.layers_with_exploding_grads
    assert (reference.issue_frames, reference.frames) == (want.issue_frames, want.frames)


def test_5000_layers(pipeline: Pipeline) -> None:
    rng = np.random.default_rng(5)
    layers = [f"blocks.{i}.w" for i in range(5000)]  # model order != name order
    exponents = rng.integers(-45, 4, len(layers))
    grads = [{n: dyadic(rng, 2, int(e)) for n, e in zip(layers, exponents, strict=True)}
             for _ in range(3)]
    assert_conforms(pipeline, Case("5000-layers", layers, grads, [0, 1, 2]))


@pytest.mark.parametrize(("layout", "ranks"), [("shards", 3), ("replicas", 2), ("hsdp", 4)])
def test_shards_out_of_order_and_duplicated(pipeline: Pipeline, layout: str, ranks: int) -> None:
    """Ranks send their summaries interleaved at random and their steps permuted; replicas
    send the same piece more than once (counted once)."""
    rng = np.random.default_rng(ranks)
    layers = ["emb", "mid", "out"]
    grads = [{"emb": dyadic(rng, 12, -40), "mid": dyadic(rng, 9, -12),
              "out": dyadic(rng, 8, -4 if i % 3 else -3)} for i in range(6)]
    case = Case(f"{layout}-{ranks}-out-of-order", layers, grads, list(range(6)), ranks=ranks,
                layout=layout, send_seed=ranks * 17)  # type: ignore[arg-type]
    assert_conforms(pipeline, case)


def test_rolling_window(pipeline: Pipeline) -> None:
    """The reference's ``max_frames = 3`` against the report over the last 3 steps: the
    early vanishing steps leave the window."""
    rng = np.random.default_rng(9)
    grads = [{"a": dyadic(rng, 4, -40 if i < 4 else -8), "b": dyadic(rng, 4, -6)}
             for i in range(8)]
    assert_conforms(pipeline, Case("window-3-of-8", ["a", "b"], grads, list(range(8)),
                                   window=3))


@pytest.mark.parametrize("late_issues", [False, True])
def test_consumer_max_frames_is_the_rolling_window(windowed_pipeline: Pipeline,
                                                   late_issues: bool) -> None:
    """The consumer's live health with ``--max-frames 3`` against the reference's
    ``max_frames = 3``: early vanishing steps leave both windows; late exploding steps
    stay."""
    rng = np.random.default_rng(13)
    grads = [{"a": dyadic(rng, 4, -40 if i < 4 else -8),
              "b": dyadic(rng, 4, 1 if late_issues and i >= 6 else -6)} for i in range(9)]
    case = Case(f"max-frames-3-late-{late_issues}", ["a", "b"], grads, list(range(9)),
                window=3)
    assert_conforms(windowed_pipeline, case)


# -- random runs --------------------------------------------------------------------------------

NAME_ALPHABET = "abxyz019._- ,\u00fc"

THRESHOLDS = [(1e-7, 1e3), (1e-6, 100.0), (2.0**-20, 2.0**10), (2.0**-10, 2.0**-9)]
"""(vanishing, exploding) thresholds of the random runs: the defaults, the reference's unit
tests' custom ones, and powers of two that dyadic values hit exactly (ties)."""


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A random run: 1-5 layers (names of letters, digits, punctuation, a space, a comma and
    a non-ASCII letter), 1-6 steps (not necessarily from 0), 1-3 ranks in any layout, float32
    or float64, dtypes declared or not, a window, thresholds (:data:`THRESHOLDS`), per-layer
    magnitudes 2^-45..2^12 (both thresholds inside), zero layers, NaN / +-Inf elements
    now and then (about one run in four, at a few random places), and a random send
    order."""
    names = draw(st.lists(st.text(NAME_ALPHABET, min_size=1, max_size=6), min_size=1,
                          max_size=5, unique=True))
    n_steps = draw(st.integers(1, 6))
    first = draw(st.integers(0, 3))
    gap = draw(st.integers(1, 2))
    steps = [first + gap * i for i in range(n_steps)]
    layout = draw(st.sampled_from(["shards", "replicas", "hsdp"]))
    ranks = {"shards": draw(st.integers(1, 3)), "replicas": draw(st.integers(1, 2)),
             "hsdp": 4}[layout]
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    exponents = {n: draw(st.integers(-45, 12)) for n in names}
    zero = {n: draw(st.booleans()) and draw(st.booleans()) for n in names}
    sizes = {n: draw(st.integers(max(ranks, 2), 10)) for n in names}
    bad = draw(st.integers(0, 3)) if draw(st.booleans()) and draw(st.booleans()) else 0
    grads = []
    for _ in steps:
        frame = {}
        for n in names:
            g = dyadic(rng, sizes[n], exponents[n] + int(rng.integers(-2, 3)), dtype)
            frame[n] = np.zeros_like(g) if zero[n] else g
        grads.append(frame)
    for _ in range(bad):  # a NaN, +Inf or -Inf at a random (step, layer, element)
        g = grads[int(rng.integers(len(grads)))][names[int(rng.integers(len(names)))]]
        g[int(rng.integers(g.size))] = (NAN, INF, -INF)[int(rng.integers(3))]
    return Case(
        label=f"random(seed={seed})", layers=names, grads=grads, steps=steps, ranks=ranks,
        layout=layout, send_seed=draw(st.none() | st.integers(0, 1000)),  # type: ignore[arg-type]
        declare_dtypes=draw(st.booleans()), window=draw(st.integers(0, n_steps)),
        thresholds=draw(st.sampled_from(THRESHOLDS)),
    )


@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_random_runs(pipeline: Pipeline, case: Case) -> None:
    assert_conforms(pipeline, case)
