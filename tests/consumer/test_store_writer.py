"""Store-writer reconciliation of republished, replayed and late frames
(consumer.store_writer), on a real DuckDB file; records are fed to the store writer's
handler directly (the alerts it evaluates go to a real broker's alerts topic)."""

from __future__ import annotations

from collections import namedtuple

import duckdb
import numpy as np
import pytest

from consumer.frames import MergedShards, compute_frame
from consumer.outputs.frames_topic import frame_to_message
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from schemas.wire import RunStarted, StepSummary, encode_message

Record = namedtuple("Record", "topic partition offset value key")


def shard(rank: int) -> StepSummary:
    return StepSummary(run_id="r", step=5, rank=rank, world_size=3, wall_time=10.0 + rank,
                       layer_indices=[0, 1], numel=[4, 6], sum_abs=[1.0 + rank, 2.0],
                       sum_sq=[0.5, 1.0 + rank], max_abs=[0.25 * (rank + 1), 0.5],
                       nonfinite=[0, rank])


def frame_of(ranks: list[int]):
    merged = MergedShards.empty(2)
    for r in ranks:
        s = shard(r)
        merged.add(np.array([0, 1]), np.asarray(s.numel), np.asarray(s.sum_abs),
                   np.asarray(s.sum_sq), np.asarray(s.max_abs), np.asarray(s.nonfinite))
    return compute_frame("r", 5, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
                         ranks_seen=tuple(ranks), world_size=3, wall_time=12.0)


@pytest.fixture
def store(tmp_path, kafka_bootstrap, unique_name):
    # frames of one step fed out of order on purpose: no wait in the reorder buffer; the
    # alert rules' events go to a real alerts topic
    s = StoreWriter(StoreWriterSettings(db=str(tmp_path / "s.duckdb"), reorder_delay_s=0,
                                        bootstrap_servers=kafka_bootstrap,
                                        alerts_topic=f"store-alerts-{unique_name}"))
    s.open()
    offset = iter(range(10**6))

    def feed(message) -> None:
        s.consume(Record("frames", 0, next(offset), encode_message(message), b"r"))
        s.flush()

    feed(RunStarted(run_id="r", world_size=3, layer_names=["a", "b"], numel=[12, 18],
                    start_time=1.0))
    yield s, feed
    s.output.close()


def stored(store: StoreWriter):
    con: duckdb.DuckDBPyConnection = store.output.sink.con
    rows = con.execute("SELECT numel, sum_abs, sum_sq, max_abs_grad, nonfinite FROM layer_stats "
                       "ORDER BY layer_index").fetchall()
    ranks = con.execute("SELECT ranks_seen, complete FROM frames").fetchall()
    return rows, ranks


def expected(ranks: list[int]):
    f = frame_of(ranks)
    return [(int(f.numel[i]), f.sum_abs[i], f.sum_sq[i], f.max_abs_grad[i],
             int(f.nonfinite[i])) for i in range(2)]


def test_late_rank_is_merged_and_replays_are_ignored(store):
    s, feed = store
    feed(frame_to_message(frame_of([0, 2])))
    assert stored(s) == (expected([0, 2]), [([0, 2], False)])
    feed(frame_to_message(frame_of([1])))  # a late rank: disjoint, merged exactly
    assert stored(s) == (expected([0, 1, 2]), [([0, 1, 2], True)])
    assert s.counters.merged_late == 1
    feed(frame_to_message(frame_of([2])))  # a replayed subset: ignored
    assert stored(s) == (expected([0, 1, 2]), [([0, 1, 2], True)])
    feed(frame_to_message(frame_of([0, 1, 2])))  # republished: same values
    assert stored(s) == (expected([0, 1, 2]), [([0, 1, 2], True)])
    assert s.counters.ignored_replays == 1
    assert s.output.sink.con.execute("SELECT count(*) FROM layer_stats").fetchone() == (2,)


def test_late_rank_merges_with_a_frame_stored_before_a_restart(store, tmp_path):
    s, feed = store
    feed(frame_to_message(frame_of([1])))
    s.output.close()
    # a restarted store: state from DuckDB
    again = StoreWriter(StoreWriterSettings(db=s.settings.db, reorder_delay_s=0,
                                            bootstrap_servers=s.settings.bootstrap_servers,
                                            alerts_topic=s.settings.alerts_topic))
    again.open()
    again.consume(Record("frames", 0, 99, encode_message(frame_to_message(frame_of([0, 2]))),
                         b"r"))
    again.flush()
    assert stored(again) == (expected([0, 1, 2]), [([0, 1, 2], True)])
    again.output.close()
    s.open()  # for the fixture's teardown


