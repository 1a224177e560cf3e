"""A straight port of the reference enhanced analysis
(``EnhancedGradientAnalyzer::generate_enhanced_analysis`` of trustformers-debug's
``enhanced_analysis`` module), for the scaling comparison of ``bench/analysis_scale.py``.

It keeps the reference algorithm: one in-memory history per layer in a ``dict`` (the
reference's ``HashMap``), per-layer statistics recomputed by every helper that needs them (health
metrics and suggestions recompute the statistics and the flow characteristics), and the
comparative analysis that computes the statistics of every other layer, twice, for every
layer (O(L^2 x T) with a sort per history), then all layer pairs for the interactions.
Inner loops over one history use NumPy (as fast per element as the reference's
compiled loops), so the comparison isolates the algorithm, not the language. Placeholders are kept
as in the reference: this is the algorithm to time, not an analysis to use.
"""

from __future__ import annotations

import numpy as np

CONVERGENCE_WINDOW = 100
"""Convergence window of the reference ``EnhancedGradientAnalyzer::default``."""
STABILITY_THRESHOLD = 0.8
"""Stability threshold of the reference ``EnhancedGradientAnalyzer::default``."""


def detailed_stats(norms: np.ndarray) -> dict[str, float]:
    """``compute_detailed_gradient_stats``: moments and sorted-index percentiles."""
    n = norms.size
    if n == 0:
        return dict.fromkeys(("mean", "std", "median", "p95", "p5", "variance", "skewness",
                              "kurtosis"), 0.0)
    mean = float(norms.mean())
    variance = float(((norms - mean) ** 2).mean())
    std = variance**0.5
    s = np.sort(norms)
    mid = n // 2
    median = float((s[mid - 1] + s[mid]) / 2) if n % 2 == 0 else float(s[mid])
    p5 = float(s[int(n * 0.05)])
    p95 = float(s[min(int(n * 0.95), n - 1)])
    z = (norms - mean) / std if std > 0 else None
    return {
        "mean": mean, "std": std, "median": median, "p95": p95, "p5": p5,
        "variance": variance,
        "skewness": float((z**3).mean()) if z is not None else 0.0,
        "kurtosis": float((z**4).mean() - 3.0) if z is not None else 0.0,
    }


def _trend(values: np.ndarray) -> float:
    if values.size < 3:
        return 0.0
    x = np.arange(values.size, dtype=np.float64)
    n = float(values.size)
    return float((n * (x * values).sum() - x.sum() * values.sum())
                 / (n * (x * x).sum() - x.sum() ** 2))


def flow_characteristics(norms: np.ndarray) -> dict[str, float]:
    """``analyze_flow_characteristics``."""
    if norms.size >= 2:
        variations = np.abs(np.diff(norms)) / (norms[:-1] + 1e-8)
        consistency = min(1.0 / (1.0 + float(variations.mean())), 1.0)
    else:
        consistency = 1.0
    if norms.size >= 3:
        second = norms[2:] - 2.0 * norms[1:-1] + norms[:-2]
        smoothness = min(1.0 / (1.0 + float(np.abs(second).mean())), 1.0)
    else:
        smoothness = 1.0
    trend = min(abs(_trend(norms)), 1.0)
    if norms.size >= 4:
        d = np.diff(norms)
        oscillation = float((d[1:] * d[:-1] < 0).sum()) / norms.size
    else:
        oscillation = 0.0
    mean = float(norms.mean()) if norms.size else 0.0
    stability = 0.0 if mean == 0.0 else min(1.0 / (1.0 + float(norms.std()) / mean), 1.0)
    return {"consistency": consistency, "smoothness": smoothness, "trend": trend,
            "oscillation": oscillation, "stability": stability}


