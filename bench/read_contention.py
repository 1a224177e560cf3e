"""Ingest rate of a writing process while readers query it: long queries must not hold up
ingestion.

Every process that writes a store answers reads on its endpoint (:mod:`deploy.serve`).
This measures what concurrent readers cost the writer:

1. **Produce** once: ``--ranks`` ranks x ``--steps`` steps x ``--layers`` layers (sharded:
   every layer entry is one stored row) to a fresh topic on a real broker
   (``KAFKA_BOOTSTRAP_SERVERS``, else a temporary :class:`deploy.broker.LocalBroker`), with
   the pre-encoded messages of ``bench/pipeline_throughput.py`` (:func:`produce_direct`).
2. **Consume** the same topic into a fresh store once per case, each time with a new
   group: a consumer worker with its read endpoint attached
   (:class:`deploy.serve.ServedLoop`, what ``gradstream consume`` runs). The ingest rate is
   the stored layer rows divided by the time from partition assignment to the commit of
   the last row (seen through a cursor on the writer's own instance, polled every 20 ms).
   Cases:

   - ``no readers``;
   - ``4 readers, normal priority, unbounded`` (``max_readers=None``, ``reader_nice=0``:
     what a writing process would do without the guards);
   - ``4 readers, nice 19, bound 2``: two reads at once at the lowest priority;
   - ``4 readers, defaults``: the endpoint as the commands start it: at most
     :data:`deploy.serve.DEFAULT_MAX_READERS` reads at once (half the cores, at least one),
     each request thread at nice :data:`deploy.serve.READER_NICE`.

   A reader is a separate process (as ``gradstream query`` or a notebook is) that POSTs a
   full-scan aggregate over ``layer_stats`` (per-layer count, mean norm, 99th percentile
   of the norm, peak |g|) to the endpoint's ``/api/query`` with the sidecar's token, reads
   the Arrow IPC answer, and starts again at once, for as long as the case runs. The table
   grows while they read, so each query is longer than the last.

Prints each case's ingest rate, its ratio to the ``no readers`` rate, the reads answered
and their median latency, side by side; the last line is ``read_contention_ratio=X.XX``
(defaults case / no readers). Runs in about 1-2 minutes on a 2-core machine (most of it
the local broker's start). Timings on a shared machine vary between runs: compare the
ratios of one run.

Run: ``python bench/read_contention.py [--steps N] [--layers L] [--ranks R] [--readers K]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline_throughput import LOCAL_BROKER_TIMEOUT_S, produce_direct

READ_SQL = """
SELECT layer_index, count(*) AS n, avg(grad_norm) AS mean_norm,
       quantile_cont(grad_norm, 0.99) AS p99_norm, max(max_abs_grad) AS peak
FROM layer_stats GROUP BY layer_index ORDER BY layer_index
"""
"""The readers' query: a full scan of ``layer_stats`` with a per-layer aggregate."""


