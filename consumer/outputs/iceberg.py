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

Partitioning: identity on ``run_id`` for every table that has it (all but
``kafka_offsets``). The reads of the store are per run (a report, an analysis, a plot or
an export takes one run), so a run's reads open only its own data files; and a rewrite of
a run's rows (below) rewrites only that run's files. A run's data files stay as the writes
made them (one or more per write that touched the run); compacting them is housekeeping.
The tables are created with ``commit.manifest-merge.enabled`` (pyiceberg's merge append),
so the manifests a planned scan or delete reads do not grow by one per write.

Writes (:meth:`IcebergOutput.write`). Iceberg has no multi-table transaction, so a batch
is one pyiceberg transaction per table it touches. The DuckDB output's semantics are kept
by construction: the batch is first written by a :class:`consumer.outputs.duckdb.DuckDBSink`
on an in-memory staging database into which the rows the batch may read or replace were
loaded from Iceberg (the batch's *scope* in each table: its runs, or its (run, step)
keys, or its alert ids, or its Kafka partitions). The staged rows of each table are then
the new content of that scope, and each table's transaction is ``overwrite(rows,
overwrite_filter=scope)``: a row-level delete of the scope, then an append. pyiceberg
deletes copy-on-write (a data file wholly inside the scope is dropped, one partly inside is
rewritten without the matched rows; merge-on-read delete files it does not write), inside
the same transaction as the append, so a reader sees the old rows or the new ones, never
both and never neither. So a late rank's rewrite of a partial frame, a frame that has
fewer layers than before and a replay after a crash all replace the stored rows of their
(run, step), as in DuckDB (``layer_stats`` deleted then appended, ``frames`` upserted,
step scalars recomputed over every stored rank, and so on). A table whose scope the
write read (:data:`REPLACED_WHOLE` aside) and found empty is appended to without a delete.

Exactly once with respect to Kafka (the scheme of Iceberg's Kafka Connect sink: offsets in
the snapshot summary of the commit that holds the data). The next offset to consume per
partition goes into the snapshot properties (:func:`offset_property`) of the write's last
commit, the one to ``kafka_offsets`` (whose rows hold the same offsets, for other
engines). A crash between two commits of a write leaves rows whose offsets are not
stored: the restarted output resumes from the offsets of the last complete write
(:meth:`IcebergOutput.stored_offsets` walks the snapshot ancestry of ``kafka_offsets``)
and the replay writes those rows again, replacing the same scopes: every table write is
idempotent (``rank_scalars`` rows of a (run, step, rank) the batch carries are replaced
even for a frame not marked as a rewrite, since a replay may find them stored). Offsets
are therefore never ahead of the data.

Restoring (:meth:`IcebergOutput.restore`) reads the stored tables into an in-memory DuckDB
database and rebuilds the loop's runs from it with the DuckDB output's own code; its memory
and time grow with the stored history.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.expressions import AlwaysFalse, And, BooleanExpression, EqualTo, In, Or
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC, PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    IcebergType,
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StringType,
)

from consumer.alerts.rows import load_active_incidents
from consumer.frames import MergedShards
from consumer.outputs.base import Batch, KnownState, Output, PartitionKey, commit_offsets
from consumer.outputs.duckdb import DuckDBSink, stored_sums
from consumer.settings import DEFAULT_ICEBERG_NAMESPACE

if TYPE_CHECKING:
    import duckdb

    from consumer.runbook import RunBook
    from consumer.runs import RunInfo
    from consumer.settings import LoopSettings

log = logging.getLogger("gradstream.consumer")

CATALOG_NAME = "gradstream"
"""The catalog's name: pyiceberg's SQL catalog keeps tables of several catalogs in one
database, keyed by this name (its ``catalog_name`` column), so another engine opens the
same database under this name to see the tables."""

OFFSETS_TABLE = "kafka_offsets"
"""The table whose commit ends every write and carries the offsets in its snapshot
properties."""

OFFSET_PROPERTY_PREFIX = "gradstream.offsets"
"""Snapshot-property key prefix of a stored offset (:func:`offset_property`)."""

PARTITION_COLUMN = "run_id"
"""The identity partition column of every table that has it (module docstring)."""

TABLE_PROPERTIES: dict[str, str] = {"commit.manifest-merge.enabled": "true"}
"""Iceberg table properties set on creation: merge manifests on append (pyiceberg's
``MergeAppend``; Iceberg table properties, "Write properties"), so a write's delete
planning reads a bounded number of manifests instead of one more per write."""

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

S3_ENVIRONMENT: dict[str, str] = {
    "AWS_ENDPOINT_URL": "s3.endpoint",
    "AWS_ACCESS_KEY_ID": "s3.access-key-id",
    "AWS_SECRET_ACCESS_KEY": "s3.secret-access-key",
    "AWS_SESSION_TOKEN": "s3.session-token",
    "AWS_REGION": "s3.region",
}
"""Standard AWS environment variables (AWS SDKs and CLI, "Environment variables to
configure the AWS CLI") -> the pyiceberg FileIO property that takes each (pyiceberg
configuration, "S3")."""

