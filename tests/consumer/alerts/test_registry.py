"""The rule registry drives everything: a rule defined in one module (here: in this file)
and added to ``consumer.alerts.rules.RULES`` gets its rule-file table, its ``--alert-set``
keys, its place in ``gradstream alert-rules``, its evaluation by the engine, its title,
and alert records carrying its name, with no other change."""

from __future__ import annotations

import re
import types
from typing import ClassVar

import pytest
from pydantic import Field
from typer.testing import CliRunner

import consumer.alerts.rules as registry
from consumer.alerts.config import (
    AlertConfigError,
    AlertRulesConfig,
    dump_alert_rules,
    load_alert_rules,
    rules_config_model,
)
from consumer.alerts.engine import AlertEngine
from consumer.alerts.incident import ActiveIncident
from consumer.alerts.rules import (
    RULES,
    Finding,
    FrameContext,
    Rule,
    RuleConfig,
    RunContext,
    check_rules,
    find_rule,
    rule_names,
    rule_title,
)
from schemas.alert import (
    Alert,
    AlertRule,
    AlertSeverity,
    decode_alert_record,
    encode_alert_record,
    incident_id,
)
from schemas.wire import StepSummary, WireError
from tests.consumer.alerts.helpers import FIRING, RESOLVED, Run, states

# -- a tiny rule module -----------------------------------------------------------------


class StepGapRuleConfig(RuleConfig):
    """A frame whose step is more than ``max_gap`` steps after the newest step before it
    (steps skipped by the producers)."""

    severity: AlertSeverity = AlertSeverity.INFO
    max_gap: int = Field(default=1, ge=1)


class StepGapRule(Rule[StepGapRuleConfig]):
    """Skipped steps: per-run state (the newest step), a shard hook (the ranks whose
    shards of the step arrived), a config field."""

    name: ClassVar[str] = "step_gap"
    title: ClassVar[str] = "skipped steps"
    description: ClassVar[str] = "A frame more than `max_gap` steps after the previous one."
    config_model: ClassVar[type[RuleConfig]] = StepGapRuleConfig

    def __init__(self, run: RunContext, config: StepGapRuleConfig) -> None:
        super().__init__(run, config)
        self.newest: int | None = None
        self.shard_ranks: dict[int, set[int]] = {}

    def note_shard(self, shard: StepSummary) -> None:
        """Remember which ranks sent a shard of each step."""
        self.shard_ranks.setdefault(shard.step, set()).add(shard.rank)

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Bad when the step jumps more than ``max_gap`` past the newest one."""
        step = ctx.frame.step
        ranks = sorted(self.shard_ranks.pop(step, set()))
        previous, self.newest = self.newest, step if self.newest is None else max(
            self.newest, step)
        if previous is None or step - previous <= self.config.max_gap:
            return Finding(False)
        return Finding(True, [], ranks, {"gap": step - previous},
                       f"step {step} follows step {previous}")


RULES_FILE = """\
[exploding]
consecutive = 4

