"""Housekeeping of the Apache Iceberg table set (:mod:`consumer.outputs.iceberg`): small data
files compacted per partition, old snapshots expired, and the Kafka offsets the store
resumes from never lost (``gradstream maintain``).

Three steps, in this order, on every table of the namespace (:func:`maintain`):

1. **Offsets carried.** A store resumes from the offsets in the snapshot properties of
   ``kafka_offsets`` (:meth:`consumer.outputs.iceberg.IcebergOutput.stored_offsets` walks
   the snapshot ancestry of its current snapshot, newest first, and takes each
   (group, topic, partition)'s first value). A partition not written for a while has its
   offset only in an old snapshot, which step 3 may expire. So when expiring would remove a
   snapshot that walk needs (:func:`offsets_walk`), the newest value of every offset key
   (:func:`newest_offsets`) is first committed again, in the properties of one new snapshot
   of ``kafka_offsets`` that changes no file (:func:`carry_offsets`). That commit is
   validated by pyiceberg against the snapshots committed since the values were read
   (serializable isolation: any data file added meanwhile, i.e. a store's write, refuses
   it), and then read again and retried, so the carried values are never older than a
   store's. It adds and deletes no file, so no store's commit conflicts with it. After it,
   the walk stops at that snapshot, and everything older may go.
2. **Compaction.** Per table (``kafka_offsets`` aside: every write already rewrites its
   few rows, and it is the table all stores commit to) and per partition (a run: the
   tables are identity-partitioned on ``run_id``), a partition holding at least
   ``min_input_files`` small data files (smaller than :data:`SMALL_FILE_RATIO` of the
   table's ``write.target-file-size-bytes``) and no file added within ``quiet_period`` is
   rewritten: its rows are read at the current snapshot and written back with
   ``overwrite(rows, overwrite_filter=run_id = <run>)`` in one transaction (the partition's
   files dropped whole, its rows appended as files of the target size). The quiet period
   keeps compaction off the runs that stores are writing: pyiceberg validates the commit
   against the snapshots committed since the read (a file added to or deleted from the
   partition meanwhile refuses it: the partition is skipped and reported, nothing lost),
   but a store whose write to the same run started before the compaction committed would be
   refused in turn (it stops, and resumes from its stored offsets: nothing lost). A
   partition with row-level delete files (written by another engine) is not rewritten. The
   rewrite holds the partition's rows (one run of one table) in memory.
3. **Expiry.** A snapshot is expired when it stopped being the table's current snapshot
   more than ``retain`` ago (its successor's entry in the table's snapshot log, Iceberg
   table spec "Table Metadata", ``snapshot-log``; a snapshot never current: its own
   timestamp), unless it is a branch or tag head or, in ``kafka_offsets``, a snapshot the
   offsets walk needs. This is Iceberg's age rule (``history.expire.max-snapshot-age-ms``)
   measured from when a reader could last have planned a scan on the snapshot rather than
   from when it was written, so a reader that began within ``retain`` keeps its files even
   when the snapshot it read was written long before. The metadata commit is pyiceberg's
   ``ExpireSnapshots``; the files that only expired snapshots referenced (manifest lists,
   manifests, data files: every path the expired snapshots' manifests name, any entry
   status, less every path a remaining snapshot's manifests name) are then deleted, as
   Iceberg's own expiry does. Files no snapshot ever referenced (a write that failed before
   its commit) are orphans, which this does not look for.

``dry_run`` plans the same steps on the current state and commits and deletes nothing.
Run one maintenance at a time per namespace (the Kubernetes CronJob forbids overlaps).
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo, IsNull
from pyiceberg.manifest import ManifestContent
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot, ancestors_of
from pyiceberg.transforms import IdentityTransform

from consumer.outputs.iceberg import CATALOG_NAME, OFFSET_PROPERTY_PREFIX, OFFSETS_TABLE
from consumer.settings import DEFAULT_ICEBERG_NAMESPACE, ICEBERG_WAREHOUSE_SCHEMES

log = logging.getLogger("gradstream.maintain")

DEFAULT_RETAIN = timedelta(days=5)
"""Snapshots kept unless ``GRADSTREAM_ICEBERG_RETAIN`` / ``--retain`` says otherwise:
Iceberg's own default age of snapshots to keep (table property
``history.expire.max-snapshot-age-ms``, default 5 days; Iceberg "Configuration", "Table
behavior properties")."""

