"""The report's ``ignore_layers`` / ``exclude_rounding`` through both readers: the file
read directly and a writer's endpoint (``GET /api/report``) give the same summary."""

from __future__ import annotations

from analysis.read.reader import StoreReader
from tests.analysis.read.test_hardening import reader, store, writer

__all__ = ["reader", "store", "writer"]  # fixtures used below


def test_report_options_reach_the_reader(reader: StoreReader) -> None:
    plain = reader.report("r")
    assert plain.ignore_layers == [] and not plain.excluded_rounding_level
    summary = reader.report("r", ignore_layers=["b", "z*"], exclude_rounding=True)
    assert summary.ignore_layers == ["b", "z*"] and summary.layers_excluded == ["b"]
    assert summary.excluded_rounding_level
