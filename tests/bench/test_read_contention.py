"""bench/read_contention.py at a tiny size through the real broker: every case ingests the
whole topic while its readers query the writing process, and the ratios are printed."""

from __future__ import annotations

import re

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_of_every_case(kafka_bootstrap: str) -> None:
    out = run_script("read_contention", "--steps", "5", "--layers", "20", "--ranks", "2",
                     "--readers", "2", bootstrap=kafka_bootstrap)
    lines = out.strip().splitlines()
    assert "produced 14 messages (2 ranks x 5 steps x 20 layers, 200 layer rows)" in out, out
    rows = re.findall(r"^(no readers|2 readers, .*?)\s+([\d,]+)\s+(\d+\.\d\d)\s+(\d+)\s+(\S+)$",
                      out, re.MULTILINE)
    assert len(rows) == 4 and rows[0][0] == "no readers", out
    assert rows[0][2] == "1.00"
    for _, rate, ratio, _reads, _p50 in rows:
        finite_positive(rate.replace(",", ""))
        finite_positive(ratio)
    finite_positive(key_values(lines[-1])["read_contention_ratio"])
