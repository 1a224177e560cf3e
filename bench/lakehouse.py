"""The same stream written to DuckDB and to Apache Iceberg on a local S3 endpoint.

1. **Endpoints.** A Kafka broker (``KAFKA_BOOTSTRAP_SERVERS``, else a temporary
   :class:`deploy.broker.LocalBroker`: :func:`bench.live_broker.live_broker`) and an S3
   endpoint: moto's ``ThreadedMotoServer`` on a free loopback port, in a child process of
   its own (as object storage runs beside, not inside, the store; in this process it
   would take the workers' interpreter lock), with a bucket made by boto3. pyiceberg
   reaches it through the standard AWS variables (``AWS_ENDPOINT_URL`` ...,
   :func:`consumer.outputs.iceberg.s3_properties`).
2. **Stream.** ``--runs`` runs of ``--ranks`` ranks, each rank a disjoint shard of a
   ``--layers``-layer model (so every frame has ``--layers`` layer rows), ``--steps``
   steps, sent to a fresh topic by one SDK producer process per rank
   (:func:`bench.pipeline_throughput.produce`: ``GradientProducer.record_summaries``, with
   the per-rank step times the SDK measures, so every write also touches the scalar
   tables).
3. **Writes.** A real worker (:class:`consumer.worker.Worker`, the single-process mode of
   ``gradstream consume``) consumes the topic from the beginning into a DuckDB file, then
   another, of another consumer group, into Iceberg (SQLite catalog, warehouse
   ``s3://BUCKET/warehouse``, a namespace of its own; the output's defaults: write-behind,
   commit interval ``iceberg_commit_interval_s``). Each is timed from partition assignment
   until every record was read and the worker, stopped, has committed its last batch;
   rows/s = ``layer_stats`` rows / that time. The workers run one after the other on the
   same machine, ``--repeats`` times alternating (a new file, group and namespace each
   time); the best of each is reported, as other work on a shared machine only slows a
   pass down.
4. **Bytes per row.** The sum of the sizes of the objects of the pass's namespace (data,
   manifests, metadata), and the DuckDB file's size, each divided by the stored
   ``layer_stats`` rows.
5. **Visibility.** The last Iceberg worker is started again (it resumes from the offsets
   in the snapshot properties), and ``--markers`` times a one-step marker run is produced
   (:func:`bench.pipeline_throughput.produce_direct`, from this process) and the Iceberg
   table polled (a pyiceberg catalog of its own, every :data:`POLL_INTERVAL_S`) until the
   marker's rows are readable: seconds from the send to the first scan that returns them;
   the worst is reported.
6. **Lost and duplicated.** Every table of each Iceberg pass (read with pyiceberg alone)
   and of the first DuckDB store is compared row by row over the stream's runs (multiset
   difference in DuckDB, ``EXCEPT ALL``; the writers' clock columns and each group's own
   ``kafka_offsets`` left out): ``lost`` = rows of the DuckDB store missing from Iceberg,
   ``duplicated`` = rows Iceberg holds beyond them; and ``layer_stats`` must hold runs x
   steps x layers rows.
7. **Read back.** A run of ``--rows`` layer rows (default 10 M, 1000-layer frames computed
   here by :func:`consumer.frames.compute_frame`) is written by the Iceberg output directly
   (no Kafka; batches of the loop's ``max_batch_rows``) into a namespace of its own on the
   S3 endpoint and by the DuckDB output into a file; then the run's ``layer_stats`` rows are
   read into an in-memory DuckDB table: from Iceberg by a pyiceberg scan (partition
   ``run_id``) -> Arrow -> ``CREATE TABLE AS``; from the DuckDB file by ``CREATE TABLE AS
   SELECT`` on the attached file. ``--rows 0`` skips it (``iceberg_read_10m_s=nan``).

Run (from the repository root): ``python bench/lakehouse.py [--steps N] [--layers L]
[--ranks R] [--runs N] [--rows N] [--markers N] [--repeats N] [--commit-interval S]``.
Last line:
``iceberg_rows_per_s=N duckdb_rows_per_s=N iceberg_read_10m_s=X visible_after_s=X lost=N
duplicated=N``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.live_broker import live_broker  # noqa: E402
from bench.pipeline_throughput import (  # noqa: E402
    _proc_cpu_seconds,
    produce,
    produce_direct,
)

BUCKET = "gradstream-lake"
"""The S3 bucket the Iceberg warehouse lives in."""

S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "gradstream", "AWS_SECRET_ACCESS_KEY": "gradstream-bench",
                  "AWS_REGION": "us-east-1"}
"""Credentials of the local endpoint (moto accepts any)."""

POLL_INTERVAL_S = 0.1
"""Seconds between two scans of the Iceberg table while waiting for a marker (each scan
plans the table's files: a few manifest reads)."""

WORKER_TIMEOUT_S = 600.0
"""Seconds a worker may take to start or to read the whole stream before the bench
gives up."""

VISIBLE_TIMEOUT_S = 120.0
"""Seconds a marker may take to become readable before the bench gives up."""

CLOCK_COLUMNS = {"frames": ("finalized_at",), "alerts": ("created_at",)}
"""Columns each writer fills from its own clock: left out of the comparison of the two
stores."""

NOT_COMPARED = frozenset({"kafka_offsets"})
"""Tables whose rows are each consumer group's own (its positions: the Iceberg worker
also read the marker runs), left out of the comparison."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_s3(port: int, ready: Any, stop: Any) -> None:
    """Child process: moto's S3 server on 127.0.0.1:``port`` until ``stop`` is set (its
    request log silenced)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    ready.set()
    try:
        stop.wait()
    finally:
        server.stop()


