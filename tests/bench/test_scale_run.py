"""bench/scale_run.py at a tiny size through the session's broker: every shape's row, a
reduced run's wire bytes independent of the world size, and the summary line."""

from __future__ import annotations

from tests.bench import finite_positive, key_values, run_script


def test_tiny_run_prints_every_case_and_the_summary(kafka_bootstrap: str) -> None:
    out = run_script("scale_run", "--ranks", "8,64", "--steps", "4", "--layers", "40",
                     "--stage-layers", "8", bootstrap=kafka_bootstrap)
    lines = out.strip().splitlines()
    rows = {(p[0], int(p[1])): p for p in (line.split() for line in lines)
            if p and p[0] in ("ddp", "fsdp2", "pp", "pp-off")}
    assert set(rows) == {(s, w) for s in ("ddp", "fsdp2", "pp") for w in (8, 64)} | {
        ("pp-off", 8)}, out
    for shape in ("ddp", "fsdp2"):
        assert rows[(shape, 8)][2] == rows[(shape, 64)][2] == "1"  # one message a step
        small, large = (int(rows[(shape, w)][3].replace(",", "")) for w in (8, 64))
        # the summary does not grow with W (only digits); the per-rank training scalars
        # add 3 float64 values a rank (dense)
        assert abs(large - small - 3 * 8 * (64 - 8)) <= 32
        per_rank = int(rows[(shape, 64)][4].replace(",", ""))
        assert per_rank > 32 * large  # per-rank sending multiplies by W
    assert rows[("pp", 64)][2] == "1"  # the union of the stages, reduced in-band
    assert rows[("pp-off", 8)][2] == "8"  # per-rank sending: every rank its stage's layers
    summary = key_values(lines[-1])
    finite_positive(summary["ddp64_wire_bytes_per_step"])
    finite_positive(summary["fsdp64_worker_ms_per_step"])
    finite_positive(summary["pp_us_per_message"])
    # keyed run_id/step (partition_key="step"): the steps spread over both partitions
    assert float(summary["two_worker_max_share"]) <= 0.6
    assert int(summary["workers_for_10k_ranks"]) >= 1
