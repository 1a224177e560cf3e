"""Defaults of the consumer processes that the ``gradstream`` command shows in its help.

This module imports nothing, so the command can read it without loading pydantic.
"""

from __future__ import annotations

DEFAULT_DB = "gradstream.duckdb"
"""The DuckDB store written and read when neither ``--db`` nor ``GRADSTREAM_DB`` is given."""
