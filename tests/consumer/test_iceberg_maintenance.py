"""Housekeeping of the Iceberg table set (consumer.iceberg_maintenance): many small writes of
the real Iceberg output to a real SQLite catalog and file warehouse, then compaction and
snapshot expiry, checked with pyiceberg alone: the same rows, fewer files, old snapshots and
their files gone, and every Kafka offset a store resumes from still found."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

from consumer.iceberg_maintenance import (
    CARRY,
    COMPACTION,
    MAINTENANCE_PROPERTY,
    MaintenanceError,
    MaintenanceSettings,
    compact,
    maintain,
    offset_partition,
    open_catalog,
    parse_age,
    plan_compactions,
)
from consumer.outputs.base import Batch, RunState
from consumer.outputs.iceberg import IcebergOutput, offset_property
from tests.consumer.outputs.test_duckdb_replay import LAYERS, _frame, _started

GROUPS = ("g.store", "other")
"""Two consumer groups: the offsets of both are kept."""

WRITES = 10
"""Small writes of run ``r``: one frame each, so ``layer_stats`` and ``frames`` get one
data file per write in partition ``run_id=r``."""


def _batch(step: int, offsets: dict[tuple[str, int], int]) -> Batch:
    """One frame of run ``r`` at ``step`` (the run started with step 0), with ``offsets``."""
    batch = Batch()
    if step == 0:
        batch.runs_started.append(_started())
    batch.frames[("r", step)] = (_frame(step, np.arange(LAYERS), 1.0 + step, (0, 1)),
                                 "Healthy")
    batch.run_states["r"] = RunState("Healthy", step + 1, 0, step, None)
    batch.offsets.update(offsets)
    return batch


def _write_history(catalog: str, warehouse: str) -> None:
    """:data:`WRITES` small writes by group ``g.store`` (partition t/1 only in the second,
    so its offset is in an old snapshot), and one by group ``other`` after the third (each
    output opened after the other's last write)."""
    for steps in (range(3), range(3, WRITES)):
        store = IcebergOutput(catalog, warehouse, GROUPS[0])
        try:
            for step in steps:
                offsets = {("t", 0): 100 + step}
                if step == 1:
                    offsets[("t", 1)] = 7
                store.write(_batch(step, offsets))
        finally:
            store.close()
        if steps.start == 0:
            other = IcebergOutput(catalog, warehouse, GROUPS[1])
            other.write(_batch(2, {("t", 0): 40}))  # a replay of step 2: the same rows
            other.close()


def _offsets(catalog: str, warehouse: str) -> dict[str, dict[Any, int]]:
    """Per group, what a restarted store resumes from."""
    out = {}
    for group in GROUPS:
        output = IcebergOutput(catalog, warehouse, group)
        try:
            out[group] = output.stored_offsets(["t"])
        finally:
            output.close()
    return out


def _reader(catalog: str, warehouse: str) -> SqlCatalog:
    return SqlCatalog("gradstream", uri=catalog, warehouse=warehouse)


def _rows(tbl: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(tuple(repr(v) for v in r.values()) for r in tbl.to_pylist())


def _state(reader: SqlCatalog) -> dict[str, dict[str, Any]]:
    """Per table: rows, live data files, snapshot ids, metadata location."""
    state = {}
    for ident in reader.list_tables("gradstream"):
        table = reader.load_table(ident)
        files = table.inspect.files()
        state[ident[-1]] = {
            "rows": _rows(table.scan().to_arrow()),
            "files": sorted(files["file_path"].to_pylist()),
            "snapshots": [s.snapshot_id for s in table.metadata.snapshots],
            "current": table.metadata.current_snapshot_id,
            "metadata": table.metadata_location,
        }
    return state


def _on_disk(root: Path, suffix: str) -> set[str]:
    return {p.as_uri() for p in root.rglob(f"*{suffix}")}


def _referenced(table: Table) -> set[str]:
    """Every manifest list, manifest and data file the table's snapshots reference."""
    paths: set[str] = set()
    for snapshot in table.metadata.snapshots:
        paths.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            paths.add(manifest.manifest_path)
            paths |= {e.data_file.file_path
                      for e in manifest.fetch_manifest_entry(table.io, discard_deleted=False)}
    return paths


@pytest.fixture
def history(tmp_path: Path) -> tuple[str, str, Path]:
    """(catalog URL, warehouse URL, warehouse folder) after :func:`_write_history`."""
    root = tmp_path / "warehouse"
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", root.as_uri()
    _write_history(catalog, warehouse)
    return catalog, warehouse, root


def _local_uri(uri: str) -> str:
    """``file:/x`` and ``file:///x`` spelled alike."""
    return Path(uri.removeprefix("file:").removeprefix("//")).as_uri()


def test_maintain_compacts_expires_and_keeps_every_offset(
    history: tuple[str, str, Path]
) -> None:
    catalog, warehouse, root = history
    reader = _reader(catalog, warehouse)
    before = _state(reader)
    offsets = _offsets(catalog, warehouse)
    assert offsets == {GROUPS[0]: {("t", 0): 109, ("t", 1): 7}, GROUPS[1]: {("t", 0): 40}}
    assert len(before["layer_stats"]["files"]) == WRITES  # one small file per write
    parquet = _on_disk(root, ".parquet")

    # a dry run plans the same work and changes nothing
    planned = maintain(open_catalog(catalog, warehouse, {}), "gradstream", timedelta(0),
                       quiet_period=timedelta(0), dry_run=True)
    assert _state(reader) == before and _on_disk(root, ".parquet") == parquet
    assert {(c.table, c.partition, c.files) for c in planned.compactions} == {
        ("layer_stats", ("r",), WRITES), ("frames", ("r",), WRITES)}
    assert planned.carry_snapshot is None and set(planned.offsets) == {
        offset_property(GROUPS[0], "t", 0), offset_property(GROUPS[0], "t", 1),
        offset_property(GROUPS[1], "t", 0)}
    assert planned.summary().startswith("dry run: would compact 2 partition(s)")

    steps: list[tuple[str, int, int]] = []
    done = maintain(open_catalog(catalog, warehouse, {}), "gradstream", timedelta(0),
                    quiet_period=timedelta(0), progress=lambda *a: steps.append(a))
    after = _state(reader)
    assert steps[-1] == ("expiring", len(before), len(before))
    # the same rows in every table, in fewer files
    assert {n: t["rows"] for n, t in after.items()} == {n: t["rows"] for n, t in before.items()}
    assert len(after["layer_stats"]["files"]) == len(after["frames"]["files"]) == 1
    assert [(c.table, c.files, c.files_after, c.refused) for c in done.compactions] == [
        ("frames", WRITES, 1, None), ("layer_stats", WRITES, 1, None)]
    # every snapshot replaced before maintain began is gone: the heads it found remain (as
    # the parents of its own commits) or nothing changed there
    for name, table in after.items():
        kept = set(table["snapshots"]) & set(before[name]["snapshots"])
        assert kept == {before[name]["current"]} - {None}, name
    # the offsets, carried into one new kafka_offsets snapshot, are all found again
    assert _offsets(catalog, warehouse) == offsets
    offsets_table = reader.load_table(("gradstream", "kafka_offsets"))
    head = offsets_table.current_snapshot()
    assert head is not None and head.snapshot_id == done.carry_snapshot
    assert head.summary[MAINTENANCE_PROPERTY] == CARRY
    assert head.summary[offset_property(GROUPS[0], "t", 1)] == "7"
    assert {offset_partition(k) for k in done.offsets} == {
        (GROUPS[0], "t", 0), (GROUPS[0], "t", 1), (GROUPS[1], "t", 0)}
    compacted = reader.load_table(("gradstream", "layer_stats")).current_snapshot()
    assert compacted is not None and compacted.summary[MAINTENANCE_PROPERTY] == COMPACTION
    # the files of expired snapshots are deleted, those of the remaining ones are all there
    deleted = {_local_uri(p) for e in done.expiries for p in e.files}
    assert deleted and not deleted & _on_disk(root, "")
    for ident in reader.list_tables("gradstream"):
        referenced = {_local_uri(p) for p in _referenced(reader.load_table(ident))}
        assert referenced <= _on_disk(root, ""), ident
    assert len(_on_disk(root, ".parquet")) < len(parquet)

    # a second run expires what the first replaced; stores then go on writing
    again = maintain(open_catalog(catalog, warehouse, {}), "gradstream", timedelta(0),
                     quiet_period=timedelta(0))
    assert not again.compactions and not again.offsets
    assert {e.table for e in again.expiries if e.snapshots} == {
        "frames", "layer_stats", "kafka_offsets"}
    assert _offsets(catalog, warehouse) == offsets
    store = IcebergOutput(catalog, warehouse, GROUPS[0])
    try:
        store.write(_batch(WRITES, {("t", 0): 110}))
        assert store.stored_offsets(["t"]) == {("t", 0): 110, ("t", 1): 7}
        assert len(store.tables["layer_stats"].scan().to_arrow()) == (WRITES + 1) * LAYERS
    finally:
        store.close()


def test_retention_and_quiet_period_hold_back_recent_work(
    history: tuple[str, str, Path]
) -> None:
    """With the defaults (snapshots kept 5 days, partitions written within the hour left
    alone) a fresh history is left as it is; its offsets are in place, nothing committed."""
    catalog, warehouse, _root = history
    reader = _reader(catalog, warehouse)
    before = _state(reader)
    settings = MaintenanceSettings()
    report = maintain(open_catalog(catalog, warehouse, {}), "gradstream",
                      settings.iceberg_retain, settings.iceberg_min_input_files,
                      settings.iceberg_quiet_period)
    assert _state(reader) == before
    assert report.summary() == ("maintained: no partition to compact; expire 0 snapshot(s) "
                                "of 0 table(s) and delete 0 file(s); offsets in place")
    # more small files than the run has: not worth compacting
    report = maintain(open_catalog(catalog, warehouse, {}), "gradstream", timedelta(days=1),
                      min_input_files=WRITES + 1, quiet_period=timedelta(0))
    assert not report.compactions and _state(reader) == before


def test_a_partition_written_during_compaction_is_left_as_written(
    history: tuple[str, str, Path]
) -> None:
    """A store's write to the run between the plan and the compaction's commit: pyiceberg
    refuses the compaction, and the store's rows stay."""
    catalog, warehouse, _root = history
    table = open_catalog(catalog, warehouse, {}).load_table(("gradstream", "layer_stats"))
    (plan,) = plan_compactions(table, 2, quiet_cutoff_ms=2**62)
    store = IcebergOutput(catalog, warehouse, GROUPS[0])
    try:
        store.write(_batch(WRITES, {("t", 0): 110}))
    finally:
        store.close()
    result = compact(table, plan)
    assert result.refused is not None and result.files_after is None
    rows = _reader(catalog, warehouse).load_table(("gradstream", "layer_stats")).scan()
    assert len(rows.to_arrow()) == (WRITES + 1) * LAYERS


def test_ages_settings_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_age("7d") == timedelta(days=7) and parse_age("90m") == timedelta(minutes=90)
    assert parse_age("0") == timedelta(0) and parse_age("1.5h") == timedelta(minutes=90)
    assert parse_age("2w") == timedelta(days=14) and parse_age(30) == timedelta(seconds=30)
    for wrong in ("7 days", "-1d", "d", ""):
        with pytest.raises(ValueError, match="age"):
            parse_age(wrong)
    monkeypatch.setenv("GRADSTREAM_ICEBERG_RETAIN", "36h")
    monkeypatch.setenv("GRADSTREAM_ICEBERG_QUIET_PERIOD", "0")
    settings = MaintenanceSettings(iceberg_catalog="sqlite:///c.db")
    assert settings.iceberg_retain == timedelta(hours=36)
    assert settings.iceberg_quiet_period == timedelta(0) and settings.iceberg_min_input_files == 5
    with pytest.raises(ValueError, match="file:///path or s3://"):
        MaintenanceSettings(iceberg_warehouse="/no/scheme")

    with pytest.raises(MaintenanceError, match="no Iceberg catalog"):
        open_catalog(f"sqlite:///{tmp_path}/none.db", tmp_path.as_uri(), {})
    assert not (tmp_path / "none.db").exists()
    catalog = f"sqlite:///{tmp_path}/c.db"
    IcebergOutput(catalog, tmp_path.as_uri(), "g").close()
    with pytest.raises(MaintenanceError, match="no namespace 'lab'"):
        maintain(open_catalog(catalog, tmp_path.as_uri(), {}), "lab", timedelta(0))
