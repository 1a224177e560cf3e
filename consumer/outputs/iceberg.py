"""The Apache Iceberg output: the DuckDB store's tables, in an Iceberg catalog, with the
consumed Kafka offsets in the snapshot properties of each write's last commit.

:class:`IcebergOutput` is a :class:`consumer.outputs.base.Output`: the same table set,
the same columns and the same write semantics as :mod:`consumer.outputs.duckdb`, written
with pyiceberg (Apache Iceberg table spec v2, "Snapshots", "Scan Planning") to a SQL
catalog (``sqlite:///...`` now; any SQLAlchemy URL pyiceberg's ``SqlCatalog`` takes) and a
warehouse (``file:///...`` or ``s3://...``), so any Iceberg engine reads the history.

The tables (:func:`iceberg_schemas`). Each table of :data:`schemas.tables.SCHEMA_DDL`
becomes an Iceberg table of the same name in the namespace (default ``gradstream``), its
columns in the same order: VARCHAR and JSON -> string, BIGINT -> long, INTEGER and
SMALLINT -> int (Iceberg has no 16-bit integer), DOUBLE -> double, BOOLEAN -> boolean,
``T[]`` -> ``list<T>``; NOT NULL columns are required fields, and a DuckDB primary key
becomes the table's identifier fields (the row key other engines may upsert on).

Schema evolution (:func:`evolve_schema`): a table set written by an earlier gradstream is
brought to the store's current columns when the output opens it, by Iceberg's rules: a
column the store gained is added, optional (rows written before read it as null), a
narrower number type is promoted (int -> long, float -> double), nothing is dropped, and
any other change stops the output with the table and column named.

Partitioning: identity on ``run_id`` for every table that has it (all but
``kafka_offsets``). The reads of the store are per run (a report, an analysis, a plot or
an export takes one run), so a run's reads open only its own data files; and a rewrite of
a run's rows (below) rewrites only that run's files. A run's data files stay as the writes
made them (one or more per write that touched the run); compacting them is housekeeping.
The tables are created with :data:`TABLE_PROPERTIES` (manifest merging, metadata files
deleted after 100 commits, Parquet dictionaries for key columns only).

Writes (:meth:`IcebergOutput.write`). Iceberg has no multi-table transaction, so a batch
is one pyiceberg transaction per table it puts rows in. The DuckDB output's semantics are
kept by construction: the batch is first written by a
:class:`consumer.outputs.duckdb.DuckDBSink` on an in-memory staging database into which the
stored rows the batch may read or replace were loaded (the batch's *scope* in each table:
its runs, its (run, step) keys, its (run, alert id) keys or its Kafka partitions,
:func:`batch_scopes`). The staged rows of each table are then the new content of that
scope, and each table's transaction is a row-level delete of the keys that may be
stored, then an append of the rows' data files (pyiceberg's ``Transaction.overwrite``,
the files written beforehand: :meth:`IcebergOutput._data_files`). pyiceberg deletes
copy-on-write (a data file wholly inside the filter is dropped, one partly inside is
rewritten without the matched rows; merge-on-read delete files it does not write), inside
the same transaction as the append, so a reader sees the old rows or the new ones, never
both and never neither. So a late rank's rewrite of a partial frame, a frame that has
fewer layers than before and a replay after a crash all replace the stored rows of their
(run, step), as in DuckDB (``layer_stats`` deleted then appended, ``frames`` upserted,
step scalars recomputed over every stored rank, and so on).

Which keys may be stored is known without reading Iceberg in the common case. The output
keeps, per table and run, the largest step that may be stored (:attr:`IcebergOutput.known`):
looked up once from the table's metadata (the ``step`` upper bounds of the run's data
files, :meth:`IcebergOutput.stored_bounds`; no data file is read), then raised by every
write. A key above it is new: its rows are appended, with no delete and nothing loaded
(new frames of a streaming run, new runs: nearly every write). A key at or below it (a
late rank, a replay, a flight recorder's earlier steps) is loaded (read-modify-write
tables) and deleted before the append, the filter bounded by the keys' step range so that
only the data files that may hold them are read or rewritten. The ``runs`` rows of the
runs a write touched stay in the staging database (one row per run, the
:data:`KNOWN_RUNS_MAX` most recent runs), so the counters each write updates are not read
back either. This holds while a run has one writer, the owner of its Kafka partition (the
producer keys a run's records by run id): the knowledge is dropped whenever partitions are
assigned (:meth:`IcebergOutput.stored_offsets`) and looked up again after a refresh, so a
partition that moved in from another process is seen with that process's rows. Two
processes writing the same run at the same time (two consumer groups on one topic into one
table set) are not supported.

Commits run behind (``write_behind``, as :func:`IcebergOutput.from_settings` opens the
output, for a worker or a store): :meth:`IcebergOutput.write` hands the batch to a staging
thread and returns; the staging thread stages it, starts writing its tables' data files
(Parquet, one file per run, on a pool: written once, whatever the commit's tries) and hands
its commits to a writer thread, which commits the writes one after the other: the tables
outside :data:`COMMIT_LAST` side by side, then those in order. At most
:data:`WRITES_IN_FLIGHT` writes are handed over and not committed, so the next batch's files
are written while the previous batch commits; a write after a failed one commits nothing,
and the failure is raised to the loop by the next :meth:`IcebergOutput.write` or
:meth:`IcebergOutput.settle`. Without it every step runs in the caller's thread (the
data files still on the pool) and :meth:`IcebergOutput.write` returns once the batch is
committed. The loop writes at most every :attr:`IcebergOutput.min_write_interval_s`
(``iceberg_commit_interval_s``, :data:`consumer.settings.DEFAULT_ICEBERG_COMMIT_INTERVAL_S`),
or at once at ``max_batch_rows``, so a table gets few snapshots (each commit's cost grows
with the table's snapshot count) and large files. Several processes may commit to the same
tables: a commit that finds the table changed is retried by pyiceberg on the refreshed
metadata (``commit.retry.num-retries``, its data files kept), and one whose delete meets a
concurrent change (pyiceberg's serializable validation) is planned again from a refreshed
table (:data:`COMMIT_ATTEMPTS`). The writer's FileIO saves requests to the object store
(:class:`WriterFileIO`).

Exactly once with respect to Kafka (the scheme of Iceberg's Kafka Connect sink: offsets in
the snapshot summary of the commit that holds the data). The next offset to consume per
partition goes into the snapshot properties (:func:`offset_property`) of the write's last
commit, the one to ``kafka_offsets`` (whose rows hold the same offsets, for other
engines). A crash between two commits of a write leaves rows whose offsets are not
stored: the restarted output resumes from the offsets of the last complete write
(:meth:`IcebergOutput.stored_offsets` walks the snapshot ancestry of ``kafka_offsets``)
and the replay writes those rows again; their keys are at or below the stored bounds the
restarted output looks up, so they replace the same scopes: every table write is
idempotent (``rank_scalars`` rows of a (run, step, rank) the batch carries are replaced
even for a frame not marked as a rewrite, since a replay may find them stored). Offsets
are therefore never ahead of the data.

Restoring (:meth:`IcebergOutput.restore`) reads the stored tables into an in-memory DuckDB
database and rebuilds the loop's runs from it with the DuckDB output's own code; its memory
and time grow with the stored history.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow.fs import FileSystem, S3FileSystem
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.conversions import from_bytes
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import (
    AlwaysFalse,
    And,
    BooleanExpression,
    EqualTo,
    GreaterThanOrEqual,
    In,
    LessThanOrEqual,
    Or,
)
from pyiceberg.io import PY_IO_IMPL, OutputStream
from pyiceberg.io.pyarrow import (
    BUFFER_SIZE,
    ONE_MEGABYTE,
    PyArrowFile,
    PyArrowFileIO,
    bin_pack_arrow_table,
    pyarrow_to_schema,
    schema_to_pyarrow,
    write_file,
)
from pyiceberg.manifest import DataFile
from pyiceberg.partitioning import (
    UNPARTITIONED_PARTITION_SPEC,
    PartitionField,
    PartitionFieldValue,
    PartitionSpec,
)
from pyiceberg.partitioning import PartitionKey as IcebergPartitionKey
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties, Transaction, WriteTask
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StringType,
)
from pyiceberg.utils.properties import property_as_bool, property_as_int

from consumer.alerts.rows import load_active_incidents
from consumer.frames import MergedShards
from consumer.outputs.base import Batch, KnownState, Output, PartitionKey, commit_offsets
from consumer.outputs.duckdb import DuckDBSink, stored_sums
from consumer.settings import DEFAULT_ICEBERG_COMMIT_INTERVAL_S, DEFAULT_ICEBERG_NAMESPACE
from schemas.grid_rollup import ROLLUP_TABLE
from schemas.iceberg_catalog import (  # the readers' contract, shared with the writer
    CATALOG_NAME,
    s3_properties,
)

if TYPE_CHECKING:
    import duckdb

    from consumer.runbook import RunBook
    from consumer.runs import RunInfo
    from consumer.settings import LoopSettings

log = logging.getLogger("gradstream.consumer")

_QUIET_DELETE = threading.Lock()
"""Held while a delete runs with pyiceberg's "Delete operation did not match any records"
warning filtered (a key that may be stored and is not, e.g. a replay that finds nothing
left by the crash, is an expected case): ``warnings.catch_warnings`` swaps the process's
filters, which is safe for one thread at a time only, and commits run on several."""

OFFSETS_TABLE = "kafka_offsets"
"""The table whose commit ends every write and carries the offsets in its snapshot
properties."""

OFFSET_PROPERTY_PREFIX = "gradstream.offsets"
"""Snapshot-property key prefix of a stored offset (:func:`offset_property`)."""

PARTITION_COLUMN = "run_id"
"""The identity partition column of every table that has it (module docstring)."""

STEP_COLUMN = "step"
"""The column whose stored upper bound per run tells new keys from stored ones (module
docstring)."""

RUNS_TABLE = "runs"
"""The table whose rows of recent runs stay in the staging database between writes."""

KNOWN_RUNS_MAX = 1024
"""Runs whose stored bounds and ``runs`` row the output keeps between writes, the most
recently written first: a run beyond them is looked up again when next written (one
metadata read per table). A run costs one staging row and one bound per table, so the
limit only keeps a long-lived store's memory flat; a worker rarely streams more runs at
once."""

COMMIT_ATTEMPTS = 5
"""Times a table's commit is planned and tried from a refreshed table before a write fails.
Each try already retries a commit that finds the table changed (pyiceberg's
``commit.retry.num-retries``, 4 by default, backing off from 100 ms); a new try is needed
when a concurrent commit removed or added files the write's delete matches (pyiceberg's
``ValidationException``, e.g. two writers' offset rows in one ``kafka_offsets`` file,
or a compaction of the run)."""

WRITES_IN_FLIGHT = 2
"""Writes handed to the writer thread and not yet committed before :meth:`IcebergOutput.write`
waits: one committing, the next with its data files being written (or waiting its turn).
The writes commit one after the other, in order, and none after one that failed, so a
write's offsets are never stored before an earlier write's rows."""

STAGING_THREADS = 1
"""DuckDB threads of the staging database. A write stages one batch (an insert, then one
read per table), on a thread of its own beside the loop: a second DuckDB thread left its
wall time as it was and added 0.24 µs of CPU per ``layer_stats`` row (0.87 against 0.63,
500,000-row batches of 1000-layer frames, 2 cores)."""

PARALLEL_TABLES = 4
"""Threads that write data files, and threads that commit the tables a write may commit in
any order: a steady write's data tables are ``layer_stats``, ``step_scalars`` and
``rank_scalars`` (four with ``local_layer_stats``), whose commits mostly wait on the
object store and the catalog, so they overlap."""

RETRY_WAIT_S = 0.1
"""Seconds before the second try of :data:`COMMIT_ATTEMPTS`, doubled for each further try
(pyiceberg's own first wait, ``commit.retry.min-wait-ms``)."""

PARQUET_DICTIONARY_BYTES = 64 * 1024
"""Largest Parquet dictionary page of a column chunk before its values are written plain
(``write.parquet.dict-size-bytes``; pyiceberg's default is 2 MB). 64 KiB holds 8,192
distinct 8-byte values: the key columns of a write (run, step, layer index, sizes, flags)
keep their dictionaries, while a statistics column, whose every value differs, falls back
at once instead of after hashing 2 MB of values into a dictionary that is then thrown away.
Measured on 500,000 ``layer_stats`` rows of the bench's stream (zstd): 0.27 s to encode and
52.1 bytes/row with 2 MB, 0.10 s and 45.6 bytes/row with 64 KiB (8 KiB: the same)."""

TABLE_PROPERTIES: dict[str, str] = {
    "commit.manifest-merge.enabled": "true",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.parquet.dict-size-bytes": str(PARQUET_DICTIONARY_BYTES),
}
"""Iceberg table properties set on creation (Iceberg table properties, "Write
properties"): merge manifests on append (pyiceberg's ``MergeAppend``, once 100 have
accumulated: ``commit.manifest.min-count-to-merge``), so a scan's or a delete's planning
reads a bounded number of manifests instead of one more per write; and delete a table
metadata file once ``write.metadata.previous-versions-max`` (100) newer ones exist, as
every commit writes one (a reader that loaded the table 100 commits ago may find its file
gone; it loads the table again); and :data:`PARQUET_DICTIONARY_BYTES`. The data files
otherwise keep pyiceberg's defaults: zstd Parquet
(a ``layer_stats`` row's random doubles compress no further at a higher level, and snappy
or lz4 save 17 % of encode time for 7 % more bytes), one file per run and write up to
``write.target-file-size-bytes`` (512 MB of Arrow data, well above a write's
``max_batch_rows``)."""

COMMIT_LAST: tuple[str, ...] = ("frames", "runs", OFFSETS_TABLE)
"""Tables committed after every other table of a write, in this order: a ``frames`` row
claims its rows stored, ``runs`` holds the counters after the batch, and the offsets
commit comes last so that they are never ahead of the data."""

REPLACED_WHOLE = frozenset({"layer_stats", "frames", "alerts", OFFSETS_TABLE})
"""Tables whose stored rows in a batch's scope the DuckDB write replaces without reading
them (``layer_stats`` deleted per (run, step); ``frames``, ``alerts`` and
``kafka_offsets`` upserted with whole rows): nothing is loaded into the staging database
for them. The other tables are read-modify-write (``INSERT OR IGNORE``, ``UPDATE``, step
values recomputed over stored ranks), so their scope is loaded first."""

LOAD_SUMS_COLUMNS: tuple[str, ...] = (
    "layer_index", "numel", "sum_abs", "sum_sq", "max_abs_grad", "nonfinite", "nan",
    "weight_sum_sq", "update_sum_sq", "exp_hist_columns", "exp_hist_counts", "weight_sum",
    "weight_sum_cube", "weight_sum_quad", "weight_min", "weight_max", "weight_nonfinite",
    "weight_exp_hist_columns", "weight_exp_hist_counts",
)
"""``layer_stats`` columns :func:`consumer.outputs.duckdb.stored_sums` reads."""


_SCALAR_TYPES: dict[str, Callable[[], IcebergType]] = {
    "VARCHAR": StringType, "JSON": StringType, "BIGINT": LongType, "INTEGER": IntegerType,
    "SMALLINT": IntegerType, "DOUBLE": DoubleType, "BOOLEAN": BooleanType,
}
"""DuckDB column type -> Iceberg type (Iceberg spec, "Primitive Types": int is 32-bit,
long 64-bit; JSON is text)."""




class NewObjectFile(PyArrowFile):
    """A file the writer creates: pyiceberg names every file it writes anew (a UUID in the
    name of each data, manifest, manifest list and table metadata file), so
    :meth:`create` skips the existence check (a ``HeadObject`` request per file on S3:
    four per table and commit)."""

    def create(self, overwrite: bool = False) -> OutputStream:
        """The output stream of this new file (``overwrite`` is moot: see the class)."""
        return super().create(overwrite=True)


class WriterFileIO(PyArrowFileIO):
    """pyiceberg's PyArrow FileIO, with fewer requests per commit for the writer:

    - its S3 file system opens an object for writing only when its first part is uploaded
      (Arrow ``S3Options.allow_delayed_open``), so a file smaller than one upload part (a
      manifest, a manifest list, a table metadata file, a small table's data file) goes in
      one ``PutObject`` request instead of a multipart upload's three
      (``CreateMultipartUpload``, ``UploadPart``, ``CompleteMultipartUpload``; Amazon S3
      API Reference);
    - the files it creates skip the existence check (:class:`NewObjectFile`).

    The writer names it in its catalog's ``py-io-impl`` property (pyiceberg's FileIO
    extension point), so readers keep pyiceberg's own FileIO. With moto's S3 server
    (``bench/lakehouse.py``), 100 small files cost its process 1.35 s of CPU in multipart
    uploads and 0.44 s in single ``PutObject`` requests."""

    def _initialize_fs(self, scheme: str, netloc: str | None = None) -> FileSystem:
        """pyiceberg's file system for ``scheme``, with delayed opens when it is S3."""
        fs = super()._initialize_fs(scheme, netloc)
        if isinstance(fs, S3FileSystem):
            rebuild, (options,) = fs.__reduce__()  # every option the file system was given
            fs = rebuild({**options, "allow_delayed_open": True})
        return fs

    def new_output(self, location: str) -> PyArrowFile:
        """A :class:`NewObjectFile` at ``location`` (as ``PyArrowFileIO.new_output``)."""
        scheme, netloc, path = self.parse_location(location, self.properties)
        return NewObjectFile(location=location, path=path, fs=self.fs_by_scheme(scheme, netloc),
                             buffer_size=int(self.properties.get(BUFFER_SIZE, ONE_MEGABYTE)))


def offset_property(group: str, topic: str, partition: int) -> str:
    """The snapshot-property key of the next offset of (group, topic, partition):
    ``gradstream.offsets.<group>.<topic>.<partition>``, the group and topic percent-encoded
    (RFC 3986) with ``.`` encoded too, so that the key names one partition whatever dots
    the names hold."""
    return f"{_offset_prefix(group, topic)}{int(partition)}"


def _offset_prefix(group: str, topic: str) -> str:
    """The key of :func:`offset_property` without the partition."""
    def encode(name: str) -> str:
        return quote(name, safe="").replace(".", "%2E")

    return f"{OFFSET_PROPERTY_PREFIX}.{encode(group)}.{encode(topic)}."


def _iceberg_type(duckdb_type: str, next_id: Callable[[], int], column: str) -> IcebergType:
    """The Iceberg type of a DuckDB column type (:data:`_SCALAR_TYPES`; ``T[]`` -> a list
    of optional ``T``).

    Raises:
        TypeError: a type without an Iceberg mapping (add it to :data:`_SCALAR_TYPES`).
    """
    if duckdb_type.endswith("[]"):
        element = _iceberg_type(duckdb_type[:-2], next_id, column)
        return ListType(next_id(), element, element_required=False)
    if duckdb_type not in _SCALAR_TYPES:
        raise TypeError(f"column {column} has DuckDB type {duckdb_type}, which has no Iceberg "
                        "type in consumer.outputs.iceberg._SCALAR_TYPES: add one")
    return _SCALAR_TYPES[duckdb_type]()


def iceberg_schemas(con: duckdb.DuckDBPyConnection) -> dict[str, Schema]:
    """The Iceberg schema of every table of the DuckDB database ``con`` (the store's tables:
    :data:`schemas.tables.SCHEMA_DDL`), columns in the DuckDB order, NOT NULL columns
    required, the primary key as identifier fields (module docstring). The grid rollup
    (``schemas.grid_rollup``) is left out: it is derived from ``layer_stats`` block by
    block, which a staged write does not hold, and a reader of a store without it reads
    the rows.

    Raises:
        TypeError: a column type without an Iceberg mapping.
    """
    keys = {table: set(columns) for table, columns in con.execute(
        "SELECT table_name, constraint_column_names FROM duckdb_constraints() "
        "WHERE constraint_type = 'PRIMARY KEY'").fetchall()}
    columns = con.execute(
        "SELECT table_name, column_name, data_type, is_nullable = 'NO' FROM "
        "information_schema.columns ORDER BY table_name, ordinal_position").fetchall()
    schemas: dict[str, Schema] = {}
    for table in dict.fromkeys(t for t, *_ in columns if t != ROLLUP_TABLE):
        next_id = iter(range(1, 1 << 20)).__next__  # this table's field ids, from 1
        fields, identifiers = [], []
        for name, kind, required in ((c, k, r) for t, c, k, r in columns if t == table):
            field_id = next_id()
            fields.append(NestedField(field_id, name, _iceberg_type(kind, next_id, name),
                                      required=required))
            if name in keys.get(table, ()):
                identifiers.append(field_id)
        schemas[table] = Schema(*fields, identifier_field_ids=identifiers)
    return schemas


def key_filter(keys: pa.Table) -> BooleanExpression:
    """The Iceberg row filter matching exactly the distinct key rows of ``keys`` (one
    column per key column): ``c0 IN (...)`` for one column, else for each value v of the
    first column ``c0 = v AND <filter of the rest of its rows>``, OR-ed; so a (run, step)
    scope is one ``step IN (...)`` per run. An integer column with several values is
    also bounded, ``c >= min AND c <= max AND c IN (...)``: the same rows, but pyiceberg
    prunes data files on the bounds whatever the number of values (it reads every file
    that may match an ``IN`` of more than 200 values: ``IN_PREDICATE_LIMIT`` of
    ``pyiceberg.expressions.visitors``).

    Raises:
        ValueError: ``keys`` has no rows.
    """
    if keys.num_rows == 0:
        raise ValueError("a key filter needs at least one key")
    first, *rest = keys.column_names
    values = pc.unique(keys[first]).to_pylist()
    if not rest:
        if len(values) > 1 and pa.types.is_integer(keys.schema.field(first).type):
            return And(And(GreaterThanOrEqual(first, min(values)),
                           LessThanOrEqual(first, max(values))), In(first, values))
        return In(first, values)
    parts = [
        And(EqualTo(first, value),
            key_filter(keys.filter(pc.equal(keys[first], value)).select(rest)))
        for value in values
    ]
    return reduce(Or, parts)


def _run_steps(keys: Iterable[tuple[str, int]]) -> pa.Table | None:
    """(run_id, step) key table of ``keys``; None when empty."""
    pairs = list(dict.fromkeys(keys))
    if not pairs:
        return None
    return pa.table({"run_id": pa.array([r for r, _ in pairs], pa.string()),
                     "step": pa.array([s for _, s in pairs], pa.int64())})


def _runs(run_ids: Iterable[str]) -> pa.Table | None:
    """run_id key table of ``run_ids``; None when empty."""
    ids = list(dict.fromkeys(run_ids))
    return pa.table({"run_id": pa.array(ids, pa.string())}) if ids else None


def batch_scopes(batch: Batch, group: str) -> dict[str, pa.Table]:
    """Per table, the keys of the stored rows the DuckDB write of ``batch`` may read or
    replace (module docstring, "Writes"): tables the batch does not touch are absent.

    Returns:
        table name -> key table (columns ``run_id``; ``run_id, step``; ``run_id,
        alert_id`` (an alert id names one run's incident: ``schemas.alert.incident_id``);
        or ``consumer_group, topic, kafka_partition``).
    """
    frames = [f for f, _ in batch.frames.values()]
    started = [m.run_id for m in batch.runs_started]
    finished = [m.run_id for m in batch.runs_finished]
    scopes: dict[str, pa.Table | None] = {
        "runs": _runs([*started, *batch.run_states, *finished]),
        "layers": _runs(started),
        "run_ranks": _runs(finished),
        "refused_ranks": _runs(r for r, _, _ in batch.refusals),
        "layer_stats": _run_steps(batch.frames),
        "frames": _run_steps(batch.frames),
        "local_layer_stats": _run_steps([
            *((f.run_id, f.step) for f in frames if f.local is not None and len(f.local)),
            *((m.run_id, m.step) for m in batch.local_summaries)]),
        "step_scalars": _run_steps(
            (f.run_id, f.step) for f in frames
            if f.scalars or (f.rank_scalars is not None and len(f.rank_scalars))),
        "rank_scalars": _run_steps(
            (f.run_id, f.step) for f in frames
            if f.rank_scalars is not None and len(f.rank_scalars)),
    }
    if batch.alerts:
        ids = list(dict.fromkeys((a.run_id, a.alert_id) for a in batch.alerts))
        scopes["alerts"] = pa.table({"run_id": pa.array([r for r, _ in ids], pa.string()),
                                     "alert_id": pa.array([i for _, i in ids], pa.string())})
    if batch.offsets:
        keys = list(batch.offsets)
        scopes[OFFSETS_TABLE] = pa.table({
            "consumer_group": pa.array([group] * len(keys), pa.string()),
            "topic": pa.array([t for t, _ in keys], pa.string()),
            "kafka_partition": pa.array([p for _, p in keys], pa.int32()),
        })
    return {name: keys for name, keys in scopes.items() if keys is not None}


def _carried_rank_keys(batch: Batch) -> pa.Table | None:
    """(run_id, step, rank) of the per-rank scalar rows the batch's frames carry; None when
    none."""
    ranked = [f for f, _ in batch.frames.values()
              if f.rank_scalars is not None and len(f.rank_scalars)]
    if not ranked:
        return None
    ranks = [np.unique(f.rank_scalars.rank) for f in ranked]  # type: ignore[union-attr]
    lengths = np.array([len(r) for r in ranks])
    return pa.table({
        "run_id": pa.array(np.repeat(np.array([f.run_id for f in ranked], object), lengths),
                           pa.string()),
        "step": pa.array(np.repeat(np.array([f.step for f in ranked], np.int64), lengths)),
        "rank": pa.array(np.concatenate(ranks).astype(np.int32)),
    })


def _sqlite_parent(uri: str) -> Path | None:
    """The folder of a ``sqlite:///path`` catalog file (None for another URL or an
    in-memory SQLite)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path).parent


def _redacted(uri: str) -> str:
    """``uri`` with any password replaced by ``***``."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return uri.replace(f":{parts.password}@", ":***@", 1)


Commit = tuple[str, pa.Table, BooleanExpression, dict[str, str]]
"""One table's part of a write: (table, rows to append, filter of the stored rows to delete
first, snapshot properties)."""


PROMOTIONS: frozenset[tuple[type, type]] = frozenset({
    (IntegerType, LongType), (FloatType, DoubleType)})
"""The column type changes Iceberg allows on data already written that the store's
schema may need (Iceberg table spec, "Schema Evolution": int -> long, float -> double)."""


def evolve_schema(table: Table, expected: Schema) -> Table:
    """Bring ``table`` (created by an earlier gradstream) to the columns of ``expected``
    (:func:`iceberg_schemas`: the store's current DuckDB schema), by Iceberg's rules
    (Iceberg table spec, "Schema Evolution"), in one schema update:

    - a column the table lacks is added, optional (Iceberg cannot add a required column
      to data already written: rows written before read it as null, as DuckDB's
      ``ALTER TABLE ADD COLUMN`` gives them);
    - a column of a narrower type is promoted (:data:`PROMOTIONS`);
    - a column the table has and the store no longer writes is kept (nothing is dropped:
      other engines may read it; new rows leave it null).

    Returns:
        ``table``, refreshed when its schema changed.

    Raises:
        ValueError: a column's type changed in a way Iceberg does not allow (naming the
            table and the column): migrate the table, or write to a new namespace.
    """
    current = {f.name: f for f in table.schema().fields}
    missing = [f for f in expected.fields if f.name not in current]
    promote = []
    for f in expected.fields:
        have = current.get(f.name)
        if have is None or str(have.field_type) == str(f.field_type):  # (ids aside)
            continue
        if (type(have.field_type), type(f.field_type)) not in PROMOTIONS:
            raise ValueError(
                f"Iceberg table {'.'.join(table.name())} column {f.name!r} is "
                f"{have.field_type}, the store now writes {f.field_type}, which Iceberg "
                "cannot promote: migrate the table or write to a new namespace")
        promote.append(f)
    if not missing and not promote:
        return table
    with table.update_schema() as update:
        for f in missing:
            update.add_column(f.name, f.field_type, doc=f.doc, required=False)
        for f in promote:
            update.update_column(f.name, field_type=f.field_type)
    log.info("Iceberg table %s: added column(s) %s, promoted %s", ".".join(table.name()),
             [f.name for f in missing] or "none", [f.name for f in promote] or "none")
    table.refresh()
    return table


class IcebergOutput(Output):
    """Batches into Iceberg tables (module docstring): one pyiceberg transaction per table
    the batch puts rows in, the offsets in the snapshot properties of the last one
    (``kafka_offsets``).

    Args:
        catalog: the SQL catalog's SQLAlchemy URL (``sqlite:///path/catalog.db``; its
            folder is created).
        warehouse: where the tables' files go (``file:///path`` or ``s3://bucket/path``).
        group: the consumer group the offsets are kept under.
        ignore_layers: the writing process's own ``--ignore-layers`` patterns, recorded
            with each run it stores first
            (:attr:`consumer.outputs.duckdb.DuckDBSink.ignore_layers`).
        namespace: the Iceberg namespace of the tables (created if absent).
        io_properties: pyiceberg FileIO properties (``s3.endpoint``, ``s3.access-key-id``,
            ...; :func:`s3_properties`); ``py-io-impl`` replaces :class:`WriterFileIO`.
        write_behind: stage and commit on threads of the output's own (module
            docstring): :meth:`write` returns once the previous batch is staged;
            :meth:`settle` says when every batch is committed. False (default):
            :meth:`write` returns once the batch is committed.
        commit_interval_s: least seconds between two writes, asked of the loop
            (:attr:`min_write_interval_s`).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the catalog cannot be opened.
        OSError: the warehouse cannot be written (creating a table writes its metadata).
        TypeError: a store column type has no Iceberg type (:func:`iceberg_schemas`).
    """

    name = "iceberg"

    def __init__(self, catalog: str, warehouse: str, group: str,
                 ignore_layers: Iterable[str] = (),
                 namespace: str = DEFAULT_ICEBERG_NAMESPACE,
                 io_properties: Mapping[str, str] | None = None,
                 write_behind: bool = False,
                 commit_interval_s: float = DEFAULT_ICEBERG_COMMIT_INTERVAL_S) -> None:
        parent = _sqlite_parent(catalog)
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.catalog_uri = catalog
        self.warehouse = warehouse
        self.group = group
        self.namespace = namespace
        self.min_write_interval_s = commit_interval_s
        self.catalog = SqlCatalog(CATALOG_NAME, uri=catalog, warehouse=warehouse, **{
            PY_IO_IMPL: f"{WriterFileIO.__module__}.{WriterFileIO.__qualname__}",
            **(io_properties or {})})
        self.staging = DuckDBSink(":memory:", write_behind=False)
        """In-memory DuckDB database with the store's tables: each write's staging area
        (between writes it holds the ``runs`` rows of the known runs), and the mirror
        :meth:`restore` reads (module docstring)."""
        self.staging.ignore_layers = tuple(ignore_layers)
        self.staging.write_rollup = False  # staged blocks would miss the stored rows
        self.staging.con.execute(f"SET threads = {STAGING_THREADS}")
        self._failed: BaseException | None = None
        self._writer = (ThreadPoolExecutor(1, thread_name_prefix="gradstream-iceberg")
                        if write_behind else None)
        self._stager = (ThreadPoolExecutor(1, thread_name_prefix="gradstream-iceberg-stage")
                        if write_behind else None)
        self._staging: Future[None] | None = None  # the batch being staged
        self._files = ThreadPoolExecutor(PARALLEL_TABLES, thread_name_prefix="gradstream-files")
        """Writes each table's data files of a write (:meth:`_data_files`); with
        ``write_behind``, those of the next write while the previous one commits."""
        self._commits = ThreadPoolExecutor(PARALLEL_TABLES,
                                           thread_name_prefix="gradstream-commit")
        """Commits the tables of a write that may go in any order (all but
        :data:`COMMIT_LAST`) side by side."""
        self._pending: deque[tuple[Future[None], frozenset[tuple[str, str]]]] = deque()
        """Writes committing, oldest first, each with the (table, run) pairs it writes."""
        self._broken: BaseException | None = None  # a commit failed: commit nothing more
        try:
            self.schemas = iceberg_schemas(self.staging.con)
            self.catalog.create_namespace_if_not_exists(namespace)
            self.tables: dict[str, Table] = {
                name: evolve_schema(self.catalog.create_table_if_not_exists(
                    (namespace, name), schema=schema, partition_spec=self._spec(schema),
                    properties=TABLE_PROPERTIES), schema)
                for name, schema in self.schemas.items()
            }
        except BaseException:
            self.close()
            raise
        self._arrow = {name: schema_to_pyarrow(t.schema()) for name, t in self.tables.items()}
        self._table_locks = {name: threading.Lock() for name in self.tables}
        """Per table: held while a thread reads or replaces the table's metadata
        (:meth:`_data_files`, :meth:`_commit`). pyiceberg's metadata objects fill cached
        properties on first use (the schema's name mapping, its field lookups) and a
        commit deep-copies them: a write's data files and the previous write's commit of
        the same table, side by side, failed with "dictionary changed size during
        iteration" (``bench/lakehouse.py``'s read-back, 500,000-row writes)."""
        last = [n for n in COMMIT_LAST if n in self.tables]
        self.commit_order: tuple[str, ...] = (
            *sorted(n for n in self.tables if n not in last), *last)
        """The order of a write's table commits: :data:`COMMIT_LAST` last."""
        self.known: dict[str, dict[str, float]] = {name: {} for name in self.tables}
        """Per table, per run: the largest step that may be stored (tables whose scope has
        no step: ``inf`` when rows may be stored), ``-inf`` when nothing is; a run
        absent is unknown (module docstring)."""
        self._recent: OrderedDict[str, None] = OrderedDict()  # known runs, oldest first

    @staticmethod
    def _spec(schema: Schema) -> PartitionSpec:
        """Identity on :data:`PARTITION_COLUMN` when the schema has it, else none."""
        names = {f.name: f.field_id for f in schema.fields}
        if PARTITION_COLUMN not in names:
            return UNPARTITIONED_PARTITION_SPEC
        return PartitionSpec(PartitionField(source_id=names[PARTITION_COLUMN], field_id=1000,
                                            transform=IdentityTransform(),
                                            name=PARTITION_COLUMN))

    @classmethod
    def from_settings(cls, settings: LoopSettings) -> IcebergOutput:
        """The output on ``settings.iceberg_catalog`` and ``settings.iceberg_warehouse``,
        offsets kept under ``settings.group_id``, S3 access from the AWS environment
        variables (:func:`s3_properties`), committing behind at most every
        ``settings.iceberg_commit_interval_s``.

        Raises:
            ValueError: the catalog or the warehouse is not set.
            sqlalchemy.exc.SQLAlchemyError / OSError: as the constructor.
        """
        if not settings.iceberg_catalog or not settings.iceberg_warehouse:
            raise ValueError(
                "the Iceberg output needs a catalog and a warehouse: set "
                "GRADSTREAM_ICEBERG_CATALOG (e.g. sqlite:///store/catalog.db) and "
                "GRADSTREAM_ICEBERG_WAREHOUSE (file:///store/warehouse or s3://bucket/path)")
        return cls(settings.iceberg_catalog, settings.iceberg_warehouse, settings.group_id,
                   settings.ignore_layers, settings.iceberg_namespace,
                   s3_properties(os.environ), write_behind=True,
                   commit_interval_s=settings.iceberg_commit_interval_s)

    def describe(self) -> str:
        """The catalog (password hidden), the warehouse and the namespace."""
        return (f"iceberg catalog {_redacted(self.catalog_uri)}, warehouse {self.warehouse}, "
                f"namespace {self.namespace}")

    # -- reads ----------------------------------------------------------------------------

    def _fresh(self, name: str) -> Table:
        """Table ``name`` as the catalog has it now, in an object of its own: the writer
        thread may be committing through :attr:`tables` meanwhile."""
        return self.catalog.load_table((self.namespace, name))

    def _scan(self, name: str, row_filter: BooleanExpression | None = None,
              columns: tuple[str, ...] = ("*",), table: Table | None = None) -> pa.Table:
        """Rows of table ``name`` (or of ``table``) matching ``row_filter`` (all rows when
        None)."""
        table = self.tables[name] if table is None else table
        if row_filter is None:
            return table.scan(selected_fields=columns).to_arrow()
        return table.scan(row_filter=row_filter, selected_fields=columns).to_arrow()

    def _load(self, name: str, rows: pa.Table) -> None:
        """Insert ``rows`` (Iceberg's Arrow types) into the staging table ``name``."""
        if rows.num_rows == 0:
            return
        con = self.staging.con
        con.register("gs_iceberg_rows", rows)
        try:
            con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM gs_iceberg_rows")
        finally:
            con.unregister("gs_iceberg_rows")

    def _clear_staging(self, keep_runs: bool = False) -> None:
        """Empty every staging table (``keep_runs``: but ``runs``)."""
        for name in self.tables:
            if not (keep_runs and name == RUNS_TABLE):
                self.staging.con.execute(f"DELETE FROM {name}")

    def _forget_all(self) -> None:
        """Drop every stored bound and the staging rows of known runs (they are looked up
        again when next written)."""
        for known in self.known.values():
            known.clear()
        self._recent.clear()
        self._clear_staging()

    def _refresh(self) -> None:
        """Reload every table's metadata from the catalog (commits of other processes)."""
        for table in self.tables.values():
            table.refresh()

    def stored_bounds(self, name: str, runs: list[str], by_step: bool) -> dict[str, float]:
        """Per run of ``runs``, what table ``name`` may hold of it, from the table's
        metadata after a refresh (the data files of the runs' partitions; no data file is
        read): with ``by_step``, the largest upper bound of ``step`` over the run's data
        files (Iceberg spec, "Manifests": ``upper_bounds``), else ``inf`` when the run has
        a data file; ``-inf`` when it has none. ``inf`` too for a data file without a
        bound, or whatever the files when the table is not partitioned by run (every key
        then counts as stored: always correct, only slower)."""
        table = self._fresh(name)
        spec, schema = table.spec(), table.schema()
        positions = [i for i, f in enumerate(spec.fields)
                     if isinstance(f.transform, IdentityTransform)
                     and schema.find_column_name(f.source_id) == PARTITION_COLUMN]
        if not positions:
            return dict.fromkeys(runs, math.inf)
        step = schema.find_field(STEP_COLUMN) if by_step else None
        bounds = dict.fromkeys(runs, -math.inf)
        for task in table.scan(row_filter=In(PARTITION_COLUMN, runs)).plan_files():
            data = task.file
            if data.spec_id != spec.spec_id:  # written under another spec: no run known
                return dict.fromkeys(runs, math.inf)
            run = data.partition[positions[0]]
            if run not in bounds:
                continue
            upper = None if step is None else (data.upper_bounds or {}).get(step.field_id)
            bound = math.inf if upper is None else float(from_bytes(step.field_type, upper))
            bounds[run] = max(bounds[run], bound)
        return bounds

    def restore(self, book: RunBook) -> KnownState:
        """Every stored run into ``book``, the stored frames, refused ranks and the
        incidents still firing, read from every table into the staging database and
        rebuilt by :meth:`consumer.runbook.RunBook.restore`.

        Raises:
            OSError: a data file cannot be read.
            Exception: a write in flight failed.
        """
        self._wait_all()
        self._refresh()
        self._forget_all()
        try:
            for name in self.tables:
                self._load(name, self._scan(name))
            frames = book.restore(self.staging)
            return KnownState(frames=frames, refusals=self.staging.load_refusals(),
                              incidents=load_active_incidents(self.staging.con))
        finally:
            self._clear_staging()

    def load_sums(self, run: RunInfo, step: int) -> MergedShards | None:
        """The stored merged sums of frame (run, step) over the run's layers
        (:func:`consumer.outputs.duckdb.stored_sums`), or None if it is not stored; waits
        for the write in flight.

        Raises:
            Exception: the write in flight failed.
        """
        self._wait_all()
        tbl = self._scan("layer_stats", And(EqualTo("run_id", run.run_id),
                                            EqualTo("step", int(step))), LOAD_SUMS_COLUMNS)
        if tbl.num_rows == 0:
            return None
        idx = tbl["layer_index"].to_numpy().astype(np.int64)
        return MergedShards.empty(run.num_layers).merge_at(idx, stored_sums(tbl))

    def load_frame_verdict(self, run_id: str, step: int) -> tuple[list[int], int]:
        """(refused ranks, number of layers whose pieces do not fit) of the stored frame
        (run, step), for a late rank merged into it (as
        :meth:`consumer.outputs.duckdb.DuckDBSink.load_frame_verdict`); ([], 0) when it is
        not stored. Waits for the writes in flight.

        Raises:
            Exception: a write failed.
        """
        self._wait_all()
        rows = self._scan("frames", And(EqualTo("run_id", run_id), EqualTo("step", int(step))),
                          ("refused_ranks", "layout_violations")).to_pylist()
        if not rows:
            return [], 0
        return ([int(r) for r in rows[0]["refused_ranks"] or ()],
                int(rows[0]["layout_violations"] or 0))

    def stored_offsets(self, topics: Iterable[str]) -> dict[PartitionKey, int]:
        """The next offset per (topic, partition) of this output's group: for each
        partition, the value in the newest snapshot of ``kafka_offsets`` (its current
        snapshot, then its ancestors) whose properties carry one (:func:`offset_property`).
        The loop asks on every assignment, so the stored bounds are dropped here: a
        partition that moved in may hold runs another process wrote (module docstring).

        Raises:
            Exception: the write in flight failed.
        """
        self._wait_all()
        self._forget_all()
        table = self.tables[OFFSETS_TABLE]
        table.refresh()
        prefixes = {_offset_prefix(self.group, topic): topic for topic in topics}
        found: dict[PartitionKey, int] = {}
        for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
            for key, value in snapshot.summary.additional_properties.items():
                for prefix, topic in prefixes.items():
                    partition = key[len(prefix):]
                    if key.startswith(prefix) and partition.isdigit():
                        found.setdefault((topic, int(partition)), int(value))
        return found

    # -- the write ------------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        """Stage ``batch`` and commit it: one transaction per table it puts rows in, the
        offsets in the snapshot properties of the last (``kafka_offsets``). With
        ``write_behind`` the batch is handed to the staging thread once the previous one is
        staged, and its commits to the writer thread once at most
        :data:`WRITES_IN_FLIGHT` - 1 writes are committing; the caller must not change
        ``batch`` afterwards.

        Raises:
            duckdb.Error: the staged write failed (nothing of it was committed; with
                ``write_behind``: the previous batch's).
            pyiceberg.exceptions.CommitFailedException / ValidationException / OSError: a
                commit failed (with ``write_behind``: an earlier batch's); the tables
                committed before it hold rows whose offsets are not stored (a restart
                replays them). Every later write is refused with the same error: its
                offsets would pass the rows of this one.
        """
        if self._failed is not None:
            raise self._failed
        if self._stager is None:
            self._write(batch)
            return
        self._wait_staged()
        self._staging = self._stager.submit(self._write, batch)

    def _write(self, batch: Batch) -> None:
        """Stage ``batch``, start writing its data files and commit it (write-behind: hand
        the commits to the writer thread); on the staging thread with ``write_behind``.

        Raises:
            Exception: as :meth:`write`.
        """
        try:
            commits, touched = self._stage(batch)
        except BaseException as exc:
            if self._failed is None:
                self._failed = exc
            raise
        if not commits:
            return
        files = {name: self._files.submit(self._data_files, name, rows)
                 for name, rows, _, _ in commits}
        if self._writer is not None:
            try:
                self._wait(WRITES_IN_FLIGHT - 1)
            except BaseException:
                for future in files.values():
                    future.cancel()
                raise
            self._pending.append((self._writer.submit(self._commit_all, commits, files),
                                  touched))
            return
        try:
            self._commit_all(commits, files)
        except BaseException as exc:
            self._failed = exc
            raise

    def _wait_staged(self) -> None:
        """Block until the batch being staged (if any) is staged and its commits handed
        over.

        Raises:
            Exception: a write failed.
        """
        staging, self._staging = self._staging, None
        if staging is not None:
            try:
                staging.result()
            except BaseException as exc:
                if self._failed is None:
                    self._failed = exc
        if self._failed is not None:
            raise self._failed

    def _wait_all(self) -> None:
        """Block until every batch given to :meth:`write` is committed.

        Raises:
            Exception: a write failed.
        """
        self._wait_staged()
        self._wait()

    def _wait(self, keep: int = 0) -> None:
        """Block until at most ``keep`` writes are committing (the oldest done first).

        Raises:
            Exception: a write failed (this one or an earlier one).
        """
        while len(self._pending) > keep:
            try:
                self._pending.popleft()[0].result()
            except BaseException as exc:
                if self._failed is None:
                    self._failed = exc
        if self._failed is not None:
            raise self._failed

    def _wait_touching(self, name: str, runs: Iterable[str]) -> None:
        """Block until no write committing writes table ``name`` for one of ``runs``
        (the later writes may go on).

        Raises:
            Exception: a write failed.
        """
        pairs = {(name, run) for run in runs}
        for newest in range(len(self._pending) - 1, -1, -1):
            if not pairs.isdisjoint(self._pending[newest][1]):
                self._wait(len(self._pending) - newest - 1)
                return
        if self._failed is not None:
            raise self._failed

    def _touch(self, runs: Iterable[str]) -> None:
        """Mark ``runs`` the most recently written; forget the runs beyond
        :data:`KNOWN_RUNS_MAX` (their bounds and staged ``runs`` rows)."""
        for run in runs:
            self._recent[run] = None
            self._recent.move_to_end(run)
        stale = []
        while len(self._recent) > KNOWN_RUNS_MAX:
            stale.append(self._recent.popitem(last=False)[0])
        if stale:
            for known in self.known.values():
                for run in stale:
                    known.pop(run, None)
            self._delete_staged(RUNS_TABLE, pa.table({"run_id": pa.array(stale, pa.string())}))

    def _learn(self, name: str, keys: pa.Table) -> None:
        """Look up the stored bounds of the runs of ``keys`` not known in table ``name``
        (after the commits in flight); for ``runs``, also load their stored rows into the
        staging database."""
        known = self.known[name]
        runs = [r for r in pc.unique(keys[PARTITION_COLUMN]).to_pylist() if r not in known]
        if not runs:
            return
        self._wait_touching(name, runs)
        if name == RUNS_TABLE:
            stored = self._scan(name, In(PARTITION_COLUMN, runs), table=self._fresh(name))
            self._load(name, stored)
            found = set(stored[PARTITION_COLUMN].to_pylist())
            known.update({r: math.inf if r in found else -math.inf for r in runs})
            return
        known.update(self.stored_bounds(name, runs, STEP_COLUMN in keys.column_names))

    def _maybe_stored(self, name: str, keys: pa.Table) -> pa.Table | None:
        """The rows of ``keys`` that table ``name`` may hold (:attr:`known`), None when
        none; every key of ``kafka_offsets``."""
        if name == OFFSETS_TABLE:
            return keys
        known = self.known[name]
        bounds = np.array([known[r] for r in keys[PARTITION_COLUMN].to_pylist()])
        if STEP_COLUMN in keys.column_names:
            mask = keys[STEP_COLUMN].to_numpy() <= bounds
        else:
            mask = bounds > -math.inf
        if not mask.any():
            return None
        return keys if mask.all() else keys.filter(pa.array(mask))

    def _remember(self, name: str, keys: pa.Table) -> None:
        """Table ``name`` may now hold ``keys``: raise the runs' bounds."""
        if name == OFFSETS_TABLE:
            return
        known = self.known[name]
        if STEP_COLUMN not in keys.column_names:
            known.update(dict.fromkeys(keys[PARTITION_COLUMN].to_pylist(), math.inf))
            return
        highest = keys.group_by(PARTITION_COLUMN).aggregate([(STEP_COLUMN, "max")])
        for run, step in zip(highest[PARTITION_COLUMN].to_pylist(),
                             highest[f"{STEP_COLUMN}_max"].to_pylist(), strict=True):
            known[run] = max(known.get(run, -math.inf), float(step))

    def _stage(self, batch: Batch) -> tuple[list[Commit], frozenset[tuple[str, str]]]:
        """Write ``batch`` into the staging database over the stored rows of its scope that
        it may read (module docstring) and return each table's commit, in
        :attr:`commit_order` (tables the batch puts no rows in and deletes nothing from
        are left out), and the (table, run) pairs of its scope.

        Raises:
            duckdb.Error: the staged write failed.
            RuntimeError: the write staged rows in a table without a scope.
        """
        scopes = batch_scopes(batch, self.group)
        if not scopes:
            return [], frozenset()
        self._touch(dict.fromkeys(
            run for keys in scopes.values() if PARTITION_COLUMN in keys.column_names
            for run in keys[PARTITION_COLUMN].to_pylist()))
        filters: dict[str, BooleanExpression] = {}
        try:
            for name, keys in scopes.items():
                if name != OFFSETS_TABLE:
                    self._learn(name, keys)
                stored = self._maybe_stored(name, keys)
                filters[name] = AlwaysFalse() if stored is None else key_filter(stored)
                if stored is not None and name not in REPLACED_WHOLE and name != RUNS_TABLE:
                    self._wait_touching(name, pc.unique(stored[PARTITION_COLUMN]).to_pylist())
                    self._load(name, self._scan(name, filters[name], table=self._fresh(name)))
            carried = _carried_rank_keys(batch)
            if carried is not None:  # a replayed frame's rows are replaced (module doc)
                self._delete_staged("rank_scalars", carried)
            self.staging.write(batch, self.group)
            staged = {name: self._staged_rows(name, scopes[name]) for name in scopes}
            stray = sorted(n for n in self.tables if n not in scopes and n != RUNS_TABLE
                           and self.staging.con.execute(
                               f"SELECT count(*) FROM {n}").fetchall()[0][0])
        finally:
            self._clear_staging(keep_runs=True)
        if stray:
            raise RuntimeError(f"the DuckDB write staged rows in {', '.join(stray)}, which "
                               "consumer.outputs.iceberg.batch_scopes gives no scope: add it")
        for name, keys in scopes.items():
            self._remember(name, keys)
        properties = {offset_property(self.group, topic, partition): str(int(offset))
                      for (topic, partition), offset in batch.offsets.items()}
        commits: list[Commit] = []
        for name in self.commit_order:
            if name not in scopes:
                continue
            rows = staged[name].select(self._arrow[name].names).cast(self._arrow[name])
            if rows.num_rows == 0 and filters[name] == AlwaysFalse():
                continue
            commits.append((name, rows, filters[name],
                            properties if name == OFFSETS_TABLE else {}))
        touched = frozenset((name, run) for name, keys in scopes.items()
                            if PARTITION_COLUMN in keys.column_names
                            for run in pc.unique(keys[PARTITION_COLUMN]).to_pylist())
        return commits, touched

    def _staged_rows(self, name: str, keys: pa.Table) -> pa.Table:
        """The staged rows of table ``name`` after a write: all of them, or for ``runs``
        (which holds the known runs) those of the runs in ``keys``."""
        con = self.staging.con
        if name != RUNS_TABLE:
            return con.sql(f"SELECT * FROM {name}").to_arrow_table()
        con.register("gs_keys", keys)
        try:
            return con.sql(f"SELECT * FROM {name} WHERE run_id IN "
                           "(SELECT run_id FROM gs_keys)").to_arrow_table()
        finally:
            con.unregister("gs_keys")

    def _delete_staged(self, name: str, keys: pa.Table) -> None:
        """Delete from staging table ``name`` the rows matching a row of ``keys`` on all
        its columns."""
        con = self.staging.con
        on = " AND ".join(f"t.{c} = k.{c}" for c in keys.column_names)
        con.register("gs_keys", keys)
        try:
            con.execute(f"DELETE FROM {name} t USING gs_keys k WHERE {on}")
        finally:
            con.unregister("gs_keys")

    def _commit_all(self, commits: list[Commit],
                    files: Mapping[str, Future[list[DataFile] | None]]) -> None:
        """Commit each table's part of a write once its data files are written: the
        tables outside :data:`COMMIT_LAST` side by side, then those in order (timed for
        the write metrics).

        Raises:
            Exception: a data file or a commit failed (the first failure; the tables
                committed meanwhile keep their rows, a restart replays them).
        """
        def commit(part: Commit) -> None:
            name, rows, scope, properties = part
            self._commit(name, rows, scope, properties, files[name].result())

        if self._broken is not None:  # an earlier write's rows are not all stored
            raise self._broken
        try:
            with self.timed_write():
                free = [c for c in commits if c[0] not in COMMIT_LAST]
                for future in [self._commits.submit(commit, c) for c in free]:
                    future.result()
                for part in commits:
                    if part[0] in COMMIT_LAST:
                        commit(part)
        except BaseException as exc:
            self._broken = exc
            raise

    def _data_files(self, name: str, rows: pa.Table) -> list[DataFile] | None:
        """Write ``rows`` as Parquet data files of table ``name`` (not committed): one
        file per run (the partition) and ``write.target-file-size-bytes`` of rows, as
        pyiceberg's own append writes them (``pyiceberg.io.pyarrow.write_file``), but
        split by run with one sort instead of one filter per run, and written once
        whatever the commit's tries. None when the table's partition spec is not
        identity on :data:`PARTITION_COLUMN` alone (nor unpartitioned): pyiceberg then
        writes the rows itself (:meth:`_commit`). Holds the table's lock
        (:attr:`_table_locks`)."""
        with self._table_locks[name]:
            return self._write_data_files(name, rows)

    def _write_data_files(self, name: str, rows: pa.Table) -> list[DataFile] | None:
        """:meth:`_data_files` under the table's lock."""
        table = self.tables[name]
        metadata = table.metadata
        schema, spec = metadata.schema(), metadata.spec()
        partitioned = not spec.is_unpartitioned()
        if partitioned and not (
                len(spec.fields) == 1 and isinstance(spec.fields[0].transform, IdentityTransform)
                and schema.find_column_name(spec.fields[0].source_id) == PARTITION_COLUMN):
            return None
        if rows.num_rows == 0:
            return []
        target = property_as_int(metadata.properties, TableProperties.WRITE_TARGET_FILE_SIZE_BYTES,
                                 TableProperties.WRITE_TARGET_FILE_SIZE_BYTES_DEFAULT)
        task_schema = pyarrow_to_schema(rows.schema, name_mapping=schema.name_mapping,
                                        format_version=metadata.format_version)
        parts: list[tuple[IcebergPartitionKey | None, pa.Table]] = [(None, rows)]
        if partitioned:
            if pc.count_distinct(rows[PARTITION_COLUMN]).as_py() > 1:
                rows = rows.sort_by(PARTITION_COLUMN)
            counts = pc.value_counts(rows[PARTITION_COLUMN])  # in the (sorted) order seen
            cuts = [0, *np.cumsum(counts.field("counts").to_numpy()).tolist()]
            parts = [(IcebergPartitionKey([PartitionFieldValue(spec.fields[0], run)], spec,
                                          schema), rows.slice(a, b - a))
                     for run, (a, b) in zip(counts.field("values").to_pylist(),
                                            itertools.pairwise(cuts), strict=True)]
        write_uuid, counter = uuid.uuid4(), itertools.count()
        tasks = (WriteTask(write_uuid=write_uuid, task_id=next(counter), schema=task_schema,
                           record_batches=batches, partition_key=key)
                 for key, part in parts for batches in bin_pack_arrow_table(part, target))
        return list(write_file(table.io, metadata, tasks))

    def _commit(self, name: str, rows: pa.Table, scope: BooleanExpression,
                properties: dict[str, str], files: list[DataFile] | None) -> None:
        """One transaction on table ``name``: delete the rows in ``scope`` (none when it is
        ``AlwaysFalse``), append ``rows`` (``files``, their data files written once by
        :meth:`_data_files`; None: pyiceberg writes them), with ``properties`` in the
        snapshot summaries; planned again from a refreshed table when a concurrent commit
        conflicts with it (:data:`COMMIT_ATTEMPTS`).

        Raises:
            pyiceberg.exceptions.CommitFailedException / ValidationException: every try
                conflicted.
            OSError: a file could not be written.
        """
        with self._table_locks[name]:
            self._commit_locked(name, rows, scope, properties, files)

    def _commit_locked(self, name: str, rows: pa.Table, scope: BooleanExpression,
                       properties: dict[str, str], files: list[DataFile] | None) -> None:
        """:meth:`_commit` under the table's lock (:attr:`_table_locks`)."""
        table = self.tables[name]
        for attempt in range(COMMIT_ATTEMPTS):
            transaction = table.transaction()
            try:
                if scope != AlwaysFalse():
                    with _QUIET_DELETE, warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Delete operation did not "
                                                "match any records", category=UserWarning)
                        transaction.delete(scope, snapshot_properties=properties)
                if files is None:
                    transaction.append(rows, snapshot_properties=properties)
                elif files:
                    with self._append(table, transaction, properties) as append:
                        for data_file in files:
                            append.append_data_file(data_file)
                transaction.commit_transaction()
                return
            except (CommitFailedException, ValidationException) as exc:
                if attempt == COMMIT_ATTEMPTS - 1:
                    raise
                log.info("commit to %s conflicted (%s); planning it again", name, exc)
                time.sleep(RETRY_WAIT_S * 2 ** attempt)
                table.refresh()

    @staticmethod
    def _append(table: Table, transaction: Transaction, properties: dict[str, str]) -> Any:
        """The snapshot producer that appends data files in ``transaction`` on ``table``:
        a merge append when the table has ``commit.manifest-merge.enabled``, else a fast
        append (as pyiceberg's own ``Transaction.append`` chooses; the table's properties
        are read from ``table``, as the transaction's copy costs a deep copy)."""
        update = transaction.update_snapshot(snapshot_properties=properties)
        if property_as_bool(table.metadata.properties,
                            TableProperties.MANIFEST_MERGE_ENABLED,
                            TableProperties.MANIFEST_MERGE_ENABLED_DEFAULT):
            return update.merge_append()
        return update.fast_append()

    def settle(self, wait: bool) -> bool:
        """Whether every batch given to :meth:`write` is committed (``wait``: block until
        it is, then True); always True without ``write_behind``.

        Raises:
            Exception: a write failed (its offsets must never be acknowledged).
        """
        if not wait and ((self._staging is not None and not self._staging.done())
                         or not all(future.done() for future, _ in self._pending)):
            return False
        self._wait_all()
        return True

    def acknowledge(self, consumer: Any, offsets: dict[PartitionKey, int],
                    blocking: bool = True) -> None:
        """Mirror the stored offsets to Kafka (always asynchronously; a failure is only
        logged: the snapshot properties hold the positions)."""
        try:
            commit_offsets(consumer, offsets, sync=False)
        except Exception as exc:
            log.debug("offset commit to Kafka failed: %s", exc)

    def close(self) -> None:
        """Wait for the commits in flight, release the writer thread, the staging
        database and the catalog's connections. A failed write is logged, not raised
        (:meth:`settle` raised it to the loop)."""
        try:
            self._wait_all()
        except BaseException as exc:
            log.warning("closing the Iceberg output after a failed write: %s", exc)
        finally:
            try:
                for pool in (self._stager, self._writer, self._files, self._commits):
                    if pool is not None:
                        pool.shutdown(wait=True)
                self.staging.close()
            finally:
                self.catalog.engine.dispose()
