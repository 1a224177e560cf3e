"""Severities and advice of the gradient explosion analysis (gradstream's rules)."""

from __future__ import annotations

from analysis.analyses.explosion.models import ExplosionSeverity, severity_above, worst


def classify_severity(ratio: float, nonfinite: bool) -> ExplosionSeverity:
    """:class:`ExplosionSeverity` of a norm-to-threshold ratio.

    Args:
        ratio: ``norm / threshold`` (>= 0).
        nonfinite: NaN/Inf gradients were seen.
    """
    if nonfinite:
        return ExplosionSeverity.CRITICAL
    return severity_above(ratio, 10, 5, 2)


def overall_severity(
    layer_ratio: float, top: float, threshold: float, nonfinite: bool
) -> ExplosionSeverity:
    """The run's severity (the reference's ``overall_severity`` rule, plus NaN/Inf):
    Critical with NaN/Inf, else the worse of the exploding share of the layers against
    0.5 / 0.3 / 0.1 and the largest counted norm against 10 / 5 / 2 x ``threshold``.

    Args:
        layer_ratio: exploding layers / layers with rows.
        top: the largest ``grad_norm`` of the layers not excluded.
        threshold: the L2-norm threshold (> 0).
        nonfinite: some layer held NaN/Inf gradients.
    """
    if nonfinite:
        return ExplosionSeverity.CRITICAL
    return worst(severity_above(layer_ratio, 0.5, 0.3, 0.1),
                 severity_above(top, 10 * threshold, 5 * threshold, 2 * threshold))


def layer_action(severity: ExplosionSeverity, nonfinite: bool) -> str:
    """gradstream's advice for an exploding layer: by ``severity``, or the NaN/Inf advice
    when the layer held non-finite gradients."""
    if nonfinite:
        return ("NaN/Inf gradients: skip optimiser steps whose gradients are not finite, "
                "then lower the learning rate and clip the gradient norm.")
    return {
        ExplosionSeverity.CRITICAL: "Lower the learning rate by an order of magnitude and "
        "clip the gradient norm.",
        ExplosionSeverity.HIGH: "Lower the learning rate and clip the gradient norm.",
        ExplosionSeverity.MEDIUM: "Clip the gradient norm or lower the learning rate.",
        ExplosionSeverity.LOW: "Just above the threshold: watch this layer's norm.",
    }[severity]


def recommendations(
    ratio: float, top: float, threshold: float, nonfinite: bool, first_bad: int | None,
    clip: float | None, count: int,
) -> list[str]:
    """gradstream's mitigation list for the run.

    Args:
        ratio: exploding layers / layers with rows.
        top: the largest counted layer norm; ``threshold``: the L2-norm threshold.
        nonfinite: some layer held NaN/Inf gradients.
        first_bad: the first step with an explosion or NaN/Inf (``None``: none).
        clip: the clip-norm suggestion (``None``: none).
        count: exploding layers.
    """
    if count == 0:
        return [f"No layer's gradient norm exceeded {threshold:g}; nothing to mitigate."]
    recs = []
    if ratio > 0.3:
        recs.append(
            f"{ratio:.0%} of the layers exploded: the cause is global, lower the learning "
            "rate substantially (or lengthen its warm-up) rather than treating layers."
        )
    if clip is not None:
        recs.append(
            f"Clip the global gradient norm at about {clip:.3g}: the largest whole-model "
            f"norm before the first explosion at step {first_bad}."
        )
    else:
        recs.append("Clip the global gradient norm (torch.nn.utils.clip_grad_norm_).")
    if nonfinite:
        recs.append(
            "Gradients reached NaN/Inf: skip non-finite optimiser steps and, with mixed "
            "precision, use dynamic loss scaling."
        )
    if top > 10 * threshold:
        recs.append(
            f"The largest layer norm ({top:.3g}) is {top / threshold:.0f}x the threshold: "
            "check normalisation layers and weight initialisation of the layers listed."
        )
    return recs
