"""bench/pipeline_throughput.py at a tiny size through the real broker: every shape (the
insert micro-benchmark, the three fixed shapes at 2 steps, the SDK-produced default) runs
end to end, stores every row, and prints finite, positive figures."""

from __future__ import annotations

import re

from tests.bench import finite_positive, key_values, run_script

SHAPES = ("sharded64", "replicated64", "runs20", "default")


def test_tiny_run_of_every_shape(kafka_bootstrap: str) -> None:
    out = run_script("pipeline_throughput", "--steps", "3", "--layers", "8", "--ranks", "2",
                     "--fixed-steps", "2", "--insert-rows", "2000", bootstrap=kafka_bootstrap)
    lines = out.strip().splitlines()
    insert = re.search(r"insert: (\d+\.\d\d) µs CPU/layer-row .* without a key, (\d+\.\d\d) "
                       r"with the old primary key \(ratio (\d+\.\d\d); 2,000 rows", out)
    assert insert is not None, out
    for value in insert.groups():
        finite_positive(value)
    shapes = {}
    for line in lines:
        if line.startswith("shape="):
            values = key_values(line)
            shapes[values.pop("shape")] = values
    assert list(shapes) == list(SHAPES), out
    for name, values in shapes.items():
        assert set(values) == {"rows_per_s", "floor_rows_per_s", "ratio",
                               "us_cpu_per_row"}, name
        for value in values.values():
            finite_positive(value)
    assert "default: produced 10 messages (1 run(s) x 2 ranks x 3 steps, 8 layers each" in out
    stages = re.findall(r"stages \(CPU µs per layer-row.*?\): (.*)\| sum (\d+\.\d\d)", out)
    assert len(stages) == len(SHAPES)
    last = key_values(lines[-1])
    assert set(last) == {"pipeline_rows_per_s", "ratio_to_consume_floor"}, lines[-1]
    for value in last.values():
        finite_positive(value)
