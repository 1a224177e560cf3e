"""bench/message_cost.py at a tiny size through the real broker: the in-process passes and
the end-to-end run handle every record, the split's shares add up to the whole, and every
figure is finite and positive."""

from __future__ import annotations

import re

import pytest

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_prints_the_cost_per_message_and_its_split(kafka_bootstrap: str) -> None:
    out = run_script("message_cost", "--ranks", "4", "--layers", "4", "--steps", "3",
                     "--repeat", "2", bootstrap=kafka_bootstrap)
    # 4 RunStarted + 3 steps x 4 summaries + 4 RunFinished, 4 per frame
    assert "3 steps: 20 records (4 per frame)" in out, out
    assert re.search(r"in process: 20 records, CPU .* \(best of 2: [\d.]+, [\d.]+\)", out), out
    read = re.search(r"end to end: (\d+) messages read and stored", out)
    assert read is not None and int(read.group(1)) >= 20, out
    last = key_values(out.strip().splitlines()[-1])
    assert set(last) == {"us_per_message", "decode_validate", "merge", "frame_health",
                         "output", "e2e_us_per_message"}, last
    for value in last.values():
        finite_positive(value)
    shares = [float(last[k]) for k in ("decode_validate", "merge", "frame_health", "output")]
    assert sum(shares) == pytest.approx(1.0, abs=0.03)
