"""bench/tap_reduce.py at a tiny size with real gloo ranks: rank 0 of W reads about 1/W of
the gradient (plus the bounded cross-check) and the summary line is complete."""

from __future__ import annotations

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_reads_a_share_of_the_gradient() -> None:
    out = run_script("tap_reduce", "--world", "1,2", "--layers", "8", "--width", "16",
                     "--steps", "4")
    values = key_values(out.strip().splitlines()[-1])
    assert float(values["share_w1"]) == 1.0
    # 1/2 owned plus at most 1/(C R) = 1/8 cross-checked, by numel (equal layers here).
    assert 0.5 <= float(values["share_w2"]) <= 0.5 + 1 / 8 + 1e-9
    finite_positive(values["tap_cpu_ms_w1"])
    finite_positive(values["tap_cpu_ms_w2"])
    finite_positive(values["reduce_ms_w2"])