def test_alert_records_are_stored_once_and_bad_ones_skipped(store):
    """Alert events on the alerts topic land in the alerts table (a replayed record
    changes nothing); a run status is skipped; an unusable record is counted."""
    from schemas.alert import Alert, AlertRule, AlertSeverity, AlertState, encode_alert_record

    s, _feed = store
    alert = Alert(alert_id="i1-firing", incident_id="i1", run_id="r", step=5, first_step=5,
                  rule=AlertRule.NONFINITE, severity=AlertSeverity.CRITICAL,
                  state=AlertState.FIRING, layers=["a"], ranks=[1], message="NaN in a",
                  created_at=3.0)
    topic = s.settings.alerts_topic
    for offset, value in enumerate([encode_alert_record(alert), b"{not json",
                                    encode_alert_record(alert)]):
        s.consume(Record(topic, 0, offset, value, b"r"))
    s.flush()
    rows = s.output.sink.con.execute("SELECT alert_id, rule, ranks FROM alerts").fetchall()
    assert rows == [("i1-firing", "nonfinite", [1])]
    assert s.counters.dead_letters == 1 and s.counters.alerts == 2
    assert s.output.sink.load_offsets(s.settings.group_id, topic) == {0: 3}


def test_a_frame_whose_pieces_overflow_the_parameters_is_stored_as_partial(store):
    """Scale-out: the store checks the merged sizes again (RunStarted: a 12, b 18): three
    ranks of (4, 6) fit, six would count (24, 36) elements: marked partial, not complete."""
    s, feed = store
    frame = frame_of([0, 1, 2])
    feed(frame_to_message(frame))
    assert stored(s)[1] == [([0, 1, 2], True)]
    doubled = frame_of([0, 1, 2])
    doubled.numel = doubled.numel * 2
    doubled.step = 6
    feed(frame_to_message(doubled))
    rows = s.output.sink.con.execute(
        "SELECT step, ranks_seen, complete, missing_ranks FROM frames ORDER BY step").fetchall()
    assert rows == [(5, [0, 1, 2], True, []), (6, [0, 1, 2], False, [])]


@pytest.mark.parametrize("wire_format", ["json", "binary"])
def test_worker_layout_violations_travel_and_keep_the_frame_partial(store, wire_format):
    """Scale-out: a replica of another size is left out of the worker's sums, so the merged
    numel adds up; the violation rows it sends (schema 1.8) make the store's frame partial,
    with the misfit layer counted in ``layout_violations``, also after a late merge and
    after a restart (read back from DuckDB)."""
    from consumer.merge import VIOLATION_REPLICA_NUMEL
    from schemas.wire import decode_frame_message

    s, _feed = store
    offset = iter(range(1000, 10**6))

    def feed(message) -> None:
        raw = encode_message(message, wire_format)
        assert decode_frame_message(raw) == message
        s.consume(Record("frames", 0, next(offset), raw, b"r"))
        s.flush()

    frame = frame_of([0, 1, 2])
    frame.numel = np.array([12, 18])  # the counted pieces fit the parameters
    frame.layout_violations = np.array([[1, VIOLATION_REPLICA_NUMEL, 2, 9, 6]], np.int64)
    message = frame_to_message(frame)
    assert message.layout_violations == [1, VIOLATION_REPLICA_NUMEL, 2, 9, 6]
    feed(message)
    verdict = ("SELECT step, complete, missing_ranks, refused_ranks, layout_violations "
               "FROM frames ORDER BY step")

    def rows():
        return s.output.sink.con.execute(verdict).fetchall()

    assert rows() == [(5, False, [], [], 1)]

    # a partial frame with a refused rank and a misfit replica, then its late rank
    part = frame_of([0])
    part.step = 7
    part.layout_violations = np.array([[0, VIOLATION_REPLICA_NUMEL, 0, 3, 4]], np.int64)
    part.refused_ranks = {2: "its RunStarted was refused: another layer list"}
    feed(frame_to_message(part))
    assert rows()[1] == (7, False, [1, 2], [2], 1)
    s._partial.clear()  # the late rank's base is read back from DuckDB
    late = frame_of([1])
    late.step = 7
    feed(frame_to_message(late))
    assert rows()[1] == (7, False, [2], [2], 1)


