"""Alert rules and thresholds: pydantic models, TOML/YAML rule files, flag overrides.

A rule file has one table (TOML) or mapping (YAML) per rule, named after
:class:`schemas.alert.AlertRule`, plus the top-level ``max_layer_values``; everything left
out keeps its default::

    # rules.toml
    [exploding]
    consecutive = 5          # frames in a row with max |g| above the run's threshold
    severity = "critical"

    [stalled]
    after_s = 120            # fixed threshold instead of the data-driven one

    [grad_norm_spike]
    enabled = false

Overrides given as flags (``--alert-set exploding.consecutive=5``) are applied over the
file. Mistakes are reported all at once, each with where it is (``file:line`` or the flag)
and why: :class:`AlertConfigError`.

Defaults are policy choices, not measured quantities; each is explained at its field.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.alert import AlertRule, AlertSeverity
from schemas.wire import GradientHealth


class _RuleConfig(BaseModel):
    """Fields every rule has.

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


class RunHealthRuleConfig(_RuleConfig):
    """Run health (seed 001 ``classify_health``, see ``consumer.health``) at or above
    ``level``. The default level Critical is the seed's most severe class."""

    severity: AlertSeverity = AlertSeverity.CRITICAL
    level: GradientHealth = GradientHealth.CRITICAL


class NonfiniteRuleConfig(_RuleConfig):
    """Any NaN/Inf gradient element in any layer of a frame (a non-finite gradient
    makes the frame Critical at once, ``consumer.health``)."""

    severity: AlertSeverity = AlertSeverity.CRITICAL


class StreakRuleConfig(_RuleConfig):
    """A layer flagged (exploding / vanishing, seed 001 thresholds of the run) in at least
    ``consecutive`` frames in a row."""

    consecutive: int = Field(default=3, ge=1)


class ExplodingRuleConfig(StreakRuleConfig):
    """Exploding layers (max |g| above the run's exploding threshold). Default 3 frames: a
    single step above the threshold is common right after a learning-rate change; three in
    a row is a trend."""

    consecutive: int = Field(default=3, ge=1)


class VanishingRuleConfig(StreakRuleConfig):
    """Vanishing layers (mean |g| below the run's vanishing threshold). Default 10 frames:
    vanishing is a slow failure, and layers can start small at initialisation."""

    consecutive: int = Field(default=10, ge=1)


