"""Versioned pydantic v2 models of the alerts topic: :class:`Alert` and :class:`RunStatus`.

Workers publish both to the alerts topic (``schemas.topics.DEFAULT_ALERTS_TOPIC``), keyed by
run id, as JSON with a ``type`` discriminator (``"alert"`` / ``"run_status"``) and a
``schema_version`` ``"MAJOR.MINOR"`` (same rules as ``schemas.wire``: every minor version of
the known major parses, unknown fields are ignored, another major is refused). Each record
also carries a ``type`` Kafka header, so a consumer interested in alerts only can skip
status records without parsing them.

Alert semantics (``consumer.alerts``): an *incident* is one continuous period during which a
rule's bad condition holds for a run. It produces exactly two events sharing an
``incident_id``: ``state="firing"`` on the transition into the bad state and
``state="resolved"`` once the condition has been clear for the rule's ``resolve_after``
frames. ``alert_id`` is ``f"{incident_id}-{state}"``; ``incident_id`` is derived from
(run, rule, first step), so a worker that replays frames after a crash produces the same
ids and the store keeps one row per event.

Rule names: ``rule`` (and ``RunStatus.active_rules``) holds any :data:`RuleName`, a
lower-case identifier; the built-in rules' names come back as :class:`AlertRule` members,
so ``alert.rule is AlertRule.NONFINITE`` works, and a rule added to the worker's registry
(``consumer.alerts.rules.RULES``) needs no change here. On the wire a rule is its name, as
before.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)

from schemas.versioned import VersionedMessage
from schemas.wire import MAX_RUN_ID_LENGTH, GradientHealth, WireError

ALERT_SCHEMA_MAJOR = 1
ALERT_SCHEMA_MINOR = 0
ALERT_SCHEMA_VERSION = f"{ALERT_SCHEMA_MAJOR}.{ALERT_SCHEMA_MINOR}"
"""1.0: Alert and RunStatus as described in the module doc."""

MAX_ALERT_BYTES = 1024 * 1024
"""Largest encoded alert-topic record accepted on either side (bytes)."""

RunId = Annotated[str, Field(min_length=1, max_length=MAX_RUN_ID_LENGTH)]
UnixTime = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class AlertRule(StrEnum):
    """Names of the built-in rules (constants for code and tests).

    The rules a worker evaluates are those of the registry ``consumer.alerts.rules.RULES``
    (each rule's module documents its condition); a new rule is added there, not here.
    """

    RUN_HEALTH = "run_health"
    NONFINITE = "nonfinite"
    NONFINITE_LOSS = "nonfinite_loss"
    EXPLODING = "exploding"
    VANISHING = "vanishing"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    LOSS_SPIKE = "loss_spike"
    LOSS_SCALE_COLLAPSE = "loss_scale_collapse"
    STALLED = "stalled"
    MISSING_RANKS = "missing_ranks"
    STRAGGLER = "straggler"
    REPLICA_DIVERGENCE = "replica_divergence"
    SHARD_LAYOUT = "shard_layout"


RULE_NAME_PATTERN = r"[a-z][a-z0-9_]{0,63}"
"""What a rule name looks like: a lower-case identifier of at most 64 characters (it is a
rule-file table name and an ``--alert-set`` key)."""
_RULE_NAME = re.compile(RULE_NAME_PATTERN)


def rule_name(value: Any) -> AlertRule | str:
    """Validate a rule name: a built-in name becomes its :class:`AlertRule` member, any
    other name matching :data:`RULE_NAME_PATTERN` stays a ``str``.

    Raises:
        ValueError: not a string, or not a valid name.
    """
    if isinstance(value, AlertRule):
        return value
    if not isinstance(value, str):
        raise ValueError(f"a rule name must be a string, got {type(value).__name__}")
    try:
        return AlertRule(value)
    except ValueError:
        pass
    if _RULE_NAME.fullmatch(value) is None:
        raise ValueError(
            f"invalid rule name {value!r}: expected a lower-case identifier "
            f"({RULE_NAME_PATTERN})"
        )
    return value


RuleName = Annotated[
    AlertRule | str,
    PlainValidator(rule_name),
    PlainSerializer(str, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": f"^{RULE_NAME_PATTERN}$"}),
]
"""A rule's name in a model field (:func:`rule_name` validates it; JSON: the name)."""


class AlertSeverity(StrEnum):
    """How urgent an alert is, ordered ``info < warning < critical``."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """0 (info), 1 (warning) or 2 (critical)."""
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {AlertSeverity.INFO: 0, AlertSeverity.WARNING: 1, AlertSeverity.CRITICAL: 2}


class AlertState(StrEnum):
    """``firing`` on entering the bad state, ``resolved`` once it has cleared."""

    FIRING = "firing"
    RESOLVED = "resolved"


class _AlertWire(VersionedMessage):
    """Common base of the alerts-topic records (:class:`schemas.versioned.VersionedMessage`)."""

    schema_major: ClassVar[int] = ALERT_SCHEMA_MAJOR
    schema_label: ClassVar[str] = "alert schema"

    schema_version: str = ALERT_SCHEMA_VERSION


class Alert(_AlertWire):
    """One alert event (firing or resolved) of one run.

    Attributes:
        alert_id: ``f"{incident_id}-{state}"``, unique per event.
        incident_id: shared by the firing and the resolved event of one incident
            (:func:`incident_id`).
        run_id: the run. step: optimiser step of the frame that caused the event (for
            ``stalled``, the last step seen). first_step: step at which the incident began.
        rule: the rule's name (:data:`RuleName`). severity, state: see the enums.
        layers: names of the layers involved (model order); for a resolved event, every
            layer involved during the incident.
        ranks: ranks involved (e.g. the ranks whose shard held NaN/Inf, or the missing
            ranks), ascending; empty when the rule is not about ranks.
        message: one human-readable line.
        values: the frame values behind the event, JSON: ``{"layers": {name: {statistic:
            value}}, ...}`` plus rule-specific keys (documented in each rule's module,
            ``consumer.alerts.rules``).
        created_at: worker wall time when the event was made (unix s).
        wall_time: producer wall time of the triggering frame (unix s), None for events not
            caused by a frame (``stalled`` firing).
    """

    type: Literal["alert"] = "alert"
    alert_id: str = Field(min_length=1, max_length=128)
    incident_id: str = Field(min_length=1, max_length=128)
    run_id: RunId
    step: int = Field(ge=0)
    first_step: int = Field(ge=0)
    rule: RuleName
    severity: AlertSeverity
    state: AlertState
    layers: list[str] = Field(default_factory=list)
    ranks: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    message: str
    values: dict[str, Any] = Field(default_factory=dict)
    created_at: UnixTime
    wall_time: UnixTime | None = None


class RunStatus(_AlertWire):
    """A run's live state as a worker sees it, for ``gradstream watch``.

    Published on the alerts topic (type ``run_status``) when the run's health changes, an
    alert fires or resolves, the run stalls or finishes, and otherwise at most once per
    ``status_interval_s`` while frames arrive. Not an alert: sinks other than Kafka ignore it.

    Attributes:
        run_id: the run. step: last optimiser step of a frame. world_size: ranks per step.
        health: run health after that frame (Healthy / MinorIssues / ProblemsDetected /
            Critical, ``schemas.health``).
        frames: frames considered by the run's health. ranks_seen: ranks in the last frame.
        wall_time: producer wall time of the last frame (unix s).
        finished: every rank sent RunFinished. stalled: the ``stalled`` rule is firing.
        active_rules: rules with an incident firing now.
        emitted_at: worker wall time of this record (unix s).
    """

    type: Literal["run_status"] = "run_status"
    run_id: RunId
    step: int = Field(ge=0)
    world_size: int = Field(gt=0)
    health: GradientHealth
    frames: int = Field(ge=0)
    ranks_seen: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    wall_time: UnixTime
    finished: bool = False
    stalled: bool = False
    active_rules: list[RuleName] = Field(default_factory=list)
    emitted_at: UnixTime


AlertRecord = Annotated[Alert | RunStatus, Field(discriminator="type")]
_ADAPTER: TypeAdapter[Alert | RunStatus] = TypeAdapter(AlertRecord)


def incident_id(run_id: str, rule: AlertRule | str, first_step: int) -> str:
    """Deterministic id of the incident of ``rule`` in ``run_id`` that began at ``first_step``.

    Returns:
        The first 24 hex digits (96 bits) of SHA-256 over the three fields joined by the
        ASCII unit separator (so replayed frames reproduce the id).
    """
    text = f"{run_id}\x1f{rule}\x1f{int(first_step)}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def decode_alert_record(raw: bytes | str) -> Alert | RunStatus:
    """Parse and validate one alerts-topic record value.

    Args:
        raw: UTF-8 JSON of an Alert or a RunStatus, at most ``MAX_ALERT_BYTES``.

    Returns:
        The validated Alert or RunStatus.

    Raises:
        WireError: empty, oversized, not JSON, unknown ``type`` or major version, or an
            invalid field (``reason`` names it).
    """
    if raw is None or len(raw) == 0:
        raise WireError("empty alert record (no value)")
    if len(raw) > MAX_ALERT_BYTES:
        raise WireError(f"alert record of {len(raw)} bytes exceeds {MAX_ALERT_BYTES} bytes")
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "record"
        raise WireError(f"{where}: {err['msg']}") from None


def encode_alert_record(record: Alert | RunStatus) -> bytes:
    """Compact UTF-8 JSON of an Alert or RunStatus (non-finite floats become ``null``).

    Raises:
        WireError: the encoded record exceeds ``MAX_ALERT_BYTES``.
    """
    data = record.model_dump_json().encode()
    if len(data) > MAX_ALERT_BYTES:
        raise WireError(f"encoded {record.type} is {len(data)} bytes, over {MAX_ALERT_BYTES}")
    return data
