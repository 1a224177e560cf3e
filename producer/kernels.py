"""Numba kernels behind :func:`producer.summary.summarize` (the fast path).

This module imports numba at import time, so :mod:`producer.summary` imports it lazily, on
the first summary, and falls back to its pure-NumPy path when numba is missing or broken
(see ``producer.summary.set_backend``). Every kernel is ``@njit(cache=True, nogil=True)``:
compiled on first use for each (dtype, layout) and cached on disk next to this file (or in
``NUMBA_CACHE_DIR``), and it releases the GIL so the producer's sender thread keeps running
while the training thread summarises.

One call summarises one whole layer in one read of its memory, in blocks of ``BLOCK``
elements (16/32 KiB, L1-resident):

1. fast pass, per block: ``sum |g|``, ``sum g^2`` in float64 and ``max |g|`` as the maximum
   of the IEEE bit patterns with the sign bit cleared (for non-negative IEEE 754 numbers the
   integer order of the bit patterns is their numeric order, so this is an integer max, which
   vectorises). No finiteness test here: a NaN/Inf element propagates into the sums.
   The block loop is compiled with ``fastmath={"reassoc", "contract"}`` only, so LLVM may
   vectorise the float64 reductions (several partial sums) but must keep NaN/Inf
   semantics (no ``nnan``/``ninf`` flags).
2. the block partial sums are added with Neumaier compensation (strict IEEE arithmetic,
   outside the fastmath function), so the error stays ~ (BLOCK/lanes + small) ulps whatever
   the layer size: far below the 1e-12 relative tolerance of the tests.
3. only in a block whose sums came out non-finite (a NaN/Inf element, or a float64 square
   that overflows) the block is redone with masking while it is still in L1 (no second
   read of the layer): elements whose exponent field is all ones (IEEE 754 NaN/Inf) are
   counted and excluded; sums that still overflow saturate at the largest double.

Weight statistics (:func:`weights_f32`, :func:`weights_f64`) use the same scheme: per block
a vectorised pass for S1..S4 and the min / max (as integer order keys of the bit patterns,
which vectorise where float min / max with NaN semantics do not), the update's squared
differences against the kept float32 copy, the exponent histogram, and the masked variants
only for a block with a non-finite sum.

The optional exponent histogram is counted in the same block loop, while the block is in L1:
each element's biased exponent field is mapped through a lookup table to its column (see
``producer.summary`` for the bin layout); elements with a zero exponent field (zeros and
subnormals) are re-binned exactly per block, only in blocks that contain any.

Float16 is not a numba type: ``producer.summary`` converts float16 layers to float32 (exact,
NaN/Inf preserved) and uses the float32 kernels.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = [
    "BLOCK",
    "summarize_f32",
    "summarize_f64",
    "summarize_hist_f32",
    "summarize_hist_f64",
    "weights_f32",
    "weights_f64",
]

#: Elements per block (float32: 16 KiB, float64: 32 KiB; both fit a 48 KiB L1 data cache).
BLOCK = 4096

# Only reassociation and FMA contraction: NaN/Inf semantics stay IEEE (no nnan/ninf/nsz).
# (numba wants a set here, not a frozenset.)
_FASTMATH = {"reassoc", "contract"}
_MAX_DOUBLE = float(np.finfo(np.float64).max)

# The histogram layout (EXP_HIST_MIN, number of columns, exponent lookup tables) is passed
# in by producer.summary at run time, never frozen into this module's cached machine code,
# so changing the layout there cannot leave a stale numba cache behind.


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _block_fast(x, u, absmask):  # pragma: no cover - compiled
    sum_abs = 0.0
    sum_sq = 0.0
    top = absmask ^ absmask
    for i in range(x.size):
        v = np.float64(x[i])
        sum_abs += abs(v)
        sum_sq += v * v
        b = u[i] & absmask
        top = b if b > top else top
    return sum_abs, sum_sq, top


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _block_masked(x, u, absmask, expmask):  # pragma: no cover - compiled
    sum_abs = 0.0
    sum_sq = 0.0
    zero = absmask ^ absmask
    top = zero
    bad = 0
    for i in range(x.size):
        b = u[i] & absmask
        ok = (b & expmask) != expmask
        v = np.float64(x[i]) if ok else 0.0
        sum_abs += abs(v)
        sum_sq += v * v
        bad += 0 if ok else 1
        b = b if ok else zero
        top = b if b > top else top
    return sum_abs, sum_sq, top, bad


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _count_zeros(u, absmask):  # pragma: no cover - compiled
    zeros = 0
    for i in range(u.size):
        zeros += 1 if (u[i] & absmask) == 0 else 0
    return zeros


@njit(cache=True, nogil=True)
def _add(total, comp, value):  # pragma: no cover - compiled
    """Neumaier-compensated ``total + value``; an overflow leaves total at +-inf."""
    t = total + value
    if not math.isfinite(t):
        return t, 0.0
    if abs(total) >= abs(value):
        comp += (total - t) + value
    else:
        comp += (value - t) + total
    return t, comp


@njit(cache=True, nogil=True)
def _block_hist(x, u, absmask, expmask, mant_bits, lut, hist_min, tables):  # pragma: no cover
    """Count one block's exponent columns into tables[0..3]; exact zero/subnormal fix-up.

    tables: int64[4, B + 2]; column B collects NaN/Inf (dropped), column B + 1 the
    elements with a zero exponent field, which are re-binned here: zeros to column 0,
    subnormals to the column of their exponent (from frexp of the exact float64 value).
    """
    nbins = tables.shape[1] - 2
    col_exp0 = nbins + 1
    before = tables[:, col_exp0].sum()
    n = u.size
    i = 0
    while i + 4 <= n:  # four interleaved tables: repeated columns do not serialise
        tables[0, lut[u[i] >> mant_bits]] += 1
        tables[1, lut[u[i + 1] >> mant_bits]] += 1
        tables[2, lut[u[i + 2] >> mant_bits]] += 1
        tables[3, lut[u[i + 3] >> mant_bits]] += 1
        i += 4
    while i < n:
        tables[0, lut[u[i] >> mant_bits]] += 1
        i += 1
    exp0 = tables[:, col_exp0].sum() - before
    if exp0 == 0:
        return
    zeros = _count_zeros(u, absmask)
    tables[0, 0] += zeros
    if exp0 == zeros:
        return
    for j in range(n):
        b = u[j] & absmask
        if (b & expmask) == 0 and b != 0:
            k = math.frexp(abs(np.float64(x[j])))[1] - 1  # |g| in [2^k, 2^(k+1))
            tables[0, min(max(k - hist_min + 2, 1), nbins - 1)] += 1


@njit(cache=True, nogil=True)
def _bits_to_float(bits, mant_bits, bias):  # pragma: no cover - compiled
    """Value of a non-negative finite IEEE 754 bit pattern, as float64 (exact)."""
    b = np.int64(bits)  # sign bit cleared: fits int64
    mb = np.int64(mant_bits)
    e = b >> mb  # biased exponent field
    m = b - (e << mb)  # significand field
    if e == 0:  # zero or subnormal: m * 2^(1 - bias - mant_bits)
        return math.ldexp(np.float64(m), 1 - bias - mb)
    return math.ldexp(np.float64(m + (np.int64(1) << mb)), e - bias - mb)


@njit(cache=True, nogil=True)
def _summarize_into(
    x, u, absmask, expmask, mant_bits, bias, out, i, counts, lut, hist_min
):  # pragma: no cover - compiled
    """One layer in one read: per block the fast pass (+ histogram), and the masked pass
    over the same (L1-resident) block only when the block's sums came out non-finite."""
    n = x.size
    sum_abs = 0.0
    comp_abs = 0.0
    sum_sq = 0.0
    comp_sq = 0.0
    zero = absmask ^ absmask
    top = zero
    hist = counts.shape[0] > 0
    nbins = counts.shape[1]
    tables = np.zeros((4 if hist else 0, nbins + 2), dtype=np.int64)
    bad = 0
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        a, q, t = _block_fast(x[lo:hi], u[lo:hi], absmask)
        if not (math.isfinite(a) and math.isfinite(q)):
            # A NaN/Inf element (or, float64 only, a square that overflowed): redo this
            # block, still in L1, with masking; the other blocks keep their fast sums.
            a, q, t, nb = _block_masked(x[lo:hi], u[lo:hi], absmask, expmask)
            bad += nb
        sum_abs, comp_abs = _add(sum_abs, comp_abs, a)
        sum_sq, comp_sq = _add(sum_sq, comp_sq, q)
        top = t if t > top else top
        if hist:
            _block_hist(x[lo:hi], u[lo:hi], absmask, expmask, mant_bits, lut, hist_min, tables)
    sum_abs = min(sum_abs + comp_abs, _MAX_DOUBLE)
    sum_sq = min(sum_sq + comp_sq, _MAX_DOUBLE)
    out[0, i] = n
    out[1, i] = sum_abs
    out[2, i] = sum_sq
    out[3, i] = _bits_to_float(top, mant_bits, bias)
    out[4, i] = bad
    if hist:
        for c in range(nbins):
            counts[i, c] = tables[0, c] + tables[1, c] + tables[2, c] + tables[3, c]


