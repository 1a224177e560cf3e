"""GradientProducer.start_run(..., ignore_layers=...): the patterns travel in RunStarted
(schema 1.5) through the real broker; a pattern that matches no layer is logged."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from producer import GradientProducer
from schemas.wire import RunStarted
from tests.producer import read_all


def test_ignore_layers_travel_in_run_started(kafka_bootstrap: str, unique_name: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    topic = f"ign-{unique_name}"
    g = {"attn.key.bias": np.full(4, 1e-13), "attn.key.weight": np.ones(8),
         "head.weight": np.ones(3)}
    with caplog.at_level(logging.WARNING, logger="gradstream.producer"), GradientProducer(
            "r", bootstrap_servers=kafka_bootstrap, topic=topic) as gp:
        gp.start_run({k: v.size for k, v in g.items()},
                     ignore_layers=["*.key.bias", "nothing.*", "*.key.bias"])
        gp.record_step(0, g)
        gp.finish_run()
    (started,) = [m for m in read_all(kafka_bootstrap, topic, 3) if isinstance(m, RunStarted)]
    assert started.ignore_layers == ["*.key.bias", "nothing.*"]  # repeats dropped
    warned = [r.getMessage() for r in caplog.records]
    assert any("'nothing.*' matches none of the run's 3 layers" in m for m in warned)
    assert not any("'*.key.bias'" in m for m in warned)
