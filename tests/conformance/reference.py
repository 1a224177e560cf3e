"""An executable reference of trustformers-debug's ``gradient_flow`` module.

A small, independent Python port of the reference implementation (trustformers-debug
0.1.1, module ``gradient_flow``: ``GradientFlowAnimator``), written from its Rust source
and nothing else: it imports nothing from gradstream. The conformance suite
(``tests/conformance/test_conformance.py``) feeds the same gradients to this module and to
gradstream end to end and compares the two.

What it reproduces, with Rust ``f64`` semantics (Python floats are IEEE 754 doubles):

- ``record_step(step, gradients)``: per layer ``mean_abs_grad = (sum |g|) / n`` (0 for an
  empty vector), ``max_abs_grad = fold(0.0, f64::max)`` over ``|g|`` (``f64::max`` ignores
  a NaN operand, so NaN elements never raise the maximum), ``grad_norm = sqrt(sum g*g)``.
  Sums run left to right from 0.0 in plain double arithmetic (no compensation, no
  pairwise order: CPython's ``sum()`` compensates since 3.12, so it is not used), and a
  square above ~1.34e154 overflows to ``inf`` (nothing is capped). ``is_vanishing =
  mean_abs_grad < vanishing_threshold`` (default 1e-7; NaN compares false),
  ``is_exploding = max_abs_grad > exploding_threshold`` (default 1e3),
  ``flow_intensity = clamp(grad_norm / global_max_norm, 0, 1)`` when the step's largest
  norm (NaN norms ignored) is above 0, else 0 (``clamp`` keeps NaN: ``inf / inf`` gives a
  NaN intensity). A frame's layers are sorted by name (code-point order, which is Rust's
  byte order of UTF-8).
- ``max_frames``: a rolling window; 0 keeps every frame, N keeps the last N recorded.
- ``summary_report()``: ``total_steps = last frame's step + 1`` (0 with no frame), the
  sorted lists of layers vanishing / exploding in at least one retained frame, the health
  rule (:func:`classify_health`) and the recommendations (:func:`build_recommendations`,
  the reference's sentences; gradstream writes its own words, so the suite compares their
  kinds, :data:`RECOMMENDATION_KINDS`).
- ``export_csv()``: header ``step,layer,mean_abs_grad,max_abs_grad,grad_norm,
  is_vanishing,is_exploding``, one line per (frame, layer), floats as Rust's
  ``format!("{:.8e}", x)`` (:func:`rust_exp`), flags as 0/1, names written raw.
- ``export_json()``: ``serde_json::to_string_pretty`` of the frames (two-space indent,
  floats as serde_json writes them, :func:`rust_json_float`; NaN and infinities as
  ``null``; no trailing newline).
- ``to_ascii_animation()``: the terminal heatmap, character for character.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

VANISHING_THRESHOLD = 1e-7
"""Default vanishing threshold of the reference animator (mean |g| below it)."""
EXPLODING_THRESHOLD = 1e3
"""Default exploding threshold of the reference animator (max |g| above it)."""

BLOCKS = (" ", "\u2591", "\u2592", "\u2593", "\u2588")
"""Heatmap glyphs of the reference: space, light, medium and dark shade, full block."""
HEATMAP_TITLE = "Gradient Flow Animation (step \u2192 right, layer \u2193)"
HEATMAP_EMPTY = "(no gradient frames recorded)\n"
RULE_CHAR = "\u2500"
CSV_HEADER = "step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding"


class GradientHealth(StrEnum):
    """The reference's health classes (their Rust variant names as values)."""

    HEALTHY = "Healthy"
    MINOR_ISSUES = "MinorIssues"
    PROBLEMS_DETECTED = "ProblemsDetected"
    CRITICAL = "Critical"


@dataclass(frozen=True)
class LayerGradientInfo:
    """One layer at one step (the reference's ``LayerGradientInfo``); floats are f64."""

    name: str
    mean_abs_grad: float
    max_abs_grad: float
    grad_norm: float
    is_vanishing: bool
    is_exploding: bool
    flow_intensity: float


@dataclass(frozen=True)
class GradientFrame:
    """All layers at one step (``GradientFrame``), layers sorted by name."""

    step: int
    layers: tuple[LayerGradientInfo, ...]