class SpikeRuleConfig(_RuleConfig):
    """A layer's gradient norm far above its recent history (``consumer.alerts.robust``).

    Attributes:
        window: frames of history per layer (rolling).
        min_samples: history needed before a layer is tested.
        z_threshold: modified z-score above which a norm is a spike. 3.5 is the cut-off
            recommended by Iglewicz & Hoaglin (1993), "How to Detect and Handle Outliers".
        min_ratio: the norm must also be at least this many times the layer's median
            norm: statistical unusualness and a practically large change together, like
            the fold-change-plus-significance criterion of volcano plots (2-fold is that
            criterion's conventional cut). Without it, a layer whose norm is very steady
            flags harmless 20% wobbles, and with many layers and a short history the
            z-score alone fires on noise.
        log_scale: test ``ln(grad_norm)`` instead of ``grad_norm`` (gradient norms vary
            multiplicatively: a 10x jump is as notable at 1e-3 as at 1e2).
        refresh_every: frames between recomputations of the window's median and MAD
            (``consumer.alerts.robust.RollingRobustZ``); None = ``max(1, window // 10)``,
            so at most a tenth of the window is newer than the statistics. Measured with
            1000 layers and window 100 (2-core VM): the whole engine costs 8-11 ms per
            frame with 1, ~2 ms with 10, 0.3 ms without this rule.
    """

    window: int = Field(default=100, ge=3)
    min_samples: int = Field(default=20, ge=3)
    z_threshold: float = Field(default=3.5, gt=0, allow_inf_nan=False)
    min_ratio: float = Field(default=2.0, ge=1, allow_inf_nan=False)
    log_scale: bool = True
    refresh_every: int | None = Field(default=None, ge=1)

    @property
    def refresh_frames(self) -> int:
        """``refresh_every``, or its default ``max(1, window // 10)``."""
        return self.refresh_every or max(1, self.window // 10)

    @model_validator(mode="after")
    def _samples_fit(self) -> SpikeRuleConfig:
        if self.min_samples > self.window:
            raise ValueError(
                f"min_samples ({self.min_samples}) must not exceed window ({self.window})"
            )
        return self


class StalledRuleConfig(_RuleConfig):
    """No new frame of a run for a while, although not every rank has finished.

    The threshold is ``after_s`` when given; otherwise it is computed from the run's own
    pace: ``max(min_after_s, interval_factor * median interval between its last frames)``
    (median over the last ``window`` intervals, worker clock), so a run doing one step a
    minute is not declared stalled after ten seconds.

    Attributes:
        after_s: fixed threshold (s), or None for the data-driven one.
        interval_factor: how many median step intervals without a frame make a stall.
        min_after_s: floor of the data-driven threshold (s).
        window: intervals kept per run for the median.
    """

    resolve_after: int = Field(default=1, ge=1)
    after_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    interval_factor: float = Field(default=10.0, gt=1, allow_inf_nan=False)
    min_after_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    window: int = Field(default=32, ge=1)


class MissingRanksRuleConfig(_RuleConfig):
    """Frames finalised without every rank (partial, after the worker's shard timeout) in
    at least ``consecutive`` frames in a row."""

    consecutive: int = Field(default=1, ge=1)


class ReplicaDivergenceRuleConfig(_RuleConfig):
    """Replicas of one piece of a parameter (DDP ranks, the replicate dimension of HSDP, a
    DTensor ``Replicate`` placement) whose statistics disagree beyond
    ``consumer.merge.REPLICA_RTOL`` in a frame. After an all-reduce they are bitwise
    identical, so any disagreement is a desynchronised replica (a skipped all-reduce,
    non-deterministic kernels after the reduction, a rank that loaded other weights).
    Critical: the ranks no longer train the same model."""

    severity: AlertSeverity = AlertSeverity.CRITICAL


class AlertRulesConfig(BaseModel):
    """Every rule's configuration.

    Attributes:
        run_health, nonfinite, exploding, vanishing, grad_norm_spike, stalled,
            missing_ranks, replica_divergence: the rules (see each class).
        max_layer_values: at most this many layers (the worst ones by the rule's statistic)
            get their frame values in ``Alert.values``; ``Alert.layers`` always names all.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_health: RunHealthRuleConfig = RunHealthRuleConfig()
    nonfinite: NonfiniteRuleConfig = NonfiniteRuleConfig()
    exploding: ExplodingRuleConfig = ExplodingRuleConfig()
    vanishing: VanishingRuleConfig = VanishingRuleConfig()
    grad_norm_spike: SpikeRuleConfig = SpikeRuleConfig()
    stalled: StalledRuleConfig = StalledRuleConfig()
    missing_ranks: MissingRanksRuleConfig = MissingRanksRuleConfig()
    replica_divergence: ReplicaDivergenceRuleConfig = ReplicaDivergenceRuleConfig()
    max_layer_values: int = Field(default=16, ge=1)

    def rule(self, rule: AlertRule) -> _RuleConfig:
        """The configuration of ``rule``."""
        return getattr(self, rule.value)


# -- errors ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One mistake: ``source`` (file path or ``--alert-set ...``), ``line`` (1-based, or
    None for flags), ``where`` (dotted key) and ``reason``."""

    source: str
    line: int | None
    where: str
    reason: str

    def __str__(self) -> str:
        place = f"{self.source}:{self.line}" if self.line is not None else self.source
        return f"{place}: {self.where}: {self.reason}" if self.where else f"{place}: {self.reason}"


class AlertConfigError(ValueError):
    """An invalid rule file or override. ``problems`` lists every mistake found;
    ``str(exc)`` gives one line per problem, ``source:line: key: reason``."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


# -- locating keys in the source text ---------------------------------------------------

_HEADER = re.compile(r"^\s*\[\[?\s*(?P<key>[^\]#]+?)\s*\]\]?\s*(#.*)?$")
_ASSIGN = re.compile(r"""^\s*(?P<key>(?:"[^"]*"|'[^']*'|[A-Za-z0-9_\-\.\s])+?)\s*=""")


def _split_key(key: str) -> tuple[str, ...]:
    """TOML dotted key -> parts (quotes removed; dots inside quotes kept)."""
    parts = re.findall(r"""\s*("[^"]*"|'[^']*'|[^.]+)\s*(?:\.|$)""", key.strip())
    return tuple(p.strip().strip("\"'") for p in parts if p.strip())


def toml_key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map every table header and key of a TOML document to its 1-based line.

    Handles ``[table]`` headers, bare/quoted/dotted keys and skips the inside of
    multi-line strings; keys inside inline tables map to the line of the enclosing key
    (lookups fall back to the longest known prefix).
    """
    out: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    closing: str | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if closing is not None:
            if closing in line:
                closing = None
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        header = _HEADER.match(line)
        if header:
            table = _split_key(header.group("key"))
            out.setdefault(table, lineno)
            continue
        assign = _ASSIGN.match(line)
        if assign:
            key = table + _split_key(assign.group("key"))
            for i in range(len(table) + 1, len(key) + 1):
                out.setdefault(key[:i], lineno)
            rest = line[assign.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) == 1:
                    closing = quote
    return out


def _yaml_load(text: str, source: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    """Parse YAML; return (data, key path -> 1-based line). Duplicate keys are errors."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        reason = f"invalid YAML: {exc.problem or exc.context}"
        raise AlertConfigError([ConfigProblem(source, line, "", reason)]) from None
    except yaml.YAMLError as exc:
        raise AlertConfigError([ConfigProblem(source, None, "", f"invalid YAML: {exc}")]) from None
    lines: dict[tuple[str, ...], int] = {}
    problems: list[ConfigProblem] = []

    def walk(n: Any, path: tuple[str, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in n.value:
                key = str(key_node.value)
                child = (*path, key)
                if key in seen:
                    problems.append(ConfigProblem(
                        source, key_node.start_mark.line + 1, ".".join(child),
                        "duplicate key (each key may appear once)",
                    ))
                seen.add(key)
                lines.setdefault(child, key_node.start_mark.line + 1)
                walk(value_node, child)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                child = (*path, str(i))
                lines.setdefault(child, item.start_mark.line + 1)
                walk(item, child)

    if node is not None:
        walk(node, ())
    if problems:
        raise AlertConfigError(problems)
    return data, lines


def _line_of(lines: dict[tuple[str, ...], int], loc: tuple[str, ...]) -> int | None:
    for i in range(len(loc), 0, -1):
        if loc[:i] in lines:
            return lines[loc[:i]]
    return None


def _allowed_keys(loc: tuple[str, ...]) -> list[str]:
    model: Any = AlertRulesConfig
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        model = field.annotation
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _reason(err: dict[str, Any], loc: tuple[str, ...]) -> str:
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        what = "rule or setting" if len(loc) == 1 else "key"
        return f"unknown {what} {loc[-1]!r}; expected one of: {', '.join(allowed)}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if "input" in err and not isinstance(err["input"], (dict, list)) and err["type"] != "missing":
        return f"{msg} (got {err['input']!r})"
    return msg


# -- loading -----------------------------------------------------------------------------


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """Parse one ``--alert-set`` flag: ``KEY.PATH=VALUE``.

    The value is read as a TOML value (``5``, ``2.5``, ``true``, ``"critical"``); anything
    that is not valid TOML is taken as a plain string (so ``severity=critical`` works).

    Returns:
        (key path, value).

    Raises:
        AlertConfigError: no ``=``, or an empty key.
    """
    key, sep, raw = text.partition("=")
    path = _split_key(key)
    if not sep or not path:
        raise AlertConfigError([ConfigProblem(
            f"--alert-set {text}", None, "", "expected RULE.FIELD=VALUE, e.g. "
            "exploding.consecutive=5",
        )])
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def _load_file(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AlertConfigError([ConfigProblem(
            source, None, "", f"cannot read the rule file: {exc.strerror or exc}",
        )]) from None
    except UnicodeDecodeError as exc:
        raise AlertConfigError([ConfigProblem(source, None, "", f"not UTF-8 text: {exc}")]) \
            from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            msg = str(exc)
            m = re.search(r"\(at line (\d+), column \d+\)", msg)
            line = int(m.group(1)) if m else None
            raise AlertConfigError([ConfigProblem(source, line, "", f"invalid TOML: {msg}")]) \
                from None
        return data, toml_key_lines(text)
    if suffix in (".yaml", ".yml"):
        data, lines = _yaml_load(text, source)
        if data is None:
            return {}, lines
        if not isinstance(data, dict):
            raise AlertConfigError([ConfigProblem(
                source, 1, "", f"the top level must be a mapping of rule names, got "
                f"{type(data).__name__}",
            )])
        return data, lines
    raise AlertConfigError([ConfigProblem(
        source, None, "", f"unknown rule file format {suffix or '(no suffix)'!r}: use .toml, "
        ".yaml or .yml",
    )])


def load_alert_rules(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> AlertRulesConfig:
    """Build the alert rules from an optional rule file and ``--alert-set`` overrides.

    Args:
        path: a ``.toml``, ``.yaml`` or ``.yml`` rule file (module doc), or None for the
            defaults.
        overrides: ``RULE.FIELD=VALUE`` strings applied over the file, in order.

    Returns:
        The validated configuration.

    Raises:
        AlertConfigError: unreadable file, syntax error, unknown rule or key, wrong type or
            out-of-range value; every problem names its file and line (or its flag) and
            the reason.
    """
    data: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data, lines = _load_file(Path(path))
    set_by: dict[tuple[str, ...], str] = {}
    for text in overrides:
        key, value = parse_override(text)
        node = data
        for part in key[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[key[-1]] = value
        set_by[key] = f"--alert-set {text}"
    try:
        return AlertRulesConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = tuple(str(p) for p in err["loc"])
            flag = next((set_by[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in set_by),
                        None)
            where = ".".join(loc)
            if flag is not None:
                problems.append(ConfigProblem(flag, None, where, _reason(err, loc)))
            else:
                problems.append(ConfigProblem(source, _line_of(lines, loc), where,
                                              _reason(err, loc)))
        problems.sort(key=lambda p: (p.source, p.line or 0))
        raise AlertConfigError(problems) from None


def dump_alert_rules(rules: AlertRulesConfig) -> str:
    """The configuration as YAML text that :func:`load_alert_rules` reads back (``.yaml``)."""
    import yaml

    return yaml.safe_dump(rules.model_dump(mode="json"), sort_keys=False)