class S3Endpoint(NamedTuple):
    """A running local S3 endpoint: its URL and the process serving it."""

    url: str
    pid: int | None


@contextlib.contextmanager
def s3_endpoint() -> Iterator[S3Endpoint]:
    """A moto S3 server in a child process on a free loopback port.

    Raises:
        RuntimeError: the server did not start within 60 s.
    """
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    port = _free_port()
    process = ctx.Process(target=_serve_s3, args=(port, ready, stop), daemon=True)
    process.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the moto S3 server did not start within 60 s")
        yield S3Endpoint(f"http://127.0.0.1:{port}", process.pid)
    finally:
        stop.set()
        process.join(10)
        if process.is_alive():
            process.terminate()
            process.join(5)


def bucket_bytes(s3: Any, bucket: str, prefix: str = "") -> tuple[int, int]:
    """(objects, total bytes) of the objects of ``bucket`` under ``prefix``."""
    objects = size = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            objects += 1
            size += int(item["Size"])
    return objects, size


class Phase(NamedTuple):
    """A worker's pass over the stream: wall seconds, CPU seconds of this process (every
    thread) and of the S3 endpoint's process over the same span."""

    seconds: float
    cpu: float
    s3_cpu: float

    def describe(self, rows: int) -> str:
        """CPU per row, here and in the S3 endpoint."""
        return (f"{self.cpu / rows * 1e6:.2f} µs CPU/row in the worker's process, "
                f"{self.s3_cpu / rows * 1e6:.2f} in the S3 endpoint")


def run_worker(settings: Any, messages: int, rows: int, s3_pid: int | None) -> Phase:
    """Run a worker on a thread until it has read ``messages`` records and put ``rows``
    layer rows into batches, then stop it (its last batch is committed before its thread
    ends). Timed from partition assignment to the end of the thread (``s3_pid``: the S3
    endpoint's process, whose CPU is measured too).

    Raises:
        RuntimeError: the worker failed or stalled (:data:`WORKER_TIMEOUT_S`).
    """
    from consumer.worker import Worker

    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        if not worker.wait_ready(WORKER_TIMEOUT_S):
            raise RuntimeError(f"the worker did not start: {worker.error}")
        start = time.perf_counter(), time.process_time(), _proc_cpu_seconds(s3_pid)
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while worker.counters.messages < messages or worker.counters.layer_rows < rows:
            if worker.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker stalled at {worker.counters}: {worker.error}")
            time.sleep(0.01)
    finally:
        worker.stop()
        thread.join(WORKER_TIMEOUT_S)
    if worker.error is not None or thread.is_alive():
        raise RuntimeError(f"the worker failed: {worker.error}")
    return Phase(time.perf_counter() - start[0], time.process_time() - start[1],
                 _proc_cpu_seconds(s3_pid) - start[2])


