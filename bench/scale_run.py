"""One run at any scale: wire bytes and worker CPU per optimiser step, W = 64 ... 4096 ranks.

Simulated runs of W ranks x ``--layers`` parameters (default 1000) in three shapes, with
the messages the *default* configuration of the torch tap sends (in-band reduction,
``producer.adapters.torch_reduce``), built in this process and produced directly (no SDK
processes), keyed by run id, through a real broker (``KAFKA_BOOTSTRAP_SERVERS``, else a
temporary :class:`deploy.broker.LocalBroker`) to real workers (``consumer.worker.Worker``,
single-process DuckDB mode):

- ``ddp``: every rank holds the whole gradient; the replicas divide the layers, reduce
  in-band, rank 0 sends one summary of the whole parameters per step, reduced over
  ``[0, W)``.
- ``fsdp2``: every rank holds a piece of every parameter; the pieces are summed in-band,
  rank 0 sends one summary per step.
- ``pp``: pipeline stages of ``--stage-layers`` parameters (default 16), the W ranks split
  evenly over the ``ceil(layers / stage_layers)`` stages, each stage's tap declaring its
  own layers: the run's layer list is their union
  (``producer.adapters.torch_run_layers``), each stage's replicas divide its layers and the
  in-band reduction spans every stage, so rank 0 sends one summary of every layer per step.
- ``pp-off`` (measured at the smallest W only): the pipeline with per-rank sending
  (``reduce="off"``), every rank a summary of its stage's layers: W small messages a step,
  the worker's cost per message (``pp_us_per_message``).

Every message carries the training scalars the SDK sends by default (``schemas.scalars``):
the learning rate and each reported rank's loss, step time and compute time (dense, 8
bytes a value: 98 kB a step at 4,096 ranks beside the summary).

Per case it prints: record bytes per optimiser step (values + keys of the summaries of one
step), beside what per-rank sending (``reduce="off"``, every rank its own summary of the
layers it holds) would put on the wire, as a ratio to one rank's full summary; the worker
process's CPU ms per step (``time.process_time`` of this process while one worker thread
consumes ``--steps`` steps from the beginning of the topic, from partition assignment to
the last frame stored; the broker runs in its own process); the steps/s one worker sustains
(``1 / CPU per step``); CPU µs per message. Once per run every rank also sends a RunStarted
and a RunFinished; the bench sends rank 0's RunStarted only, so the per-step figures hold the
per-step traffic alone.

Then the largest share of one run's steps either of two workers would take
(``two_worker_max_share``): the run's summaries (at least 400 steps) sent to a topic of
two partitions keyed as a producer with ``partition_key="step"`` keys them
(``producer.transport.kafka.record_key``: ``run_id/step``, the scale-out setting),
counted per partition from the end offsets (a
worker of a consumer group of two owns one partition; with the default run-id key the
whole run lands in one partition, 1.0).

On paper, from the measured CPU per step: the workers a 10,000-rank x ``--layers`` run at
1 step/s needs in each shape, ``ceil(cpu seconds per step at W = 10,000 x 1 step/s)``, with
the CPU per step at 10,000 ranks taken from a least-squares line through the measured
points (the in-band shapes' traffic does not grow with W, so the line is flat up to noise).

Run: ``python bench/scale_run.py [--ranks 64,256,1024,4096] [--steps N] [--layers L]``.
Last line: ``ddp4096_wire_bytes_per_step=N fsdp4096_worker_ms_per_step=N
pp_us_per_message=N two_worker_max_share=X workers_for_10k_ranks=N`` (the largest W given
stands in for 4096 when 4096 is not among them).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAPES = ("ddp", "fsdp2", "pp")
PER_RANK_PIPELINE = "pp-off"
"""The pipeline shape with per-rank sending (``reduce="off"``): every rank sends its stage's
layers, W small messages a step, measured at the smallest W for the worker's cost per
message."""


@dataclass
class Case:
    """Measured figures of one (shape, W)."""

    shape: str
    ranks: int
    bytes_per_step: int
    per_rank_bytes_per_step: int
    one_rank_full_bytes: int
    messages_per_step: int
    cpu_ms_per_step: float

    @property
    def steps_per_s(self) -> float:
        """Steps one worker sustains: 1 / CPU seconds per step."""
        return 1e3 / self.cpu_ms_per_step

    @property
    def us_per_message(self) -> float:
        """Worker CPU µs per summary message."""
        return self.cpu_ms_per_step * 1e3 / self.messages_per_step


def _stats(rng: np.random.Generator, numel: np.ndarray) -> dict[str, list]:
    """Plausible whole-parameter statistics of layers of ``numel`` elements."""
    rms = rng.lognormal(-6.0, 1.0, len(numel))
    return {"numel": numel.tolist(), "sum_abs": (rms * numel * 0.8).tolist(),
            "sum_sq": (rms * rms * numel).tolist(),
            "max_abs": (rms * rng.uniform(2, 6, len(numel))).tolist(),
            "nonfinite": [0] * len(numel)}


RANK_SCALAR_NAMES = ("loss", "step_time_s", "compute_time_s")
"""The per-rank training scalars every message carries: the loss a training loop gives and
the two times the torch tap measures on every rank (``schemas.scalars``)."""


def _scalars(rng: np.random.Generator, ranks: np.ndarray) -> dict[str, object]:
    """Training scalars of a message reporting for ``ranks``: the learning rate and every
    rank's :data:`RANK_SCALAR_NAMES` (``schemas.wire.rank_scalar_fields``: dense, as the
    SDK sends them when every rank has every name)."""
    from schemas.scalars import RankScalars
    from schemas.wire import rank_scalar_fields

    k = len(RANK_SCALAR_NAMES)
    rows = RankScalars(RANK_SCALAR_NAMES, np.repeat(ranks, k),
                       np.tile(np.arange(k), len(ranks)),
                       rng.uniform(0.1, 3.0, len(ranks) * k))
    return {"scalars": {"lr": 3e-4}, **rank_scalar_fields(rows, ranks)}


def stage_ranges(ranks: int, stages: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` rank range of each of ``stages`` pipeline stages over
    ``ranks`` ranks, split as evenly as possible.

    >>> stage_ranges(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    edges = [len(part) for part in np.array_split(np.arange(ranks), stages)]
    starts = np.cumsum([0, *edges[:-1]])
    return [(int(a), int(a + n)) for a, n in zip(starts, edges, strict=True)]


def step_messages(shape: str, ranks: int, layers: int, stage_layers: int, run_id: str,
                  step: int, numel: np.ndarray, rng: np.random.Generator) -> list[bytes]:
    """The binary StepSummary records the default configuration sends for one step."""
    from schemas.wire import StepSummary, encode_message

    if shape != PER_RANK_PIPELINE:  # in-band: one summary of every layer (every stage's)
        idx = np.arange(layers)
        return [encode_message(StepSummary(
            run_id=run_id, step=step, rank=0, world_size=ranks, wall_time=time.time(),
            layer_indices=idx.tolist(), shard_index=[0] * layers, shard_count=[1] * layers,
            reduced_ranks=[0, ranks], **_stats(rng, numel),
            **_scalars(rng, np.arange(ranks))), "binary")]
    stages = math.ceil(layers / stage_layers)
    out = []
    for i, (start, stop) in enumerate(stage_ranges(ranks, stages)):
        idx = np.arange(i * stage_layers, min((i + 1) * stage_layers, layers))
        stats = _stats(rng, numel[idx])
        for rank in range(start, stop):  # the stage's data-parallel replicas
            out.append(encode_message(StepSummary(
                run_id=run_id, step=step, rank=rank, world_size=ranks, wall_time=time.time(),
                layer_indices=idx.tolist(), shard_index=[0] * len(idx),
                shard_count=[1] * len(idx), **stats,
                **_scalars(rng, np.array([rank]))), "binary"))
    return out


def per_rank_bytes(shape: str, ranks: int, layers: int, stage_layers: int,
                   numel: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """(record bytes one step would take with per-rank sending, bytes of one rank's summary
    of every layer): every rank sends its summary of the layers it holds (DDP: all, as a
    replica; FSDP2: a piece of all; pipeline: its stage's). Encoded once per distinct
    message shape and multiplied."""
    from schemas.wire import StepSummary, encode_message

    def size(idx: np.ndarray, index: int, count: int) -> int:
        return len(encode_message(StepSummary(
            run_id="r" * 36, step=1, rank=ranks - 1, world_size=ranks, wall_time=time.time(),
            layer_indices=idx.tolist(), shard_index=[index] * len(idx),
            shard_count=[count] * len(idx), **_stats(rng, np.maximum(numel[idx] // count, 1)),
            **_scalars(rng, np.array([ranks - 1]))), "binary")) + 36

    full = size(np.arange(layers), 0, 1)
    if shape == "ddp":
        return ranks * full, full
    if shape == "fsdp2":
        return ranks * size(np.arange(layers), ranks - 1, ranks), full
    return ranks * size(np.arange(min(stage_layers, layers)), 0, 1), full


def _broker() -> tuple[str, object | None]:
    """A bootstrap address: ``KAFKA_BOOTSTRAP_SERVERS`` or a temporary local broker."""
    import os

    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if env:
        return env, None
    from deploy.broker import LocalBroker

    broker = LocalBroker(Path(tempfile.mkdtemp(prefix="scale-run-broker-")))
    return broker.start(timeout=180.0), broker


def produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]],
            partitions: int = 1) -> None:
    """Create ``topic`` and send ``records`` ((key, value) pairs) with the SDK's settings."""
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                             compression_type="zstd", batch_size=256 * 1024,
                             max_request_size=20 * 1024 * 1024)
    for key, value in records:
        producer.send(topic, value, key=key)
    producer.flush()
    producer.close()


