"""Rule files (TOML, YAML) and --alert-set overrides: valid ones load, mistakes are
rejected with the file line (or the flag) and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.alerts.config import (
    AlertConfigError,
    AlertRulesConfig,
    dump_alert_rules,
    load_alert_rules,
    toml_key_lines,
)
from schemas.alert import AlertSeverity
from schemas.wire import GradientHealth

TOML = """\
# gradstream alert rules
max_layer_values = 8

[run_health]
level = "ProblemsDetected"

[exploding]
consecutive = 5
severity = "critical"

[grad_norm_spike]
enabled = false

[stalled]
after_s = 120.5
"""

YAML = """\
# the same rules in YAML
max_layer_values: 8
run_health:
  level: ProblemsDetected
exploding:
  consecutive: 5
  severity: critical
grad_norm_spike:
  enabled: false
stalled:
  after_s: 120.5
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    rules = load_alert_rules()
    assert rules == AlertRulesConfig()
    assert rules.run_health.level is GradientHealth.CRITICAL
    assert rules.exploding.consecutive == 3 and rules.vanishing.consecutive == 10
    assert rules.nonfinite.severity is AlertSeverity.CRITICAL


def test_toml_and_yaml_give_the_same_rules(tmp_path):
    a = load_alert_rules(write(tmp_path, "r.toml", TOML))
    b = load_alert_rules(write(tmp_path, "r.yaml", YAML))
    assert a == b
    assert a.max_layer_values == 8
    assert a.run_health.level is GradientHealth.PROBLEMS_DETECTED
    assert a.exploding.consecutive == 5 and a.exploding.severity is AlertSeverity.CRITICAL
    assert a.vanishing.consecutive == 10  # untouched rules keep their own defaults
    assert not a.grad_norm_spike.enabled and a.stalled.after_s == 120.5


def test_overrides_apply_over_the_file(tmp_path):
    rules = load_alert_rules(write(tmp_path, "r.toml", TOML), [
        "exploding.consecutive=7", "nonfinite.severity=warning", "grad_norm_spike.enabled=true",
        "run_health.level=Critical",
    ])
    assert rules.exploding.consecutive == 7 and rules.exploding.severity is AlertSeverity.CRITICAL
    assert rules.nonfinite.severity is AlertSeverity.WARNING
    assert rules.grad_norm_spike.enabled and rules.run_health.level is GradientHealth.CRITICAL


def test_dump_reads_back(tmp_path):
    rules = load_alert_rules(None, ["stalled.after_s=9", "vanishing.enabled=false"])
    again = load_alert_rules(write(tmp_path, "dump.yaml", dump_alert_rules(rules)))
    assert again == rules


BAD_TOML = """\
[exploding]
consecutive = 0
severity = "urgent"

[grad_norm_spike]
window = 10
min_samples = 20

[explodng]
consecutive = 3

[stalled]
after_s = -3
nonsense = true
"""


def test_every_toml_mistake_is_reported_with_its_line_and_reason(tmp_path):
    path = write(tmp_path, "bad.toml", BAD_TOML)
    with pytest.raises(AlertConfigError) as info:
        load_alert_rules(path)
    got = [(p.line, p.where) for p in info.value.problems]
    assert got == [
        (2, "exploding.consecutive"),
        (3, "exploding.severity"),
        (5, "grad_norm_spike"),
        (9, "explodng"),
        (13, "stalled.after_s"),
        (14, "stalled.nonsense"),
    ]
    text = str(info.value).splitlines()
    assert text[0] == f"{path}:2: exploding.consecutive: Input should be greater than or " \
                      "equal to 1 (got 0)"
    assert "'info', 'warning' or 'critical'" in text[1] and "'urgent'" in text[1]
    assert "min_samples (20) must not exceed window (10)" in text[2]
    assert "unknown rule or setting 'explodng'" in text[3] and "exploding" in text[3]
    assert "unknown key 'nonsense'" in text[5] and "after_s" in text[5]