MIN_INPUT_FILES = 5
"""Small data files a partition must hold to be compacted unless
``GRADSTREAM_ICEBERG_MIN_INPUT_FILES`` says otherwise: the default of Iceberg's
``rewrite_data_files`` procedure option ``min-input-files`` (Iceberg "Spark Procedures")."""

SMALL_FILE_RATIO = 0.75
"""A data file is small below this fraction of the table's target file size
(``write.target-file-size-bytes``): the default ratio of ``min-file-size-bytes`` of
Iceberg's ``rewrite_data_files`` (``SizeBasedFileRewriter.MIN_FILE_SIZE_DEFAULT_RATIO``)."""

DEFAULT_QUIET_PERIOD = timedelta(hours=1)
"""A partition to which a file was added more recently than this is left uncompacted
unless ``GRADSTREAM_ICEBERG_QUIET_PERIOD`` says otherwise. A streaming run gets a file per
write (writes are spaced by ``iceberg_commit_interval_s``, 5 s by default), so an hour
without one means the run finished or stalls; compacting a run a store is writing would
make one of the two commits fail (module docstring, step 2). The value trades how long a
finished run keeps its small files against that risk: an hour is below any sensible
``retain``, so a run is compacted long before its old snapshots expire."""

COMMIT_ATTEMPTS = 5
"""Tries of a maintenance commit that a concurrent commit refused (re-read and
re-planned each time): a store commits a table about once a commit interval, so a refusal
is possible but several in a row mean the table is busier than maintenance should
contend with."""

MAINTENANCE_PROPERTY = "gradstream.maintenance"
"""Snapshot-property key naming the maintenance step that made a snapshot
(:data:`CARRY` or :data:`COMPACTION`), for the history's readers."""

CARRY = "carry-offsets"
""":data:`MAINTENANCE_PROPERTY` of the snapshot that carries the offsets (step 1)."""

COMPACTION = "compaction"
""":data:`MAINTENANCE_PROPERTY` of a compaction's snapshot (step 2)."""

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(value: str | float | timedelta) -> timedelta:
    """An age given as ``<number><unit>`` (unit ``s``, ``m``, ``h``, ``d`` or ``w``; none =
    seconds), e.g. ``7d``, ``12h``, ``90m``, ``0``; a number (seconds) or a timedelta as is.

    Raises:
        ValueError: another text, or a negative age.
    """
    if isinstance(value, timedelta):
        age = value
    elif isinstance(value, int | float):
        age = timedelta(seconds=float(value))
    else:
        match = _AGE.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not an age: write a number and a unit s, m, h, d "
                             "or w, e.g. 7d, 12h or 30m")
        age = timedelta(seconds=float(match.group(1)) * _AGE_UNITS[match.group(2)])
    if age < timedelta(0):
        raise ValueError(f"an age cannot be negative, got {value!r}")
    return age


def format_age(age: timedelta) -> str:
    """``age`` in the largest unit of :func:`parse_age` that divides it (``5d``, ``90m``)."""
    seconds = age.total_seconds()
    for unit in ("w", "d", "h", "m"):
        if seconds and seconds % _AGE_UNITS[unit] == 0:
            return f"{int(seconds // _AGE_UNITS[unit])}{unit}"
    return f"{seconds:g}s"


