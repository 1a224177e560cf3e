"""End-to-end throughput of one worker: producer processes -> Kafka -> worker -> DuckDB.

1. **Produce.** ``--ranks`` producer processes (one per rank of each of ``--runs`` runs)
   send RunStarted, ``--steps`` StepSummary messages and RunFinished through the producer
   SDK (``GradientProducer.record_summaries``: its default binary wire, zstd, acks=all,
   idempotent) to a fresh
   topic on a real broker (``KAFKA_BOOTSTRAP_SERVERS``, else a temporary
   :class:`deploy.broker.LocalBroker` on this machine). By default the ranks shard the
   model (FSDP-style: rank r reports its ``--layers`` layers of a ``ranks x layers`` model),
   so every layer entry of a message becomes one stored row; ``--replicated`` makes every
   rank report a disjoint piece of every layer (FSDP2-style: the pieces add up to the
   parameter; ranks are merged, rows = message rows / ranks).
2. **Floor.** A bare kafka-python consumer (no group, same fetch sizes as the worker)
   reads the whole topic and discards the bytes: the cost of getting the records out of
   Kafka into Python, measured twice (before and after the pipeline), best kept.
3. **Pipeline.** One worker (the single-process mode of ``gradstream consume --db``, run
   in this process so that it can be profiled) consumes the topic from the beginning:
   decode + validate, merge ranks, frames, health, alerts, DuckDB (rows and offsets in one
   transaction). Timed from partition assignment to the last frame written; afterwards
   the store is checked to hold every expected row.

4. **Stages.** The same records, built in this process, go through the worker's stage
   functions called in order without Kafka (:func:`stage_costs`): CPU µs per layer-row of
   decode, merge, frame, health, rules and write. The hot path carries no timers.

A layer-row is one ``layer_stats`` row (one layer of one frame). Both rates divide the same
stored row count by the time each consumer needs to get through the same topic, so
``ratio_to_consume_floor = floor seconds / pipeline seconds``.

``--shapes`` (default ``all``) picks the cases (:func:`shapes`): ``insert`` (the DuckDB
insert with and without the old ``layer_stats`` primary key, :func:`insert_cost`),
``sharded64``, ``replicated64`` and ``runs20`` (their messages sent from this process,
:func:`produce_direct`), then ``default``, the shape of the options above, produced by SDK
processes. Each case prints ``shape=NAME rows_per_s=N floor_rows_per_s=N ratio=X.XX
us_cpu_per_row=X.XX``.

Run: ``python bench/pipeline_throughput.py [--shapes all|NAME,...] [--steps N] [--layers L]
[--ranks R] [--profile FILE.html]``. The last line is ``pipeline_rows_per_s=N
ratio_to_consume_floor=X.XX`` for the default case.
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
from dataclasses import dataclass
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


def _piece_numel(numel: np.ndarray, rank: int, ranks: int) -> np.ndarray:
    """int64[L]: the elements of each parameter that ``rank`` holds when every one of
    ``ranks`` ranks holds a disjoint piece of every parameter (the shapes' ``replicated``
    case, as under FSDP): ``numel // ranks`` each, the last rank also the remainder, so the
    pieces add up to the parameter's numel (the consumer checks it; a short sum is a
    partial frame). Raises ValueError when a parameter has fewer elements than ranks."""
    if int(numel.min()) < ranks:
        raise ValueError(f"every parameter needs at least {ranks} elements to give each rank one")
    return numel // ranks + (numel % ranks if rank == ranks - 1 else 0)


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
    shard = (_piece_numel(numel[:layers], rank, ranks) if replicated
             else numel[rank * layers:(rank + 1) * layers])
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
                 profile: str | None) -> int:
    """Run one worker on this thread until ``rows`` layer rows are committed; ``span``
    times it from partition assignment to that commit (seen through a read cursor on the
    worker's own DuckDB instance); prints how many transactions the worker wrote (their
    size grows while a write-behind transaction is in flight) and returns their average
    size in layer rows. With ``profile``, pyinstrument samples the worker thread and
    writes an HTML profile there (and a text summary to stdout)."""
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
                # Query the store only once the worker has put every row into a batch: a
                # count every 5 ms through the whole run took ~0.3 µs of CPU per row from
                # the two cores the worker runs on.
                if worker.counters.layer_rows < rows:
                    time.sleep(0.005)
                    continue
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
    writes = max(worker.counters.writes, 1)
    rows_per_write = max(worker.counters.layer_rows // writes, 1)
    print(f"worker: {worker.counters.writes} DuckDB transactions, "
          f"{rows_per_write:,} layer-rows each on average")
    if profiler is not None:
        Path(profile).write_text(profiler.output_html())
        print(profiler.output_text(unicode=False, color=False, show_all=False,
                                   time="percent_of_total")[:6000])
    return rows_per_write


STAGES = ("decode", "merge", "frame", "health", "rules", "write")


def _stage_messages(run_ids: list[str], ranks: int, layers: int, steps: int,
                    replicated: bool) -> tuple[list[bytes], list[bytes]]:
    """Encoded RunStarted (one per run, rank 0) and StepSummary records (step-major, then
    run, then rank: concurrent runs interleave as they would on one partition), with the
    values the producer processes of :func:`_produce_rank` send (same generators, same
    shapes) in the wire format they send them in (the SDK's default, binary)."""
    from producer.settings import ProducerSettings
    from schemas.wire import RunStarted, StepSummary, encode_message

    wire_format = ProducerSettings.model_fields["wire_format"].default
    starts: list[bytes] = []
    records: list[bytes] = []
    total_layers = layers if replicated else layers * ranks
    names = [f"block{i // 8}.layer{i % 8}.weight" for i in range(total_layers)]
    runs = []
    for run_id in run_ids:
        run_rng = np.random.default_rng(zlib.crc32(run_id.encode()))
        numel = run_rng.integers(1_000, 5_000_000, total_layers)
        scale = run_rng.lognormal(-6.0, 2.0, total_layers)
        starts.append(encode_message(RunStarted(
            run_id=run_id, rank=0, world_size=ranks, layer_names=names,
            numel=numel.tolist(), vanishing_threshold=1e-7, exploding_threshold=1e3,
            host="bench", start_time=time.time(), config={})))
        rngs = [np.random.default_rng([r, zlib.crc32(run_id.encode())]) for r in range(ranks)]
        runs.append((run_id, numel, scale, rngs))
    for step in range(steps):
        for run_id, numel, scale, rngs in runs:
            for rank in range(ranks):
                lo = 0 if replicated else rank * layers
                shard = (_piece_numel(numel[:layers], rank, ranks) if replicated
                         else numel[lo:lo + layers])
                rms = scale[lo:lo + layers] * rngs[rank].lognormal(0.0, 0.1, layers)
                records.append(encode_message(StepSummary(
                    run_id=run_id, step=step, rank=rank, world_size=ranks,
                    wall_time=time.time(), layer_indices=list(range(lo, lo + layers)),
                    numel=shard.tolist(), sum_abs=(rms * shard * 0.8).tolist(),
                    sum_sq=(rms * rms * shard).tolist(),
                    max_abs=(rms * rngs[rank].uniform(2, 6, layers)).tolist(),
                    nonfinite=[0] * layers), wire_format))
    return starts, records


def produce_direct(bootstrap: str, topic: str, run_ids: list[str], ranks: int, layers: int,
                   steps: int, replicated: bool) -> tuple[int, float]:
    """Send the messages of every rank of every run from this process (for shapes with
    many ranks, where one process per rank would take minutes to start on a small
    machine): each rank's RunStarted, the records of :func:`_stage_messages` (same values
    as the SDK processes) and each rank's RunFinished, keyed by run id, through one
    KafkaProducer with the SDK's settings (acks=all, idempotence, zstd, 256 KiB batches).

    Returns:
        (messages, wall seconds).
    """
    from kafka import KafkaProducer

    from schemas.wire import RunFinished, decode_message, encode_message

    starts, records = _stage_messages(run_ids, ranks, layers, steps, replicated)
    begin = time.perf_counter()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                             compression_type="zstd", batch_size=256 * 1024,
                             max_request_size=20 * 1024 * 1024)
    sent = 0
    for raw in starts:
        start = decode_message(raw)
        for rank in range(ranks):
            producer.send(topic, encode_message(start.model_copy(update={"rank": rank})),
                          key=start.run_id.encode())
            sent += 1
    for raw, run_id in zip(records, (r for _ in range(steps) for r in run_ids
                                     for _ in range(ranks)), strict=True):
        producer.send(topic, raw, key=run_id.encode())
        sent += 1
    for run_id in run_ids:
        for rank in range(ranks):
            producer.send(topic, encode_message(RunFinished(
                run_id=run_id, rank=rank, world_size=ranks, last_step=steps - 1,
                steps_recorded=steps, end_time=time.time())), key=run_id.encode())
            sent += 1
    producer.flush()
    producer.close()
    return sent, time.perf_counter() - begin