@dataclass(frozen=True)
class GradientFlowSummary:
    """The reference's ``GradientFlowSummary``: layer lists sorted by name."""

    total_steps: int
    layers_with_vanishing_grads: list[str]
    layers_with_exploding_grads: list[str]
    overall_health: GradientHealth
    recommendations: list[str]
    recommendation_kinds: list[str] = field(default_factory=list)
    issue_frames: int = 0
    frames: int = 0


# -- f64 helpers ---------------------------------------------------------------------------


def f64_max(a: float, b: float) -> float:
    """Rust's ``f64::max``: the larger operand; when one is NaN, the other."""
    if a != a:
        return b
    if b != b:
        return a
    return a if a >= b else b


def mean_abs(values: Sequence[float]) -> float:
    """``sum |v| / n`` summed left to right from 0.0; 0.0 for an empty vector."""
    if not values:
        return 0.0
    acc = 0.0
    for v in values:
        acc += abs(v)
    return acc / len(values)


def max_abs(values: Iterable[float]) -> float:
    """``fold(0.0, f64::max)`` over ``|v|`` (NaN elements ignored)."""
    acc = 0.0
    for v in values:
        acc = f64_max(acc, abs(v))
    return acc


def l2_norm(values: Iterable[float]) -> float:
    """``sqrt(sum v * v)`` summed left to right; squares may overflow to inf."""
    acc = 0.0
    for v in values:
        acc += v * v
    return math.sqrt(acc) if acc == acc else acc


def clamp01(x: float) -> float:
    """Rust's ``f64::clamp(0.0, 1.0)``: NaN stays NaN."""
    if x != x:
        return x
    return 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)


def rust_round(x: float) -> float:
    """Rust's ``f64::round``: halves away from zero (NaN and infinities unchanged)."""
    if not math.isfinite(x):
        return x
    r = math.floor(abs(x))
    if abs(x) - r >= 0.5:
        r += 1
    return math.copysign(r, x)


def saturating_usize(x: float) -> int:
    """Rust's ``x as usize``: NaN and negatives give 0, too large gives usize::MAX."""
    if x != x or x <= 0:
        return 0
    if x >= 2.0**64:
        return 2**64 - 1
    return int(x)


# -- Rust float formatting ----------------------------------------------------------------


def rust_exp(x: float, precision: int = 8) -> str:
    """Rust's ``format!("{:.8e}", x)``: ``1.00000000e-2`` (exponent without ``+`` or
    zero padding), ``inf``, ``-inf``, ``NaN``. Rounding is exact on the binary value with
    ties to even, as Rust (>= 1.67) and CPython both do."""
    if x != x:
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    mantissa, exponent = f"{x:.{precision}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def rust_json_float(x: float) -> str:
    """A float as serde_json writes it: ``null`` when not finite, else ryu's shortest
    round-trip digits laid out as ryu's ``format64`` does (``0.1``, ``1.0``,
    ``12340000000.0``, ``0.001234``, ``1e-7``, ``1.234e33``)."""
    if not math.isfinite(x):
        return "null"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if x == 0.0:
        return sign + "0.0"
    digits, exp = _shortest_digits(abs(x))
    length = len(digits)
    k = exp  # value = digits * 10**k
    kk = length + k
    if k >= 0 and kk <= 16:
        body = digits + "0" * k + ".0"
    elif 0 < kk <= 16:
        body = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:
        body = "0." + "0" * (-kk) + digits
    elif length == 1:
        body = f"{digits}e{kk - 1}"
    else:
        body = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + body


def _shortest_digits(x: float) -> tuple[str, int]:
    """Shortest round-trip decimal digits of a positive finite ``x`` and the exponent k
    with ``x == int(digits) * 10**k`` (from ``repr``, CPython's shortest repr)."""
    text = repr(x)
    if "e" in text:
        mant, e = text.split("e")
        exp = int(e)
    else:
        mant, exp = text, 0
    if "." in mant:
        whole, frac = mant.split(".")
    else:
        whole, frac = mant, ""
    digits = (whole + frac).lstrip("0")
    exp -= len(frac)
    stripped = digits.rstrip("0")
    exp += len(digits) - len(stripped)
    return stripped, exp


