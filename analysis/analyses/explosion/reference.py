"""The reference's rules of the explosion analysis, applied under ``rules="reference"``
(trustformers-debug, ``utilities::weight_analysis``)."""

from __future__ import annotations

from analysis.analyses.explosion.models import ExplosionSeverity, severity_above

REFERENCE_EPSILON = 1e-8
"""Guard added to the mean norm by the reference's severity ratio (``norm / (mean +
1e-8)``), kept as written under ``rules="reference"``."""


def classify_severity_reference(norm: float, mean_so_far: float) -> ExplosionSeverity:
    """The reference's per-layer severity (``classify_explosion_severity``): ``r = norm /
    (mean_so_far + 1e-8)``, Critical if r > 100, High if r > 50, Medium if r > 10, Low
    otherwise.

    Args:
        norm: the layer's L2 norm.
        mean_so_far: mean L2 norm of the layers up to and including this one in model
            order (the reference's running list of norms).
    """
    return severity_above(norm / (mean_so_far + REFERENCE_EPSILON), 100, 50, 10)


def reference_action(norm: float) -> str:
    """The reference's advice by absolute L2 norm (``recommend_explosion_mitigation``):
    above 100, above 10, above 5, otherwise (gradstream's wording)."""
    if norm > 100:
        return ("Critical explosion (norm above 100): lower the learning rate tenfold and "
                "clip the gradient norm.")
    if norm > 10:
        return "Strong explosion (norm above 10): lower the learning rate and clip the norm."
    if norm > 5:
        return "Moderate explosion (norm above 5): clip the norm or lower the learning rate."
    return "Keep watching this layer's gradient norm."


def reference_recommendations(ratio: float, top: float) -> list[str]:
    """The reference's list (``generate_explosion_recommendations``), gradstream's wording:
    two lines if more than 30 % of the layers explode, two if the largest norm is above
    100, and always the two monitoring lines."""
    recs = []
    if ratio > 0.3:
        recs += ["Many layers' gradients explode at once.",
                 "Lower the learning rate substantially."]
    if top > 100:
        recs += ["Very large gradient norms (above 100).",
                 "Clip the gradient norm, at a threshold below 1.0."]
    recs += ["Keep monitoring the gradient norms during training.",
             "Consider batch or layer normalisation."]
    return recs
