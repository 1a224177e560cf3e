"""The contract of an alert rule: :class:`Rule` (one instance per run: the rule's state
and its evaluation), :class:`RuleConfig` (the settings every rule has), :class:`Finding`
(a rule's verdict on one observation) and the contexts a rule reads (:class:`RunContext`,
:class:`FrameContext`).

The engine (``consumer.alerts.engine``) makes one instance of each enabled rule per run,
calls :meth:`Rule.evaluate` on every evaluated frame, :meth:`Rule.note_shard` on every
validated shard and :meth:`Rule.check_idle` from its poll loop; the incident state
machine (``consumer.alerts.incident``) turns the findings into firing / resolved events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from consumer.alerts.rules.shared import FrameView
from consumer.frames import GradientFrame
from consumer.health_tracker import RunHealthTracker
from consumer.runs import RunInfo
from schemas.alert import AlertSeverity, RuleName
from schemas.wire import LocalSummary, StepSummary


class RuleConfig(BaseModel):
    """Fields every rule has (a rule's own config model subclasses this one and may change
    the defaults).

    Attributes:
        enabled: evaluate the rule at all.
        severity: severity of its events.
        resolve_after: consecutive frames (steps) with the condition clear before the
            incident is resolved; 1 resolves on the first clear frame.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    severity: AlertSeverity = AlertSeverity.WARNING
    resolve_after: int = Field(default=5, ge=1)
    """Five clean frames in a row: a debounce so that a condition flickering on alternate
    steps stays one incident instead of a pair of events per flicker."""


class CriticalRuleConfig(RuleConfig):
    """Fields of a rule whose events are Critical unless configured otherwise."""

    severity: AlertSeverity = AlertSeverity.CRITICAL


@dataclass(slots=True)
class Finding:
    """A rule's verdict on one observation.

    Attributes:
        bad: the condition holds (True), is clear (False), or cannot be judged from this
            observation (None: neither starts nor clears an incident).
        layers: involved layer names (model order).
        ranks: involved ranks (ascending).
        values: frame values for ``Alert.values``: ``{"layers": {name: {statistic:
            value}}}`` for at most ``max_layer_values`` layers (the worst by the rule's
            statistic) plus rule-specific keys, JSON-safe (non-finite numbers as None).
        message: one line describing the bad state (used when the incident fires).
    """

    bad: bool | None
    layers: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    message: str = ""


@dataclass(frozen=True, slots=True)
class FrameContext:
    """What a rule reads when a frame is evaluated.

    Attributes:
        frame: the run's next finalised frame (complete or partial).
        tracker: the run's health tracker, already updated with ``frame``.
        view: the frame's layer lookup and value builder, shared by the rules.
        now: worker monotonic time (s) of the frame's arrival.
        interval_s: seconds since the previous frame arrived, when this frame is the
            newest step so far (None for the first frame or an older step).
    """

    frame: GradientFrame
    tracker: RunHealthTracker
    view: FrameView
    now: float
    interval_s: float | None


