"""The incident state machine shared by every rule: fire once, stay quiet, resolve.

For one (run, rule): when the rule's condition becomes bad while no incident is active, an
incident starts (``FIRE``). While it is active, bad observations only reset the count of
clear observations and add the layers/ranks involved. Each clear observation increments
that count; when it reaches the rule's ``resolve_after``, the incident ends (``RESOLVE``).
So one incident yields exactly one firing and one resolved event, however long it lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from schemas.alert import AlertRule, incident_id


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
    rule: AlertRule
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
    """An incident whose last stored event is ``firing`` (read back on worker start)."""

    run_id: str
    rule: AlertRule
    incident_id: str
    first_step: int
    layers: list[str]
    ranks: list[int]
