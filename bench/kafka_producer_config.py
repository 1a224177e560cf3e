"""Measure kafka-python producer settings for gradstream's traffic (many small messages).

Sends real StepSummary messages (``--layers`` layers, encoded in ``--wire-format``: by
default the producer's own default, the columnar binary form; ``json`` for the JSON one)
through a real broker (``KAFKA_BOOTSTRAP_SERVERS`` or a temporary local broker) for each
combination of
compression and ``linger_ms``, with ``acks=all`` and idempotence, and prints throughput
(messages/s), the median and p99 time from ``send`` to acknowledgement, and the bytes on
the wire per message (compressed batch size / messages). The producer defaults in
``producer/settings.py`` come from this table (first measured with JSON messages).

Run: ``python bench/kafka_producer_config.py [--messages N] [--layers L]
[--wire-format binary|json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from producer.settings import ProducerSettings
from schemas.wire import StepSummary, WireFormat, encode_message

SENT_FORMAT: WireFormat = ProducerSettings.model_fields["wire_format"].default
"""The wire format the producer sends by default (``GRADSTREAM_WIRE_FORMAT`` unset)."""


def payloads(layers: int, count: int, wire_format: WireFormat = SENT_FORMAT) -> list[bytes]:
    """``count`` StepSummary messages of ``layers`` layers with random statistics, encoded
    in ``wire_format``."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(count):
        sum_sq = rng.lognormal(-10, 3, layers)
        out.append(encode_message(StepSummary(
            run_id="bench", step=step, rank=0, world_size=1, wall_time=time.time(),
            layer_indices=list(range(layers)), numel=[4096] * layers,
            sum_abs=(np.sqrt(sum_sq) * 40).tolist(), sum_sq=sum_sq.tolist(),
            max_abs=np.sqrt(sum_sq).tolist(), nonfinite=[0] * layers,
        ), wire_format))
    return out


def measure(bootstrap: str, values: list[bytes], compression: str | None, linger_ms: int,
            interval_s: float) -> dict[str, float]:
    """Send ``values`` (one every ``interval_s`` seconds, 0 = as fast as possible)."""
    from kafka import KafkaProducer

    topic = f"bench-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=-1, enable_idempotence=True,
                             compression_type=compression, linger_ms=linger_ms,
                             batch_size=256 * 1024, max_request_size=20 * 1024 * 1024)
    producer.send(topic, b"warm-up").get(timeout=30)
    latencies: list[float] = []

    def done(t0: float):
        return lambda _md: latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    for value in values:
        t0 = time.perf_counter()
        producer.send(topic, key=b"bench", value=value).add_callback(done(t0))
        if interval_s:
            time.sleep(interval_s)
    producer.flush()
    elapsed = time.perf_counter() - start
    metrics = producer.metrics().get("producer-metrics", {})
    producer.close()
    lat = sorted(latencies)
    return {
        "msg_per_s": len(values) / elapsed,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
        "ratio": float(metrics.get("compression-rate-avg", float("nan"))),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the table (``argv`` as on the command line, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--wire-format", choices=("binary", "json"), default=SENT_FORMAT,
                        help=f"message encoding (default {SENT_FORMAT}: what the producer "
                        "sends by default)")
    args = parser.parse_args(argv)
    values = payloads(args.layers, args.messages, args.wire_format)
    size = statistics.mean(len(v) for v in values)
    sent = " (the producer's default)" if args.wire_format == SENT_FORMAT else ""
    print(f"{args.messages} StepSummary messages of {args.layers} layers, {size / 1024:.1f} KiB "
          f"each in the {args.wire_format} wire format{sent}; acks=all, idempotent")

    broker = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    tmp = tempfile.TemporaryDirectory()
    if not bootstrap:
        from deploy.broker import LocalBroker

        broker = LocalBroker(Path(tmp.name))
        bootstrap = broker.start(timeout=120)
    try:
        print(f"{'compression':<12}{'linger_ms':>10}{'burst msg/s':>13}{'paced p50 ms':>14}"
              f"{'paced p99 ms':>14}{'wire/raw':>10}")
        for compression in (None, "lz4", "zstd"):
            for linger in (0, 5, 50):
                burst = measure(bootstrap, values, compression, linger, 0.0)
                paced = measure(bootstrap, values[:100], compression, linger, 0.01)
                print(f"{compression or 'none':<12}{linger:>10}{burst['msg_per_s']:>13.0f}"
                      f"{paced['p50_ms']:>14.1f}{paced['p99_ms']:>14.1f}"
                      f"{burst['ratio']:>10.2f}")
    finally:
        if broker is not None:
            broker.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
