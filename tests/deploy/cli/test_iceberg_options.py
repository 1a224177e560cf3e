"""The Iceberg store options (:class:`deploy.cli.options.IcebergOptions`) of ``consume`` and
``store``, and ``store --assign-partitions``: they become the settings of the process,
which then writes Iceberg instead of DuckDB; a partition subset without an Iceberg table
set, or a warehouse of another scheme, stops the command before it connects."""

from __future__ import annotations

from pathlib import Path

import pytest
from kafka import TopicPartition
from typer.testing import CliRunner

from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from deploy.cli import app
from deploy.cli.consume import WorkerOptions
from deploy.cli.options import IcebergOptions

ENV = ("GRADSTREAM_ICEBERG_CATALOG", "GRADSTREAM_ICEBERG_WAREHOUSE",
       "GRADSTREAM_ICEBERG_NAMESPACE", "GRADSTREAM_ASSIGNED_PARTITIONS", "GRADSTREAM_DB")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_options_make_the_worker_write_iceberg(tmp_path: Path) -> None:
    assert WorkerOptions().settings().output == "duckdb"
    iceberg = IcebergOptions(iceberg_catalog=f"sqlite:///{tmp_path / 'c.db'}",
                             iceberg_warehouse=(tmp_path / "wh").as_uri(),
                             iceberg_namespace="team")
    settings = WorkerOptions().settings(**iceberg.settings())
    assert (settings.output, settings.store_output) == ("iceberg", "iceberg")
    assert settings.iceberg_namespace == "team"
    scale_out = WorkerOptions().settings(frames_topic="frames", **iceberg.settings())
    assert scale_out.output == "frames_topic"  # a scale-out worker writes no store


def test_a_store_reads_only_its_assigned_partitions(tmp_path: Path) -> None:
    settings = StoreWriterSettings(iceberg_catalog=f"sqlite:///{tmp_path / 'c.db'}",
                                   iceberg_warehouse=(tmp_path / "wh").as_uri(),
                                   assigned_partitions="2,0")
    every = [TopicPartition(t, p) for t in ("frames", "alerts") for p in range(4)]
    assert StoreWriter(settings).read_partitions(every) == [
        TopicPartition("frames", 0), TopicPartition("frames", 2),
        TopicPartition("alerts", 0), TopicPartition("alerts", 2)]
    assert StoreWriter(StoreWriterSettings()).read_partitions(every) == every
    with pytest.raises(ValueError, match=r"assigned_partitions \[7\] do not exist"):
        StoreWriter(settings.model_copy(update={"assigned_partitions": [7]})).read_partitions(
            every)


@pytest.mark.parametrize(("args", "message"), [
    (["store", "--assign-partitions", "0,1"], "set iceberg_catalog too"),
    (["store", "--iceberg-catalog", "sqlite:///c.db", "--iceberg-warehouse", "hdfs://x/y"],
     "iceberg_warehouse must be a file:///path or s3://bucket/path URL"),
    (["consume", "--iceberg-catalog", "sqlite:///c.db", "--iceberg-warehouse", "/plain/path"],
     "iceberg_warehouse must be a file:///path or s3://bucket/path URL"),
])
def test_invalid_store_options_exit_2_before_connecting(args: list[str], message: str,
                                                         tmp_path: Path) -> None:
    result = CliRunner().invoke(app, [*args, "--db", str(tmp_path / "s.duckdb"),
                                      "--bootstrap-servers", "127.0.0.1:1"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "invalid settings" in result.output and message in result.output
    assert not (tmp_path / "s.duckdb").exists()
