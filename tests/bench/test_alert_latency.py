"""bench/alert_latency.py at a tiny size through the real broker: every injected NaN
incident raises its alert, and the latency lines are finite and positive."""

from __future__ import annotations

import re

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_alerts_every_incident(kafka_bootstrap: str) -> None:
    out = run_script("alert_latency", "--incidents", "3", "--ranks", "2", "--layers", "4",
                     "--elements", "64", bootstrap=kafka_bootstrap)
    lines = out.strip().splitlines()
    assert "3 of 3 incidents alerted (0 missed)" in out, out
    for row in ("Kafka hop (floor, send -> receive)", "producer wall_time -> alert created_at",
                "record_step -> alert on the topic"):
        found = re.search(rf"{re.escape(row)}\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d)", out)
        assert found is not None, (row, out)
        p50, p99, peak = (float(x) for x in found.groups())
        assert 0 < p50 <= p99 <= peak
    ratio = re.search(r"ratio p50 / \(2 x hop p50\): (\d+\.\d\d)", out)
    assert ratio is not None
    finite_positive(ratio.group(1))
    finite_positive(key_values(lines[-1])["alert_latency_p99_ms"])