class MaintenanceSettings(BaseSettings):
    """Settings of ``gradstream maintain``: flags, else ``GRADSTREAM_*`` environment
    variables, else these defaults. S3 endpoint and credentials come from the standard
    ``AWS_*`` variables (:func:`consumer.outputs.iceberg.s3_properties`).

    Attributes:
        iceberg_catalog: the SQL catalog's SQLAlchemy URL (``sqlite:///path/catalog.db``,
            ``postgresql+psycopg2://user:password@host/db``; ``GRADSTREAM_ICEBERG_CATALOG``).
        iceberg_warehouse: the warehouse (``file:///path`` or ``s3://bucket/path``;
            ``GRADSTREAM_ICEBERG_WAREHOUSE``).
        iceberg_namespace: the namespace of the store's tables.
        iceberg_retain: how long a snapshot is kept after it stopped being current
            (``GRADSTREAM_ICEBERG_RETAIN``, e.g. ``7d``; :data:`DEFAULT_RETAIN`).
        iceberg_min_input_files: small files a partition must hold to be compacted
            (``GRADSTREAM_ICEBERG_MIN_INPUT_FILES``; :data:`MIN_INPUT_FILES`; at least 2:
            one file is already compact).
        iceberg_quiet_period: age of a partition's newest file below which it is not
            compacted (``GRADSTREAM_ICEBERG_QUIET_PERIOD``; :data:`DEFAULT_QUIET_PERIOD`).
    """

    model_config = SettingsConfigDict(env_prefix="GRADSTREAM_", extra="ignore")

    iceberg_catalog: str | None = Field(default=None, min_length=1)
    iceberg_warehouse: str | None = Field(default=None, min_length=1)
    iceberg_namespace: str = Field(default=DEFAULT_ICEBERG_NAMESPACE, min_length=1)
    iceberg_retain: timedelta = DEFAULT_RETAIN
    iceberg_min_input_files: int = Field(default=MIN_INPUT_FILES, ge=2)
    iceberg_quiet_period: timedelta = DEFAULT_QUIET_PERIOD

    @field_validator("iceberg_retain", "iceberg_quiet_period", mode="before")
    @classmethod
    def _age(cls, value: Any) -> timedelta:
        """Accept ``7d``-style ages (:func:`parse_age`)."""
        return parse_age(value)

    @field_validator("iceberg_warehouse")
    @classmethod
    def _warehouse(cls, value: str | None) -> str | None:
        """Accept a ``file://`` or ``s3://`` warehouse URL.

        Raises:
            ValueError: another scheme.
        """
        if value is not None and urlsplit(value).scheme not in ICEBERG_WAREHOUSE_SCHEMES:
            raise ValueError(f"iceberg_warehouse must be a file:///path or s3://bucket/path "
                             f"URL, got {value!r}")
        return value


class MaintenanceError(RuntimeError):
    """Maintenance cannot start (no catalog, no namespace) or a step failed after
    :data:`COMMIT_ATTEMPTS` refused commits; the message says what to do."""


def open_catalog(uri: str, warehouse: str, io_properties: Mapping[str, str]) -> Catalog:
    """The store's SQL catalog (named :data:`consumer.outputs.iceberg.CATALOG_NAME`, as the
    output opens it) on ``uri`` and ``warehouse``.

    Raises:
        MaintenanceError: ``uri`` is a ``sqlite:///`` file that does not exist (opening it
            would create an empty catalog).
        sqlalchemy.exc.SQLAlchemyError: the catalog database cannot be reached.
    """
    from pyiceberg.catalog.sql import SqlCatalog

    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].split("?", 1)[0]
        if path and path != ":memory:" and not Path(path).is_file():
            raise MaintenanceError(f"no Iceberg catalog at {path}: give the catalog the store "
                                   "writes (--catalog / GRADSTREAM_ICEBERG_CATALOG)")
    return SqlCatalog(CATALOG_NAME, uri=uri, warehouse=warehouse, **dict(io_properties))


# --------------------------------------------------------------------------- offsets


def _is_offset_key(key: str) -> bool:
    return key.startswith(f"{OFFSET_PROPERTY_PREFIX}.")


def offset_partition(key: str) -> tuple[str, str, int] | None:
    """(group, topic, partition) of an offset key
    (:func:`consumer.outputs.iceberg.offset_property`), or None for another key."""
    if not _is_offset_key(key):
        return None
    parts = key[len(OFFSET_PROPERTY_PREFIX) + 1:].split(".")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return unquote(parts[0]), unquote(parts[1]), int(parts[2])


def newest_offsets(metadata: TableMetadata) -> dict[str, str]:
    """Every offset key (``gradstream.offsets.*``) found in the ancestry of the current
    snapshot, with the value of the newest snapshot that carries it: the values
    :meth:`consumer.outputs.iceberg.IcebergOutput.stored_offsets` reads, for every group."""
    found: dict[str, str] = {}
    for snapshot in ancestors_of(metadata.current_snapshot(), metadata):
        for key, value in snapshot.summary.additional_properties.items():
            if _is_offset_key(key):
                found.setdefault(key, value)
    return found


