"""bench/lakehouse.py at a tiny size through the session's broker and a moto S3 endpoint:
the same stream into DuckDB and into Iceberg, every table compared, and the summary line
with 0 lost, 0 duplicated."""

from __future__ import annotations

import re

from tests.bench import finite_positive, key_values, run_script

LAST_LINE = re.compile(r"iceberg_rows_per_s=\d+ duckdb_rows_per_s=\d+ "
                       r"iceberg_read_10m_s=\d+\.\d\d visible_after_s=\d+\.\d\d "
                       r"lost=\d+ duplicated=\d+")


def test_tiny_run_stores_every_row_once_in_both_stores(kafka_bootstrap: str) -> None:
    out = run_script("lakehouse", "--steps", "6", "--layers", "8", "--ranks", "2",
                     "--rows", "4000", "--markers", "1", "--commit-interval", "1",
                     "--repeats", "2", bootstrap=kafka_bootstrap, timeout=120)
    lines = out.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    values = key_values(lines[-1])
    assert values["lost"] == "0" and values["duplicated"] == "0", out
    for name in ("iceberg_rows_per_s", "duckdb_rows_per_s", "iceberg_read_10m_s",
                 "visible_after_s"):
        finite_positive(values[name])
    assert float(values["visible_after_s"]) < 10  # a 1 s commit interval
    assert "stream: 16 messages, 48 layer rows (1 run(s) x 6 steps x 8 layers, 2 ranks)" in out
    assert out.count("(layer_stats 48 of 48)") == 2  # both Iceberg passes
    assert "best of 2: duckdb " in out
    bytes_per_row = re.search(r"\d+ objects [\d.]+ MiB = ([\d.]+) bytes/row", out)
    assert bytes_per_row is not None and float(bytes_per_row.group(1)) > 0, out
    assert re.search(r"read back 4,000 rows: iceberg [\d.]+ s", out), out