def iceberg_tables(catalog: Any, namespace: str, runs: list[str]) -> dict[str, Any]:
    """Every table of ``namespace``, the rows of ``runs`` only (all rows of a table without
    ``run_id``), read with pyiceberg alone."""
    from pyiceberg.expressions import In

    tables = {}
    for ident in catalog.list_tables(namespace):
        table = catalog.load_table(ident)
        names = {f.name for f in table.schema().fields}
        scan = table.scan(row_filter=In("run_id", runs)) if "run_id" in names else table.scan()
        tables[ident[-1]] = scan.to_arrow()
    return tables


def compare_stores(db: Path, iceberg: dict[str, Any], runs: list[str]) -> tuple[int, int]:
    """(lost, duplicated): rows of the DuckDB store ``db`` (over ``runs``) missing from
    ``iceberg``, and rows ``iceberg`` holds beyond them, per table as multisets
    (``EXCEPT ALL``) without :data:`CLOCK_COLUMNS`; summed over the tables but
    :data:`NOT_COMPARED` (each table that differs is printed).

    Raises:
        AssertionError: a table of one store is missing from the other.
    """
    import duckdb
    import pyarrow as pa

    from schemas.grid_rollup import ROLLUP_TABLE

    con = duckdb.connect()
    con.execute(f"ATTACH '{db}' AS d (READ_ONLY)")
    names = [n for (n,) in con.execute(  # the rollup is derived; the Iceberg output has none
        "SELECT table_name FROM duckdb_tables() WHERE database_name = 'd'").fetchall()
        if n != ROLLUP_TABLE]
    assert set(names) == set(iceberg), (sorted(names), sorted(iceberg))
    con.register("gs_runs", pa.table({"run_id": pa.array(runs, pa.string())}))
    lost = duplicated = 0
    for name in sorted(set(names) - NOT_COMPARED):
        columns = [c for (c,) in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE database_name = 'd' AND "
            "table_name = ? ORDER BY column_index", [name]).fetchall()]
        keep = ", ".join(f'"{c}"' for c in columns if c not in CLOCK_COLUMNS.get(name, ()))
        where = ("WHERE run_id IN (SELECT run_id FROM gs_runs)" if "run_id" in columns
                 else "")
        con.register("gs_iceberg", iceberg[name])
        stored = f"SELECT {keep} FROM d.{name} {where}"
        other = f"SELECT {keep} FROM gs_iceberg"
        table_lost, table_extra = (
            con.execute(f"SELECT count(*) FROM ({a} EXCEPT ALL {b})").fetchall()[0][0]
            for a, b in ((stored, other), (other, stored)))
        con.unregister("gs_iceberg")
        if table_lost or table_extra:
            print(f"  {name}: {table_lost} rows of the DuckDB store missing from Iceberg, "
                  f"{table_extra} more in Iceberg")
        lost += table_lost
        duplicated += table_extra
    con.close()
    return lost, duplicated