_KEY_MAX = np.int64(np.iinfo(np.int64).max)
_KEY_MIN = np.int64(np.iinfo(np.int64).min)


@njit(cache=True, nogil=True)
def _order_key(bits, keymask):  # pragma: no cover - compiled
    """Signed-integer key of an IEEE 754 bit pattern (given as a signed integer of its
    width) whose integer order is the numeric order of finite values (IEEE 754-2019
    section 3.4: sign-magnitude encoding): negative values get their magnitude bits
    flipped. The map is its own inverse. -0 sorts just below +0."""
    k = np.int64(bits)
    return k ^ ((k >> 63) & keymask)


@njit(cache=True, nogil=True)
def _key_to_float(key, keymask, mant_bits, bias):  # pragma: no cover - compiled
    """Value (float64, exact) of a finite order key of :func:`_order_key`."""
    k = _order_key(key, keymask)  # back to the bit pattern (sign-extended)
    value = _bits_to_float(k & keymask, mant_bits, bias)
    return -value if k < 0 else value


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _wblock_fast(x, k, keymask):  # pragma: no cover - compiled
    """Power sums S1..S4 (float64) and min / max order keys of one block; no finiteness
    test (a NaN/Inf element makes S2 non-finite, and the caller redoes the block)."""
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    s4 = 0.0
    kmin = _KEY_MAX
    kmax = _KEY_MIN
    for j in range(x.size):
        v = np.float64(x[j])
        v2 = v * v
        s1 += v
        s2 += v2
        s3 += v2 * v
        s4 += v2 * v2
        kk = _order_key(k[j], keymask)
        kmin = kk if kk < kmin else kmin
        kmax = kk if kk > kmax else kmax
    return s1, s2, s3, s4, kmin, kmax


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _wblock_masked(x, u, k, absmask, expmask, keymask):  # pragma: no cover - compiled
    """:func:`_wblock_fast` over the finite elements only (NaN/Inf: exponent field all
    ones, IEEE 754-2019 section 3.4)."""
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    s4 = 0.0
    kmin = _KEY_MAX
    kmax = _KEY_MIN
    for j in range(x.size):
        ok = (u[j] & expmask) != expmask
        v = np.float64(x[j]) if ok else 0.0
        v2 = v * v
        s1 += v
        s2 += v2
        s3 += v2 * v
        s4 += v2 * v2
        kk = _order_key(k[j], keymask)
        kmin = kk if (ok and kk < kmin) else kmin
        kmax = kk if (ok and kk > kmax) else kmax
    return s1, s2, s3, s4, kmin, kmax


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _ublock_fast(x, p):  # pragma: no cover - compiled
    """sum (float32(x) - p)^2 of one block in float64, no finiteness test."""
    su = 0.0
    for j in range(x.size):
        d = np.float64(np.float32(x[j])) - np.float64(p[j])
        su += d * d
    return su


