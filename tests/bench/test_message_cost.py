"""bench/message_cost.py at a tiny size through the real broker: the in-process passes and
the end-to-end run handle every record, the split's shares add up to the whole, and every
figure is finite and positive."""

from __future__ import annotations

import re

import pytest

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_prints_the_cost_per_message_and_its_split(kafka_bootstrap: str) -> None:
    out = run_script("message_cost", "--ranks", "4", "--layers", "4", "--steps", "3",
                     "--repeat", "2", "--fit-layers", "1,8", bootstrap=kafka_bootstrap)
    # 4 RunStarted + 3 steps x 4 summaries + 4 RunFinished, 4 per frame
    assert "3 steps: 20 records (4 per frame)" in out, out
    assert re.search(r"in process: 20 records, CPU .* \(best of 2: [\d.]+, [\d.]+\)", out), out
    read = re.search(r"end to end: (\d+) messages read and stored", out)
    assert read is not None and int(read.group(1)) >= 20, out
    last = key_values(out.strip().splitlines()[-1])
    assert set(last) == {"us_per_message", "decode_validate", "merge", "frame_health",
                         "output", "e2e_us_per_message", "fixed_us_per_message",
                         "us_per_row"}, last
    for key, value in last.items():
        if key not in ("fixed_us_per_message", "us_per_row"):  # a fit may go either way
            finite_positive(value)
    assert re.search(r"by message size: 1 layers [\d.]+ µs, 4 layers [\d.]+ µs, 8 layers", out), out
    shares = [float(last[k]) for k in ("decode_validate", "merge", "frame_health", "output")]
    assert sum(shares) == pytest.approx(1.0, abs=0.03)


def test_fixed_cost_is_the_intercept_of_the_least_squares_line() -> None:
    from bench.message_cost import fixed_cost

    assert fixed_cost({1: 12.0, 4: 18.0, 16: 42.0}) == pytest.approx((10.0, 2.0))
    # noisy points: the intercept of the best line, not of any two points
    fixed, per_row = fixed_cost({4: 31.0, 16: 53.0, 64: 151.0})
    assert fixed == pytest.approx(22.0, abs=1e-6) and per_row == pytest.approx(2.0119, abs=1e-4)
    with pytest.raises(ValueError, match="two layer counts"):
        fixed_cost({16: 60.0})