def visible_after(settings: Any, catalog: Any, namespace: str, bootstrap: str, ranks: int,
                  layers: int, markers: int) -> list[float]:
    """Start an Iceberg worker on ``settings`` (it resumes from its stored offsets), then
    ``markers`` times produce a one-step run and poll ``layer_stats`` until its rows are
    readable; the seconds each took (from just before the send to the scan that found
    them).

    Raises:
        RuntimeError: the worker failed, or a marker was not readable within
            :data:`VISIBLE_TIMEOUT_S`.
    """
    from pyiceberg.expressions import EqualTo

    from consumer.worker import Worker

    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    seconds = []
    try:
        if not worker.wait_ready(WORKER_TIMEOUT_S):
            raise RuntimeError(f"the worker did not start: {worker.error}")
        table = catalog.load_table((namespace, "layer_stats"))
        for i in range(markers):
            run_id = f"marker-{uuid.uuid4().hex[:8]}-{i}"
            start = time.perf_counter()
            produce_direct(bootstrap, settings.topic, [run_id], ranks, layers // ranks, 1,
                           False)
            while True:
                table.refresh()
                found = table.scan(row_filter=EqualTo("run_id", run_id),
                                   selected_fields=("layer_index",)).to_arrow().num_rows
                if found == layers:
                    break
                if worker.error is not None or time.perf_counter() - start > VISIBLE_TIMEOUT_S:
                    raise RuntimeError(f"marker {run_id} not readable: {worker.error}")
                time.sleep(POLL_INTERVAL_S)
            seconds.append(time.perf_counter() - start)
    finally:
        worker.stop()
        thread.join(WORKER_TIMEOUT_S)
    if worker.error is not None:
        raise RuntimeError(f"the worker failed: {worker.error}")
    return seconds


def _frames(run_id: str, layers: int, steps: range) -> Any:
    """A batch of complete 1-rank frames of ``run_id`` at ``steps`` (``layers`` layers,
    values from a fixed generator; :func:`consumer.frames.compute_frame`)."""
    from consumer.frames import MergedShards, compute_frame
    from consumer.outputs.base import Batch, RunState
    from schemas.stats import GradientSums

    batch = Batch()
    rng = np.random.default_rng(steps.start)
    for step in steps:
        sums = MergedShards(GradientSums.from_columns(
            np.full(layers, 4096, np.int64), rng.random(layers) * 40, rng.random(layers),
            rng.random(layers) * 0.1, np.zeros(layers, np.int64)))
        frame = compute_frame(run_id, step, sums, vanishing_threshold=1e-7,
                              exploding_threshold=1e3, ranks_seen=(0,), world_size=1,
                              wall_time=float(step))
        batch.frames[(run_id, step)] = (frame, "Healthy")
    batch.run_states[run_id] = RunState("Healthy", steps.stop, 0, steps.stop - 1, None)
    return batch


