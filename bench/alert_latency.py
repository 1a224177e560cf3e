"""Alert latency: from ``record_step`` on a producer to the alert on the alerts topic.

A real run through a real broker (``KAFKA_BOOTSTRAP_SERVERS`` or a temporary local broker,
``deploy.broker.LocalBroker``): ``--ranks`` GradientProducers of one run send ``--layers``
layers per step, a consumer worker (``consumer.worker.Worker``, default alert rules,
default flush interval and shard timeout) runs on a thread, and a reader tails the alerts
topic. ``--incidents`` incidents are injected: a step in which one random rank's gradient
of one random layer holds a NaN. Incidents are ``resolve_after + 1`` steps apart so that
each one is a new incident (the previous one has resolved).

Latency of an incident = arrival time of its ``nonfinite`` firing event at the reader -
the time ``record_step`` was called on the NaN rank for that step (one process, one
monotonic clock). The frame is finalised when the last rank's shard of the step arrives,
so this includes the other ranks' ``record_step`` calls of that step.

Floor, measured in the same run: one Kafka hop (a small record sent with the worker's
producer settings, ``acks=all``, ``linger_ms=0``, and received by a polling consumer). An
alert crosses two hops (summaries topic, alerts topic), so the printed ratio is
``p50 alert latency / (2 x p50 hop)``.

Run: ``python bench/alert_latency.py [--incidents 200] [--ranks 4] [--layers 100]``.
Last line: ``alert_latency_p99_ms=X``.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from consumer.alerts.config import load_alert_rules
from consumer.alerts.feed import AlertFeed
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from producer import GradientProducer
from schemas.alert import Alert, AlertRule, AlertState


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of ``values`` (NumPy ``inverted_cdf``)."""
    return float(np.percentile(np.asarray(values), q, method="inverted_cdf"))


