"""The stuck-partition watchdog's rule (consumer.stuck_partition): when a partition counts
as stuck, the escalation seek -> recreate, and what clears it. The loop's recovery against a real
broker is in tests/integration/test_stuck_partition.py."""

from __future__ import annotations

import pytest

from consumer.stuck_partition import Recovered, StuckPartition, StuckPartitionWatchdog

P = ("t", 0)


def test_checks_are_rate_limited_to_a_quarter_of_the_timeout() -> None:
    dog = StuckPartitionWatchdog(8.0)
    assert dog.interval_s == 2.0
    assert dog.due(100.0)
    assert not dog.due(101.9)
    assert dog.due(102.0)
    off = StuckPartitionWatchdog(0)
    assert not off.enabled and not off.due(1e9)
    with pytest.raises(ValueError, match="0 = off"):
        StuckPartitionWatchdog(-1)


def test_waiting_partition_is_stuck_after_the_timeout_then_escalates() -> None:
    """Records waiting (end > position) and the same position: nothing before the timeout,
    a seek at the timeout, a recreate one timeout after the seek, nothing in between."""
    dog = StuckPartitionWatchdog(10.0)
    assert dog.observe(0.0, {P: 5}, {P: 9}) == ([], [])
    assert dog.observe(9.9, {P: 5}, {P: 12}) == ([], [])
    assert dog.observe(10.0, {P: 5}, {P: 12}) == ([StuckPartition("t", 0, 5, 12, 10.0, "seek")], [])
    assert dog.observe(19.0, {P: 5}, {P: 12}) == ([], [])
    assert dog.observe(20.0, {P: 5}, {P: 12}) == (
        [StuckPartition("t", 0, 5, 12, 20.0, "recreate")], [])
    assert dog.observe(29.0, {P: 5}, {P: 12}) == ([], [])
    # Still stuck a timeout after the recreate (the loop resets the watchdog after one;
    # without a reset it keeps asking for one).
    assert dog.observe(30.0, {P: 5}, {P: 12})[0][0].action == "recreate"


def test_a_partition_read_to_its_end_is_never_stuck() -> None:
    """A quiet partition (position = end offset) is not stuck however long it waits."""
    dog = StuckPartitionWatchdog(1.0)
    for t in range(10):
        assert dog.observe(float(t), {P: 7}, {P: 7}) == ([], [])


def test_a_moving_position_clears_the_stuck_state_and_reports_the_recovery() -> None:
    dog = StuckPartitionWatchdog(1.0)
    dog.observe(0.0, {P: 3}, {P: 8})
    stuck, _ = dog.observe(1.5, {P: 3}, {P: 8})
    assert [s.action for s in stuck] == ["seek"]
    assert dog.observe(2.0, {P: 6}, {P: 8}) == ([], [Recovered("t", 0, 2.0, "seek")])
    # The clock restarts from the new position: not stuck before another full timeout.
    assert dog.observe(2.9, {P: 6}, {P: 8}) == ([], [])
    assert [s.action for s in dog.observe(3.0, {P: 6}, {P: 8})[0]] == ["seek"]
    # Read to the end after an action: recovered, and forgotten.
    assert dog.observe(3.5, {P: 6}, {P: 6}) == ([], [Recovered("t", 0, 1.5, "seek")])


def test_unknown_figures_and_revoked_partitions_are_forgotten() -> None:
    """A partition whose position or end offset is unknown, or which is no longer
    assigned, starts afresh when seen again; reset() forgets everything."""
    q = ("t", 1)
    dog = StuckPartitionWatchdog(1.0)
    dog.observe(0.0, {P: 1, q: 1}, {P: 5, q: 5})
    assert dog.observe(1.0, {P: None, q: 1}, {P: 5}) == ([], [])  # q: end unknown
    assert dog.observe(1.5, {P: 1, q: 1}, {P: 5, q: 5}) == ([], [])  # both start afresh
    assert len(dog.observe(2.5, {P: 1, q: 1}, {P: 5, q: 5})[0]) == 2
    dog.observe(2.6, {q: 1}, {q: 5})  # P revoked
    assert dog.observe(3.0, {P: 1, q: 1}, {P: 5, q: 5})[0] == []  # P starts afresh
    dog.reset()
    assert dog.observe(10.0, {P: 1, q: 1}, {P: 5, q: 5}) == ([], [])