def consume(bootstrap: str, topic: str, db: Path, frames: int, workers: int = 1
            ) -> tuple[float, list[int]]:
    """Run ``workers`` Worker threads (one consumer group) until ``frames`` frames were
    finalised in all; (CPU seconds of this process from the first assignment to the end,
    frames finalised by each worker)."""
    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker

    group = f"scale-{uuid.uuid4().hex[:8]}"
    pool = [Worker(ConsumerSettings(
        bootstrap_servers=bootstrap, topic=topic, dlq_topic=f"{topic}-dlq", group_id=group,
        db=str(db.with_name(f"{db.stem}-{i}.duckdb")), shard_timeout_s=600.0))
        for i in range(workers)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in pool]
    for t in threads:
        t.start()
    try:
        if not all(w.wait_ready(120) for w in pool):
            raise RuntimeError("a worker did not start")
        cpu0 = time.process_time()
        deadline = time.monotonic() + 600
        while sum(w.counters.frames for w in pool) < frames:
            if time.monotonic() > deadline or any(w.error for w in pool):
                raise RuntimeError(f"workers stalled: {[w.error for w in pool]}")
            time.sleep(0.01)
        cpu = time.process_time() - cpu0
    finally:
        for w in pool:
            w.stop()
        for t in threads:
            t.join(30)
    return cpu, [w.counters.frames for w in pool]