def read_back(rows: int, layers: int, catalog_url: str, warehouse: str, db: Path,
              batch_rows: int) -> tuple[float, float, float]:
    """Write a run of ``rows`` layer rows (``layers``-layer frames) with the Iceberg output
    into namespace ``readback`` and with the DuckDB output into ``db``, in batches of
    ``batch_rows``; then read the run's ``layer_stats`` into an in-memory DuckDB table
    from each. Returns (Iceberg write seconds, Iceberg read seconds, DuckDB read
    seconds)."""
    import duckdb
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.expressions import EqualTo

    from consumer.outputs.duckdb import DuckDBSink
    from consumer.outputs.iceberg import CATALOG_NAME, IcebergOutput, s3_properties
    from schemas.wire import RunStarted

    run_id = f"readback-{uuid.uuid4().hex[:8]}"
    steps = max(1, rows // layers)
    start = RunStarted(run_id=run_id, rank=0, world_size=1,
                       layer_names=[f"block{i // 8}.layer{i % 8}.weight" for i in range(layers)],
                       numel=[4096] * layers, vanishing_threshold=1e-7,
                       exploding_threshold=1e3, host="bench", start_time=0.0, config={})
    output = IcebergOutput(catalog_url, warehouse, "readback", namespace="readback",
                           io_properties=s3_properties(os.environ), write_behind=True)
    sink = DuckDBSink(db)
    per_batch = max(1, batch_rows // layers)
    iceberg_write = 0.0
    try:
        for first in range(0, steps, per_batch):
            batch = _frames(run_id, layers, range(first, min(steps, first + per_batch)))
            if first == 0:
                batch.runs_started.append(start)
            batch.offsets[("readback", 0)] = first + per_batch
            sink.write(batch, "readback")
            t = time.perf_counter()
            output.write(batch)
            iceberg_write += time.perf_counter() - t
        t = time.perf_counter()
        output.settle(wait=True)
        iceberg_write += time.perf_counter() - t
    finally:
        output.close()
        sink.close()

    catalog = SqlCatalog(CATALOG_NAME, uri=catalog_url, warehouse=warehouse,
                         **s3_properties(os.environ))
    con = duckdb.connect()
    t = time.perf_counter()
    arrow = catalog.load_table(("readback", "layer_stats")).scan(
        row_filter=EqualTo("run_id", run_id)).to_arrow()
    con.register("gs_arrow", arrow)
    con.execute("CREATE TABLE iceberg_run AS SELECT * FROM gs_arrow")
    con.unregister("gs_arrow")
    iceberg_read = time.perf_counter() - t
    del arrow
    got = con.execute("SELECT count(*) FROM iceberg_run").fetchall()[0][0]
    assert got == steps * layers, (got, steps * layers)
    con.execute("DROP TABLE iceberg_run")
    t = time.perf_counter()
    con.execute(f"ATTACH '{db}' AS d (READ_ONLY)")
    con.execute("CREATE TABLE duckdb_run AS SELECT * FROM d.layer_stats WHERE run_id = ?",
                [run_id])
    duckdb_read = time.perf_counter() - t
    con.close()
    return iceberg_write, iceberg_read, duckdb_read


def main(argv: list[str] | None = None) -> None:
    """Run the bench and print its figures; ``argv`` as on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    parser.add_argument("--layers", type=int, default=1000,
                        help="layers per frame, split over the ranks (default 1000)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--runs", type=int, default=1, help="concurrent runs (default 1)")
    parser.add_argument("--rows", type=int, default=10_000_000,
                        help="layer rows of the read-back run (default 10,000,000; 0 skips)")
    parser.add_argument("--markers", type=int, default=3,
                        help="marker runs timed until readable (default 3)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes of each store, alternating; the best is reported "
                        "(default 1)")
    parser.add_argument("--commit-interval", type=float, default=None, metavar="S",
                        help="the Iceberg worker's iceberg_commit_interval_s (default: the "
                        "setting's default)")
    args = parser.parse_args(argv)
    if args.layers % args.ranks:
        parser.error("--layers must be a multiple of --ranks")

    import boto3
    from pyiceberg.catalog.sql import SqlCatalog

    from consumer.outputs.iceberg import CATALOG_NAME, s3_properties
    from consumer.settings import ConsumerSettings
    from consumer.topic_admin import ensure_topics

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gradstream-lake-")))
        bootstrap = stack.enter_context(live_broker())
        endpoint = stack.enter_context(s3_endpoint())
        os.environ.update(S3_CREDENTIALS, AWS_ENDPOINT_URL=endpoint.url)
        s3 = boto3.client("s3", endpoint_url=endpoint.url, region_name=S3_CREDENTIALS["AWS_REGION"],
                          aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket=BUCKET)
        catalog_url = f"sqlite:///{tmp}/catalog.db"
        warehouse = f"s3://{BUCKET}/warehouse"

        tag = uuid.uuid4().hex[:8]
        common = {"bootstrap_servers": bootstrap, "topic": f"lake-sum-{tag}",
                  "dlq_topic": f"lake-dlq-{tag}", "alerts_topic": f"lake-alerts-{tag}",
                  "shard_timeout_s": 600.0}
        interval = ({} if args.commit_interval is None
                    else {"iceberg_commit_interval_s": args.commit_interval})
        ensure_topics(ConsumerSettings(**common), [common["topic"]])
        runs = [f"lake-{tag}-{i}" for i in range(args.runs)]
        messages, produce_s = produce(bootstrap, common["topic"], runs, args.ranks,
                                      args.layers // args.ranks, args.steps, False)
        rows = args.runs * args.steps * args.layers
        print(f"stream: {messages} messages, {rows:,} layer rows ({args.runs} run(s) x "
              f"{args.steps} steps x {args.layers} layers, {args.ranks} ranks), produced in "
              f"{produce_s:.1f} s")

        duck_runs: list[tuple[float, Any]] = []
        ice_runs: list[tuple[float, Any]] = []
        for attempt in range(args.repeats):  # alternate, so both see the same machine
            duck = ConsumerSettings(**common, group_id=f"lake-duck-{tag}-{attempt}",
                                    db=str(tmp / f"store-{attempt}.duckdb"))
            duck_pass = run_worker(duck, messages, rows, endpoint.pid)
            duck_bytes = Path(duck.db).stat().st_size
            print(f"duckdb:  {rows / duck_pass.seconds:,.0f} rows/s ({duck_pass.seconds:.2f} "
                  f"s), file {duck_bytes / 2**20:.1f} MiB = {duck_bytes / rows:.1f} bytes/row; "
                  f"{duck_pass.describe(rows)}")
            duck_runs.append((duck_pass.seconds, duck))
            ice = ConsumerSettings(**common, group_id=f"lake-ice-{tag}-{attempt}",
                                   iceberg_catalog=catalog_url, iceberg_warehouse=warehouse,
                                   iceberg_namespace=f"lake{attempt}", **interval)
            ice_pass = run_worker(ice, messages, rows, endpoint.pid)
            objects, ice_bytes = bucket_bytes(s3, BUCKET, f"warehouse/{ice.iceberg_namespace}/")
            print(f"iceberg: {rows / ice_pass.seconds:,.0f} rows/s ({ice_pass.seconds:.2f} s; "
                  f"commit interval {ice.iceberg_commit_interval_s:g} s), {objects} objects "
                  f"{ice_bytes / 2**20:.1f} MiB = {ice_bytes / rows:.1f} bytes/row; "
                  f"{ice_pass.describe(rows)}")
            print(f"ratio iceberg / duckdb: {duck_pass.seconds / ice_pass.seconds:.2f}")
            ice_runs.append((ice_pass.seconds, ice))
        duck_s, ice_s = min(t for t, _ in duck_runs), min(t for t, _ in ice_runs)
        if args.repeats > 1:
            print(f"best of {args.repeats}: duckdb {rows / duck_s:,.0f} rows/s, iceberg "
                  f"{rows / ice_s:,.0f} rows/s, ratio {duck_s / ice_s:.2f}")

        reader = SqlCatalog(CATALOG_NAME, uri=catalog_url, warehouse=warehouse,
                            **s3_properties(os.environ))
        ice = ice_runs[-1][1]
        visible = visible_after(ice, reader, ice.iceberg_namespace, bootstrap, args.ranks,
                                args.layers, args.markers) if args.markers else [math.nan]
        print("visible after: " + ", ".join(f"{v:.2f} s" for v in visible) + " (marker runs)")

        lost = duplicated = 0
        for _, ice in ice_runs:  # every Iceberg pass against the first DuckDB store
            tables = iceberg_tables(reader, ice.iceberg_namespace, runs)
            pass_lost, pass_duplicated = compare_stores(Path(duck_runs[0][1].db), tables, runs)
            stored = len(tables["layer_stats"])
            del tables
            pass_lost += max(0, rows - stored)
            print(f"compared every table of {ice.iceberg_namespace} over the stream's runs: "
                  f"{pass_lost} lost, {pass_duplicated} duplicated (layer_stats {stored:,} of "
                  f"{rows:,})")
            lost, duplicated = lost + pass_lost, duplicated + pass_duplicated

        read_s = math.nan
        if args.rows:
            write_s, read_s, duck_read_s = read_back(args.rows, args.layers, catalog_url,
                                                     warehouse, tmp / "readback.duckdb",
                                                     ice.max_batch_rows)
            print(f"read back {args.rows:,} rows: iceberg {read_s:.2f} s (written in "
                  f"{write_s:.1f} s, {args.rows / write_s:,.0f} rows/s), duckdb file "
                  f"{duck_read_s:.2f} s (pyiceberg scan -> Arrow -> DuckDB table vs "
                  "CREATE TABLE AS from the file)")
    print(f"iceberg_rows_per_s={rows / ice_s:.0f} duckdb_rows_per_s={rows / duck_s:.0f} "
          f"iceberg_read_10m_s={read_s:.2f} visible_after_s={max(visible):.2f} "
          f"lost={lost} duplicated={duplicated}")


if __name__ == "__main__":
    main()