@njit(cache=True, nogil=True)
def _ublock_masked(x, p):  # pragma: no cover - compiled
    """:func:`_ublock_fast` over the finite differences only."""
    su = 0.0
    for j in range(x.size):
        d = np.float64(np.float32(x[j])) - np.float64(p[j])
        if math.isfinite(d):
            su += d * d
    return su


@njit(cache=True, nogil=True)
def _weights_into(
    x, u, k, absmask, expmask, keymask, mant_bits, bias, prev, has_prev, out, nonfinite,
    i, counts, lut, hist_min,
):  # pragma: no cover - compiled
    """One weight layer in one read of ``x`` (and of ``prev``): per block the vectorised
    power sums and extremes, the update's squared differences and the exponent histogram,
    the masked variants only for a block whose sums came out non-finite; block partial
    sums added with Neumaier compensation (:func:`_add`)."""
    n = x.size
    acc = np.zeros(5)  # S1..S4, update
    comp = np.zeros(5)
    kmin = _KEY_MAX
    kmax = _KEY_MIN
    nbins = counts.shape[1]
    tables = np.zeros((4, nbins + 2), dtype=np.int64)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        s1, s2, s3, s4, bmin, bmax = _wblock_fast(x[lo:hi], k[lo:hi], keymask)
        if not math.isfinite(s2):  # a NaN/Inf weight (or an overflowing float64 square)
            s1, s2, s3, s4, bmin, bmax = _wblock_masked(
                x[lo:hi], u[lo:hi], k[lo:hi], absmask, expmask, keymask)
        acc[0], comp[0] = _add(acc[0], comp[0], s1)
        acc[1], comp[1] = _add(acc[1], comp[1], s2)
        acc[2], comp[2] = _add(acc[2], comp[2], s3)
        acc[3], comp[3] = _add(acc[3], comp[3], s4)
        kmin = bmin if bmin < kmin else kmin
        kmax = bmax if bmax > kmax else kmax
        if has_prev:
            su = _ublock_fast(x[lo:hi], prev[lo:hi])
            if not math.isfinite(su):
                su = _ublock_masked(x[lo:hi], prev[lo:hi])
            acc[4], comp[4] = _add(acc[4], comp[4], su)
        _block_hist(x[lo:hi], u[lo:hi], absmask, expmask, mant_bits, lut, hist_min, tables)
    for r in range(5):
        out[r, i] = acc[r] + comp[r] if math.isfinite(acc[r]) else acc[r]
    out[5, i] = _key_to_float(kmin, keymask, mant_bits, bias) if kmin != _KEY_MAX else math.inf
    out[6, i] = _key_to_float(kmax, keymask, mant_bits, bias) if kmax != _KEY_MIN else -math.inf
    for c in range(nbins):
        counts[i, c] = tables[0, c] + tables[1, c] + tables[2, c] + tables[3, c]
    nonfinite[i] = tables[0, nbins] + tables[1, nbins] + tables[2, nbins] + tables[3, nbins]