def _reader(db: str, stop: mp.synchronize.Event, results: mp.Queue) -> None:
    """Child process: query the endpoint of ``db`` back to back until ``stop``; put the
    latencies (s) of the answered reads on ``results``."""
    import pyarrow as pa

    from analysis.read.sidecar import read_sidecar

    info = None
    while info is None and not stop.is_set():
        info = read_sidecar(db)
        time.sleep(0.01)
    latencies: list[float] = []
    body = json.dumps({"sql": READ_SQL, "timeout_s": 120}).encode()
    while info is not None and not stop.is_set():
        request = urllib.request.Request(
            f"{info.url}/api/query", data=body, method="POST",
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {info.token}"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=180) as answer:
                pa.ipc.open_stream(answer).read_all()
        except OSError:  # the endpoint stopped at the end of the case
            break
        latencies.append(time.perf_counter() - start)
    results.put(latencies)


@dataclass(frozen=True)
class Case:
    """One consumption of the topic: ``readers`` reader processes, ``max_readers`` the
    endpoint's bound (None: unbounded), ``nice`` its request threads' nice value."""

    name: str
    readers: int
    max_readers: int | None
    nice: int


@dataclass(frozen=True)
class Outcome:
    """What one case measured: ingest seconds, reads answered and their latencies (s)."""

    seconds: float
    latencies: list[float]


def consume(settings: object, rows: int, case: Case) -> Outcome:
    """Consume the topic of ``settings`` into its fresh store with the endpoint attached
    and ``case.readers`` readers querying it; time it from partition assignment to the
    commit of the ``rows``-th layer row.

    Raises:
        RuntimeError: the worker stopped or did not store every row within 300 s.
    """
    from consumer.worker import Worker
    from deploy.serve import EndpointOptions, ServedLoop

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    results: mp.Queue = ctx.Queue()
    db = settings.db  # type: ignore[attr-defined]
    readers = [ctx.Process(target=_reader, args=(db, stop, results), daemon=True)
               for _ in range(case.readers)]
    for reader in readers:
        reader.start()
    time.sleep(2.0 if readers else 0.0)  # let them import pyarrow before the clock starts
    served = ServedLoop(functools.partial(Worker, settings), db,
                        EndpointOptions(port=0, max_readers=case.max_readers,
                                                        reader_nice=case.nice), "bench")
    served.start()
    watch = served.loop.output.sink.read_cursor()  # type: ignore[union-attr]
    try:
        if not served.loop.wait_ready(120):
            raise RuntimeError(f"the worker did not start: {served.loop.error}")
        start = time.perf_counter()
        deadline = time.monotonic() + 300
        while watch.execute("SELECT count(*) FROM layer_stats").fetchone()[0] < rows:
            if not served.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not store {rows} rows: {served.loop.error}")
            time.sleep(0.02)
        seconds = time.perf_counter() - start
    finally:
        watch.close()
        stop.set()
        served.stop()
    latencies = [lat for _ in readers for lat in results.get(timeout=60)]
    for reader in readers:
        reader.join(30)
    return Outcome(seconds, latencies)


def main() -> None:
    from consumer.settings import ConsumerSettings
    from consumer.topic_admin import ensure_topics
    from deploy.serve import DEFAULT_MAX_READERS, READER_NICE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="steps (default 500)")
    parser.add_argument("--layers", type=int, default=1000,
                        help="layers per rank and message (default 1000)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--readers", type=int, default=4,
                        help="concurrent reader processes (default 4)")
    args = parser.parse_args()
    k = args.readers
    cases = [
        Case("no readers", 0, None, 0),
        Case(f"{k} readers, nice 0, unbounded", k, None, 0),
        Case(f"{k} readers, nice {READER_NICE}, bound 2", k, 2, READER_NICE),
        Case(f"{k} readers, defaults: nice {READER_NICE}, bound {DEFAULT_MAX_READERS}", k,
             DEFAULT_MAX_READERS, READER_NICE),
    ]
    rows = args.ranks * args.layers * args.steps
    with tempfile.TemporaryDirectory(prefix="gradstream-read-bench-") as tmp:
        broker = None
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        try:
            if not bootstrap:
                from deploy.broker import LocalBroker

                broker = LocalBroker(Path(tmp) / "broker")
                bootstrap = broker.start(timeout=LOCAL_BROKER_TIMEOUT_S)
            tag = uuid.uuid4().hex[:8]
            topic = f"bench-read-{tag}"
            base = ConsumerSettings(bootstrap_servers=bootstrap, topic=topic,
                                    dlq_topic=f"{topic}-dlq", alerts_topic=f"{topic}-alerts")
            ensure_topics(base, [topic])
            run_ids = [f"bench-read-{tag}"]
            messages, produce_s = produce_direct(bootstrap, topic, run_ids, args.ranks,
                                                 args.layers, args.steps, False)
            print(f"produced {messages} messages ({args.ranks} ranks x {args.steps} steps x "
                  f"{args.layers} layers, {rows} layer rows) in {produce_s:.1f} s")
            outcomes = {}
            for i, case in enumerate(cases):
                settings = base.model_copy(update={
                    "group_id": f"bench-read-{tag}-{i}", "db": str(Path(tmp) / f"{i}.duckdb")})
                outcomes[case.name] = consume(settings, rows, case)
        finally:
            if broker is not None:
                broker.stop()
    floor = rows / outcomes[cases[0].name].seconds
    print(f"\n{'case':<42} {'ingest rows/s':>14} {'ratio':>6} {'reads':>6} "
          f"{'read p50 s':>10}")
    for case in cases:
        outcome = outcomes[case.name]
        rate = rows / outcome.seconds
        p50 = f"{statistics.median(outcome.latencies):.2f}" if outcome.latencies else "-"
        print(f"{case.name:<42} {rate:>14,.0f} {rate / floor:>6.2f} "
              f"{len(outcome.latencies):>6} {p50:>10}")
    bounded = rows / outcomes[cases[-1].name].seconds
    print(f"read_contention_ratio={bounded / floor:.2f}")


if __name__ == "__main__":
    main()
