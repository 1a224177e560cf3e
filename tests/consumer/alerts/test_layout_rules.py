"""Alert texts say what happened: a refused rank is not a silent rank (``missing_ranks``),
and pieces that do not fit their parameter raise ``shard_layout`` on a frame stored as
partial. Frames come from the consumer's own merger (``consumer.merge.ShardMerger``)."""

from __future__ import annotations

import numpy as np

from consumer.alerts.engine import AlertEngine
from consumer.merge import ShardMerger
from schemas.alert import AlertRule, AlertSeverity
from tests.consumer.alerts.helpers import FIRING, LAYERS, NUMEL, RESOLVED, Run, only, shard, states

P = ("summaries", 0)


def merger() -> ShardMerger:
    return ShardMerger(5.0, lambda _run, _step: None)


def grads(run: Run, numel: int = NUMEL) -> dict[str, np.ndarray]:
    return {n: run.rng.standard_normal(numel) * 1e-2 for n in LAYERS}


def test_missing_ranks_names_the_refusal_of_a_refused_rank_and_the_silence_of_another():
    run = Run(AlertEngine(only("missing_ranks", resolve_after=1)), world=3)
    m = merger()
    m.refuse(run.info.run_id, 2, "its layer list differs from rank 0's (4 layers vs 3)")
    m.add(run.info, shard(run.info.run_id, 0, 0, 3, grads(run)), P, 0, 0.0)
    (frame,) = m.expire({run.info.run_id: run.info}, 10.0)  # rank 1 silent, rank 2 refused
    (alert,) = run.feed(frame)
    assert alert.rule is AlertRule.MISSING_RANKS and alert.ranks == [1, 2]
    assert "rank(s) [1] sent nothing for it" in alert.message
    assert ("rank 2's data was refused: its RunStarted was refused: its layer list differs "
            "from rank 0's") in alert.message
    assert alert.values["silent_ranks"] == [1]
    assert list(alert.values["refused_ranks"]) == ["2"]


def test_a_refused_rank_alone_is_never_called_silent():
    run = Run(AlertEngine(only("missing_ranks", resolve_after=1)), world=2)
    m = merger()
    m.refuse(run.info.run_id, 1, "another layer list")
    frame = m.add(run.info, shard(run.info.run_id, 0, 0, 2, grads(run)), P, 0, 0.0)
    assert frame is not None  # finalised at once: nothing more will come from rank 1
    (alert,) = run.feed(frame)
    assert "sent nothing" not in alert.message
    assert "rank 1's data was refused" in alert.message and alert.values["silent_ranks"] == []


def test_shard_layout_fires_on_pieces_that_overflow_their_parameter_and_resolves():
    run = Run(AlertEngine(only("shard_layout", resolve_after=1)), world=2)
    info, m = run.info, merger()
    # each rank claims a whole 64-element parameter as its own disjoint piece: 128 counted
    m.add(info, shard(info.run_id, 0, 0, 2, grads(run, 2 * NUMEL)), P, 0, 0.0)
    frame = m.add(info, shard(info.run_id, 0, 1, 2, grads(run, 2 * NUMEL)), P, 1, 0.0)
    assert frame.all_ranks_seen and not frame.complete
    (alert,) = run.feed(frame)
    assert (alert.rule, alert.severity) == (AlertRule.SHARD_LAYOUT, AlertSeverity.CRITICAL)
    assert alert.layers == list(LAYERS)
    assert alert.values["violations"] == {"numel": 4}
    assert alert.values["layers"]["embed"]["elements"] == 128
    assert alert.values["layers"]["embed"]["expected"] == 64
    assert ("embed's pieces hold 128 elements, the parameter 64 (RunStarted)"
            in alert.message) and "stored as partial" in alert.message
    m.add(info, shard(info.run_id, 1, 0, 2, grads(run)), P, 2, 0.0)
    good = m.add(info, shard(info.run_id, 1, 1, 2, grads(run)), P, 3, 0.0)
    assert good.complete
    assert states(run.feed(good)) == [(RESOLVED, 1)]


def test_shard_layout_names_the_rank_of_a_replica_of_another_size():
    run = Run(AlertEngine(only("shard_layout")), world=2)
    info, m = run.info, merger()
    whole = shard(info.run_id, 0, 0, 2, grads(run, 2 * NUMEL))
    layout = {"shard_index": [0] * 4, "shard_count": [1] * 4}
    m.add(info, whole.model_copy(update=layout), P, 0, 0.0)
    small = shard(info.run_id, 0, 1, 2, {**grads(run, 2 * NUMEL), "head": np.ones(NUMEL)})
    # constructed directly: the message-level check would refuse it in a worker
    frame = m.add(info, small.model_copy(update=layout), P, 1, 0.0)
    (alert,) = run.feed(frame)
    assert states([alert]) == [(FIRING, 0)] and alert.ranks == [1] and alert.layers == ["head"]
    assert "rank 1's replica of a piece of head holds 32 elements, the counted replica 64" \
        in alert.message