def kafka_hop(settings: ConsumerSettings, count: int = 200) -> list[float]:
    """Seconds from ``send`` to receipt of ``count`` small records, one at a time."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = f"bench-hop-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings.model_copy(update={"partitions": 1}), [topic])
    producer = KafkaProducer(**settings.kafka_kwargs(), acks=-1, linger_ms=0)
    consumer = KafkaConsumer(**settings.kafka_kwargs(), group_id=None)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    producer.send(topic, b"warm-up").get(timeout=30)
    consumer.seek_to_end(tp)
    consumer.position(tp)
    out = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            producer.send(topic, b"x")
            while not consumer.poll(timeout_ms=50):
                pass
            out.append(time.perf_counter() - t0)
    finally:
        producer.close()
        consumer.close()
    return out


def run(bootstrap: str, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """The run with injected incidents. Returns (latencies s, worker-side latencies s,
    missed incidents)."""
    from rich.progress import Progress

    tag = uuid.uuid4().hex[:8]
    settings = ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"bench-{tag}.summaries",
        dlq_topic=f"bench-{tag}.dlq", alerts_topic=f"bench-{tag}.alerts",
        group_id=f"bench-{tag}", db=str(Path(args.tmp) / "bench.duckdb"),
    )
    rules = load_alert_rules(None, settings.alert_set)
    spacing = rules.nonfinite.resolve_after + 1
    steps = args.incidents * spacing + 1
    rng = np.random.default_rng(args.seed)
    incident_steps = {1 + i * spacing: (int(rng.integers(args.ranks)),
                                       int(rng.integers(args.layers)))
                      for i in range(args.incidents)}
    names = [f"block.{i}.weight" for i in range(args.layers)]

    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, name="worker", daemon=True)
    thread.start()
    if not worker.wait_ready(60):
        raise RuntimeError(f"worker did not start: {worker.error}")
    feed = AlertFeed(settings, settings.alerts_topic, since=None, wait_s=30)
    arrivals: dict[int, float] = {}
    created: dict[int, float] = {}
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            for record in feed.poll(20):
                if (isinstance(record, Alert) and record.rule is AlertRule.NONFINITE
                        and record.state is AlertState.FIRING):
                    arrivals.setdefault(record.step, time.perf_counter())
                    created[record.step] = record.created_at - (record.wall_time or 0.0)

    reader = threading.Thread(target=read, name="alerts-reader", daemon=True)
    reader.start()
    run_id = f"bench-{tag}"
    producers = [GradientProducer(run_id, rank=r, world_size=args.ranks,
                                  bootstrap_servers=bootstrap, topic=settings.topic)
                 for r in range(args.ranks)]
    recorded: dict[int, float] = {}
    try:
        for p in producers:
            p.start_run(dict.fromkeys(names, args.elements * args.ranks))
        for p in producers:
            p.flush(timeout=30)
        grads = [{n: (np.random.default_rng(r * 7919 + i).standard_normal(args.elements)
                      .astype(np.float32) * np.float32(1e-2)) for i, n in enumerate(names)}
                 for r in range(args.ranks)]
        with Progress() as progress:
            task = progress.add_task(f"{args.incidents} incidents, {steps} steps", total=steps)
            for step in range(steps):
                started = time.perf_counter()
                bad = incident_steps.get(step)
                for rank, p in enumerate(producers):
                    g = grads[rank]
                    if bad is not None and bad[0] == rank:
                        g = dict(g)
                        layer = names[bad[1]]
                        g[layer] = g[layer].copy()
                        g[layer][int(rng.integers(args.elements))] = np.nan
                        recorded[step] = time.perf_counter()
                    p.record_step(step, g)
                progress.advance(task)
                time.sleep(max(0.0, args.interval - (time.perf_counter() - started)))
        for p in producers:
            p.finish_run()
            p.close()
        deadline = time.monotonic() + 10
        while len(arrivals) < len(incident_steps) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        reader.join(5)
        feed.close()
        worker.stop()
        thread.join(60)
    latencies = [arrivals[s] - recorded[s] for s in incident_steps if s in arrivals]
    worker_side = [created[s] for s in incident_steps if s in created]
    return latencies, worker_side, len(incident_steps) - len(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--incidents", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--elements", type=int, default=4096, help="per layer per rank")
    parser.add_argument("--interval", type=float, default=0.02,
                        help="seconds per training step (pacing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    logging.getLogger("gradstream.alerts").setLevel(logging.CRITICAL)  # 400 alert log lines

    broker = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    with tempfile.TemporaryDirectory(prefix="gradstream-bench-") as tmp:
        args.tmp = tmp
        if not bootstrap:
            from deploy.broker import LocalBroker

            broker = LocalBroker(Path(tmp) / "broker")
            bootstrap = broker.start(timeout=120)
        try:
            hop = kafka_hop(ConsumerSettings(bootstrap_servers=bootstrap))
            latencies, worker_side, missed = run(bootstrap, args)
        finally:
            if broker is not None:
                broker.stop()
    ms = [x * 1e3 for x in latencies]
    hop_ms = [x * 1e3 for x in hop]
    print(f"{args.ranks} ranks x {args.layers} layers x {args.elements} float32, one step "
          f"every {args.interval * 1e3:.0f} ms; {len(ms)} of {args.incidents} incidents "
          f"alerted ({missed} missed)")
    print(f"{'':<40}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    print(f"{'Kafka hop (floor, send -> receive)':<40}{percentile(hop_ms, 50):>10.1f}"
          f"{percentile(hop_ms, 99):>10.1f}{max(hop_ms):>10.1f}")
    if worker_side:
        w = [x * 1e3 for x in worker_side]
        print(f"{'producer wall_time -> alert created_at':<40}{percentile(w, 50):>10.1f}"
              f"{percentile(w, 99):>10.1f}{max(w):>10.1f}")
    if not ms:
        raise SystemExit("no alert arrived")
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    print(f"{'record_step -> alert on the topic':<40}{p50:>10.1f}{p99:>10.1f}{max(ms):>10.1f}")
    print(f"ratio p50 / (2 x hop p50): {p50 / (2 * percentile(hop_ms, 50)):.2f}")
    if missed:
        print(f"WARNING: {missed} incident(s) raised no alert within 10 s")
    print(f"alert_latency_p99_ms={p99:.1f}")


if __name__ == "__main__":
    main()
