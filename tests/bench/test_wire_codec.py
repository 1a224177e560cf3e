"""bench/wire_codec.py at a tiny size: both codecs read the same container, and the ratio
lines are finite and positive."""

from __future__ import annotations

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_prints_the_ratios() -> None:
    out = run_script("wire_codec", "--layers", "3", "10", "--repeats", "2")
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    for line in lines[:2]:
        values = key_values(line)
        finite_positive(values["decode_ratio_library_to_ours"])
        finite_positive(values["encode_ratio_library_to_ours"])
    finite_positive(key_values(lines[-1])["decode_ratio_library_to_ours"])