def stage_costs(run_ids: list[str], ranks: int, layers: int, steps: int, replicated: bool,
                db: Path, batch_rows: int = 100_000) -> tuple[int, dict[str, float]]:
    """CPU seconds (``time.process_time``, this process) of each worker stage over the same
    records, called directly in order (no Kafka, no threads): ``decode``
    (``schemas.wire.decode_message``), ``merge`` (``ShardMerger.add`` without the frame
    fields), ``frame`` (``consumer.frames.compute_frame``), ``health``
    (``RunBook.record``), ``rules`` (``AlertEngine.note_shard`` + ``on_frame``, default
    rules) and ``write`` (``DuckDBSink.write`` in the calling thread, a transaction per
    ``batch_rows`` layer rows, into a new store at ``db``).

    Returns:
        (layer rows stored, stage -> CPU seconds).
    """
    import consumer.merge as merge_module
    from consumer.alerts.config import load_alert_rules
    from consumer.alerts.engine import AlertEngine
    from consumer.merge import ShardMerger
    from consumer.outputs.base import Batch
    from consumer.outputs.duckdb import DuckDBSink
    from consumer.runbook import RunBook
    from schemas.wire import RunStarted, decode_message

    starts, records = _stage_messages(run_ids, ranks, layers, steps, replicated)
    cpu = dict.fromkeys(STAGES, 0.0)
    clock = time.process_time
    t = clock()
    messages = [decode_message(r) for r in records]
    cpu["decode"] = clock() - t

    book = RunBook(0)
    engine = AlertEngine(load_alert_rules())
    sink = DuckDBSink(db, write_behind=False)
    merger = ShardMerger(3600.0, lambda _run, _step: None)
    batch = Batch()
    for raw in starts:
        msg = decode_message(raw)
        assert isinstance(msg, RunStarted)
        book.start(msg)
        batch.runs_started.append(msg)
    compute_frame = merge_module.compute_frame

    def timed_frame(*args: object, **kwargs: object) -> object:
        t0 = clock()
        try:
            return compute_frame(*args, **kwargs)
        finally:
            cpu["frame"] += clock() - t0

    merge_module.compute_frame = timed_frame  # the merger's reference to it
    rows = 0
    try:
        for offset, msg in enumerate(messages):
            run = book.runs[msg.run_id]
            t = clock()
            engine.note_shard(run, msg)
            t1 = clock()
            frame = merger.add(run, msg, ("bench", 0), offset, 0.0)
            t2 = clock()
            cpu["rules"] += t1 - t
            cpu["merge"] += t2 - t1
            if frame is None:
                continue
            book.record(frame, batch)
            t3 = clock()
            engine.on_frame(frame, run, book.trackers[frame.run_id], now=0.0)
            t4 = clock()
            cpu["health"] += t3 - t2
            cpu["rules"] += t4 - t3
            rows += len(frame.layer_index)
            if batch.layer_rows() >= batch_rows or offset == len(messages) - 1:
                batch.offsets[("bench", 0)] = offset + 1
                sink.write(batch, "bench")
                cpu["write"] += clock() - t4
                batch = Batch()
    finally:
        merge_module.compute_frame = compute_frame
        sink.close()
    cpu["merge"] -= cpu["frame"]
    return rows, cpu


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@dataclass(frozen=True)
class Shape:
    """One benchmark case: ``runs`` concurrent runs of ``ranks`` ranks, each rank sending
    ``layers`` layer entries per step (a disjoint shard, or every layer with
    ``replicated``) for ``steps`` steps."""

    name: str
    runs: int
    ranks: int
    layers: int
    steps: int
    replicated: bool

    @property
    def rows(self) -> int:
        """layer_stats rows the case stores."""
        return self.runs * self.steps * self.layers * (1 if self.replicated else self.ranks)

    def describe(self) -> str:
        return (f"{self.runs} run(s) x {self.ranks} ranks x {self.steps} steps, "
                f"{self.layers} layers each, {'replicated' if self.replicated else 'sharded'}")