class RunContext:
    """What every rule of one run shares: the run, its layer names, the frame-arrival
    clock and the last evaluated frame.

    Args:
        info: the run (layer names, thresholds, world size).
        max_layer_values: at most this many layers get values in an event.

    Attributes:
        info: the run. names: object[L] layer names (model order). index: name -> layer
        index. last_view: the last evaluated frame's view, or None. last_step: the newest
        step evaluated, or None. last_frame_at: monotonic time (s) of the last frame.
    """

    def __init__(self, info: RunInfo, max_layer_values: int) -> None:
        self.info = info
        self.max_layer_values = max_layer_values
        self.names = np.asarray(info.layer_names, dtype=object)
        self.index = {name: i for i, name in enumerate(info.layer_names)}
        self.last_view: FrameView | None = None
        self.last_step: int | None = None
        self.last_frame_at: float | None = None

    def begin_frame(
        self, frame: GradientFrame, tracker: RunHealthTracker, now: float
    ) -> FrameContext:
        """Record a frame's arrival (``now``: worker monotonic clock, s) and build the
        context the rules evaluate it with."""
        interval = None
        if self.last_frame_at is not None and (
            self.last_step is None or frame.step > self.last_step
        ):
            interval = now - self.last_frame_at
        self.last_frame_at = now
        self.last_step = frame.step if self.last_step is None else max(self.last_step,
                                                                         frame.step)
        view = FrameView(frame, self.names, self.max_layer_values)
        self.last_view = view
        return FrameContext(frame, tracker, view, now, interval)

    def current_values(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Values of the named layers in the last evaluated frame (for resolved events:
        what the layers look like now), at most ``max_layer_values`` of them."""
        if self.last_view is None or not names:
            return {}
        layers = np.asarray([self.index[n] for n in names if n in self.index], np.int64)
        return self.last_view.layer_values(layers, np.zeros(layers.size))

    def model_order(self, names: set[str] | list[str]) -> list[str]:
        """``names`` sorted by layer index (unknown names last)."""
        return sorted(names, key=lambda n: self.index.get(n, len(self.index)))


ConfigT = TypeVar("ConfigT", bound=RuleConfig)


class Rule(Generic[ConfigT]):
    """One alert rule: subclass it in one module and add the class to
    ``consumer.alerts.rules.RULES``.

    Class attributes (the rule's identity):
        name: the rule's name: its rule-file table, ``--alert-set`` prefix and
            ``Alert.rule`` (:data:`schemas.alert.RuleName`).
        title: short human name ("non-finite gradients") for messages and views.
        description: one sentence on the condition (the rules-file model's field
            description).
        config_model: the rule's settings, a :class:`RuleConfig` subclass whose defaults
            are the rule's defaults: the class parameter of ``Rule[...]`` (or of a generic
            base such as ``StreakRule[...]``), unless the subclass sets it.
        resolves_when_run_finishes: an open incident resolves when every rank of the run
            has finished (conditions about the run still sending frames).
        marks_run_stalled: an open incident sets ``RunStatus.stalled``.

    An instance holds the rule's state for one run; the engine makes it with the run's
    :class:`RunContext` and the rule's validated config, and only for enabled rules.

    Args:
        run: the run's shared context. config: the rule's settings.
    """

    name: ClassVar[RuleName]
    title: ClassVar[str]
    description: ClassVar[str]
    config_model: ClassVar[type[RuleConfig]]
    resolves_when_run_finishes: ClassVar[bool] = False
    marks_run_stalled: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Take ``config_model`` from the class parameter (``Rule[XConfig]``) when the
        subclass does not set it."""
        super().__init_subclass__(**kwargs)
        if "config_model" in cls.__dict__:
            return
        for base in getattr(cls, "__orig_bases__", ()):
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, RuleConfig):
                    cls.config_model = arg
                    return

    def __init__(self, run: RunContext, config: ConfigT) -> None:
        self.run = run
        self.config = config

    def evaluate(self, ctx: FrameContext) -> Finding:
        """The rule's verdict on a new frame (updates the rule's state).

        Raises:
            NotImplementedError: the subclass does not implement it.
        """
        raise NotImplementedError(f"{type(self).__name__}.evaluate")

    def note_shard(self, shard: StepSummary) -> None:
        """See one validated shard of the run before its frame is evaluated (default:
        nothing to do)."""

    def note_local(self, local: LocalSummary) -> None:
        """See one validated local-view entry of a rank of the run (a flight recorder's
        ``LocalSummary``, never part of a frame; default: nothing to do)."""

    def check_idle(self, now: float) -> Finding | None:
        """The rule's verdict while no frame arrives (``now``: worker monotonic clock, s),
        checked from the worker's poll loop. None (the default) judges nothing; a finding
        is observed at the run's newest step, with no wall time."""
        return None