[step_gap]
max_gap = 2
"""


@pytest.fixture
def with_step_gap(monkeypatch):
    """The registry with StepGapRule added: the one line a new rule needs."""
    monkeypatch.setattr(registry, "RULES", (*registry.RULES, StepGapRule))


# -- tests -------------------------------------------------------------------------------


def test_registry_holds_every_built_in_rule_once():
    built_in = [r.value for r in AlertRule]
    # every built-in rule is registered, in the rule-file order `gradstream alert-rules`
    # has always printed; a new rule needs no AlertRule member
    assert [n for n in rule_names() if n in built_in] == built_in
    assert [str(r.name) for r in AlertRulesConfig.rule_types] == rule_names()
    assert all(isinstance(r.name, AlertRule) for r in RULES)
    check_rules(RULES)
    assert rule_title(AlertRule.NONFINITE) == "non-finite gradients"
    assert rule_title("from_a_newer_worker") == "from_a_newer_worker"
    assert find_rule("nonfinite") is find_rule(AlertRule.NONFINITE) is not None
    assert find_rule("nope") is None


def test_a_registered_rule_gets_a_rule_file_table_flags_and_a_dump(with_step_gap, tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(RULES_FILE)
    rules = load_alert_rules(path, ["step_gap.resolve_after=2"])
    assert StepGapRule in type(rules).rule_types
    cfg = rules.rule("step_gap")
    assert isinstance(cfg, StepGapRuleConfig)
    assert (cfg.max_gap, cfg.resolve_after, cfg.severity) == (2, 2, AlertSeverity.INFO)
    assert rules.exploding.consecutive == 4  # the built-in rules are still there
    # its table comes after the built-in ones, before max_layer_values
    dumped = dump_alert_rules(rules)
    assert "step_gap:\n  enabled: true\n  severity: info\n  resolve_after: 2\n  max_gap: 2\n" \
        "max_layer_values: 16\n" in dumped
    again = tmp_path / "dump.yaml"
    again.write_text(dumped)
    assert load_alert_rules(again) == rules
    # mistakes in its table are reported like any other, with the file line
    path.write_text("[step_gap]\nmax_gap = 0\nmax_gaps = 3\n")
    with pytest.raises(AlertConfigError) as info:
        load_alert_rules(path)
    assert [(p.line, p.where) for p in info.value.problems] == [
        (2, "step_gap.max_gap"), (3, "step_gap.max_gaps")]
    assert "expected one of: enabled, severity, resolve_after, max_gap" in str(info.value)
    # the field's description is the rule's
    field = type(rules).model_fields["step_gap"]
    assert field.description == StepGapRule.description


def test_alert_rules_command_prints_the_registered_rule(with_step_gap, tmp_path):
    from deploy.cli import app

    path = tmp_path / "rules.toml"
    path.write_text(RULES_FILE)
    result = CliRunner().invoke(app, ["alert-rules", str(path), "--alert-set",
                                      "step_gap.severity=critical"])
    assert result.exit_code == 0, result.output
    assert "step_gap:\n  enabled: true\n  severity: critical\n" in result.output
    assert "max_gap: 2" in result.output


def test_the_engine_evaluates_a_registered_rule(with_step_gap, tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("step_gap:\n  max_gap: 2\n  resolve_after: 2\n")
    overrides = [f"{name}.enabled=false" for name in rule_names() if name != "step_gap"]
    engine = AlertEngine(load_alert_rules(path, overrides))
    run = Run(engine, world=3)
    for s in (0, 1, 3):  # gaps of 1 and 2: fine
        assert run.step(s) == []
    fired = run.step(6, ranks=[0, 2])  # 3 steps after step 3
    assert states(fired) == [(FIRING, 6)]
    alert = fired[0]
    assert alert.rule == "step_gap" and not isinstance(alert.rule, AlertRule)
    assert alert.severity is AlertSeverity.INFO
    assert alert.ranks == [0, 2]  # from its shard hook
    assert alert.values == {"gap": 3}
    assert alert.message == "run run-1: step 6 follows step 3"
    assert alert.incident_id == incident_id("run-1", "step_gap", 6)
    run.step(7)
    resolved = run.step(8)
    assert states(resolved) == [(RESOLVED, 8)]
    assert resolved[0].message.startswith("run run-1: skipped steps resolved, clear for 2 ")
    assert engine.take_statuses()[-1].active_rules == []
    # its records travel like any other: the name stays a plain string
    again = decode_alert_record(encode_alert_record(alert))
    assert again == alert and again.rule == "step_gap"


def test_a_model_can_be_built_from_an_explicit_rule_list():
    model = rules_config_model((*RULES, StepGapRule))
    assert model is rules_config_model((*RULES, StepGapRule))  # built once
    assert list(model.model_fields)[-2:] == ["step_gap", "max_layer_values"]
    assert "step_gap" not in AlertRulesConfig.model_fields  # the registry is untouched
    rules = load_alert_rules(None, ["step_gap.max_gap=5"], model=model)
    assert rules.rule("step_gap").max_gap == 5
    with pytest.raises(AlertConfigError, match="unknown rule or setting 'step_gap'"):
        load_alert_rules(None, ["step_gap.max_gap=5"])
    engine = AlertEngine(rules)
    iid = incident_id("run-1", "step_gap", 3)
    engine.restore([ActiveIncident("run-1", "step_gap", iid, 3, [], [1])])
    assert [inc.incident_id for inc in engine.active("run-1")] == [iid]


def test_disabled_rules_keep_no_state():
    engine = AlertEngine(load_alert_rules(None, ["grad_norm_spike.enabled=false"]))
    run = Run(engine)
    run.step(0)
    state = engine._runs["run-1"]
    assert [str(r.name) for r in state.rules] == [n for n in rule_names()
                                                  if n != "grad_norm_spike"]
    assert [str(r.name) for r in state.shard_rules] == ["nonfinite"]


def _rule(name: str) -> type[Rule]:
    return type("Named", (StepGapRule,), {"name": name})


@pytest.mark.parametrize(("rules", "error", "match"), [
    ((StepGapRule, StepGapRule), ValueError, "two registered rules are named 'step_gap'"),
    ((_rule("max_layer_values"),), ValueError, "reserved"),
    ((_rule("Step Gap"),), ValueError, "invalid rule name"),
    ((int,), TypeError, "not a Rule subclass"),
    ((type("Bare", (Rule,), {"name": "bare"}),), TypeError, "lacks title, description"),
])
def test_registering_an_invalid_rule_fails(rules, error, match):
    with pytest.raises(error, match=match):
        check_rules(rules)
    with pytest.raises(error, match=match):
        rules_config_model(rules)


def test_rule_names_on_the_wire():
    (alert,) = [e for e in _one_alert() if e.rule is AlertRule.NONFINITE]
    raw = encode_alert_record(alert)
    assert b'"rule":"nonfinite"' in raw
    assert decode_alert_record(raw).rule is AlertRule.NONFINITE
    newer = decode_alert_record(raw.replace(b'"rule":"nonfinite"', b'"rule":"loss_spike"'))
    assert isinstance(newer, Alert) and newer.rule == "loss_spike"
    with pytest.raises(WireError, match=r"rule: .*invalid rule name"):
        decode_alert_record(raw.replace(b'"rule":"nonfinite"', b'"rule":"Loss Spike"'))


def _one_alert() -> list[Alert]:
    from tests.consumer.alerts.helpers import only

    run = Run(AlertEngine(only("nonfinite")))
    return run.step(0, nan={0: ["head"]})


def test_the_how_to_in_the_registry_docstring_works(monkeypatch):
    """The example module in ``consumer.alerts.rules``'s docstring, registered with one
    line, fires on a frame above its ceiling."""
    doc = registry.__doc__ or ""
    code = re.search(r"``norm_ceiling.py``::\n\n(.*?)\nand the line", doc, re.S)
    assert code is not None
    module = types.ModuleType("norm_ceiling_example")
    exec(compile(_dedent(code.group(1)), "norm_ceiling.py", "exec"), module.__dict__)
    rule = module.NormCeilingRule
    monkeypatch.setattr(registry, "RULES", (*registry.RULES, rule))
    overrides = [f"{n}.enabled=false" for n in rule_names() if n != "norm_ceiling"]
    run = Run(AlertEngine(load_alert_rules(None, [*overrides, "norm_ceiling.max_norm=1"])))
    assert run.step(0) == []
    (fired,) = run.step(1, scale={"ffn.out": 1e3})
    assert fired.rule == "norm_ceiling" and fired.layers == ["ffn.out"]
    assert fired.values["max_norm"] == 1


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)