def offsets_walk(metadata: TableMetadata) -> list[int]:
    """The snapshots (ids, newest first) the offsets walk visits before it has found every
    key of :func:`newest_offsets`: the current snapshot and its ancestors up to the last one
    holding a key found nowhere newer. Expiring one of them would cut the walk short."""
    remaining = set(newest_offsets(metadata))
    walk: list[int] = []
    for snapshot in ancestors_of(metadata.current_snapshot(), metadata):
        if not remaining:
            break
        walk.append(snapshot.snapshot_id)
        remaining -= snapshot.summary.additional_properties.keys()
    return walk


def carry_offsets(table: Table) -> tuple[int, dict[str, str]]:
    """Commit the newest value of every offset key (:func:`newest_offsets`) in the
    properties of one new snapshot of ``table`` that adds and deletes no file (pyiceberg's
    overwrite with no change), read again and retried when a concurrent commit refuses it
    (module docstring, step 1).

    Returns:
        (the new snapshot's id, the offsets it carries).

    Raises:
        MaintenanceError: :data:`COMMIT_ATTEMPTS` commits were refused.
    """
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table.refresh()
        offsets = newest_offsets(table.metadata)
        transaction = table.transaction()  # based on the snapshot the values were read at
        properties = {**offsets, MAINTENANCE_PROPERTY: CARRY}
        with transaction.update_snapshot(snapshot_properties=properties).overwrite() as update:
            snapshot_id = update.snapshot_id
        try:
            transaction.commit_transaction()
        except (CommitFailedException, ValidationException) as exc:
            log.info("carrying the offsets of %s: refused by a concurrent commit (%s), "
                     "try %d of %d", table.name(), exc, attempt, COMMIT_ATTEMPTS)
            continue
        return snapshot_id, offsets
    raise MaintenanceError(f"the offsets of {'.'.join(table.name())} could not be carried: "
                           f"{COMMIT_ATTEMPTS} commits were refused by concurrent writes; run "
                           "maintain again when the stores write less")


# --------------------------------------------------------------------------- expiry


def replaced_at(metadata: TableMetadata) -> dict[int, int]:
    """Per snapshot id, when (ms since the epoch) it stopped being the current snapshot:
    the timestamp of the next entry of the snapshot log after its last entry; a snapshot
    never current (no entry) at its own timestamp. The current snapshot is absent."""
    replaced = {s.snapshot_id: s.timestamp_ms for s in metadata.snapshots}
    log_entries = sorted(metadata.snapshot_log, key=lambda e: e.timestamp_ms)
    for entry, following in pairwise(log_entries):
        replaced[entry.snapshot_id] = following.timestamp_ms
    if metadata.current_snapshot_id is not None:
        replaced.pop(metadata.current_snapshot_id, None)
    return replaced


def expirable(metadata: TableMetadata, cutoff_ms: int, keep: Iterable[int] = ()) -> list[int]:
    """Snapshot ids replaced before ``cutoff_ms`` (:func:`replaced_at`), less branch and tag
    heads and ``keep``, oldest first."""
    protected = {ref.snapshot_id for ref in metadata.refs.values()} | set(keep)
    replaced = replaced_at(metadata)
    return sorted((i for i, at in replaced.items() if at < cutoff_ms and i not in protected),
                  key=lambda i: (replaced[i], i))


