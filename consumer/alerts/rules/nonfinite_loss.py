"""``nonfinite_loss``: the step's training loss, or some rank's own loss, is NaN or +-Inf.

The step's loss is ``GradientFrame.scalars["loss"]``, the mean of the losses of the ranks
merged into the frame (``schemas.scalars.RANK_AGGREGATES``: a NaN rank makes it NaN); the
ranks are those whose own ``loss`` in ``GradientFrame.rank_scalars`` is non-finite. A
frame whose step loss is non-finite but that carries no per-rank losses names no rank
("ranks unknown"). A frame without a loss (no scalars: the producers do not send them, or
not at this step) cannot be judged: ``Finding(None)``, one dictionary lookup. Per frame:
O(ranks) NumPy.

Values: ``loss`` (the step's loss, None when non-finite), ``loss_kind`` (``"nan"``,
``"+inf"`` or ``"-inf"`` for the step's loss, None when finite), ``nonfinite_loss_by_rank``
(rank -> ``"nan"`` / ``"+inf"`` / ``"-inf"``), ``ranks_reporting`` (ranks that sent a loss
in this frame), ``world_size``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from consumer.alerts.rules.base import CriticalRuleConfig, Finding, FrameContext, Rule
from consumer.alerts.rules.shared import json_number
from schemas.alert import AlertRule, RuleName
from schemas.scalars import LOSS


def nonfinite_kind(value: float) -> str | None:
    """``"nan"``, ``"+inf"`` or ``"-inf"`` for a non-finite float, None for a finite one
    (JSON-safe names of IEEE 754 non-finite values)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return None


_SHOWN = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}
"""How a message writes each non-finite kind."""


class NonfiniteLossRuleConfig(CriticalRuleConfig):
    """A NaN/Inf training loss (the step's or a rank's): Critical by default, like the
    ``nonfinite`` gradient rule, since an optimiser step taken on a NaN loss corrupts the
    weights (unless an AMP loss scaler skips it)."""


class NonfiniteLossRule(Rule[NonfiniteLossRuleConfig]):
    """NaN/Inf training loss, with the ranks whose own loss is non-finite (module doc)."""

    name: ClassVar[RuleName] = AlertRule.NONFINITE_LOSS
    title: ClassVar[str] = "non-finite loss"
    description: ClassVar[str] = (
        "The step's training loss, or some rank's own loss, is NaN or +-Inf."
    )

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Bad when the step's loss or any rank's loss is non-finite; None without a loss."""
        f = ctx.frame
        loss = f.scalars.get(LOSS)
        if loss is None:
            return Finding(None)
        ranks_arr, values = (f.rank_scalars.values_of(LOSS) if f.rank_scalars is not None
                             else (np.empty(0, np.int64), np.empty(0, np.float64)))
        bad = ~np.isfinite(values)
        step_kind = nonfinite_kind(loss)
        if step_kind is None and not bad.any():
            return Finding(False)
        ranks = [int(r) for r in ranks_arr[bad]]
        by_rank = {str(r): nonfinite_kind(float(v)) for r, v in
                   zip(ranks, values[bad].tolist(), strict=True)}
        step_loss = f"step loss {_SHOWN[step_kind] if step_kind else f'{loss:.4g}'}"
        if ranks:
            kinds = ", ".join(sorted({_SHOWN[k] for k in by_rank.values() if k is not None}))
            what = (f"{kinds} on rank(s) {ranks} of {len(ranks_arr)} reporting "
                    f"({step_loss})")
        elif len(ranks_arr):
            what = f"{step_loss}; the {len(ranks_arr)} reporting ranks' own losses are finite"
        else:
            what = f"{step_loss} (ranks unknown: no per-rank losses in the frame)"
        return Finding(
            True, [], ranks,
            {
                "loss": json_number(loss),
                "loss_kind": step_kind,
                "nonfinite_loss_by_rank": by_rank,
                "ranks_reporting": len(ranks_arr),
                "world_size": f.world_size,
            },
            f"non-finite training loss at step {f.step}: {what}",
        )