def shapes(args: argparse.Namespace) -> dict[str, Shape]:
    """The cases ``--shapes`` picks from: ``default`` (the command-line shape) and three
    fixed ones sized to run in about half a minute each on a 2-core machine:
    ``sharded64`` (64 ranks, each a disjoint 16-layer shard of a 1024-layer model, 200
    steps), ``replicated64`` (64 ranks each reporting all 1000 layers, merged: 64 message
    rows per stored row, 40 steps), ``runs20`` (20 concurrent 2-rank runs of 2 x 1000
    layers, interleaved on one partition, 30 steps). ``args.fixed_steps``, when set,
    replaces the fixed shapes' step counts (the smoke test runs them at 2 steps)."""
    fixed = args.fixed_steps
    return {
        "default": Shape("default", args.runs, args.ranks, args.layers, args.steps,
                         args.replicated),
        "sharded64": Shape("sharded64", 1, 64, 16, fixed or 200, False),
        "replicated64": Shape("replicated64", 1, 64, 1000, fixed or 40, True),
        "runs20": Shape("runs20", 20, 2, 1000, fixed or 30, False),
    }


def insert_cost(rows: int, layers: int = 1000, batch_frames: int = 100) -> dict[str, float]:
    """CPU µs per layer-row of :meth:`DuckDBSink.write` (transaction: delete the batch's
    (run, step) rows, append, frames, offsets, commit; calling thread) for ``rows`` rows in
    batches of ``batch_frames`` frames of ``layers`` layers, into a new store and into one
    whose ``layer_stats`` carries the primary key (run_id, step, layer_index) that stores
    created before had; batches alternate between the two, so that both see the same
    machine load. Fewer rows than one batch make one batch of ``rows // layers`` frames
    (at least one)."""
    import duckdb

    from consumer.frames import MergedShards, compute_frame
    from consumer.outputs.base import Batch
    from consumer.outputs.duckdb import DuckDBSink
    from schemas.stats import GradientSums
    from schemas.tables import SCHEMA_DDL
    from schemas.wire import RunStarted

    rng = np.random.default_rng(0)
    n = layers
    merged = MergedShards(GradientSums.from_columns(
        np.full(n, 1000, np.int64), rng.random(n), rng.random(n), rng.random(n),
        np.zeros(n, np.int64)))
    start = RunStarted(run_id="r", rank=0, world_size=1, layer_names=[str(i) for i in range(n)],
                       numel=[1000] * n, vanishing_threshold=1e-7, exploding_threshold=1e3,
                       host="h", start_time=0.0, config={})
    cpu = {"no key": 0.0, "primary key": 0.0}
    with tempfile.TemporaryDirectory(prefix="gradstream-insert-") as tmp:
        sinks = {}
        for label in cpu:
            path = Path(tmp) / f"{label.replace(' ', '_')}.duckdb"
            if label == "primary key":
                con = duckdb.connect(str(path))
                for ddl in SCHEMA_DDL:
                    con.execute(ddl)
                con.execute("ALTER TABLE layer_stats ADD PRIMARY KEY (run_id, step, layer_index)")
                con.close()
            sinks[label] = DuckDBSink(path, write_behind=False)
            sinks[label].write(Batch(runs_started=[start]), "g")
        batch_frames = min(batch_frames, max(1, rows // layers))
        batches = max(1, rows // (layers * batch_frames))
        for b in range(batches):
            batch = Batch()
            for step in range(b * batch_frames, (b + 1) * batch_frames):
                frame = compute_frame("r", step, merged, vanishing_threshold=1e-7,
                                      exploding_threshold=1e3, ranks_seen=(0,), world_size=1,
                                      wall_time=0.0)
                batch.frames[("r", step)] = (frame, "Healthy")
            batch.offsets[("t", 0)] = b
            for label, sink in sinks.items():
                t = time.process_time()
                sink.write(batch, "g")
                cpu[label] += time.process_time() - t
        for sink in sinks.values():
            sink.close()
    total = batches * batch_frames * layers
    return {label: seconds / total * 1e6 for label, seconds in cpu.items()}


def run_shape(settings_args: dict[str, object], shape: Shape, broker_pid: int | None,
              tmp: Path, profile: str | None) -> tuple[float, float]:
    """Produce, read at the floor, run the worker and check the store for one shape;
    print the figures and the per-stage CPU. Returns (pipeline rows/s, ratio to floor)."""
    from consumer.settings import ConsumerSettings
    from consumer.topic_admin import ensure_topics

    tag = uuid.uuid4().hex[:8]
    settings = ConsumerSettings(
        **settings_args, topic=f"bench-sum-{tag}", dlq_topic=f"bench-dlq-{tag}",
        alerts_topic=f"bench-alerts-{tag}", group_id=f"bench-{tag}",
        db=str(tmp / f"bench-{tag}.duckdb"),
    )
    run_ids = [f"bench-{tag}-{i}" for i in range(shape.runs)]
    ensure_topics(settings, [settings.topic])
    send = produce if shape.name == "default" else produce_direct
    messages, produce_s = send(settings.bootstrap_servers, settings.topic, run_ids,
                               shape.ranks, shape.layers, shape.steps, shape.replicated)
    rows = shape.rows
    how = (f"{shape.ranks * shape.runs} SDK processes" if send is produce
           else "pre-encoded, one process")
    print(f"== {shape.name}: produced {messages} messages ({shape.describe()}) in "
          f"{produce_s:.1f} s ({messages / produce_s:.0f} msg/s, {how})")
    floors = [Span(broker_pid), Span(broker_pid)]
    records, size = consume_floor(settings, settings.topic, floors[0])
    assert records == messages, f"floor read {records} of {messages} records"
    print(f"floor 1: bare consumer read {records} records, {size / 2**20:.0f} MiB, "
          f"in {floors[0].wall:.2f} s")
    pipeline = Span(broker_pid)
    rows_per_write = run_pipeline(settings, run_ids, rows, pipeline, profile)
    consume_floor(settings, settings.topic, floors[1])
    print(f"floor 2: {floors[1].wall:.2f} s")
    floor = min(floors, key=lambda f: f.wall)

    import duckdb

    con = duckdb.connect(settings.db, read_only=True)
    stored, frames, complete = con.execute(
        "SELECT (SELECT count(*) FROM layer_stats), (SELECT count(*) FROM frames), "
        "(SELECT count_if(complete) FROM frames)"
    ).fetchone()
    con.close()
    # Every frame complete: the bench's pieces fit their parameters (a misfit is partial).
    assert stored == rows and frames == complete == shape.runs * shape.steps, (
        stored, rows, frames, complete)
    pipeline_rate = rows / pipeline.wall
    floor_rate = rows / floor.wall
    print(f"pipeline: {rows} layer-rows ({frames} frames) stored in {pipeline.wall:.2f} s = "
          f"{pipeline_rate:,.0f} layer-rows/s ({messages / pipeline.wall:,.0f} msg/s, "
          f"{size / pipeline.wall / 2**20:.0f} MiB/s)\n"
          f"          {pipeline.describe(rows)}")
    print(f"floor:    {floor_rate:,.0f} layer-rows/s ({size / floor.wall / 2**20:.0f} MiB/s)"
          f"\n          {floor.describe(rows)}")
    print(f"ratio pipeline / floor: {pipeline_rate / floor_rate:.2f}")
    # The write stage in transactions of the worker's average size: below one DuckDB row
    # group (122,880 rows) a commit writes the rows to the WAL and checkpoints them again,
    # above it the insert writes compressed row groups once (about 1.5x cheaper per row).
    stage_rows, cpu = stage_costs(run_ids, shape.ranks, shape.layers, shape.steps,
                                  shape.replicated, tmp / f"stages-{tag}.duckdb",
                                  batch_rows=rows_per_write)
    assert stage_rows == rows, (stage_rows, rows)
    print(f"stages (CPU µs per layer-row, called in order on the same records, "
          f"{rows_per_write:,}-row transactions): " + "  ".join(
        f"{name} {cpu[name] / rows * 1e6:.2f}" for name in STAGES)
        + f"  | sum {sum(cpu.values()) / rows * 1e6:.2f}")
    print(f"shape={shape.name} rows_per_s={pipeline_rate:.0f} floor_rows_per_s={floor_rate:.0f} "
          f"ratio={pipeline_rate / floor_rate:.2f} "
          f"us_cpu_per_row={pipeline.cpu / rows * 1e6:.2f}")
    return pipeline_rate, pipeline_rate / floor_rate


def main(argv: list[str] | None = None) -> None:
    """Run the cases ``--shapes`` names and print their figures; ``argv`` as on the command
    line (default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    parser.add_argument("--layers", type=int, default=1000,
                        help="layers per message (default 1000)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--runs", type=int, default=1, help="concurrent runs (default 1)")
    parser.add_argument("--partitions", type=int, default=1, help="topic partitions")
    parser.add_argument("--replicated", action="store_true",
                        help="every rank reports every layer (DDP) instead of a shard")
    parser.add_argument("--shapes", default="all", metavar="NAME,...",
                        help="cases to run: default (the shape of the options above), "
                        "sharded64, replicated64, runs20, insert (the insert micro-benchmark);"
                        " `all` (default) runs every one, the default case last")
    parser.add_argument("--alert-set", action="append", default=[], metavar="RULE.FIELD=VALUE",
                        help="alert rule override for the worker, as `gradstream consume "
                        "--alert-set` (repeatable)")
    parser.add_argument("--profile", metavar="FILE.html",
                        help="profile the worker of the default case with pyinstrument, "
                        "HTML written here")
    parser.add_argument("--fixed-steps", type=int, default=None, metavar="N",
                        help="steps of the fixed shapes sharded64, replicated64 and runs20 "
                        "(default: 200, 40 and 30)")
    parser.add_argument("--insert-rows", type=int, default=300_000, metavar="N",
                        help="layer-rows of the insert micro-benchmark (default 300000)")
    args = parser.parse_args(argv)
    cases = shapes(args)
    names = (["insert", *[n for n in cases if n != "default"], "default"]
             if args.shapes == "all" else args.shapes.split(","))
    unknown = set(names) - set(cases) - {"insert"}
    if unknown:
        parser.error(f"unknown shape(s) {sorted(unknown)}: choose from {[*cases, 'insert']}")

    signal.signal(signal.SIGTERM, _interrupt)  # unwind, so that the local broker is stopped
    tmp = tempfile.TemporaryDirectory(prefix="gradstream-bench-")
    broker = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    try:
        if "insert" in names:
            cost = insert_cost(args.insert_rows)
            print(f"insert: {cost['no key']:.2f} µs CPU/layer-row into layer_stats without "
                  f"a key, {cost['primary key']:.2f} with the old primary key (ratio "
                  f"{cost['primary key'] / cost['no key']:.2f}; {args.insert_rows:,} rows, "
                  "transactions of up to 100 frames, alternating)")
        if set(names) - {"insert"} and not bootstrap:
            from deploy.broker import LocalBroker

            broker = LocalBroker(Path(tmp.name) / "broker")
            bootstrap = broker.start(timeout=LOCAL_BROKER_TIMEOUT_S)
        broker_pid = broker.status().pid if broker is not None else None
        common = {"bootstrap_servers": bootstrap, "partitions": args.partitions,
                  "alert_set": args.alert_set}
        result = None
        for name in names:
            if name == "insert":
                continue
            rate, ratio = run_shape(common, cases[name], broker_pid, Path(tmp.name),
                                    args.profile if name == "default" else None)
            if name == "default":
                result = (rate, ratio)
        if result is not None:
            print(f"pipeline_rows_per_s={result[0]:.0f} ratio_to_consume_floor={result[1]:.2f}")
    finally:
        if broker is not None:
            broker.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