class _FileIndex:
    """Paths each snapshot references (its manifest list, its manifests, every file their
    entries name, any status), each manifest read once."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self._manifests: dict[str, frozenset[str]] = {}

    def paths(self, snapshots: Iterable[Snapshot]) -> set[str]:
        out: set[str] = set()
        io = self.table.io
        for snapshot in snapshots:
            out.add(snapshot.manifest_list)
            for manifest in snapshot.manifests(io):
                path = manifest.manifest_path
                if path not in self._manifests:
                    entries = manifest.fetch_manifest_entry(io, discard_deleted=False)
                    self._manifests[path] = frozenset(e.data_file.file_path for e in entries)
                out.add(path)
                out |= self._manifests[path]
        return out


@dataclass
class Expiry:
    """What expiry did (or would do) to one table.

    Attributes:
        table: the table's name.
        snapshots: ids of the snapshots expired.
        files: paths deleted (files only expired snapshots referenced).
    """

    table: str
    snapshots: list[int] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def expire(table: Table, cutoff_ms: int, dry_run: bool,
           keep: Callable[[TableMetadata], Iterable[int]] = lambda _m: ()) -> Expiry:
    """Expire the snapshots of ``table`` replaced before ``cutoff_ms`` except ``keep`` of
    the refreshed metadata (:func:`expirable`), then delete the files only they referenced
    (module docstring, step 3); retried on a refused commit.

    Raises:
        MaintenanceError: :data:`COMMIT_ATTEMPTS` commits were refused.
        OSError: a manifest cannot be read or a file deleted.
    """
    name = table.name()[-1]
    index = _FileIndex(table)
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table.refresh()
        metadata = table.metadata
        ids = expirable(metadata, cutoff_ms, keep(metadata))
        if not ids:
            return Expiry(name)
        gone = set(ids)
        referenced = index.paths(s for s in metadata.snapshots if s.snapshot_id in gone)
        if dry_run:
            kept = index.paths(s for s in metadata.snapshots if s.snapshot_id not in gone)
            return Expiry(name, ids, sorted(referenced - kept))
        try:
            table.maintenance.expire_snapshots().by_ids(ids).commit()
        except (CommitFailedException, ValueError) as exc:  # ValueError: already expired
            log.info("expiring snapshots of %s: refused (%s), try %d of %d", name, exc,
                     attempt, COMMIT_ATTEMPTS)
            continue
        table.refresh()  # what remains, with any snapshot committed meanwhile
        kept = index.paths(table.metadata.snapshots)
        files = sorted(referenced - kept)
        for path in files:
            table.io.delete(path)
        return Expiry(name, ids, files)
    raise MaintenanceError(f"the snapshots of {name} could not be expired: {COMMIT_ATTEMPTS} "
                           "commits were refused by concurrent commits; run maintain again")


# --------------------------------------------------------------------------- compaction


@dataclass
class Compaction:
    """One partition's compaction (planned, done, or refused).

    Attributes:
        table: the table's name.
        partition: the partition's values (``(run_id,)``; ``()`` unpartitioned).
        files: data files of the partition before.
        small: how many of them are small (:data:`SMALL_FILE_RATIO`).
        rows: rows of the partition.
        files_after: data files after (None until done).
        refused: why the commit was refused (a concurrent write), else None.
    """

    table: str
    partition: tuple[Any, ...]
    files: int
    small: int
    rows: int
    files_after: int | None = None
    refused: str | None = None


@dataclass
class _Partition:
    spec_id: int
    values: tuple[Any, ...]
    sizes: list[int] = field(default_factory=list)
    rows: int = 0
    newest_ms: int = 0


def _partitions(table: Table) -> tuple[list[_Partition], bool]:
    """The live data files of the current snapshot grouped by (spec, partition), and
    whether any row-level delete file is live."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return [], False
    metadata = table.metadata
    groups: dict[tuple[int, tuple[Any, ...]], _Partition] = {}
    deletes = False
    for manifest in snapshot.manifests(table.io):
        if manifest.content == ManifestContent.DELETES:
            deletes = deletes or manifest.has_added_files() or manifest.has_existing_files()
            continue
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            data = entry.data_file
            values = tuple(data.partition[i] for i in range(len(data.partition)))
            part = groups.setdefault((manifest.partition_spec_id, values),
                                     _Partition(manifest.partition_spec_id, values))
            part.sizes.append(data.file_size_in_bytes)
            part.rows += data.record_count
            added = (metadata.snapshot_by_id(entry.snapshot_id)
                     if entry.snapshot_id is not None else None)
            part.newest_ms = max(part.newest_ms, added.timestamp_ms if added else 0)
    return list(groups.values()), deletes