def _json_string(s: str) -> str:
    """A JSON string as serde_json escapes it: quote, backslash, ``\\b \\f \\n \\r \\t``,
    other control characters as ``\\u00xx`` (lowercase); everything else raw."""
    out = ['"']
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
             "\t": "\\t"}
    for ch in s:
        if ch in short:
            out.append(short[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


# -- health and recommendations -----------------------------------------------------------


def classify_health(vanishing: Sequence[str], exploding: Sequence[str],
                    frames: Sequence[GradientFrame]) -> GradientHealth:
    """The reference health rule: ``issue_ratio = issue_frames / max(frames, 1)`` (a frame
    is an issue frame when some layer is vanishing or exploding), then the first of:
    exploding and ratio > 0.5 -> Critical; exploding or ratio > 0.3 -> ProblemsDetected;
    vanishing or ratio > 0.1 -> MinorIssues; else Healthy. The ratio is the f64 division,
    compared with the f64 literals 0.5, 0.3, 0.1."""
    issue_frames = sum(
        1 for f in frames if any(ly.is_vanishing or ly.is_exploding for ly in f.layers)
    )
    ratio = issue_frames / max(len(frames), 1)
    if exploding and ratio > 0.5:
        return GradientHealth.CRITICAL
    if exploding or ratio > 0.3:
        return GradientHealth.PROBLEMS_DETECTED
    if vanishing or ratio > 0.1:
        return GradientHealth.MINOR_ISSUES
    return GradientHealth.HEALTHY


RECOMMENDATION_KINDS = ("vanishing_layers", "initialisation", "exploding_layers",
                        "learning_rate", "health")
"""Kinds of the reference's recommendations, in the order it emits them: ``vanishing_layers``
(names the vanishing layers) and ``initialisation`` when some layer vanished;
``exploding_layers`` (names them) and ``learning_rate`` when some layer exploded; then
exactly one ``health`` line for the health class."""


def build_recommendations(health: GradientHealth, vanishing: Sequence[str],
                          exploding: Sequence[str]) -> tuple[list[str], list[str]]:
    """The reference's recommendations and their kinds (:data:`RECOMMENDATION_KINDS`).

    Returns:
        (sentences, kinds), aligned; the sentences paraphrase the reference's.
    """
    recs: list[str] = []
    kinds: list[str] = []
    if vanishing:
        recs.append(f"Vanishing gradients detected in: {', '.join(vanishing)}.")
        kinds.append("vanishing_layers")
        recs.append("Investigate weight initialisation.")
        kinds.append("initialisation")
    if exploding:
        recs.append(f"Exploding gradients detected in: {', '.join(exploding)}.")
        kinds.append("exploding_layers")
        recs.append("Consider reducing the learning rate.")
        kinds.append("learning_rate")
    recs.append(f"Health: {health.value}.")
    kinds.append("health")
    return recs, kinds


# -- the animator -------------------------------------------------------------------------


class GradientFlowAnimator:
    """Collects per-step gradient statistics (the reference's ``GradientFlowAnimator``).

    Args:
        max_frames: rolling window in frames (0 = unlimited).
        vanishing_threshold: mean |g| strictly below it is vanishing.
        exploding_threshold: max |g| strictly above it is exploding.
    """

    def __init__(self, max_frames: int = 0, vanishing_threshold: float = VANISHING_THRESHOLD,
                 exploding_threshold: float = EXPLODING_THRESHOLD) -> None:
        self.frames: list[GradientFrame] = []
        self.max_frames = max_frames
        self.vanishing_threshold = vanishing_threshold
        self.exploding_threshold = exploding_threshold

    def record_step(self, step: int, gradients: Mapping[str, Sequence[float]]) -> GradientFrame:
        """Record one step: ``gradients`` maps a layer name to its flat f64 gradient.

        Returns:
            The frame recorded (the newest frame always stays in the window).
        """
        values = {name: [float(v) for v in grad] for name, grad in gradients.items()}
        norms = {name: l2_norm(g) for name, g in values.items()}
        global_max = 0.0
        for n in norms.values():
            global_max = f64_max(global_max, n)
        layers = []
        for name, g in values.items():
            mean, top, norm = mean_abs(g), max_abs(g), norms[name]
            layers.append(LayerGradientInfo(
                name=name,
                mean_abs_grad=mean,
                max_abs_grad=top,
                grad_norm=norm,
                is_vanishing=mean < self.vanishing_threshold,
                is_exploding=top > self.exploding_threshold,
                flow_intensity=clamp01(norm / global_max) if global_max > 0.0 else 0.0,
            ))
        layers.sort(key=lambda layer: layer.name)
        frame = GradientFrame(int(step), tuple(layers))
        self.frames.append(frame)
        if self.max_frames > 0 and len(self.frames) > self.max_frames:
            del self.frames[0]
        return frame

    def summary_report(self) -> GradientFlowSummary:
        """The reference's ``summary_report`` (plus ``issue_frames`` and ``frames``)."""
        total_steps = self.frames[-1].step + 1 if self.frames else 0
        vanishing = sorted({ly.name for f in self.frames for ly in f.layers if ly.is_vanishing})
        exploding = sorted({ly.name for f in self.frames for ly in f.layers if ly.is_exploding})
        health = classify_health(vanishing, exploding, self.frames)
        recs, kinds = build_recommendations(health, vanishing, exploding)
        issue = sum(1 for f in self.frames
                    if any(ly.is_vanishing or ly.is_exploding for ly in f.layers))
        return GradientFlowSummary(total_steps, vanishing, exploding, health, recs, kinds,
                                   issue, len(self.frames))

    def export_csv(self) -> str:
        """The CSV text the reference's ``export_csv`` writes (every line ends in ``\\n``)."""
        lines = [CSV_HEADER]
        for frame in self.frames:
            for ly in frame.layers:
                lines.append(
                    f"{frame.step},{ly.name},{rust_exp(ly.mean_abs_grad)},"
                    f"{rust_exp(ly.max_abs_grad)},{rust_exp(ly.grad_norm)},"
                    f"{int(ly.is_vanishing)},{int(ly.is_exploding)}"
                )
        return "\n".join(lines) + "\n"

    def export_json(self) -> str:
        """The JSON text the reference's ``export_json`` writes (serde_json pretty)."""
        if not self.frames:
            return "[]"
        out = ["["]
        for i, frame in enumerate(self.frames):
            out.append("  {")
            out.append(f'    "step": {frame.step},')
            if not frame.layers:
                out.append('    "layers": []')
            else:
                out.append('    "layers": [')
                for j, ly in enumerate(frame.layers):
                    out.append("      {")
                    out.append(f'        "name": {_json_string(ly.name)},')
                    out.append(f'        "mean_abs_grad": {rust_json_float(ly.mean_abs_grad)},')
                    out.append(f'        "max_abs_grad": {rust_json_float(ly.max_abs_grad)},')
                    out.append(f'        "grad_norm": {rust_json_float(ly.grad_norm)},')
                    out.append(f'        "is_vanishing": {str(ly.is_vanishing).lower()},')
                    out.append(f'        "is_exploding": {str(ly.is_exploding).lower()},')
                    out.append(f'        "flow_intensity": {rust_json_float(ly.flow_intensity)}')
                    out.append("      }" + ("," if j < len(frame.layers) - 1 else ""))
                out.append("    ]")
            out.append("  }" + ("," if i < len(self.frames) - 1 else ""))
        out.append("]")
        return "\n".join(out)

    def to_ascii_animation(self) -> str:
        """The reference's ``to_ascii_animation``: title, a ruler of column indices modulo
        10 under a ``layer`` label right-aligned to the longest name, a rule line, then
        per layer (sorted by name) the name right-aligned and one glyph per frame:
        ``BLOCKS[min(round(intensity * 4) as usize, 4)]`` (absent layer = 0). Width
        quirks kept: the longest name is measured in UTF-8 bytes (Rust's ``len``) while
        padding counts characters; ``layer`` is not counted in the width; with no layer
        the width is 8."""
        if not self.frames:
            return HEATMAP_EMPTY
        names = sorted({ly.name for f in self.frames for ly in f.layers})
        width = max((len(n.encode("utf-8")) for n in names), default=8)

        def right(text: str) -> str:
            return " " * max(0, width - len(text)) + text

        out = [HEATMAP_TITLE + "\n", right("layer") + "  "]
        out.append("".join(str(i % 10) for i in range(len(self.frames))) + "\n")
        out.append(RULE_CHAR * (width + 2 + len(self.frames)) + "\n")
        by_frame = [{ly.name: ly.flow_intensity for ly in f.layers} for f in self.frames]
        for name in names:
            cells = []
            for intensities in by_frame:
                x = intensities.get(name, 0.0)
                idx = min(saturating_usize(rust_round(x * (len(BLOCKS) - 1))), len(BLOCKS) - 1)
                cells.append(BLOCKS[idx])
            out.append(right(name) + "  " + "".join(cells) + "\n")
        return "".join(out)
