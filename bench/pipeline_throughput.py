"""End-to-end throughput of one worker: producer processes -> Kafka -> worker -> DuckDB.

1. **Produce.** ``--ranks`` producer processes (one per rank of each of ``--runs`` runs)
   send RunStarted, ``--steps`` StepSummary messages and RunFinished through the producer
   SDK (``GradientProducer.record_summaries``: JSON, zstd, acks=all, idempotent) to a fresh
   topic on a real broker (``KAFKA_BOOTSTRAP_SERVERS``, else a temporary
   :class:`deploy.broker.LocalBroker` on this machine). By default the ranks shard the
   model (FSDP-style: rank r reports its ``--layers`` layers of a ``ranks x layers`` model),
   so every layer entry of a message becomes one stored row; ``--replicated`` makes every
   rank report every layer (DDP-style; ranks are merged, rows = message rows / ranks).
2. **Floor.** A bare kafka-python consumer (no group, same fetch sizes as the worker)
   reads the whole topic and discards the bytes: the cost of getting the records out of
   Kafka into Python, measured twice (before and after the pipeline), best kept.
3. **Pipeline.** One worker (the single-process mode of ``gradstream consume --db``, run
   in this process so that it can be profiled) consumes the topic from the beginning:
   decode + validate, merge ranks, frames, health, alerts, DuckDB (rows and offsets in one
   transaction). Timed from partition assignment to the last frame written; afterwards
   the store is checked to hold every expected row.

A layer-row is one ``layer_stats`` row (one layer of one frame). Both rates divide the same
stored row count by the time each consumer needs to get through the same topic, so
``ratio_to_consume_floor = floor seconds / pipeline seconds``.

Run: ``python bench/pipeline_throughput.py [--steps N] [--layers L] [--ranks R]
[--profile FILE.html]``. The last line is ``pipeline_rows_per_s=N ratio_to_consume_floor=X.XX``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path

import numpy as np

LOCAL_BROKER_TIMEOUT_S = 180.0


def _proc_cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (Linux /proc); 0 when
    unknown (e.g. a remote broker)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Span:
    """Wall seconds and CPU seconds (this process, all threads; the broker JVM) between
    :meth:`start` and :meth:`stop`."""

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid
        self.wall = self.cpu = self.broker_cpu = 0.0

    def start(self) -> None:
        self._t = (time.perf_counter(), time.process_time(), _proc_cpu_seconds(self.broker_pid))

    def stop(self) -> None:
        wall, cpu, broker = self._t
        self.wall = time.perf_counter() - wall
        self.cpu = time.process_time() - cpu
        self.broker_cpu = _proc_cpu_seconds(self.broker_pid) - broker

    def describe(self, rows: int) -> str:
        """CPU per layer-row and average busy cores."""
        per_row = f"{self.cpu / rows * 1e6:.2f} µs CPU/layer-row in this process"
        if self.broker_pid is not None:
            per_row += f", {self.broker_cpu / rows * 1e6:.2f} in the broker"
        return f"{per_row}; {(self.cpu + self.broker_cpu) / self.wall:.2f} cores busy"


def _produce_rank(bootstrap: str, topic: str, run_id: str, rank: int, ranks: int,
                  layers: int, steps: int, replicated: bool) -> tuple[int, float]:
    """Child process: one rank's producer. Returns (messages sent, seconds)."""
    from producer import GradientProducer, LayerSummaries

    total_layers = layers if replicated else layers * ranks
    names = [f"block{i // 8}.layer{i % 8}.weight" for i in range(total_layers)]
    mine = names if replicated else names[rank * layers:(rank + 1) * layers]
    run_rng = np.random.default_rng(zlib.crc32(run_id.encode()))  # same on every rank
    numel = run_rng.integers(1_000, 5_000_000, total_layers)
    scale = run_rng.lognormal(-6.0, 2.0, total_layers)  # each layer's typical RMS gradient
    rng = np.random.default_rng([rank, zlib.crc32(run_id.encode())])
    producer = GradientProducer(run_id, rank=rank, world_size=ranks, bootstrap_servers=bootstrap,
                                topic=topic, enqueue_timeout_s=600.0, queue_size=256)
    start = time.perf_counter()
    producer.start_run(dict(zip(names, numel.tolist(), strict=True)))
    shard = numel[:layers] if replicated else numel[rank * layers:(rank + 1) * layers]
    shard = np.maximum(shard // (ranks if replicated else 1), 1)
    mine_scale = scale[:layers] if replicated else scale[rank * layers:(rank + 1) * layers]
    for step in range(steps):
        rms = mine_scale * rng.lognormal(0.0, 0.1, layers)
        sum_sq = rms * rms * shard
        producer.record_summaries(step, LayerSummaries(
            tuple(mine), shard, rms * shard * 0.8, sum_sq, rms * rng.uniform(2, 6, layers),
            np.zeros(layers, np.int64),
        ))
    producer.finish_run(timeout=600)
    stats = producer.close()
    if stats.dropped or stats.failed:
        raise RuntimeError(f"rank {rank}: {stats.dropped} dropped, {stats.failed} failed")
    return stats.sent, time.perf_counter() - start


def produce(bootstrap: str, topic: str, run_ids: list[str], ranks: int, layers: int,
            steps: int, replicated: bool) -> tuple[int, float]:
    """Run every rank of every run in its own process; (messages, wall seconds)."""
    ctx = mp.get_context("spawn")
    start = time.perf_counter()
    with ctx.Pool(len(run_ids) * ranks) as pool:
        results = pool.starmap(_produce_rank, [
            (bootstrap, topic, run_id, rank, ranks, layers, steps, replicated)
            for run_id in run_ids for rank in range(ranks)
        ])
    return sum(sent for sent, _ in results), time.perf_counter() - start


def consume_floor(settings: object, topic: str, span: Span) -> tuple[int, int]:
    """Read every record of ``topic`` with a bare KafkaConsumer and discard them; ``span``
    times it from assignment to the last record.

    Returns:
        (records, value bytes).
    """
    from kafka import KafkaConsumer, TopicPartition

    s = settings
    consumer = KafkaConsumer(
        **s.kafka_kwargs(), group_id=None, enable_auto_commit=False,
        max_poll_records=s.max_poll_records, max_partition_fetch_bytes=s.max_partition_fetch_bytes,
        fetch_max_bytes=max(s.max_partition_fetch_bytes, 64 * 1024 * 1024),
    )
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(parts)
        end = consumer.end_offsets(parts)
        consumer.seek_to_beginning(*parts)
        records = size = 0
        span.start()
        remaining = {tp for tp in parts if end[tp] > 0}
        while remaining:
            for tp, batch in consumer.poll(timeout_ms=500).items():
                records += len(batch)
                size += sum(len(r.value) for r in batch)
                if batch[-1].offset + 1 >= end[tp]:
                    remaining.discard(tp)
        span.stop()
        return records, size
    finally:
        consumer.close()


def run_pipeline(settings: object, run_ids: list[str], rows: int, span: Span,
                 profile: str | None) -> None:
    """Run one worker on this thread until ``rows`` layer rows are committed; ``span``
    times it from partition assignment to that commit (seen through a read cursor on the
    worker's own DuckDB instance). With ``profile``, pyinstrument samples the worker thread
    and writes an HTML profile there (and a text summary to stdout)."""
    from consumer.worker import Worker

    cursors = []
    worker = Worker(settings, on_open=lambda sink: cursors.append(sink.read_cursor()))
    done = threading.Event()

    def watch() -> None:
        if not worker.wait_ready(120):
            worker.stop()
            return
        span.start()
        cursor = cursors[0]
        try:
            while worker.error is None:
                stored = cursor.execute("SELECT count(*) FROM layer_stats").fetchone()[0]
                if stored >= rows and worker.runs_done(run_ids):
                    span.stop()
                    done.set()
                    break
                time.sleep(0.005)
        finally:
            cursor.close()
            worker.stop()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.001)
        profiler.start()
    try:
        worker.run()
    finally:
        if profiler is not None:
            profiler.stop()
    watcher.join(10)
    if not done.is_set():
        raise RuntimeError(f"the worker did not finish: {worker.error}")
    if profiler is not None:
        Path(profile).write_text(profiler.output_html())
        print(profiler.output_text(unicode=False, color=False, show_all=False,
                                   time="percent_of_total")[:6000])


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    parser.add_argument("--layers", type=int, default=1000,
                        help="layers per message (default 1000)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--runs", type=int, default=1, help="concurrent runs (default 1)")
    parser.add_argument("--partitions", type=int, default=1, help="topic partitions")
    parser.add_argument("--replicated", action="store_true",
                        help="every rank reports every layer (DDP) instead of a shard")
    parser.add_argument("--alert-set", action="append", default=[], metavar="RULE.FIELD=VALUE",
                        help="alert rule override for the worker, as `gradstream consume "
                        "--alert-set` (repeatable)")
    parser.add_argument("--profile", metavar="FILE.html",
                        help="profile the worker with pyinstrument, HTML written here")
    args = parser.parse_args()

    from consumer.settings import ConsumerSettings
    from consumer.topic_admin import ensure_topics

    signal.signal(signal.SIGTERM, _interrupt)  # unwind, so that the local broker is stopped
    tmp = tempfile.TemporaryDirectory(prefix="gradstream-bench-")
    broker = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        from deploy.broker import LocalBroker

        broker = LocalBroker(Path(tmp.name) / "broker")
        bootstrap = broker.start(timeout=LOCAL_BROKER_TIMEOUT_S)
    tag = uuid.uuid4().hex[:8]
    settings = ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"bench-sum-{tag}", dlq_topic=f"bench-dlq-{tag}",
        alerts_topic=f"bench-alerts-{tag}", group_id=f"bench-{tag}",
        db=str(Path(tmp.name) / "bench.duckdb"), partitions=args.partitions,
        alert_set=args.alert_set,
    )
    run_ids = [f"bench-{tag}-{i}" for i in range(args.runs)]
    try:
        ensure_topics(settings, [settings.topic])
        messages, produce_s = produce(bootstrap, settings.topic, run_ids, args.ranks,
                                      args.layers, args.steps, args.replicated)
        rows = args.runs * args.steps * args.layers * (1 if args.replicated else args.ranks)
        print(f"produced {messages} messages ({args.runs} run(s) x {args.ranks} ranks x "
              f"{args.steps} steps, {args.layers} layers each, "
              f"{'replicated' if args.replicated else 'sharded'}) in {produce_s:.1f} s "
              f"({messages / produce_s:.0f} msg/s, {args.ranks * args.runs} processes)")
        broker_pid = broker.status().pid if broker is not None else None
        floors = [Span(broker_pid), Span(broker_pid)]
        records, size = consume_floor(settings, settings.topic, floors[0])
        assert records == messages, f"floor read {records} of {messages} records"
        print(f"floor 1: bare consumer read {records} records, {size / 2**20:.0f} MiB of JSON, "
              f"in {floors[0].wall:.2f} s")
        pipeline = Span(broker_pid)
        run_pipeline(settings, run_ids, rows, pipeline, args.profile)
        consume_floor(settings, settings.topic, floors[1])
        print(f"floor 2: {floors[1].wall:.2f} s")
        floor = min(floors, key=lambda f: f.wall)

        import duckdb

        con = duckdb.connect(settings.db, read_only=True)
        stored, frames = con.execute(
            "SELECT (SELECT count(*) FROM layer_stats), (SELECT count(*) FROM frames)"
        ).fetchone()
        con.close()
        assert stored == rows and frames == args.runs * args.steps, (stored, rows, frames)
        pipeline_rate = rows / pipeline.wall
        floor_rate = rows / floor.wall
        print(f"pipeline: {rows} layer-rows ({frames} frames) stored in {pipeline.wall:.2f} s = "
              f"{pipeline_rate:,.0f} layer-rows/s ({messages / pipeline.wall:,.0f} msg/s, "
              f"{size / pipeline.wall / 2**20:.0f} MiB/s)\n"
              f"          {pipeline.describe(rows)}")
        print(f"floor:    {floor_rate:,.0f} layer-rows/s ({size / floor.wall / 2**20:.0f} MiB/s)"
              f"\n          {floor.describe(rows)}")
        print(f"ratio pipeline / floor: {pipeline_rate / floor_rate:.2f}")
        print(f"pipeline_rows_per_s={pipeline_rate:.0f} "
              f"ratio_to_consume_floor={pipeline_rate / floor_rate:.2f}")
    finally:
        if broker is not None:
            broker.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