@njit(cache=True, nogil=True)
def weights_f32(x, prev, has_prev, out, nonfinite, i, counts, lut, hist_min):  # pragma: no cover
    """Weight statistics of the float32 layer ``x`` into column ``i`` of ``out``."""
    _weights_into(x, x.view(np.uint32), x.view(np.int32), np.uint32(0x7FFFFFFF),
                  np.uint32(0x7F800000), np.int64(0x7FFFFFFF), np.uint32(23), 127, prev,
                  has_prev, out, nonfinite, i, counts, lut, hist_min)


@njit(cache=True, nogil=True)
def weights_f64(x, prev, has_prev, out, nonfinite, i, counts, lut, hist_min):  # pragma: no cover
    """Weight statistics of the float64 layer ``x`` into column ``i`` of ``out``."""
    _weights_into(x, x.view(np.uint64), x.view(np.int64), np.uint64(0x7FFFFFFFFFFFFFFF),
                  np.uint64(0x7FF0000000000000), np.int64(0x7FFFFFFFFFFFFFFF),
                  np.uint64(52), 1023, prev, has_prev, out, nonfinite, i, counts, lut,
                  hist_min)


_WEIGHTS_DOC = """
    Args:
        x: {dtype}[n], C-contiguous, n >= 1 (the caller flattens any shape).
        prev: float32[n] the same layer at the previous recorded step (C-contiguous), or
            any float32 array when ``has_prev`` is False (not read).
        has_prev: compute the update's sum of squares.
        out: float64[7, L]; column i receives, over the finite weights, S1..S4 = sum w^k
            (float64 accumulation, not saturated: +-inf on overflow), then
            sum (float32(w) - prev)^2 over the finite differences (0 without ``prev``;
            computed in float64, so exact differences of float32 values), then min and max
            (exact; +inf / -inf when the layer has no finite weight).
        nonfinite: int64[L]; element i receives the number of NaN/+-Inf weights.
        i: layer index, 0 <= i < L (not checked: the caller guarantees it).
"""