def run_case(bootstrap: str, shape: str, ranks: int, layers: int, stage_layers: int,
             steps: int, out: Path) -> Case:
    """Measure one (shape, W) through the broker and one worker."""
    from schemas.wire import RunStarted, encode_message

    rng = np.random.default_rng(ranks)
    numel = rng.integers(1_000, 5_000_000, layers)
    run_id = f"{shape}-{ranks}-{uuid.uuid4().hex[:8]}"
    start = encode_message(RunStarted(
        run_id=run_id, rank=0, world_size=ranks, layer_names=[f"l{i}" for i in range(layers)],
        numel=numel.tolist(), host="bench", start_time=time.time()))
    key = run_id.encode()
    records = [(key, start)]
    per_step = 0
    messages = 0
    for step in range(steps):
        values = step_messages(shape, ranks, layers, stage_layers, run_id, step, numel, rng)
        per_step = sum(len(v) + len(key) for v in values)
        messages = len(values)
        records += [(key, v) for v in values]
    topic = f"scale-{run_id}"
    produce(bootstrap, topic, records)
    cpu, _ = consume(bootstrap, topic, out / f"{run_id}.duckdb", steps)
    off, full = per_rank_bytes(shape, ranks, layers, stage_layers, numel, rng)
    return Case(shape, ranks, per_step, off, full, messages, cpu / steps * 1e3)


def two_worker_share(bootstrap: str, ranks: int, layers: int, steps: int) -> float:
    """Largest share of one DDP run's step summaries in either partition of a two-partition
    topic, keyed as a producer with ``partition_key="step"`` keys them
    (:func:`producer.transport.kafka.record_key`; the RunStarted keeps the run-id key): with
    two workers in a consumer group each owns one
    partition and finalises the frames of the summaries in it, so this is the largest share
    of the run's steps either worker takes (read from the partitions' end offsets)."""
    from kafka import KafkaConsumer, TopicPartition

    from producer.transport.kafka import record_key
    from schemas.wire import RunStarted, encode_message

    rng = np.random.default_rng(1)
    numel = rng.integers(1_000, 100_000, layers)
    run_id = f"share-{uuid.uuid4().hex[:8]}"
    records = [(record_key(run_id, "step"), encode_message(RunStarted(
        run_id=run_id, rank=0, world_size=ranks, layer_names=[f"l{i}" for i in range(layers)],
        numel=numel.tolist(), host="bench", start_time=time.time())))]
    summaries = []
    for step in range(steps):
        key = record_key(run_id, "step", step)
        summaries += [(key, v) for v in step_messages("ddp", ranks, layers, 16, run_id, step,
                                                       numel, rng)]
    topic = f"share-{run_id}"
    produce(bootstrap, topic, records, partitions=2)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        parts = [TopicPartition(topic, p) for p in (0, 1)]
        before = consumer.end_offsets(parts)
        produce_more(bootstrap, topic, summaries)
        after = consumer.end_offsets(parts)
    finally:
        consumer.close()
    counts = [after[p] - before[p] for p in parts]
    return max(counts) / max(sum(counts), 1)


