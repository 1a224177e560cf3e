"""bench/kafka_producer_config.py at a tiny size through the real broker: one row per
compression x linger_ms, in the wire format the producer sends."""

from __future__ import annotations

import re

from tests.bench import finite_positive, run_script


def test_tiny_run_prints_every_combination_in_the_sent_format(kafka_bootstrap: str) -> None:
    out = run_script("kafka_producer_config", "--messages", "5", "--layers", "10",
                     bootstrap=kafka_bootstrap)
    assert re.search(r"5 StepSummary messages of 10 layers, \d+\.\d KiB each in the binary "
                     r"wire format \(the producer's default\)", out), out
    rows = re.findall(r"^(none|lz4|zstd)\s+(\d+)\s+(\d+)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\S+)$",
                      out, re.MULTILINE)
    assert [(c, int(linger)) for c, linger, *_ in rows] == [
        (c, linger) for c in ("none", "lz4", "zstd") for linger in (0, 5, 50)]
    for _, _, burst, p50, p99, ratio in rows:
        finite_positive(burst)
        assert 0 < float(p50) <= float(p99)
        finite_positive(ratio)  # compressed / raw batch bytes


def test_json_is_labelled_as_json(kafka_bootstrap: str) -> None:
    out = run_script("kafka_producer_config", "--messages", "2", "--layers", "10",
                     "--wire-format", "json", bootstrap=kafka_bootstrap)
    assert re.search(r"KiB each in the json wire format;", out), out
