"""Fixtures shared by the integration tests: a store written by the real ``gradstream demo``.

The demo runs once per test session (its store is only read afterwards), through the
session's Kafka (:func:`tests.conftest.kafka_bootstrap`), with the smallest options that
still give every pathology: 2 data-parallel ranks and 24 optimiser steps per scenario, so
``healthy`` stays healthy, ``vanishing`` flags its early sigmoid layers, ``exploding``
diverges and turns NaN at step 21, ``bad-rank`` turns NaN at step 20 in rank 1's local
gradient, ``loss-spike`` spikes at step 22 and ``straggler``'s rank 1 is slow from step 5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO_RANKS = 2
"""Data-parallel ranks of the session's demo store."""

DEMO_STEPS = 24
"""Optimiser steps per scenario of the session's demo store: ``exploding`` first has NaN
gradients at step 21 and ``bad-rank`` at step 20 (the scenarios' own schedules,
``deploy.demo.scenarios.SCENARIOS``), so 24 steps hold both."""


@pytest.fixture(scope="session")
def demo_store(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``demo.duckdb`` written by ``gradstream demo --ranks 2 --steps 24`` (every default
    scenario) in a session directory; read it, never write it."""
    out = tmp_path_factory.mktemp("demo-store")
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "--ranks", str(DEMO_RANKS),
         "--steps", str(DEMO_STEPS), "--out", str(out), "--no-heatmap",
         "--bootstrap-servers", kafka_bootstrap],
        env={**os.environ, "COLUMNS": "120"}, capture_output=True, text=True, timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    db = out / "demo.duckdb"
    assert db.is_file(), result.stdout[-4000:]
    return db
