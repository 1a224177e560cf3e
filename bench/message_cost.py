"""Worker CPU per message when every message is small: a pipeline-parallel run's summaries.

A run of ``--ranks`` ranks, each reporting its own ``--layers`` layers of a
``ranks x layers``-layer model (pipeline parallelism: every rank holds a disjoint slice of
the layers, so every frame needs one message from each rank), sends ``--steps`` binary
StepSummary messages per rank: the SDK's default wire format, with the values of
``pipeline_throughput``'s ``sharded64`` shape (its record builder). Each rank's RunStarted
comes first and its RunFinished last, as a real run sends them. Measured side by side in
one run:

1. **In process.** A real :class:`consumer.worker.Worker` (opened as ``gradstream consume
   --db`` opens it: DuckDB output on a fresh file, the alerts topic, the default alert
   rules; no Kafka consumer) handles the records through its own path,
   ``ConsumerLoop.consume`` (decode + validate, checks, merge, frame, health, alert rules,
   metrics, the batch), then writes the batch with its offsets (``flush(settle=True)``: one
   DuckDB transaction on the sink's writer thread). ``time.process_time`` (every thread of
   this process) around both gives ``us_per_message``: the least of ``--repeat`` passes,
   each with a fresh worker and store. A second pass over the same records
   with a fresh worker and store times the stages (the first pass carries no timers):
   decode + validate (``Worker.decode``: a poll's records together,
   ``schemas.wire_batch.decode_messages``); frame + health
   (``ShardMerger._frame``: the frame fields and the layout check, and ``Worker._emit``:
   health, alert rules, metrics, the batch); output (the write); merge (the rest of a
   record: the checks against the run, ``ShardMerger.add`` without the frame, the loop's
   bookkeeping). Each is printed as a share of that pass's total. A few steps of another
   run go through a throwaway worker first (imports, the first DuckDB write), unmeasured.
   The same in-process measure at the ``--fit-layers`` sizes (4 and 64 layers per
   message by default, the same ranks and steps) gives the least-squares line
   ``cost = fixed + per_row * layers``: ``fixed_us_per_message`` is what a message costs
   whatever its size (decode, validation, the checks and bookkeeping), ``us_per_row``
   what each of its layer rows adds (frame fields, health, alert rules, the write).
2. **End to end.** The same messages go through a real broker (``--bootstrap-servers``,
   else ``KAFKA_BOOTSTRAP_SERVERS``, else a temporary local broker) to a fresh topic, sent
   from this process (``pipeline_throughput.produce_direct``: the SDK's producer
   settings); a real Worker thread consumes it into a fresh DuckDB file, from partition
   assignment until ``worker.counters`` says every record was read, then stops (its last
   write included; the store is checked to hold every row). CPU of this process over that
   span per message (the loop thread, kafka-python's I/O thread, the DuckDB writer), and
   the loop thread's own CPU per message (``time.pthread_getcpuclockid``).

Run: ``python bench/message_cost.py [--ranks 64] [--layers 16] [--steps 200] [--repeat 3]
[--fit-layers 4,64] [--bootstrap-servers HOST:PORT] [--profile FILE.html]``. The last line is
``us_per_message=N decode_validate=R merge=R frame_health=R output=R
e2e_us_per_message=N fixed_us_per_message=N us_per_row=N`` (the ratios are shares of the
in-process total; target: ``fixed_us_per_message`` at most 50). Figures in
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from live_broker import live_broker  # noqa: E402
from pipeline_throughput import _stage_messages, produce_direct  # noqa: E402

Record = namedtuple("Record", "topic partition offset value key")
"""What the worker reads of a Kafka ``ConsumerRecord``."""

STAGES = ("decode_validate", "merge", "frame_health", "output")


def build_records(run_id: str, topic: str, ranks: int, layers: int,
                  steps: int) -> list[Record]:
    """The records of one run on partition 0 of ``topic``, in the order one partition holds
    them: each rank's RunStarted, ``steps`` rounds of one binary StepSummary per rank
    (rank r reports layers ``r * layers`` to ``(r + 1) * layers - 1``), each rank's
    RunFinished."""
    from schemas.wire import RunFinished, decode_message, encode_message

    starts, summaries = _stage_messages([run_id], ranks, layers, steps, replicated=False)
    start = decode_message(starts[0])
    values = [encode_message(start.model_copy(update={"rank": r})) for r in range(ranks)]
    values += summaries
    values += [encode_message(RunFinished(
        run_id=run_id, rank=r, world_size=ranks, last_step=steps - 1, steps_recorded=steps,
        end_time=time.time())) for r in range(ranks)]
    key = run_id.encode()
    return [Record(topic, 0, offset, value, key) for offset, value in enumerate(values)]


def _settings(bootstrap: str, tmp: Path, label: str) -> Any:
    """ConsumerSettings of one worker: fresh topics, group and DuckDB file."""
    from consumer.settings import ConsumerSettings

    tag = f"{label}-{uuid.uuid4().hex[:8]}"
    return ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"bench-msg-{tag}", dlq_topic=f"bench-dlq-{tag}",
        alerts_topic=f"bench-alerts-{tag}", group_id=f"bench-{tag}",
        db=str(tmp / f"{tag}.duckdb"),
    )


def _handled_worker(settings: Any) -> Any:
    """A Worker opened as ``run()`` opens it (output, alerts topic, restore), without a
    Kafka consumer: records are handed to ``consume``."""
    from consumer.loop import freeze_startup_heap
    from consumer.worker import Worker

    worker = Worker(settings)
    worker.open()
    freeze_startup_heap()  # as run() does, once per process
    return worker


def _feed(worker: Any, records: list[Record]) -> None:
    """Hand ``records`` to ``worker`` as its loop does: in polls of ``max_poll_records``,
    each decoded together (``Worker.decode``) and then handled record by record."""
    poll = worker.settings.max_poll_records
    for start in range(0, len(records), poll):
        chunk = records[start:start + poll]
        for record, message in zip(chunk, worker.decode(chunk), strict=True):
            worker.consume(record, message)


def _check(worker: Any, records: int, frames: int) -> None:
    """Every record handled (at least once: a consumer group may hand a partition's last
    records again after a rebalance), every frame complete, no dead letter."""
    c = worker.counters
    if c.messages < records or c.frames != frames or c.partial_frames or c.dead_letters:
        raise RuntimeError(f"worker handled {c.messages} of {records} records, {c.frames} "
                           f"frames of {frames} ({c.partial_frames} partial), "
                           f"{c.dead_letters} dead letters")


def in_process(settings: Any, records: list[Record], frames: int,
               profile: str | None = None) -> tuple[float, float]:
    """CPU seconds (``time.process_time``) of handling ``records`` with a fresh worker, and
    of writing its batch. With ``profile``, pyinstrument samples the handling and writes an
    HTML profile there (and a text summary to stdout)."""
    worker = _handled_worker(settings)
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
    try:
        clock = time.process_time
        t0 = clock()
        _feed(worker, records)
        t1 = clock()
        worker.flush(settle=True)
        t2 = clock()
        if profiler is not None:
            profiler.stop()
            Path(profile).write_text(profiler.output_html())  # type: ignore[arg-type]
            print(profiler.output_text(unicode=False, color=False, show_all=False,
                                       time="percent_of_total")[:6000])
        _check(worker, len(records), frames)
    finally:
        worker._close()
    return t1 - t0, t2 - t1


def stage_split(settings: Any, records: list[Record], frames: int) -> dict[str, float]:
    """CPU seconds per stage (:data:`STAGES`) of handling ``records`` with a fresh worker,
    each stage function wrapped in ``time.process_time`` calls (module doc)."""
    worker = _handled_worker(settings)
    cpu = dict.fromkeys(STAGES, 0.0)
    clock = time.process_time

    def timed(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[stage] += clock() - t
        return wrapper

    worker.decode = timed("decode_validate", worker.decode)
    worker.merger._frame = timed("frame_health", worker.merger._frame)
    worker._emit = timed("frame_health", worker._emit)
    try:
        t0 = clock()
        _feed(worker, records)
        handling = clock() - t0
        t1 = clock()
        worker.flush(settle=True)
        cpu["output"] = clock() - t1
        _check(worker, len(records), frames)
    finally:
        worker._close()
    cpu["merge"] = handling - cpu["decode_validate"] - cpu["frame_health"]
    return cpu


def end_to_end(bootstrap: str, tmp: Path, ranks: int, layers: int,
               steps: int, timeout_s: float = 600.0) -> tuple[int, float, float, float]:
    """Send the run to a fresh topic, then consume it with a real Worker thread into a
    fresh DuckDB file, from partition assignment until ``worker.counters`` says every
    record was read, then stop it (its last write included) and check the store.

    Returns:
        (records read: ``worker.counters.messages``, at least those sent; wall seconds,
        CPU seconds of this process over that span, CPU seconds of the worker's loop
        thread until the last record was handled).

    Raises:
        RuntimeError: the worker failed, dead-lettered a record or stored another number
            of rows or frames than the run holds. TimeoutError: not done in ``timeout_s``.
    """
    import duckdb

    from consumer.topic_admin import ensure_topics
    from consumer.worker import Worker

    settings = _settings(bootstrap, tmp, "e2e")
    run_id = f"bench-msg-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [settings.topic])
    sent, seconds = produce_direct(bootstrap, settings.topic, [run_id], ranks, layers, steps,
                                   False)
    print(f"end to end: sent {sent} messages to {settings.topic} in {seconds:.1f} s")
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, name="gradstream-worker", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s

    def wait(done: Callable[[], bool], what: str) -> None:
        while not done():
            if worker.error is not None or not thread.is_alive():
                raise RuntimeError(f"the worker stopped before {what}: {worker.error!r}")
            if time.monotonic() > deadline:
                worker.stop()
                raise TimeoutError(f"the worker did not get to {what} in {timeout_s:.0f} s")
            time.sleep(0.005)

    wait(lambda: worker.wait_ready(0.0), "its partition assignment")
    assert thread.ident is not None
    loop_clock = time.pthread_getcpuclockid(thread.ident)
    wall, cpu, loop = time.perf_counter(), time.process_time(), time.clock_gettime(loop_clock)
    wait(lambda: worker.counters.messages >= sent, "the last record")
    loop = time.clock_gettime(loop_clock) - loop
    worker.stop()
    thread.join(timeout_s)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if thread.is_alive() or worker.error is not None:
        raise RuntimeError(f"the worker did not stop cleanly: {worker.error!r}")
    _check(worker, sent, steps)
    con = duckdb.connect(settings.db, read_only=True)
    try:
        rows, complete = con.execute(
            "SELECT (SELECT count(*) FROM layer_stats), "
            "(SELECT count_if(complete) FROM frames)").fetchone()
    finally:
        con.close()
    if rows != ranks * layers * steps or complete != steps:
        raise RuntimeError(f"stored {rows} rows and {complete} complete frames, expected "
                           f"{ranks * layers * steps} and {steps}")
    if worker.counters.messages > sent:
        print(f"end to end: {worker.counters.messages - sent} records read again (a "
              "rebalance gave the partition back)")
    return worker.counters.messages, wall, cpu, loop


def fixed_cost(points: dict[int, float]) -> tuple[float, float]:
    """Split in-process cost into a fixed part per message and a part per layer row.

    Args:
        points: layers per message -> CPU µs per message (at least two layer counts).

    Returns:
        (intercept, slope) of the least-squares line ``cost = fixed + per_row * layers``:
        the fixed µs per message (what a message costs whatever its size: decode, checks,
        bookkeeping) and the µs per layer row (frame fields, health, alert rules, write).

    Raises:
        ValueError: fewer than two distinct layer counts.

    >>> fixed_cost({4: 30.0, 16: 54.0, 64: 150.0})
    (22.0, 2.0)
    """
    if len(points) < 2:
        raise ValueError("the fit needs at least two layer counts")
    layers = np.array(sorted(points), dtype=np.float64)
    cost = np.array([points[int(k)] for k in layers])
    slope, intercept = np.polyfit(layers, cost, 1)
    return round(float(intercept), 6), round(float(slope), 6)


def best_in_process(bootstrap: str, tmp: Path, records: list[Record], frames: int,
                    repeat: int, profile: str | None = None) -> tuple[list[float], float, float]:
    """``repeat`` in-process passes over ``records``, each with a fresh worker and store.

    Returns:
        (CPU seconds of each pass, handling and writing of the least one).
    """
    passes = [in_process(_settings(bootstrap, tmp, "plain"), records, frames,
                         profile if i == 0 else None) for i in range(repeat)]
    handle, write = min(passes, key=sum)
    return [sum(p) for p in passes], handle, write


def main(argv: list[str] | None = None) -> None:
    """Measure and print the figures (module doc); ``argv`` as on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64, help="ranks (default 64)")
    parser.add_argument("--layers", type=int, default=16,
                        help="layers per rank and message (default 16)")
    parser.add_argument("--steps", type=int, default=200, help="steps (default 200)")
    parser.add_argument("--bootstrap-servers", default=None,
                        help="Kafka bootstrap address (default: KAFKA_BOOTSTRAP_SERVERS, "
                        "else a temporary local broker)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="in-process passes, the least CPU kept (default 3): other "
                        "processes on a shared machine slow single passes down")
    parser.add_argument("--fit-layers", type=lambda v: [int(k) for k in v.split(",")],
                        default=[4, 64], metavar="N,N",
                        help="further layers per message, measured in process like "
                        "--layers, for the fixed cost per message (default 4,64)")
    parser.add_argument("--profile", metavar="FILE.html",
                        help="profile the in-process handling with pyinstrument")
    args = parser.parse_args(argv)
    frames = args.steps
    with tempfile.TemporaryDirectory(prefix="gradstream-msg-") as tmp_dir, \
            live_broker(args.bootstrap_servers) as bootstrap:
        tmp = Path(tmp_dir)
        records = build_records(f"bench-msg-{uuid.uuid4().hex[:8]}", "bench-msg", args.ranks,
                                args.layers, args.steps)
        n = len(records)
        print(f"run: {args.ranks} ranks x {args.layers} layers each "
              f"({args.ranks * args.layers}-layer model), {args.steps} steps: {n} records "
              f"({args.ranks} per frame), {len(records[args.ranks].value)} bytes per summary")
        # Warm up first (imports, the first DuckDB write, NumPy's first calls): a few
        # steps of another run through a throwaway worker, not measured.
        warm = min(args.steps, 3)
        in_process(_settings(bootstrap, tmp, "warm"), build_records(
            f"bench-warm-{uuid.uuid4().hex[:8]}", "bench-msg", args.ranks, args.layers, warm),
            warm)
        passes, handle, write = best_in_process(bootstrap, tmp, records, frames, args.repeat,
                                                args.profile)
        total = handle + write
        print(f"in process: {n} records, CPU {handle / n * 1e6:.1f} µs per message handled + "
              f"{write / n * 1e6:.1f} µs per message written = {total / n * 1e6:.1f} µs "
              f"(best of {args.repeat}: " + ", ".join(
                  f"{p / n * 1e6:.1f}" for p in passes) + ")")
        points = {args.layers: total / n * 1e6}
        for layers in sorted(set(args.fit_layers) - {args.layers}):
            other = build_records(f"bench-msg-{uuid.uuid4().hex[:8]}", "bench-msg",
                                  args.ranks, layers, args.steps)
            _, h, w = best_in_process(bootstrap, tmp, other, frames, args.repeat)
            points[layers] = (h + w) / len(other) * 1e6
        fixed, per_row = fixed_cost(points)
        print("in process by message size: " + ", ".join(
            f"{k} layers {v:.1f} µs" for k, v in sorted(points.items()))
            + f" -> fixed {fixed:.1f} µs per message + {per_row:.2f} µs per layer row "
            "(least squares)")
        cpu = stage_split(_settings(bootstrap, tmp, "split"), records, frames)
        split_total = sum(cpu.values())
        print("split (CPU µs per message, timed pass): " + "  ".join(
            f"{name} {cpu[name] / n * 1e6:.1f}" for name in STAGES)
            + f"  | sum {split_total / n * 1e6:.1f}")
        read, wall, cpu_e2e, loop = end_to_end(bootstrap, tmp, args.ranks, args.layers,
                                               args.steps)
        print(f"end to end: {read} messages read and stored in {wall:.2f} s, CPU "
              f"{cpu_e2e / read * 1e6:.1f} µs per message in this process "
              f"({loop / read * 1e6:.1f} on the worker's loop thread)")
        ratios = " ".join(f"{name}={cpu[name] / split_total:.2f}" for name in STAGES)
        print(f"us_per_message={total / n * 1e6:.1f} {ratios} "
              f"e2e_us_per_message={cpu_e2e / read * 1e6:.1f} "
              f"fixed_us_per_message={fixed:.1f} us_per_row={per_row:.2f}")


if __name__ == "__main__":
    main()
