"""The outputs registry (consumer.outputs.registry): one line per output, chosen by the
worker's settings."""

from __future__ import annotations

from pathlib import Path

from consumer.outputs.base import Output
from consumer.outputs.duckdb import DuckDBOutput
from consumer.outputs.frames_topic import FramesTopicOutput
from consumer.outputs.registry import OUTPUTS, open_output
from consumer.settings import ConsumerSettings


def test_settings_name_a_registered_output() -> None:
    assert ConsumerSettings().output == "duckdb"
    assert ConsumerSettings(frames_topic="frames").output == "frames_topic"
    assert ConsumerSettings(iceberg_catalog="sqlite:///c.db").output == "iceberg"
    assert set(OUTPUTS) == {"duckdb", "frames_topic", "iceberg"}
    assert FramesTopicOutput.name == "frames_topic"  # the ``output`` label of its writes


def test_the_duckdb_output_opens_from_the_settings(tmp_path: Path) -> None:
    settings = ConsumerSettings(db=str(tmp_path / "s.duckdb"), ignore_layers=["*.bias"])
    output = open_output(settings.output, settings)
    try:
        assert isinstance(output, Output) and isinstance(output, DuckDBOutput)
        assert output.describe() == settings.db
        assert output.name == settings.output  # the store-write metrics' ``output`` label
        assert output.sink.ignore_layers == ("*.bias",)
        assert output.stored_offsets(["t"]) == {}
        assert output.assign() is None
    finally:
        output.close()