def test_a_17_merged_frame_still_parses_without_violations(store):
    """A MergedFrame from a 1.7 worker (no layout_violations / refused_ranks) still parses
    and is stored by its sums alone; a malformed 1.8 field is refused."""
    from pydantic import ValidationError

    from schemas.wire import MergedFrame

    s, feed = store
    old = frame_to_message(frame_of([0, 1, 2])).model_copy(update={"schema_version": "1.7"})
    assert old.layout_violations is None and old.refused_ranks is None
    feed(old)
    assert s.output.sink.con.execute(
        "SELECT complete, refused_ranks, layout_violations FROM frames").fetchall() == [
        (True, [], 0)]
    base = frame_to_message(frame_of([0])).model_dump()
    with pytest.raises(ValidationError, match="5 integers"):
        MergedFrame(**{**base, "layout_violations": [1, 2, 3]})
    with pytest.raises(ValidationError, match="ranks_seen"):
        MergedFrame(**{**base, "refused_ranks": [0]})


def test_frames_of_a_run_are_taken_in_step_order(tmp_path):
    """Frames arriving out of step order (two workers' lags) wait in the run's reorder
    buffer and are stored and evaluated in step order; the offsets stored never pass a
    held frame; a step missing for ``reorder_delay_s`` is skipped over."""
    s = StoreWriter(StoreWriterSettings(db=str(tmp_path / "o.duckdb"), reorder_delay_s=60,
                                        alerts_topic=None))
    s.open()
    order: list[int] = []
    assert s.alerts is not None
    evaluate = s.alerts.on_frame

    def noting(frame, run, tracker):
        order.append(frame.step)
        return evaluate(frame, run, tracker)

    s.alerts.on_frame = noting  # type: ignore[method-assign]
    offsets = iter(range(10**6))

    def feed(message) -> int:
        offset = next(offsets)
        s.consume(Record("frames", 0, offset, encode_message(message), b"r"))
        return offset

    def frame(step: int):
        f = frame_of([0, 1, 2])
        f.step = step
        return frame_to_message(f)

    try:
        feed(RunStarted(run_id="r", world_size=3, layer_names=["a", "b"], numel=[12, 18],
                        start_time=1.0))
        feed(frame(0))
        held = feed(frame(2))
        feed(frame(3))
        assert order == [0] and s.pending_count() == 2
        assert s.pending_offsets() == {("frames", 0): held}
        assert not s.runs_done(["r"])
        feed(frame(1))  # the gap closes: 1, 2, 3 in step order
        assert order == [0, 1, 2, 3] and s.pending_count() == 0
        feed(frame(5))  # step 4 never comes: 5 waits, then is taken
        assert order == [0, 1, 2, 3]
        s.settings.reorder_delay_s = 0
        s.tick()
        assert order == [0, 1, 2, 3, 5]
        feed(frame(2))  # a republished step: stored again, not evaluated again
        assert order == [0, 1, 2, 3, 5]
        s.flush()
        steps = s.output.sink.con.execute("SELECT step FROM frames ORDER BY step").fetchall()
        assert steps == [(0,), (1,), (2,), (3,), (5,)]
    finally:
        s.output.close()


def test_what_only_the_worker_saw_travels_and_names_the_ranks_in_the_alerts(store):
    """A frame whose rank 2 summary held NaN and whose replicas disagreed: the worker's
    rows travel in the MergedFrame (wire 1.11) and the store writer's ``nonfinite`` and
    ``replica_divergence`` alerts name the ranks."""
    s, feed = store
    frame = frame_of([0, 1, 2])  # shard(2) holds 2 non-finite elements in layer 1
    frame.nonfinite_pieces = np.array([[2, 1]])
    frame.replica_divergence = np.array([[0, 1, 0]], np.int32)
    message = frame_to_message(frame)
    assert message.nonfinite_pieces == [2, 1] and message.replica_divergence == [0, 1, 0]
    feed(message)
    rows = dict(s.output.sink.con.execute(
        "SELECT rule, ranks FROM alerts WHERE state = 'firing'").fetchall())
    assert rows["nonfinite"] == [2]
    assert sorted(rows["replica_divergence"]) == [0, 1]