def test_yaml_mistakes_have_lines_too(tmp_path):
    path = write(tmp_path, "bad.yaml", "vanishing:\n  consecutive: 2\nstalled:\n"
                                       "  min_after_s: soon\n")
    with pytest.raises(AlertConfigError) as info:
        load_alert_rules(path)
    (problem,) = info.value.problems
    assert (problem.line, problem.where) == (4, "stalled.min_after_s")
    assert "valid number" in problem.reason


@pytest.mark.parametrize(("name", "text", "line", "reason"), [
    ("syntax.toml", "[exploding]\nconsecutive = = 3\n", 2, "invalid TOML"),
    ("dup.toml", "[exploding]\nconsecutive = 3\nconsecutive = 4\n", 3, "invalid TOML"),
    ("syntax.yaml", "exploding:\n  consecutive: [1\n", 3, "invalid YAML"),
    ("dup.yaml", "exploding:\n  consecutive: 2\n  consecutive: 3\n", 3, "duplicate key"),
    ("list.yaml", "- exploding\n", 1, "must be a mapping"),
    ("table.toml", "exploding = 3\n", 1, "valid dictionary"),
])
def test_syntax_errors_name_the_line(tmp_path, name, text, line, reason):
    with pytest.raises(AlertConfigError) as info:
        load_alert_rules(write(tmp_path, name, text))
    problem = info.value.problems[0]
    assert problem.line == line and reason in problem.reason, str(info.value)


def test_unreadable_or_unknown_files(tmp_path):
    with pytest.raises(AlertConfigError, match="cannot read the rule file"):
        load_alert_rules(tmp_path / "missing.toml")
    with pytest.raises(AlertConfigError, match=r"use \.toml, \.yaml or \.yml"):
        load_alert_rules(write(tmp_path, "rules.json", "{}"))


def test_bad_overrides_name_the_flag():
    with pytest.raises(AlertConfigError) as info:
        load_alert_rules(None, ["exploding.consecutive=abc", "stalled.after_s=5", "foo"])
    assert str(info.value) == "--alert-set foo: expected RULE.FIELD=VALUE, e.g. " \
                              "exploding.consecutive=5"
    with pytest.raises(AlertConfigError) as info:
        load_alert_rules(None, ["exploding.consecutive=abc"])
    (problem,) = info.value.problems
    assert problem.source == "--alert-set exploding.consecutive=abc" and problem.line is None
    assert problem.where == "exploding.consecutive" and "valid integer" in problem.reason


def test_empty_yaml_is_the_defaults(tmp_path):
    assert load_alert_rules(write(tmp_path, "empty.yml", "# nothing\n")) == AlertRulesConfig()


_KEYS = {
    "exploding": ["consecutive", "resolve_after", "enabled"],
    "stalled": ["after_s", "min_after_s"],
    "grad_norm_spike": ["window", "z_threshold"],
}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_toml_key_lines_find_every_key(data):
    """Generated rule files with comments and blank lines: each key maps to its line."""
    lines: list[str] = []
    expected: dict[tuple[str, ...], int] = {}
    for table in data.draw(st.lists(st.sampled_from(sorted(_KEYS)), unique=True)):
        lines += data.draw(st.lists(st.sampled_from(["", "# note", "   "]), max_size=2))
        lines.append(f"[{table}]  # rule")
        expected[(table,)] = len(lines)
        for key in data.draw(st.lists(st.sampled_from(_KEYS[table]), unique=True)):
            lines.append(f"{key} = 3")
            expected[(table, key)] = len(lines)
            lines += data.draw(st.lists(st.sampled_from(["", "# x = 1"]), max_size=1))
    found = toml_key_lines("\n".join(lines))
    assert found == expected


def test_yaml_dump_is_valid_yaml():
    assert isinstance(yaml.safe_load(dump_alert_rules(AlertRulesConfig())), dict)


def test_consume_refuses_a_bad_rule_file_before_starting(tmp_path):
    from typer.testing import CliRunner

    from deploy.cli import app

    bad = write(tmp_path, "rules.toml", "[stalled]\nafter_s = 0\n")
    result = CliRunner().invoke(app, ["consume", "--alert-rules", str(bad),
                                      "--bootstrap-servers", "127.0.0.1:9"])
    assert result.exit_code == 2
    assert f"{bad}:2: stalled.after_s: Input should be greater than 0" in result.output
