"""The incident state machine shared by every rule: fire once, stay quiet, resolve.

For one (run, rule): when the rule's condition becomes bad while no incident is active, an
incident starts (``FIRE``). While it is active, bad observations only reset the count of
clear observations and add the layers/ranks involved. Each clear observation increments
that count; when it reaches the rule's ``resolve_after``, the incident ends (``RESOLVE``).
So one incident yields exactly one firing and one resolved event, however long it lasts.

A restarted worker re-opens the incidents still open (:class:`ActiveIncident`), read from
the store (``consumer.alerts.rows.load_active_incidents``) or rebuilt from the events on
the alerts topic (:func:`active_from_events`), and hands them to
``consumer.alerts.engine.AlertEngine.restore``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum

from schemas.alert import Alert, AlertState, RuleName, RunStatus, incident_id


class Transition(Enum):
    """What an observation did to the incident."""

    FIRE = "fire"
    RESOLVE = "resolve"


@dataclass(slots=True)
class Incident:
    """The incident state of one rule in one run.

    Attributes:
        run_id, rule: what it is about.
        active: an incident is open (fired, not yet resolved).
        incident_id: id of the open (or last) incident.
        first_step: step at which it began.
        clear: consecutive clear observations since the last bad one.
        layers, ranks: everything involved since it began (reported when it resolves).
    """

    run_id: str
    rule: RuleName
    active: bool = False
    incident_id: str = ""
    first_step: int = 0
    clear: int = 0
    layers: set[str] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)

    def observe(
        self, bad: bool, step: int, resolve_after: int,
        layers: tuple[str, ...] | list[str] = (), ranks: tuple[int, ...] | list[int] = (),
    ) -> Transition | None:
        """Feed one observation (one frame, or one stall check).

        Args:
            bad: the rule's condition holds now.
            step: step of the observation (the incident's first step when it fires).
            resolve_after: clear observations in a row that resolve an active incident.
            layers, ranks: involved in this bad observation.

        Returns:
            FIRE when this observation starts an incident, RESOLVE when it ends one,
            else None.
        """
        if bad:
            self.clear = 0
            self.layers.update(layers)
            self.ranks.update(ranks)
            if self.active:
                return None
            self.active = True
            self.first_step = step
            self.incident_id = incident_id(self.run_id, self.rule, step)
            return Transition.FIRE
        if not self.active:
            return None
        self.clear += 1
        if self.clear < resolve_after:
            return None
        self.active = False
        self.clear = 0
        return Transition.RESOLVE

    def reset_involved(self) -> None:
        """Forget the layers and ranks (after the resolved event was built)."""
        self.layers = set()
        self.ranks = set()

    def restore(self, incident: str, first_step: int, layers: list[str], ranks: list[int]) -> None:
        """Mark an incident fired by an earlier worker (read from the store) as active, so
        that it is not fired again and resolves normally."""
        self.active = True
        self.incident_id = incident
        self.first_step = first_step
        self.clear = 0
        self.layers = set(layers)
        self.ranks = set(ranks)


@dataclass(frozen=True, slots=True)
class ActiveIncident:
    """An incident whose last event is ``firing`` (read back on worker start).

    Attributes:
        run_id, rule: the run and the rule's name. incident_id: the incident's id.
        first_step: step at which it began. layers, ranks: involved when it fired.
    """

    run_id: str
    rule: RuleName
    incident_id: str
    first_step: int
    layers: list[str]
    ranks: list[int]


def active_from_events(
    events: Iterable[Alert | RunStatus], rules: Collection[str] | None = None,
) -> list[ActiveIncident]:
    """The incidents still open after a sequence of alert events, e.g. the alerts topic
    read from the beginning (``consumer.alerts.feed.AlertFeed.read_to_end``, records
    decoded by ``schemas.alert.decode_alert_record``): what a restarted worker passes to
    ``AlertEngine.restore`` when it has no store to read them from.

    Per (run, rule) the last event in the given order decides: the engine holds one
    incident per (run, rule) at a time, so that event's incident is the current one, open
    when the event is ``firing``. (This is ``consumer.alerts.rows.load_active_incidents``
    over the topic: there the order is ``created_at``; here it is the topic's, which is
    the publication order because all records of a run share a partition, keyed by run
    id, and stays right when workers' clocks disagree.) Replayed duplicates change
    nothing: a second copy of the sequence, or of any event in place, leaves every last
    event as it was.

    Limits: events a crashed worker published for frames past its last committed offset
    are on the topic although those frames will be evaluated again; their incident ids
    are deterministic (``schemas.alert.incident_id``), so a replay that finds the same
    incidents repeats the same ids.

    Args:
        events: Alert and RunStatus records (RunStatus records are skipped), oldest first
            within each run.
        rules: rule names to keep (e.g. the registered ones,
            ``consumer.alerts.rules.rule_names()``); None keeps every rule.

    Returns:
        One ActiveIncident per (run, rule) whose last event is ``firing``, in the order
        those (run, rule) pairs first appeared; ``layers`` and ``ranks`` are those of the
        firing event.
    """
    keep = None if rules is None else {str(r) for r in rules}
    last: dict[tuple[str, str], Alert] = {}
    for event in events:
        if not isinstance(event, Alert):
            continue
        rule = str(event.rule)
        if keep is not None and rule not in keep:
            continue
        last[(event.run_id, rule)] = event
    return [
        ActiveIncident(e.run_id, e.rule, e.incident_id, e.first_step, list(e.layers),
                       list(e.ranks))
        for e in last.values() if e.state is AlertState.FIRING
    ]
