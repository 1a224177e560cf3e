"""bench/producer_overhead.py at a tiny size, and the message sizes it and README state,
checked against the records a real producer sends through the real broker."""

from __future__ import annotations

import re
import time
import uuid

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from bench import producer_overhead
from producer import GradientProducer
from schemas.wire import StepSummary, decode_message
from tests.bench import ROOT, finite_positive, run_script

LAYERS = 1000  # the README's figures are per step of 1000 layers


def test_tiny_run_prints_every_case_and_the_ratio_lines() -> None:
    out = run_script("producer_overhead", "--case-a", "4x1000", "--case-b", "50x16",
                     "--repeats", "1")
    lines = out.strip().splitlines()
    assert "case (a): 4 layers x 1000 float32" in out and "case (b): 50 layers x 16" in out
    assert "numba not imported" in out  # `import producer` stays free of numba
    ratios = [line for line in lines if line.strip().startswith("ratios:")]
    assert len(ratios) == 2, out
    for line in ratios:
        pairs = dict(p.split("=") for p in line.split(":", 1)[1].split())
        assert set(pairs) == {"weight_stats_to_floor", "weights_to_floor",
                              "weights_to_update_floor", "nan_to_floor"}
        for value in pairs.values():
            finite_positive(value)
    sizes = re.findall(r"StepSummary in the (binary|json) wire format \((as sent: the "
                       r"producer's default|GRADSTREAM_WIRE_FORMAT=json)\): full mode (\d+) B, "
                       r"norms mode (\d+) B", out)
    assert [(fmt, what) for fmt, what, _, _ in sizes] == [
        ("binary", "as sent: the producer's default"), ("json", "GRADSTREAM_WIRE_FORMAT=json"),
    ] * 2
    for _, _, full, norms in sizes:
        assert 0 < int(norms) < int(full)
    last = re.fullmatch(r"summary_ratio_to_floor=(\d+\.\d\d)", lines[-1])
    assert last is not None, lines[-1]
    finite_positive(last.group(1))


def _sent_step_sizes(bootstrap: str, topic: str, grads: dict[str, np.ndarray]) -> dict:
    """Record sizes (bytes) of the StepSummary a GradientProducer sends for ``grads`` in
    each (wire format, mode), read back from the broker."""
    runs = {}
    for wire_format in ("binary", "json"):
        for mode in ("full", "norms"):
            run_id = f"bench-{wire_format}-{mode}-{uuid.uuid4().hex[:8]}"
            producer = GradientProducer(run_id, bootstrap_servers=bootstrap, topic=topic,
                                        wire_format=wire_format, mode=mode)
            producer.start_run({name: g.size for name, g in grads.items()})
            producer.record_step(1, grads)
            assert producer.finish_run(timeout=60)
            stats = producer.close(timeout=10)
            assert stats.sent == 3 and stats.dropped == stats.failed == 0
            runs[run_id] = (wire_format, mode)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                             auto_offset_reset="earliest", consumer_timeout_ms=30_000)
    try:
        deadline = time.monotonic() + 60
        while not consumer.partitions_for_topic(topic) and time.monotonic() < deadline:
            time.sleep(0.1)
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        sizes = {}
        for record in consumer:
            message = decode_message(record.value)
            if isinstance(message, StepSummary):
                assert message.run_id in runs
                sizes[runs[message.run_id]] = (len(record.value), message.run_id)
            if len(sizes) == len(runs):
                break
    finally:
        consumer.close()
    assert len(sizes) == len(runs), sizes
    return sizes


def _readme_figures() -> dict[str, tuple[float, float]]:
    """The (norms, full) kB per 1000-layer step README states for each wire format."""
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(
        r"`GRADSTREAM_MODE=norms` sends only sum g² and the NaN/Inf count \(in the default "
        r"binary wire 4 of the 6 eight-byte columns per layer: two thirds of the bytes, "
        r"(\d+\.\d) kB against (\d+\.\d) kB per step for 1000 layers; with "
        r"`GRADSTREAM_WIRE_FORMAT=json` less than half, about (\d+) against (\d+) kB", text)
    assert found is not None, "README no longer states the norms-mode sizes per wire format"
    values = [float(x) for x in found.groups()]
    return {"binary": (values[0], values[1]), "json": (values[2], values[3])}


def test_sizes_stated_by_readme_and_the_bench_are_what_the_producer_sends(
    kafka_bootstrap: str,
) -> None:
    """The README sentence on GRADSTREAM_MODE=norms and the bench's size lines, against the
    record values a producer sends for 1000 float32 layers in each wire format and mode."""
    rng = np.random.default_rng(7)
    grads = {f"layer{i:04d}.weight": rng.standard_normal(16, dtype=np.float32) * 1e-3
             for i in range(LAYERS)}
    sent = _sent_step_sizes(kafka_bootstrap, f"bench-sizes-{uuid.uuid4().hex[:8]}", grads)
    for wire_format in ("binary", "json"):
        full, full_run = sent[(wire_format, "full")]
        norms, norms_run = sent[(wire_format, "norms")]
        # The bench's own encoding of the same step (same run id length, same values).
        bench_full, _ = producer_overhead.message_bytes(grads, wire_format, run_id=full_run)
        _, bench_norms = producer_overhead.message_bytes(grads, wire_format, run_id=norms_run)
        # wall_time's repr may differ by a digit or two between the two encodings, and
        # the binary header is padded to 8 bytes, so one digit can move it by 8.
        assert abs(bench_full - full) <= 8 and abs(bench_norms - norms) <= 8, (
            wire_format, full, bench_full, norms, bench_norms)
        stated_norms, stated_full = _readme_figures()[wire_format]
        if wire_format == "binary":
            # 4 of 6 eight-byte columns per layer, plus the header: "two thirds".
            assert 0.64 <= norms / full <= 0.69, (norms, full)
            assert norms / 1e3 == pytest.approx(stated_norms, abs=0.3)
            assert full / 1e3 == pytest.approx(stated_full, abs=0.3)
        else:
            # "less than half, about 33 against 75 kB" (JSON's size follows the digits).
            assert norms / full < 0.5, (norms, full)
            assert norms / 1e3 == pytest.approx(stated_norms, abs=3)
            assert full / 1e3 == pytest.approx(stated_full, abs=3)
