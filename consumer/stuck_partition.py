"""Stuck-partition detection for a consumer loop: a partition with records to read whose
position does not move.

kafka-python 3.0.x has shipped fetcher bugs where an otherwise healthy consumer stops
returning the records of some assigned partitions until the next rebalance
(dpkp/kafka-python#3106, #3131): a worker assigned every partition can fetch nothing for
minutes. Nothing in the poll loop notices: ``poll`` just returns nothing. The
:class:`StuckPartitionWatchdog` here notices it, and says what to do about it; the loop
(:class:`consumer.loop.ConsumerLoop`) does it.

Rule, for every assigned partition at each check: it is *waiting* when its log end offset
(a ListOffsets request, not the highwater of the last fetch response, which a partition
that is not fetched never updates) is above the consumer's position; it is *stuck* once
it has been waiting with the same position for ``timeout_s``. A position that moves, or a
partition read to its end, clears the partition's state. Escalation for one stuck partition:

1. ``seek``: after ``timeout_s`` without progress; the loop seeks the partition to its
   own position (the offset after the last record it handled, so nothing is skipped or
   read twice) and resumes it if it was paused (the loop never pauses a partition);
2. ``recreate``: after ``timeout_s`` more without progress; the loop writes its batch,
   gives up its partitions as in a rebalance, closes the KafkaConsumer and opens a new
   one, which is sought to the stored offsets as on any assignment; the watchdog then
   starts afresh (:meth:`StuckPartitionWatchdog.reset`), so a partition still stuck with a new
   consumer is reported and handled again.

Checks run at most every ``timeout_s / 4`` (:attr:`StuckPartitionWatchdog.interval_s`), so a stuck
partition is acted on between ``timeout_s`` and ``1.25 * timeout_s`` after the position last moved,
and each check costs one ListOffsets round trip per broker leading an assigned partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from consumer.topic_admin import PartitionKey

StuckPartitionAction = Literal["seek", "recreate"]
"""What the loop does about a stuck partition: re-seek the partition, or re-create the consumer."""


@dataclass(frozen=True, slots=True)
class StuckPartition:
    """One partition found stuck at a check.

    Attributes:
        topic / partition: the partition.
        position: the consumer's position (next offset to read).
        end_offset: the partition's log end offset (next offset to be written).
        seconds: time since the position last moved (s, as seen at checks, so late by at
            most one check interval).
        action: what the loop should do now (:data:`StuckPartitionAction`).
    """

    topic: str
    partition: int
    position: int
    end_offset: int
    seconds: float
    action: StuckPartitionAction


@dataclass(frozen=True, slots=True)
class Recovered:
    """A partition that moved again after it was found stuck and acted on.

    Attributes:
        topic / partition: the partition.
        seconds: time from the last move before it got stuck to this check (s).
        action: the last action taken before it moved.
    """

    topic: str
    partition: int
    seconds: float
    action: StuckPartitionAction


@dataclass(slots=True)
class _Watch:
    """State of one waiting partition: its position, since when (monotonic s) it has not
    moved, the last action taken (None: none yet) and when."""

    position: int
    since: float
    action: StuckPartitionAction | None = None
    acted_at: float = 0.0


class StuckPartitionWatchdog:
    """Tracks the assigned partitions' positions and end offsets and reports the stuck ones.

    Args:
        timeout_s: seconds a waiting partition's position may stay put before it is
            stuck (``stuck_partition_timeout_s``, ``--stuck-partition-timeout``); 0 turns
            the watchdog off.

    Raises:
        ValueError: ``timeout_s`` is negative.

    Pure bookkeeping: the caller reads positions and end offsets from Kafka when
    :meth:`due` says so and passes them to :meth:`observe` with the time of the check.
    """

    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"stuck-partition timeout must be >= 0 s (0 = off), got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._watch: dict[PartitionKey, _Watch] = {}
        self._last_check = float("-inf")

    @property
    def enabled(self) -> bool:
        """Whether the watchdog is on (``timeout_s > 0``)."""
        return self.timeout_s > 0

    @property
    def interval_s(self) -> float:
        """Smallest time between two checks (s): ``timeout_s / 4``."""
        return self.timeout_s / 4

    def due(self, now: float) -> bool:
        """Whether a check is due at monotonic time ``now`` (s); marks it as done when so."""
        if not self.enabled or now - self._last_check < self.interval_s:
            return False
        self._last_check = now
        return True

    def reset(self) -> None:
        """Forget every partition (after the consumer was re-created)."""
        self._watch.clear()

    def observe(self, now: float, positions: dict[PartitionKey, int | None],
                ends: dict[PartitionKey, int | None]
                ) -> tuple[list[StuckPartition], list[Recovered]]:
        """Update the state with one check's figures.

        Args:
            now: monotonic time of the check (s).
            positions: every assigned partition -> the consumer's position (None: not
                known yet, e.g. an offset reset in progress; the partition is skipped).
            ends: partition -> log end offset (missing or None: skipped).

        Returns:
            The partitions to act on now (with the action), and those that moved again
            after an action (for the log).
        """
        stuck: list[StuckPartition] = []
        recovered: list[Recovered] = []
        for key in self._watch.keys() - positions.keys():  # no longer assigned
            del self._watch[key]
        for key, position in positions.items():
            end = ends.get(key)
            state = self._watch.get(key)
            if position is None or end is None:
                self._watch.pop(key, None)
                continue
            moved = state is not None and (state.position != position or end <= position)
            if moved and state is not None and state.action is not None:
                recovered.append(Recovered(key[0], key[1], now - state.since, state.action))
            if end <= position:  # read to its end: nothing waits
                self._watch.pop(key, None)
                continue
            if state is None or moved:
                self._watch[key] = _Watch(position, now)
                continue
            waited = now - state.since
            action: StuckPartitionAction | None = None
            if state.action is None:
                if waited >= self.timeout_s:
                    action = "seek"
            elif now - state.acted_at >= self.timeout_s:
                action = "recreate"
            if action is not None:
                state.action, state.acted_at = action, now
                stuck.append(StuckPartition(key[0], key[1], position, end, waited, action))
        return stuck, recovered