weights_f32.__doc__ += _WEIGHTS_DOC.format(dtype="float32") + "{hist}"
weights_f64.__doc__ += _WEIGHTS_DOC.format(dtype="float64") + "{hist}"


_ARGS_DOC = """
    Args:
        x: {dtype}[n], C-contiguous, n >= 1 (the caller flattens any shape).
        out: float64[5, L]; column i receives numel, sum |g|, sum g^2 (both over the
            finite elements, float64 accumulation, saturated at the largest double),
            max |g| over the finite elements (0 when none) and the number of NaN/+-Inf
            elements. The counts are exact as float64 up to 2^53.
        i: layer index, 0 <= i < L (not checked: the caller guarantees it).
"""


@njit(cache=True, nogil=True)
def summarize_f32(x, out, i):  # pragma: no cover - compiled
    """Summarise the float32 layer ``x`` into column ``i`` of ``out``."""
    _summarize_into(x, x.view(np.uint32), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000),
                    np.uint32(23), 127, out, i,
                    np.zeros((0, 1), dtype=np.int64), np.zeros(0, dtype=np.uint16), 0)


@njit(cache=True, nogil=True)
def summarize_f64(x, out, i):  # pragma: no cover - compiled
    """Summarise the float64 layer ``x`` into column ``i`` of ``out``."""
    _summarize_into(x, x.view(np.uint64), np.uint64(0x7FFFFFFFFFFFFFFF),
                    np.uint64(0x7FF0000000000000), np.uint64(52), 1023, out, i,
                    np.zeros((0, 1), dtype=np.int64), np.zeros(0, dtype=np.uint16), 0)


@njit(cache=True, nogil=True)
def summarize_hist_f32(x, out, i, counts, lut, hist_min):  # pragma: no cover - compiled
    """:func:`summarize_f32` plus the exponent histogram of ``x`` into ``counts[i]``."""
    _summarize_into(x, x.view(np.uint32), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000),
                    np.uint32(23), 127, out, i, counts, lut, hist_min)


@njit(cache=True, nogil=True)
def summarize_hist_f64(x, out, i, counts, lut, hist_min):  # pragma: no cover - compiled
    """:func:`summarize_f64` plus the exponent histogram of ``x`` into ``counts[i]``."""
    _summarize_into(x, x.view(np.uint64), np.uint64(0x7FFFFFFFFFFFFFFF),
                    np.uint64(0x7FF0000000000000), np.uint64(52), 1023, out, i,
                    counts, lut, hist_min)


_HIST_ARGS_DOC = """
        counts: int64[L, B]; row i receives the layer's exponent histogram (layout:
            ``producer.summary.exp_hist_edges``; NaN/Inf not counted).
        lut: uint16[2^(1 + exponent bits)]: histogram column of ``bits >> significand
            bits`` (sign and biased exponent field), with B + 1 for a zero field (zero or
            subnormal, re-binned exactly) and B for the all-ones field (NaN/Inf, dropped).
        hist_min: EXP_HIST_MIN, the exponent of column 2 (used to bin subnormals).
"""

summarize_f32.__doc__ += _ARGS_DOC.format(dtype="float32")
summarize_f64.__doc__ += _ARGS_DOC.format(dtype="float64")
summarize_hist_f32.__doc__ += _ARGS_DOC.format(dtype="float32") + _HIST_ARGS_DOC
summarize_hist_f64.__doc__ += _ARGS_DOC.format(dtype="float64") + _HIST_ARGS_DOC
weights_f32.__doc__ = weights_f32.__doc__.format(hist=_HIST_ARGS_DOC)
weights_f64.__doc__ = weights_f64.__doc__.format(hist=_HIST_ARGS_DOC)
