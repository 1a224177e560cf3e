"""The ``rules`` option shared by the flow, enhanced, explosion and weights analyses.

gradstream's analyses port the reference (trustformers-debug, modules
``gradient_debugger::visualization``, ``gradient_debugger::enhanced_analysis`` and
``utilities::weight_analysis``). Where gradstream classifies differently (a statistical
test instead of a fixed cut-off in norm units, a rule computed from data instead of a
placeholder), the analysis's ``rules`` option chooses:

- ``"gradstream"`` (the default): gradstream's rules, documented in each report model;
- ``"reference"``: the reference's own rules and cut-offs, reproduced as written, so that
  a verdict can be compared with the reference's.

Every difference, what ``rules="reference"`` restores and why gradstream's rule is the
default is listed in ``analysis/REFERENCE_DIFFERENCES.md``.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["DEFAULT_RULES", "Rules"]

Rules = Literal["gradstream", "reference"]
"""Which classification rules an analysis applies (see the module docstring)."""

DEFAULT_RULES: Rules = "gradstream"
"""gradstream's rules (statistical tests and scale-free measures, see
``analysis/REFERENCE_DIFFERENCES.md`` for the reason of each)."""