def produce_more(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    """Send ``records`` ((key, value) pairs) to the existing ``topic``."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                             compression_type="zstd", max_request_size=20 * 1024 * 1024)
    for key, value in records:
        producer.send(topic, value, key=key)
    producer.flush()
    producer.close()


def workers_needed(cases: list[Case], ranks: int = 10_000, steps_per_s: float = 1.0) -> int:
    """``ceil(cpu s per step at ranks x steps_per_s)`` for a shape's cases, the CPU per
    step at ``ranks`` from a least-squares line through (W, CPU ms per step), never below
    the largest measured value's slope-free floor (the smallest measured CPU)."""
    w = np.array([c.ranks for c in cases], float)
    cpu = np.array([c.cpu_ms_per_step for c in cases])
    if len(cases) > 1:
        slope, intercept = np.polyfit(w, cpu, 1)
        at = max(slope * ranks + intercept, float(cpu.min()))
    else:
        at = float(cpu[0])
    return max(1, math.ceil(at / 1e3 * steps_per_s))


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, measure every case, print the table and the summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024,4096",
                        help="comma-separated world sizes (default 64,256,1024,4096)")
    parser.add_argument("--layers", type=int, default=1000, help="parameters (default 1000)")
    parser.add_argument("--stage-layers", type=int, default=16,
                        help="parameters per pipeline stage (default 16)")
    parser.add_argument("--steps", type=int, default=200, help="steps per case (default 200)")
    args = parser.parse_args(argv)
    world_sizes = [int(x) for x in args.ranks.split(",")]
    bootstrap, broker = _broker()
    cases: list[Case] = []
    try:
        with tempfile.TemporaryDirectory(prefix="scale-run-") as tmp:
            out = Path(tmp)
            print(f"{'shape':6} {'W':>5} {'msgs/step':>9} {'bytes/step':>11} "
                  f"{'per-rank bytes':>15} {'x one rank':>10} {'worker ms/step':>14} "
                  f"{'steps/s':>9} {'us/msg':>8}")
            for shape in SHAPES:
                for ranks in world_sizes:
                    case = run_case(bootstrap, shape, ranks, args.layers, args.stage_layers,
                                    args.steps, out)
                    cases.append(case)
                    print(f"{shape:6} {ranks:5d} {case.messages_per_step:9d} "
                          f"{case.bytes_per_step:11,d} {case.per_rank_bytes_per_step:15,d} "
                          f"{case.bytes_per_step / case.one_rank_full_bytes:10.2f} "
                          f"{case.cpu_ms_per_step:14.3f} {case.steps_per_s:9.0f} "
                          f"{case.us_per_message:8.1f}", flush=True)
            small = min(world_sizes)
            per_rank = run_case(bootstrap, PER_RANK_PIPELINE, small, args.layers,
                                args.stage_layers, max(10, args.steps // 4), out)
            print(f"{PER_RANK_PIPELINE:6} {small:5d} {per_rank.messages_per_step:9d} "
                  f"{per_rank.bytes_per_step:11,d} {'':>15} {'':>10} "
                  f"{per_rank.cpu_ms_per_step:14.3f} {per_rank.steps_per_s:9.0f} "
                  f"{per_rank.us_per_message:8.1f}", flush=True)
            # 400 steps: a fair split's share has a standard deviation of 0.5 / sqrt(400)
            # = 0.025, so a 0.6 ceiling holds by four of them
            share = two_worker_share(bootstrap, max(world_sizes), args.layers,
                                     max(400, args.steps // 4))
    finally:
        if broker is not None:
            broker.stop()  # type: ignore[attr-defined]
    need = {s: workers_needed([c for c in cases if c.shape == s]) for s in SHAPES}
    for shape, n in need.items():
        print(f"workers for a 10,000-rank x {args.layers}-parameter {shape} run at 1 step/s: {n}")
    top = max(world_sizes)
    pick = {c.shape: c for c in cases if c.ranks == top}
    print(f"ddp{top}_wire_bytes_per_step={pick['ddp'].bytes_per_step} "
          f"fsdp{top}_worker_ms_per_step={pick['fsdp2'].cpu_ms_per_step:.3f} "
          f"pp_us_per_message={per_rank.us_per_message:.1f} "
          f"two_worker_max_share={share:.2f} workers_for_10k_ranks={max(need.values())}")


if __name__ == "__main__":
    main()
