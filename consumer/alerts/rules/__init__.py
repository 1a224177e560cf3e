'''The alert rules and their registry, :data:`RULES`.

A rule is one module of this package holding everything about it: its settings (a
:class:`~consumer.alerts.rules.base.RuleConfig` subclass), its per-run state and its
evaluation (a :class:`~consumer.alerts.rules.base.Rule` subclass), its name, title and
description. :data:`RULES` lists the rules a worker evaluates, and everything else is
derived from it: the rules-file model (``consumer.alerts.config``: one table per rule,
``--alert-set RULE.FIELD=VALUE``, ``gradstream alert-rules``), the engine's evaluation
(``consumer.alerts.engine``), the titles in messages and views (:func:`rule_title`), the
names ``gradstream alerts --rule`` accepts and the incidents a restarted worker restores.

Adding a rule: one module plus one line. The module, e.g. ``norm_ceiling.py``::

    """``norm_ceiling``: some layer's gradient norm above a fixed ``max_norm``.

    Values: ``layers`` (largest norm first), ``max_norm``.
    """

    from typing import ClassVar

    import numpy as np
    from pydantic import Field

    from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig
    from consumer.alerts.rules.shared import preview
    from schemas.alert import RuleName


    class NormCeilingRuleConfig(RuleConfig):
        """A layer's grad_norm above ``max_norm`` (same units as the gradient)."""

        max_norm: float = Field(default=1e4, gt=0, allow_inf_nan=False)


    class NormCeilingRule(Rule[NormCeilingRuleConfig]):
        """Layers whose gradient norm exceeds ``max_norm`` (module doc)."""

        name: ClassVar[RuleName] = "norm_ceiling"
        title: ClassVar[str] = "gradient norm ceiling"
        description: ClassVar[str] = "A layer's gradient norm above `max_norm`."

        def evaluate(self, ctx: FrameContext) -> Finding:
            """Bad when any layer's grad_norm exceeds max_norm (NaN norms do not)."""
            f = ctx.frame
            rows = np.flatnonzero(f.grad_norm > self.config.max_norm)
            if rows.size == 0:
                return Finding(False)
            layers = f.layer_index[rows].astype(np.int64)
            names = [str(n) for n in self.run.names[layers]]
            return Finding(
                True, names, [],
                {"layers": ctx.view.layer_values(layers, f.grad_norm[rows]),
                 "max_norm": self.config.max_norm},
                f"{len(names)} layer(s) above gradient norm {self.config.max_norm:g} at "
                f"step {f.step}: {preview(names)}",
            )

and the line ``NormCeilingRule,`` in :data:`RULES` (with its import). Per-run state goes in
``__init__`` (``super().__init__(run, config)`` first; ``run`` is the run's
:class:`~consumer.alerts.rules.base.RunContext`); a rule that also judges idle runs
implements ``check_idle``, one that needs the raw shards ``note_shard``. Its table in a
rule file is ``[norm_ceiling]``, its flags ``--alert-set norm_ceiling.max_norm=100``, and
its events carry ``rule="norm_ceiling"`` (``schemas.alert.RuleName``: no schema change).
Events and per-frame costs: keep ``evaluate`` vectorised over layers (it runs on every
frame of every run).

The order of :data:`RULES` is the order of the rule-file tables (``gradstream
alert-rules``) and the order in which a frame's rules are evaluated (and their events
emitted).
'''

from __future__ import annotations

from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.exploding import ExplodingRule
from consumer.alerts.rules.grad_norm_spike import GradNormSpikeRule
from consumer.alerts.rules.loss_scale_collapse import LossScaleCollapseRule
from consumer.alerts.rules.loss_spike import LossSpikeRule
from consumer.alerts.rules.missing_ranks import MissingRanksRule
from consumer.alerts.rules.nonfinite import NonfiniteRule
from consumer.alerts.rules.nonfinite_loss import NonfiniteLossRule
from consumer.alerts.rules.replica_divergence import ReplicaDivergenceRule
from consumer.alerts.rules.run_health import RunHealthRule
from consumer.alerts.rules.shard_layout import ShardLayoutRule
from consumer.alerts.rules.shared import FrameView, LocalOrigin, json_number, preview
from consumer.alerts.rules.stalled import StalledRule
from consumer.alerts.rules.straggler import StragglerRule
from consumer.alerts.rules.vanishing import VanishingRule
from schemas.alert import RuleName, rule_name

RULES: tuple[type[Rule], ...] = (
    RunHealthRule,
    NonfiniteRule,
    NonfiniteLossRule,
    ExplodingRule,
    VanishingRule,
    GradNormSpikeRule,
    LossSpikeRule,
    LossScaleCollapseRule,
    StalledRule,
    MissingRanksRule,
    StragglerRule,
    ReplicaDivergenceRule,
    ShardLayoutRule,
)
"""The registry: every rule a worker evaluates, one line each (module doc)."""

RESERVED_NAMES = frozenset({"max_layer_values"})
"""Top-level rule-file settings that no rule may be named after."""


def registered_rules() -> tuple[type[Rule], ...]:
    """The rules of :data:`RULES` as it is now (read at call time, so a test may replace
    the registry with ``monkeypatch.setattr``)."""
    return RULES


def rule_names() -> list[str]:
    """Names of the registered rules, in registry order."""
    return [str(r.name) for r in registered_rules()]


def find_rule(name: RuleName | str) -> type[Rule] | None:
    """The registered rule called ``name``, or None."""
    key = str(name)
    return next((r for r in registered_rules() if str(r.name) == key), None)


def rule_title(name: RuleName | str) -> str:
    """Short human name of a rule ("non-finite gradients"); the name itself for a rule
    this build does not know (records from a newer worker)."""
    rule = find_rule(name)
    return rule.title if rule is not None else str(name)


def check_rules(rules: tuple[type[Rule], ...] | list[type[Rule]]) -> None:
    """Check that ``rules`` can be registered together.

    Raises:
        TypeError: an entry is not a :class:`Rule` subclass, or lacks ``name``, ``title``,
            ``description`` or ``config_model`` (a :class:`RuleConfig` subclass).
        ValueError: a name is invalid (``schemas.alert.RULE_NAME_PATTERN``), reserved
            (:data:`RESERVED_NAMES`) or used twice.
    """
    seen: set[str] = set()
    for rule in rules:
        if not (isinstance(rule, type) and issubclass(rule, Rule)):
            raise TypeError(f"{rule!r} is not a Rule subclass")
        missing = [a for a in ("name", "title", "description", "config_model")
                   if not hasattr(rule, a)]
        if missing:
            raise TypeError(f"rule {rule.__name__} lacks {', '.join(missing)}")
        if not (isinstance(rule.config_model, type)
                and issubclass(rule.config_model, RuleConfig)):
            raise TypeError(f"{rule.__name__}.config_model must subclass RuleConfig")
        name = str(rule_name(rule.name))
        if name in RESERVED_NAMES:
            raise ValueError(f"rule {rule.__name__}: the name {name!r} is reserved")
        if name in seen:
            raise ValueError(f"two registered rules are named {name!r}")
        seen.add(name)


__all__ = [
    "RESERVED_NAMES",
    "RULES",
    "Finding",
    "FrameContext",
    "FrameView",
    "LocalOrigin",
    "Rule",
    "RuleConfig",
    "RunContext",
    "check_rules",
    "find_rule",
    "json_number",
    "preview",
    "registered_rules",
    "rule_names",
    "rule_title",
]