def partition_filter(table: Table, spec_id: int,
                     values: tuple[Any, ...]) -> BooleanExpression | None:
    """The row filter selecting exactly one partition of spec ``spec_id``: ``column =
    value`` (``IS NULL``) per identity field, ``AlwaysTrue`` for an unpartitioned spec;
    None when a field has another transform (its rows cannot be selected by a filter on
    the partition value)."""
    spec = table.metadata.specs()[spec_id]
    schema = table.schema()
    terms: list[BooleanExpression] = []
    for part_field, value in zip(spec.fields, values, strict=True):
        if not isinstance(part_field.transform, IdentityTransform):
            return None
        column = schema.find_column_name(part_field.source_id)
        terms.append(IsNull(column) if value is None else EqualTo(column, value))
    if not terms:
        return AlwaysTrue()
    return terms[0] if len(terms) == 1 else And(*terms)


def plan_compactions(table: Table, min_input_files: int, quiet_cutoff_ms: int) -> list[Compaction]:
    """The partitions of ``table`` to compact (module docstring, step 2): those of the
    current partition spec with at least ``min_input_files`` small data files and no file
    added after ``quiet_cutoff_ms``; none when row-level delete files are live."""
    table.refresh()
    target = int(table.properties.get(TableProperties.WRITE_TARGET_FILE_SIZE_BYTES,
                                      TableProperties.WRITE_TARGET_FILE_SIZE_BYTES_DEFAULT))
    small_below = SMALL_FILE_RATIO * target
    partitions, deletes = _partitions(table)
    if deletes:
        log.info("%s holds row-level delete files: not compacted", table.name()[-1])
        return []
    plans = []
    for part in sorted(partitions, key=lambda p: repr(p.values)):
        small = sum(size < small_below for size in part.sizes)
        if (part.spec_id != table.metadata.default_spec_id or small < min_input_files
                or part.newest_ms > quiet_cutoff_ms
                or partition_filter(table, part.spec_id, part.values) is None):
            continue
        plans.append(Compaction(table.name()[-1], part.values, len(part.sizes), small,
                                part.rows))
    return plans


def compact(table: Table, plan: Compaction) -> Compaction:
    """Rewrite the partition of ``plan``: its rows read at the snapshot ``table`` last
    knew (the one :func:`plan_compactions` planned on, or the previous compaction's),
    written back by one ``overwrite`` filtered on the partition, in a transaction based on
    that snapshot: pyiceberg refuses it if a file was added to or deleted from the
    partition since (then ``plan.refused`` says why and nothing changed); commits to other
    partitions meanwhile are no conflict (pyiceberg retries on them).

    Raises:
        OSError: a data file cannot be read or written.
    """
    row_filter = partition_filter(table, table.metadata.default_spec_id, plan.partition)
    assert row_filter is not None  # plan_compactions kept only identity partitions
    snapshot_id = table.metadata.current_snapshot_id
    transaction = table.transaction()  # based on snapshot_id, the snapshot read below
    rows = table.scan(row_filter=row_filter, snapshot_id=snapshot_id).to_arrow()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Delete operation did not match")
        transaction.overwrite(rows, overwrite_filter=row_filter,
                              snapshot_properties={MAINTENANCE_PROPERTY: COMPACTION})
    try:
        transaction.commit_transaction()
    except (CommitFailedException, ValidationException) as exc:
        plan.refused = f"written meanwhile ({exc})"
        return plan
    after, _ = _partitions(table)
    plan.rows = rows.num_rows
    plan.files_after = sum(len(p.sizes) for p in after if p.values == plan.partition)
    return plan


# --------------------------------------------------------------------------- the whole run


