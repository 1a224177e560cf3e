"""``straggler``: a rank whose compute time stays above ``factor`` times the median of the
other ranks' for ``consecutive`` frames in a row.

The times are the per-rank ``compute_time_s`` of ``GradientFrame.rank_scalars``
(``schemas.scalars.COMPUTE_TIME``): seconds from the rank's previous optimiser step to the
moment its own backward pass produced the last of its local gradients, before the final
wait for the other ranks. The step time (``step_time_s``) is useless here: the gradient
all-reduce of data-parallel training (DDP, FSDP) is a barrier, so every rank's step lasts
as long as the slowest rank's, and a straggler makes every rank's step time long (the
others wait in the collective); only the time before that wait tells which rank is slow.

Per frame, for each rank ``r`` with a finite, non-negative compute time ``t_r`` (when at
least ``min_ranks`` ranks have one): ``slow_r = t_r > factor * median({t_q : q != r})``
and ``t_r - median({t_q : q != r}) > min_excess_s`` (:func:`median_of_others`, over the
ranks of the frame): the ratio alone would call a 2 ms step slow next to 1 ms ones. A
rank's count of consecutive slow frames goes up by one when it is slow and back to 0 when
it is not. A rank without a
usable compute time in the frame (absent from ``rank_scalars``, as in a partial frame, or
NaN) keeps its count unchanged: its absence says nothing about its speed (a rank too slow
to make the worker's shard timeout has not recovered; absent ranks are the
``missing_ranks`` rule's). The condition holds while some rank *of the frame* has a count
of at least ``consecutive``; when none of the frame's ranks does but an absent rank still
has such a count, the frame cannot be judged (``Finding(None)``: the straggler has not
been seen to recover). A frame with fewer than ``min_ranks`` usable times (no scalars at
all, or a single rank) changes nothing and cannot be judged. Per frame: O(k log k) NumPy
over the frame's k ranks, no per-rank Python loop; state: int64[world_size].

Values: ``stragglers`` (rank -> ``compute_time_s``, ``median_of_others_s``, ``ratio``,
``consecutive``; at most ``max_layer_values`` ranks, the slowest by ratio; ``ranks`` names
all), ``factor``, ``consecutive`` (the configured count), ``ranks_reporting``,
``median_compute_time_s`` (over the frame's ranks).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field

from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.shared import json_number
from schemas.alert import AlertRule, RuleName
from schemas.scalars import COMPUTE_TIME


def median_of_others(values: np.ndarray) -> np.ndarray:
    """For each element, the median of all the other elements (``np.median`` of the
    array without it), in O(k log k) without a k x k matrix.

    With ``s`` the sorted values and element ``i`` at sorted position ``p``, the others
    are ``r[j] = s[j]`` for ``j < p`` and ``s[j + 1]`` otherwise (``m = k - 1`` values);
    their median is ``(r[(m - 1) // 2] + r[m // 2]) / 2``.

    Args:
        values: float64[k], finite, k >= 2.

    Returns:
        float64[k], aligned with ``values``.

    Raises:
        ValueError: fewer than two values.
    """
    k = values.size
    if k < 2:
        raise ValueError(f"the median of the others needs at least 2 values, got {k}")
    order = np.argsort(values, kind="stable")
    s = values[order]
    p = np.arange(k)
    m = k - 1
    lo, hi = (m - 1) // 2, m // 2
    r_lo = np.where(lo < p, s[lo], s[min(lo + 1, k - 1)])
    r_hi = np.where(hi < p, s[hi], s[min(hi + 1, k - 1)])
    out = np.empty(k)
    out[order] = (r_lo + r_hi) / 2
    return out


class StragglerRuleConfig(RuleConfig):
    """A rank's compute time above ``factor`` x the median of the other ranks' for
    ``consecutive`` frames in a row.

    Attributes:
        factor: how many times the others' median a slow rank's compute time exceeds.
            1.5: NVIDIA Resiliency Extension's straggler detection, as NeMo and Megatron
            configure it by default (``gpu_relative_perf_threshold = 0.7``), flags a rank
            whose relative performance score (the fastest rank's time over its own) is
            below 0.7, i.e. about 1.43x slower than the fastest rank; this rule
            compares with the median of the others, which is at least the fastest, so a
            similar factor rounded up to half as slow again keeps the same order of
            sensitivity while tolerating the per-rank spread of the work itself
            (micro-batches of different sequence lengths).
        consecutive: slow frames in a row that make a rank a straggler. 10: a single
            slow step is usually a one-off (a garbage-collection pause, a checkpoint or
            evaluation on one rank, a slow batch); a persistent straggler (a throttled
            GPU, a degraded link, a noisy neighbour) stays slow for minutes to hours.
        min_ranks: usable compute times a frame needs to be judged (>= 2: one rank has no
            others to compare with).
        min_excess_s: seconds a slow rank's compute time must also exceed the others'
            median by. 0.006: the default targeted latency of Linux's CFS scheduler
            (``kernel.sched_latency_ns`` = 6 ms): a rank preempted once by another process
            can lose that much in one step without being a straggler, which matters for
            steps of a few milliseconds, where 1.5x is that much.
    """

    factor: float = Field(default=1.5, gt=1, allow_inf_nan=False)
    min_excess_s: float = Field(default=0.006, ge=0, allow_inf_nan=False)
    consecutive: int = Field(default=10, ge=1)
    min_ranks: int = Field(default=2, ge=2)


class StragglerRule(Rule[StragglerRuleConfig]):
    """Ranks persistently slower than the others (module doc).

    Attributes:
        slow_streak: int64[world_size], consecutive slow frames per rank.
    """

    name: ClassVar[RuleName] = AlertRule.STRAGGLER
    title: ClassVar[str] = "straggler rank"
    description: ClassVar[str] = (
        "A rank whose compute time (before the gradient all-reduce) stays above `factor` "
        "times the median of the other ranks' for `consecutive` frames in a row."
    )

    def __init__(self, run: RunContext, config: StragglerRuleConfig) -> None:
        super().__init__(run, config)
        self.slow_streak = np.zeros(run.info.world_size, np.int64)

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Advance the ranks' slow streaks with the frame's compute times; bad when one of
        the frame's ranks has been slow for ``consecutive`` frames."""
        cfg = self.config
        f = ctx.frame
        if f.rank_scalars is None:
            return Finding(None)
        ranks, times = f.rank_scalars.values_of(COMPUTE_TIME)
        usable = np.isfinite(times) & (times >= 0) & (ranks < self.slow_streak.size)
        ranks, times = ranks[usable], times[usable]
        if ranks.size < cfg.min_ranks:
            return Finding(None)
        others = median_of_others(times)
        slow = (times > cfg.factor * others) & (times - others > cfg.min_excess_s)
        streak = self.slow_streak
        streak[ranks] = np.where(slow, streak[ranks] + 1, 0)
        bad = streak[ranks] >= cfg.consecutive
        if not bad.any():
            held = np.flatnonzero(streak >= cfg.consecutive)
            return Finding(None) if held.size else Finding(False)
        bad_ranks = ranks[bad]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = times[bad] / others[bad]  # others may be 0 (ranks that timed nothing)
        keep = np.argsort(-ratio, kind="stable")[: self.run.max_layer_values]
        keep.sort()
        stragglers = {
            str(int(bad_ranks[i])): {
                "compute_time_s": json_number(times[bad][i]),
                "median_of_others_s": json_number(others[bad][i]),
                "ratio": json_number(ratio[i]),
                "consecutive": int(streak[bad_ranks[i]]),
            }
            for i in keep.tolist()
        }
        worst = int(np.argmax(np.where(np.isnan(ratio), -np.inf, ratio)))
        names = [int(r) for r in bad_ranks]
        return Finding(
            True, [], names,
            {
                "stragglers": stragglers,
                "factor": cfg.factor,
                "consecutive": cfg.consecutive,
                "ranks_reporting": int(ranks.size),
                "median_compute_time_s": json_number(np.median(times)),
            },
            f"straggler rank(s) {names} at step {f.step}: compute time above "
            f"{cfg.factor:g}x the median of the other ranks for >= {cfg.consecutive} "
            f"consecutive steps; rank {names[worst]} took {times[bad][worst]:.4g} s against "
            f"{others[bad][worst]:.4g} s ({ratio[worst]:.3g}x)",
        )
