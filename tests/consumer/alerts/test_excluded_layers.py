"""The vanishing and exploding rules leave out the layers the run excludes explicitly
(``ignore_layers``, ``RunHealthTracker.excluded``); the NaN/Inf rule never does."""

from __future__ import annotations

import numpy as np

from consumer.alerts.engine import AlertEngine
from consumer.health_tracker import RunHealthTracker
from schemas.alert import AlertRule
from schemas.health import match_layers
from tests.consumer.alerts.helpers import FIRING, LAYERS, Run, only


def excluding(rule: str, patterns: list[str], **fields: object) -> Run:
    run = Run(AlertEngine(only(rule, **fields)))
    run.tracker = RunHealthTracker(len(LAYERS), excluded=match_layers(LAYERS, patterns))
    return run


def test_vanishing_rule_skips_excluded_layers_only():
    run = excluding("vanishing", ["attn.*"], consecutive=3, resolve_after=2)
    for s in range(4):
        run.step(s, scale={"attn.q": 1e-8, "head": 1e-8})
    fired = run.of(AlertRule.VANISHING)
    assert [(e.state.value, e.step, e.layers) for e in fired] == [(FIRING, 2, ["head"])]
    assert run.tracker.vanishing_frames.tolist() == [0, 0, 0, 4]


def test_exploding_rule_skips_excluded_layers_only():
    run = excluding("exploding", ["head"], consecutive=2, resolve_after=2)
    for s in range(3):
        run.step(s, scale={"head": 1e7})
    assert run.of(AlertRule.EXPLODING) == [] and not run.tracker.exploding_frames.any()
    for s in range(3, 5):
        run.step(s, scale={"head": 1e7, "embed": 1e7})
    fired = run.of(AlertRule.EXPLODING)
    assert [(e.state.value, e.step, e.layers) for e in fired] == [(FIRING, 4, ["embed"])]


def test_nonfinite_rule_still_fires_for_an_excluded_layer():
    run = excluding("nonfinite", ["head"])
    run.step(0, nan={0: ["head"]})
    assert [e.layers for e in run.of(AlertRule.NONFINITE)] == [["head"]]
    assert run.tracker.nonfinite_frames.tolist() == [0, 0, 0, 1]
    assert np.array_equal(run.tracker.excluded, [False, False, False, True])