@dataclass
class MaintenanceReport:
    """What :func:`maintain` did, or would do with ``dry_run``.

    Attributes:
        dry_run: nothing was committed or deleted.
        offsets: the offset keys and values carried into a new ``kafka_offsets`` snapshot
            (empty when none had to be).
        carry_snapshot: the id of that snapshot (None: none committed).
        compactions: the partitions compacted (or planned).
        expiries: per table, the snapshots expired and the files deleted.
    """

    dry_run: bool
    offsets: dict[str, str] = field(default_factory=dict)
    carry_snapshot: int | None = None
    compactions: list[Compaction] = field(default_factory=list)
    expiries: list[Expiry] = field(default_factory=list)

    def summary(self) -> str:
        """One line: partitions compacted (files before -> after), snapshots expired,
        files deleted, offsets carried."""
        verb = "would " if self.dry_run else ""
        done = [c for c in self.compactions if c.refused is None]
        refused = len(self.compactions) - len(done)
        files = f"{sum(c.files for c in done)} data files"
        if not self.dry_run:
            files += f" -> {sum(c.files_after or 0 for c in done)}"
        parts = [
            f"{verb}compact {len(done)} partition(s) of {len({c.table for c in done})} "
            f"table(s) ({files})" if done else "no partition to compact",
            f"{verb}expire {sum(len(e.snapshots) for e in self.expiries)} snapshot(s) of "
            f"{sum(bool(e.snapshots) for e in self.expiries)} table(s) and delete "
            f"{sum(len(e.files) for e in self.expiries)} file(s)",
            f"{verb}carry {len(self.offsets)} Kafka offset(s) into a new snapshot"
            if self.offsets else "offsets in place",
        ]
        if refused:
            parts.insert(1, f"{refused} partition(s) left: written meanwhile")
        return ("dry run: " if self.dry_run else "maintained: ") + "; ".join(parts)


Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: the step under way and how far it is."""


def maintain(catalog: Catalog, namespace: str, retain: timedelta,
             min_input_files: int = MIN_INPUT_FILES,
             quiet_period: timedelta = DEFAULT_QUIET_PERIOD, dry_run: bool = False,
             progress: Progress | None = None, now: float | None = None) -> MaintenanceReport:
    """Carry the offsets if expiry needs it, compact, expire (module docstring) every table
    of ``namespace`` in ``catalog``.

    Args:
        retain: snapshots replaced less than this long ago are kept.
        min_input_files: small files that make a partition worth compacting.
        quiet_period: partitions with a file added this recently are not compacted.
        dry_run: plan only: commit and delete nothing.
        progress: called as each step advances.
        now: the current time (s since the epoch; default: the clock).

    Raises:
        MaintenanceError: the namespace does not exist, or a step's commits kept being
            refused by concurrent commits.
        OSError: a file of the warehouse cannot be read, written or deleted.
    """
    from pyiceberg.exceptions import NoSuchNamespaceError

    report = MaintenanceReport(dry_run)
    tell = progress or (lambda _what, _done, _total: None)
    now_ms = int((time.time() if now is None else now) * 1000)
    cutoff_ms = now_ms - int(retain.total_seconds() * 1000)
    try:
        names = sorted(ident[-1] for ident in catalog.list_tables(namespace))
    except NoSuchNamespaceError:
        raise MaintenanceError(f"the catalog has no namespace {namespace!r}: give the one the "
                               "stores write (--namespace / GRADSTREAM_ICEBERG_NAMESPACE)"
                               ) from None
    tables = {name: catalog.load_table((namespace, name)) for name in names}

    offsets = tables.get(OFFSETS_TABLE)
    if offsets is not None:
        tell("offsets", 0, 1)
        needed = offsets_walk(offsets.metadata)
        if set(needed) & set(expirable(offsets.metadata, cutoff_ms)):
            if dry_run:
                report.offsets = newest_offsets(offsets.metadata)
            else:
                report.carry_snapshot, report.offsets = carry_offsets(offsets)
        tell("offsets", 1, 1)

    quiet_ms = now_ms - int(quiet_period.total_seconds() * 1000)
    compacted = [name for name in tables if name != OFFSETS_TABLE]
    for done, name in enumerate(compacted):
        tell(f"compacting {name}", done, len(compacted))
        for plan in plan_compactions(tables[name], min_input_files, quiet_ms):
            report.compactions.append(plan if dry_run else compact(tables[name], plan))
    tell("compacting", len(compacted), len(compacted))

    for done, (name, table) in enumerate(tables.items()):
        tell(f"expiring {name}", done, len(tables))
        # a dry run's carry is not committed: expiry is planned as if it were
        walk = name == OFFSETS_TABLE and not (dry_run and report.offsets)
        keep = offsets_walk if walk else (lambda _m: ())
        report.expiries.append(expire(table, cutoff_ms, dry_run, keep))
    tell("expiring", len(tables), len(tables))
    return report