def health_metrics(norms: np.ndarray) -> dict[str, object]:
    """``compute_layer_health_metrics`` (recomputes statistics and flow)."""
    stats = detailed_stats(norms)
    flow = flow_characteristics(norms)
    flow_rate = float(np.abs(np.diff(norms)).sum()) / norms.size if norms.size >= 2 else 0.0
    mean = float(norms.mean())
    activity = min(mean / (mean + 1e-5), 1.0)
    if norms.size < CONVERGENCE_WINDOW:
        convergence = 0.5
    else:
        slope = _trend(norms[::-1][:CONVERGENCE_WINDOW])
        convergence = min(-slope, 1.0) if slope < 0 else 0.0
    risks = []
    if stats["mean"] < 1e-5:
        risks.append("Very low gradient magnitude")
    if stats["mean"] > 100.0:
        risks.append("Very high gradient magnitude")
    if flow["stability"] < 0.5:
        risks.append("High gradient instability")
    if flow["oscillation"] > 0.5:
        risks.append("High oscillation frequency")
    health = ("Critical" if len(risks) > 2 else "Warning") if risks else "Healthy"
    return {"health": health, "stability": flow["stability"], "flow_rate": flow_rate,
            "activity": activity, "convergence": convergence, "risks": risks}


def suggestions(norms: np.ndarray) -> list[str]:
    """``generate_layer_optimization_suggestions`` (recomputes statistics and flow)."""
    stats = detailed_stats(norms)
    flow = flow_characteristics(norms)
    out = []
    if stats["mean"] < 1e-5:
        out.append("WeightInitialization")
    if stats["mean"] > 10.0:
        out.append("LearningRateAdjustment")
    if flow["oscillation"] > 0.5:
        out.append("RegularizationAdd")
    return out


def compare(name: str, norms: np.ndarray, histories: dict[str, np.ndarray]) -> dict[str, object]:
    """``compare_with_other_layers``: statistics of every other layer, twice."""
    current = detailed_stats(norms)
    others = [detailed_stats(h)["mean"] for other, h in histories.items() if other != name]
    if not others:
        return {"relative": 1.0, "rank": 1, "similar": [], "gap": 0.0, "potential": 0.5}
    others.sort(reverse=True)
    rank = next((k for k, m in enumerate(others) if m <= current["mean"]), len(others)) + 1
    avg = sum(others) / len(others)
    relative = current["mean"] / avg if avg > 0 else 1.0
    similar = []
    for other, h in histories.items():
        if other == name:
            continue
        m = detailed_stats(h)["mean"]
        if max(current["mean"] / (m + 1e-8), m / (current["mean"] + 1e-8)) <= 1.2:
            similar.append(other)
    potential = 0.8 if relative < 0.5 else 0.6 if relative < 0.8 else 0.3
    return {"relative": relative, "rank": rank, "similar": similar,
            "gap": abs(current["mean"] - avg), "potential": potential}


def generate_enhanced_analysis(histories: dict[str, np.ndarray]) -> dict[str, object]:
    """``generate_enhanced_analysis`` over ``{layer name: norms float64[T]}``."""
    details = {}
    for name, norms in histories.items():
        details[name] = {
            "stats": detailed_stats(norms),
            "flow": flow_characteristics(norms),
            "health": health_metrics(norms),
            "suggestions": suggestions(norms),
            "compare": compare(name, norms, histories),
        }
    names = list(details)
    interactions = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = details[names[i]], details[names[j]]
            diff = abs(a["stats"]["mean"] - b["stats"]["mean"]) + abs(
                a["flow"]["stability"] - b["flow"]["stability"])
            strength = 1.0 / (1.0 + diff)
            conv = abs(a["health"]["convergence"] - b["health"]["convergence"])
            kind = "Cooperative" if conv < 0.1 else "Competitive" if conv > 0.5 else "Neutral"
            interactions.append((names[i], names[j], strength, kind, strength * 0.5))
    means = np.array([d["stats"]["mean"] for d in details.values()])
    avg_conv = float(np.mean([d["health"]["convergence"] for d in details.values()]))
    priorities = sorted(
        ((n, d["compare"]["potential"]) for n, d in details.items()), key=lambda x: -x[1])
    groups = {
        "high": [n for n, d in details.items() if d["stats"]["mean"] > 1.0],
        "medium": [n for n, d in details.items() if 0.1 <= d["stats"]["mean"] <= 1.0],
        "low": [n for n, d in details.items() if d["stats"]["mean"] < 0.1],
    }
    return {"details": details, "interactions": interactions, "mean": float(means.mean()),
            "convergence": avg_conv, "groups": groups, "priorities": priorities}
