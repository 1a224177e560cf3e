"""The exponent histogram of the summaries: its column layout (:func:`exp_hist_edges`) and
what it answers, the fraction of a layer's elements a cast to fp16 / bf16 / fp8 would flush
to zero or make subnormal (:func:`underflow_fraction`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from schemas.stats import exp_hist_column
from schemas.wire import EXP_HIST_BINS, EXP_HIST_MAX, EXP_HIST_MIN

__all__ = [
    "FLOAT_FORMATS",
    "FloatFormat",
    "UnderflowFractions",
    "exp_hist_edges",
    "underflow_fraction",
]

# The layout is part of the wire contract (schemas.wire): EXP_HIST_MIN = -134, so that the
# underflow column holds exactly the magnitudes that round to zero in bfloat16 (below half
# its smallest subnormal, 2^-133); EXP_HIST_MAX = 24, magnitudes >= 2^24 share the last
# column; EXP_HIST_BINS = MAX - MIN + 3 columns (zeros, underflow, one per exponent,
# overflow).


def exp_hist_edges() -> tuple[np.ndarray, np.ndarray]:
    """Magnitude range of each exponent-histogram column.

    Column layout (``B = EXP_HIST_BINS = EXP_HIST_MAX - EXP_HIST_MIN + 3 = 161``):

    ===========  ==========================================  ==========================
    column c     holds finite elements with                  (lower, upper)
    ===========  ==========================================  ==========================
    0            g == 0 (+0 or -0)                           (0, 0)
    1            0 < |g| < 2^EXP_HIST_MIN (underflow)        (0, 2^MIN)
    2 .. B-2     2^(MIN+c-2) <= |g| < 2^(MIN+c-1)            (2^(MIN+c-2), 2^(MIN+c-1))
    B-1          |g| >= 2^EXP_HIST_MAX (overflow)            (2^MAX, inf)
    ===========  ==========================================  ==========================

    NaN and +-Inf are not in the histogram (they are ``LayerSummaries.nonfinite``), so a
    layer's row sums to ``numel - nonfinite``.

    Returns:
        (lower, upper): float64[B] each; column c holds lower[c] <= |g| < upper[c] (column
        0: |g| == 0; column 1: 0 < |g| < upper[1]).
    """
    k = np.arange(EXP_HIST_MIN, EXP_HIST_MAX, dtype=np.float64)
    lower = np.concatenate(([0.0, 0.0], np.exp2(k), [2.0**EXP_HIST_MAX]))
    upper = np.concatenate(([0.0, 2.0**EXP_HIST_MIN], np.exp2(k + 1), [np.inf]))
    return lower, upper


class FloatFormat(NamedTuple):
    """A binary floating-point format's underflow thresholds.

    Attributes:
        emin: exponent of the smallest normal number, 2^emin.
        fraction_bits: stored significand bits; the smallest subnormal is
            2^(emin - fraction_bits).
        source: where the figures come from.
    """

    emin: int
    fraction_bits: int
    source: str


#: Formats known to :func:`underflow_fraction`.
FLOAT_FORMATS: dict[str, FloatFormat] = {
    # IEEE 754-2019, Table 3.5 binary16: emin = -14, p = 11 -> subnormal min 2^-24.
    "fp16": FloatFormat(-14, 10, "IEEE 754-2019 binary16"),
    # bfloat16: binary32's exponent (emin = -126) with 7 fraction bits -> 2^-133.
    "bf16": FloatFormat(-126, 7, "bfloat16 (binary32 exponent range, 8-bit significand)"),
    # OCP 8-bit Floating Point Specification (OFP8) rev 1.0: E4M3 bias 7 (min normal
    # 2^-6, min subnormal 2^-9), E5M2 bias 15 (2^-14, 2^-16).
    "fp8_e4m3": FloatFormat(-6, 3, "OCP OFP8 rev 1.0 E4M3"),
    "fp8_e5m2": FloatFormat(-14, 2, "OCP OFP8 rev 1.0 E5M2"),
}


class UnderflowFractions(NamedTuple):
    """Fractions of a layer's finite elements that a cast to a narrower format would hurt.

    Attributes:
        to_zero: float64[L] (or scalar), fraction with 0 < |g| < 2^(s-1), s = log2 of the
            format's smallest subnormal: these round to +-0 under round-to-nearest-even.
        subnormal: float64[L] (or scalar), fraction with 2^(s-1) <= |g| < 2^emin: these
            become subnormal (reduced precision) or, for the single tie value 2^(s-1), zero.
    """

    to_zero: np.ndarray | float
    subnormal: np.ndarray | float


def underflow_fraction(counts: np.ndarray, fmt: str = "fp16") -> UnderflowFractions:
    """Fraction of elements that would be flushed to zero / become subnormal in ``fmt``.

    Computed from exponent-histogram counts only (so it works on counts merged across ranks
    and steps). With the smallest normal 2^emin and smallest subnormal 2^s of the format
    (fp16: 2^-14 and 2^-24, IEEE 754-2019 binary16; bf16: 2^-126 and 2^-133; see
    ``FLOAT_FORMATS``), and round-to-nearest-even (IEEE 754-2019 section 4.3.1):

    * ``to_zero`` = #{0 < |g| < 2^(s-1)} / #finite: below half the smallest subnormal, a
      value rounds to zero;
    * ``subnormal`` = #{2^(s-1) <= |g| < 2^emin} / #finite: rounds to a non-zero subnormal
      (except the exact tie 2^(s-1), which rounds to zero, and values within half a
      subnormal step below 2^emin, which round up to the smallest normal).

    The denominator is the row total (finite elements, zeros included); a row with no
    finite element gives 0.0. Power-of-two bin edges make both counts exact apart from
    the tie cases above. Where conversions flush subnormals to zero (FTZ, e.g. some bf16
    hardware conversions), ``to_zero + subnormal`` is the fraction that becomes zero.

    Args:
        counts: int64[L, EXP_HIST_BINS] or int64[EXP_HIST_BINS], as in
            ``LayerSummaries.exp_hist`` (possibly summed over ranks or steps).
        fmt: a key of ``FLOAT_FORMATS``.

    Returns:
        UnderflowFractions with float64[L] fields (Python floats for 1-D counts).

    Raises:
        ValueError: unknown format, or counts whose last axis is not EXP_HIST_BINS.
    """
    spec = FLOAT_FORMATS.get(fmt)
    if spec is None:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FLOAT_FORMATS)}")
    arr = np.asarray(counts)
    if arr.ndim not in (1, 2) or arr.shape[-1] != EXP_HIST_BINS:
        raise ValueError(
            f"counts must have shape [L, {EXP_HIST_BINS}] or [{EXP_HIST_BINS}], got {arr.shape}"
        )
    s = spec.emin - spec.fraction_bits  # smallest subnormal 2^s
    # Columns of exponents k < s - 1 (incl. underflow column 1) round to zero; columns of
    # s - 1 <= k < emin become subnormal. The layout keeps these thresholds inside the range.
    zero_end = exp_hist_column(s - 1)  # first column that does not round to zero
    sub_end = exp_hist_column(spec.emin)
    total = arr.sum(axis=-1, dtype=np.float64)
    to_zero = arr[..., 1:zero_end].sum(axis=-1, dtype=np.float64)
    sub = arr[..., zero_end:sub_end].sum(axis=-1, dtype=np.float64)
    denom = np.where(total > 0, total, 1.0)
    fz = to_zero / denom
    fs = sub / denom
    if arr.ndim == 1:
        return UnderflowFractions(float(fz), float(fs))
    return UnderflowFractions(fz, fs)