_SCALAR_TYPES: dict[str, Callable[[], IcebergType]] = {
    "VARCHAR": StringType, "JSON": StringType, "BIGINT": LongType, "INTEGER": IntegerType,
    "SMALLINT": IntegerType, "DOUBLE": DoubleType, "BOOLEAN": BooleanType,
}
"""DuckDB column type -> Iceberg type (Iceberg spec, "Primitive Types": int is 32-bit,
long 64-bit; JSON is text)."""


def s3_properties(environ: Mapping[str, str]) -> dict[str, str]:
    """pyiceberg FileIO properties from the AWS variables set in ``environ``
    (:data:`S3_ENVIRONMENT`); unset or empty variables are left out."""
    return {prop: environ[var] for var, prop in S3_ENVIRONMENT.items() if environ.get(var)}


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
    required, the primary key as identifier fields (module docstring).

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
    for table in dict.fromkeys(t for t, *_ in columns):
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
    scope is one ``step IN (...)`` per run.

    Raises:
        ValueError: ``keys`` has no rows.
    """
    if keys.num_rows == 0:
        raise ValueError("a key filter needs at least one key")
    first, *rest = keys.column_names
    values = pc.unique(keys[first]).to_pylist()
    if not rest:
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
        table name -> key table (columns ``run_id``; ``run_id, step``; ``alert_id``; or
        ``consumer_group, topic, kafka_partition``).
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
        ids = list(dict.fromkeys(a.alert_id for a in batch.alerts))
        scopes["alerts"] = pa.table({"alert_id": pa.array(ids, pa.string())})
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


class IcebergOutput(Output):
    """Batches into Iceberg tables (module docstring): one pyiceberg transaction per table,
    the offsets in the snapshot properties of the last one (``kafka_offsets``). Writes are
    synchronous: :meth:`write` returns once the batch is committed.

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
            ...; :func:`s3_properties`).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the catalog cannot be opened.
        OSError: the warehouse cannot be written (creating a table writes its metadata).
        TypeError: a store column type has no Iceberg type (:func:`iceberg_schemas`).
    """

    name = "iceberg"

    def __init__(self, catalog: str, warehouse: str, group: str,
                 ignore_layers: Iterable[str] = (),
                 namespace: str = DEFAULT_ICEBERG_NAMESPACE,
                 io_properties: Mapping[str, str] | None = None) -> None:
        parent = _sqlite_parent(catalog)
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.catalog_uri = catalog
        self.warehouse = warehouse
        self.group = group
        self.namespace = namespace
        self.catalog = SqlCatalog(CATALOG_NAME, uri=catalog, warehouse=warehouse,
                                  **dict(io_properties or {}))
        self.staging = DuckDBSink(":memory:", write_behind=False)
        """In-memory DuckDB database with the store's tables: each write's staging area,
        and the mirror :meth:`restore` reads (module docstring)."""
        self.staging.ignore_layers = tuple(ignore_layers)
        self._failed: BaseException | None = None
        try:
            self.schemas = iceberg_schemas(self.staging.con)
            self.catalog.create_namespace_if_not_exists(namespace)
            self.tables: dict[str, Table] = {
                name: self.catalog.create_table_if_not_exists(
                    (namespace, name), schema=schema, partition_spec=self._spec(schema),
                    properties=TABLE_PROPERTIES)
                for name, schema in self.schemas.items()
            }
        except BaseException:
            self.close()
            raise
        self._arrow = {name: schema_to_pyarrow(t.schema()) for name, t in self.tables.items()}
        last = [n for n in COMMIT_LAST if n in self.tables]
        self.commit_order: tuple[str, ...] = (
            *sorted(n for n in self.tables if n not in last), *last)
        """The order of a write's table commits: :data:`COMMIT_LAST` last."""

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
        variables (:func:`s3_properties`).

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
                   s3_properties(os.environ))

    def describe(self) -> str:
        """The catalog (password hidden), the warehouse and the namespace."""
        return (f"iceberg catalog {_redacted(self.catalog_uri)}, warehouse {self.warehouse}, "
                f"namespace {self.namespace}")

    # -- reads ----------------------------------------------------------------------------

    def _scan(self, name: str, row_filter: BooleanExpression | None = None,
              columns: tuple[str, ...] = ("*",)) -> pa.Table:
        """Rows of table ``name`` matching ``row_filter`` (all rows when None)."""
        table = self.tables[name]
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

    def _clear_staging(self) -> None:
        """Empty every staging table."""
        for name in self.tables:
            self.staging.con.execute(f"DELETE FROM {name}")

    def _refresh(self) -> None:
        """Reload every table's metadata from the catalog (commits of other processes)."""
        for table in self.tables.values():
            table.refresh()

    def restore(self, book: RunBook) -> KnownState:
        """Every stored run into ``book``, the stored frames, refused ranks and the
        incidents still firing, read from every table into the staging database and
        rebuilt by :meth:`consumer.runbook.RunBook.restore`.

        Raises:
            OSError: a data file cannot be read.
        """
        self._refresh()
        self._clear_staging()
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
        (:func:`consumer.outputs.duckdb.stored_sums`), or None if it is not stored."""
        tbl = self._scan("layer_stats", And(EqualTo("run_id", run.run_id),
                                            EqualTo("step", int(step))), LOAD_SUMS_COLUMNS)
        if tbl.num_rows == 0:
            return None
        idx = tbl["layer_index"].to_numpy().astype(np.int64)
        return MergedShards.empty(run.num_layers).merge_at(idx, stored_sums(tbl))

    def load_frame_verdict(self, run_id: str, step: int) -> tuple[list[int], int]:
        """(refused ranks, layers whose pieces do not fit) of the stored frame (run,
        step), as :meth:`consumer.outputs.duckdb.DuckDBSink.load_frame_verdict`."""
        tbl = self._scan("frames", And(EqualTo("run_id", run_id), EqualTo("step", int(step))),
                         ("refused_ranks", "layout_violations"))
        if tbl.num_rows == 0:
            return [], 0
        refused = tbl["refused_ranks"][0].as_py() or []
        violations = tbl["layout_violations"][0].as_py()
        return [int(r) for r in refused], int(violations or 0)

    def stored_offsets(self, topics: Iterable[str]) -> dict[PartitionKey, int]:
        """The next offset per (topic, partition) of this output's group: for each
        partition, the value in the newest snapshot of ``kafka_offsets`` (its current
        snapshot, then its ancestors) whose properties carry one (:func:`offset_property`)."""
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
        """Commit ``batch``: one transaction per table it touches, the offsets in the
        snapshot properties of the last (``kafka_offsets``).

        Raises:
            duckdb.Error: the staged write failed (nothing was committed).
            pyiceberg.exceptions.CommitFailedException / OSError: a commit failed; the
                tables committed before it hold rows whose offsets are not stored (a
                restart replays them). Every later write is refused with the same error:
                its offsets would pass the rows of this one.
        """
        if self._failed is not None:
            raise self._failed
        try:
            with self.timed_write():
                self._write(batch)
        except BaseException as exc:
            self._failed = exc
            raise

    def _write(self, batch: Batch) -> None:
        scopes = batch_scopes(batch, self.group)
        if not scopes:
            return
        filters = {name: key_filter(keys) for name, keys in scopes.items()}
        self._clear_staging()
        try:
            for name, row_filter in filters.items():
                if name not in REPLACED_WHOLE:
                    stored = self._scan(name, row_filter)
                    if stored.num_rows == 0:  # nothing in the scope: append, no delete
                        filters[name] = AlwaysFalse()
                    self._load(name, stored)
            carried = _carried_rank_keys(batch)
            if carried is not None:  # a replayed frame's rows are replaced (module doc)
                self._delete_staged("rank_scalars", carried)
            self.staging.write(batch, self.group)
            staged = {name: self.staging.con.sql(f"SELECT * FROM {name}").to_arrow_table()
                      for name in self.tables}
        finally:
            self._clear_staging()
        stray = sorted(n for n, rows in staged.items() if rows.num_rows and n not in scopes)
        if stray:
            raise RuntimeError(f"the DuckDB write staged rows in {', '.join(stray)}, which "
                               "consumer.outputs.iceberg.batch_scopes gives no scope: add it")
        properties = {offset_property(self.group, topic, partition): str(int(offset))
                      for (topic, partition), offset in batch.offsets.items()}
        for name in self.commit_order:
            if name not in scopes:
                continue
            rows = staged[name].select(self._arrow[name].names).cast(self._arrow[name])
            self._commit(name, rows, filters[name],
                         properties if name == OFFSETS_TABLE else {})

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

    def _commit(self, name: str, rows: pa.Table, scope: BooleanExpression,
                properties: dict[str, str]) -> None:
        """One transaction on table ``name``: delete the rows in ``scope`` (none when it is
        ``AlwaysFalse``: a scope the write read and found empty), append ``rows``, with
        ``properties`` in the snapshot summaries."""
        transaction = self.tables[name].transaction()
        with warnings.catch_warnings():
            # pyiceberg warns when the delete matched nothing: a new scope, the usual case
            warnings.filterwarnings("ignore", message="Delete operation did not match")
            transaction.overwrite(rows, overwrite_filter=scope, snapshot_properties=properties)
        transaction.commit_transaction()

    def settle(self, wait: bool) -> bool:
        """True: :meth:`write` returns once its batch is committed.

        Raises:
            Exception: the last write failed (its offsets must never be acknowledged).
        """
        if self._failed is not None:
            raise self._failed
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
        """Release the staging database and the catalog's connections."""
        try:
            self.staging.close()
        finally:
            self.catalog.engine.dispose()
