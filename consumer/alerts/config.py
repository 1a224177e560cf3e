"""Alert rules and thresholds: pydantic models, TOML/YAML rule files, flag overrides.

A rule file has one table (TOML) or mapping (YAML) per registered rule, named after it
(``consumer.alerts.rules.RULES``; each rule's module defines its settings), plus the
top-level ``max_layer_values``; everything left out keeps its default::

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
The model itself is built from the registry (:func:`rules_config_model`), so a new rule
needs no change here.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from consumer.alerts.rules import Rule, RuleConfig, check_rules, registered_rules
from schemas.alert import RuleName


class AlertRulesBase(BaseModel):
    """Base of the rules-file models built by :func:`rules_config_model`: one field per
    rule (named after it, holding its ``config_model``), then ``max_layer_values``.

    Attributes:
        rule_types: the rules the model was built from, in order (class attribute).
        max_layer_values: at most this many layers (the worst ones by the rule's statistic)
            get their frame values in ``Alert.values``; ``Alert.layers`` always names all.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule_types: ClassVar[tuple[type[Rule], ...]] = ()

    if TYPE_CHECKING:  # a field of the built models (declared there, after the rules)
        max_layer_values: int

    def rule(self, name: RuleName | str) -> RuleConfig:
        """The configuration of the rule called ``name``.

        Raises:
            KeyError: no rule of that name in this model.
        """
        value = getattr(self, str(name), None)
        if not isinstance(value, RuleConfig):
            raise KeyError(f"no alert rule named {str(name)!r}")
        return value


MAX_LAYER_VALUES_DEFAULT = 16
"""Layers with values in one event by default: enough for a human to read, small enough
for a webhook message and a row of the ``alerts`` table."""


@functools.lru_cache(maxsize=32)
def _build_model(rules: tuple[type[Rule], ...]) -> type[AlertRulesBase]:
    check_rules(rules)
    fields: dict[str, Any] = {
        str(r.name): (r.config_model, Field(default=r.config_model(),
                                            description=r.description))
        for r in rules
    }
    fields["max_layer_values"] = (int, Field(
        default=MAX_LAYER_VALUES_DEFAULT, ge=1,
        description="Layers (the worst ones by the rule's statistic) with frame values in "
        "an event; Alert.layers always names all.",
    ))
    model = create_model(
        "AlertRulesConfig", __base__=AlertRulesBase, __module__=__name__,
        __doc__="Every rule's configuration: one field per registered rule (see "
        "consumer.alerts.rules), then max_layer_values.",
        **fields,
    )
    model.rule_types = rules
    return model


def rules_config_model(rules: Sequence[type[Rule]] | None = None) -> type[AlertRulesBase]:
    """The rules-file model of ``rules`` (default: the registry,
    ``consumer.alerts.rules.RULES``), built once per distinct tuple of rules.

    Fields, in order: one per rule, named after it, of its ``config_model`` type with its
    defaults and its ``description``; then ``max_layer_values`` (>= 1, default 16). Unknown
    keys are refused (``extra="forbid"``) and instances are frozen.

    Raises:
        TypeError, ValueError: the rules cannot be registered together
            (:func:`consumer.alerts.rules.check_rules`).
    """
    return _build_model(tuple(registered_rules() if rules is None else rules))


AlertRulesConfig = rules_config_model()
"""The rules-file model of the registry at import time; ``AlertRulesConfig()`` is the
default configuration (every rule's own defaults)."""


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


def _allowed_keys(loc: tuple[str, ...], root: type[BaseModel]) -> list[str]:
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        model = field.annotation
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _reason(err: dict[str, Any], loc: tuple[str, ...], root: type[BaseModel]) -> str:
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1], root)
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
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
    model: type[AlertRulesBase] | None = None,
) -> AlertRulesBase:
    """Build the alert rules from an optional rule file and ``--alert-set`` overrides.

    Args:
        path: a ``.toml``, ``.yaml`` or ``.yml`` rule file (module doc), or None for the
            defaults.
        overrides: ``RULE.FIELD=VALUE`` strings applied over the file, in order.
        model: the rules-file model (:func:`rules_config_model`); default: the
            registry's as it is now.

    Returns:
        The validated configuration (an instance of ``model``; it knows its rules:
        ``type(config).rule_types``).

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
    root = rules_config_model() if model is None else model
    try:
        return root.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = tuple(str(p) for p in err["loc"])
            flag = next((set_by[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in set_by),
                        None)
            where = ".".join(loc)
            if flag is not None:
                problems.append(ConfigProblem(flag, None, where, _reason(err, loc, root)))
            else:
                problems.append(ConfigProblem(source, _line_of(lines, loc), where,
                                              _reason(err, loc, root)))
        problems.sort(key=lambda p: (p.source, p.line or 0))
        raise AlertConfigError(problems) from None


def dump_alert_rules(rules: AlertRulesBase) -> str:
    """The configuration as YAML text that :func:`load_alert_rules` reads back (``.yaml``)."""
    import yaml

    return yaml.safe_dump(rules.model_dump(mode="json"), sort_keys=False)
