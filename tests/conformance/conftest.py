"""Fixtures of the conformance suite: one served worker per module, and the session's figures.

The worker (``deploy.serve.ServedWorker``: a ``consumer.worker.Worker`` writing a DuckDB file
and answering reads on a loopback endpoint) consumes a topic of its own on the session's
Kafka (:func:`tests.conftest.kafka_bootstrap`); cases read it back through
``analysis.read.reader.open_reader``, which finds the endpoint. At the end of the session the
figures (cases, comparisons, differences, documented departures) are printed, and written
as JSON to ``$GRADSTREAM_CONFORMANCE_OUT`` when that is set.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from analysis.read.reader import open_reader
from consumer.settings import ConsumerSettings
from deploy.serve import ServedWorker
from tests.conformance.harness import TALLY, Pipeline


@contextmanager
def served_pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory,
                    max_frames: int, nonfinite_rule: str = "reference") -> Iterator[Pipeline]:
    """A served worker (``--max-frames max_frames``, ``--nonfinite-rule nonfinite_rule``)
    on a fresh topic and a reader of its store."""
    name = uuid.uuid4().hex[:10]
    out = tmp_path_factory.mktemp("conformance")
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"conf-sum-{name}",
        dlq_topic=f"conf-dlq-{name}", group_id=f"conf-grp-{name}",
        db=str(out / "store.duckdb"), shard_timeout_s=120.0, max_frames=max_frames,
        nonfinite_rule=nonfinite_rule,
    )
    served = ServedWorker(settings, port=0, refresh_s=1.0)
    served.start(timeout=120.0)
    try:
        assert served.worker.wait_ready(120), f"worker did not join: {served.worker.error}"
        reader = open_reader(Path(settings.db))
        try:
            yield Pipeline(kafka_bootstrap, settings.topic, reader, served.worker, out,
                           max_frames, nonfinite_rule)
        finally:
            reader.close()
    finally:
        served.stop(timeout=60)


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Pipeline]:
    """A served worker keeping the whole run's health (module scope)."""
    with served_pipeline(kafka_bootstrap, tmp_path_factory, 0) as p:
        yield p


@pytest.fixture(scope="module")
def gradstream_pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[Pipeline]:
    """A served worker with gradstream's own non-finite rule (the default, ``critical``),
    read without the reference's options: gradstream's documented behaviour (module
    scope)."""
    with served_pipeline(kafka_bootstrap, tmp_path_factory, 0, "critical") as p:
        yield p


@pytest.fixture(scope="module")
def windowed_pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[Pipeline]:
    """A served worker whose live health covers the last 3 frames (``--max-frames 3``),
    the reference's ``max_frames`` rolling window (module scope)."""
    with served_pipeline(kafka_bootstrap, tmp_path_factory, 3) as p:
        yield p


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the conformance figures when some case ran."""
    if not TALLY.cases:
        return
    figures = TALLY.summary()
    terminalreporter.section("conformance with the reference gradient_flow")
    terminalreporter.write_line(
        f"cases {figures['cases']}, comparisons {figures['comparisons']}, differences "
        f"{figures['differences']}, documented departures {figures['departures']}")
    for line in TALLY.differences[:30]:
        terminalreporter.write_line(f"  difference {line}")
    for line in TALLY.departures[:30]:
        terminalreporter.write_line(f"  departure  {line}")
    target = os.environ.get("GRADSTREAM_CONFORMANCE_OUT")
    if target:
        Path(target).write_text(json.dumps(figures, indent=2), encoding="utf-8")
