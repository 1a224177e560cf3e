"""Numba kernels behind :func:`producer.summary.summarize` (the fast path).

This module imports numba at import time, so :mod:`producer.summary` imports it lazily, on
the first summary, and falls back to its pure-NumPy path when numba is missing or broken
(see ``producer.summary.set_backend``). Every kernel is ``@njit(cache=True, nogil=True)``:
compiled on first use for each (dtype, layout) and cached on disk next to this file (or in
``NUMBA_CACHE_DIR``), and it releases the GIL so the producer's sender thread keeps running
while the training thread summarises.

One call summarises one whole layer in one read of its memory, in blocks of ``BLOCK``
elements (2/4 KiB, L1-resident; small blocks keep the memory stream steady while the
per-block passes run and make a NaN cheap):

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
   read of the layer, and BLOCK elements of masked work per NaN): elements whose exponent
   field is all ones (IEEE 754 NaN/Inf) are counted and excluded; sums that still overflow
   saturate at the largest double.

Weight statistics (:func:`weights_f32`, :func:`weights_f64`) use the same scheme. Per
block: one vectorised pass for S1..S4 and, against the kept float32 copy, the update's
squared differences (all float64; the masked variant only for a block whose sums came out
non-finite); then, on the L1-resident block, the exponent histogram, whose NaN/Inf column
tells whether the block needs the masked extremes; the min / max as integer order keys of
the bit patterns (int32 lanes for float32, which vectorise where float min / max with NaN
semantics do not); and, on request, the refresh of the kept copy (``prev = float32(w)``),
so stats + update norm + refresh read each weight once and read and write the copy once.

The optional exponent histogram is counted in the same block loop, while the block is in L1:
each element's biased exponent field is mapped through a lookup table to its column (see
``producer.summary`` for the bin layout) and counted in one of ``TABLES`` interleaved count
tables; elements with a zero exponent field (zeros and subnormals) are re-binned exactly
per block, only in blocks that contain any. This scalar scatter (about 1.5 cycles per
element) is the largest single cost of the weight statistics.

Threads: every kernel runs on the calling thread only (no ``parallel``/``prange``): the
producer summarises on the training thread, which should not take cores from the data
loader or the framework's own threads.

Float16 is not a numba type: ``producer.summary`` converts float16 layers to float32 (exact,
NaN/Inf preserved) and uses the float32 kernels.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.extending import overload

__all__ = [
    "BLOCK",
    "TABLES",
    "summarize_f32",
    "summarize_f64",
    "summarize_hist_f32",
    "summarize_hist_f64",
    "weights_f32",
    "weights_f64",
]

#: Elements per block (float32: 2 KiB, float64: 4 KiB), the unit of every pass: the fast
#: sums are tested for a non-finite result per block and only such a block is redone
#: masked (a NaN costs one masked pass over BLOCK elements, not over the layer); the
#: histogram, extremes and copy passes re-read the block while it is in L1. Small blocks
#: keep the memory stream steady (the next block's lines are fetched while the current
#: block's passes run) and make a NaN cheap. 1024 and 2048 measured no faster on the cases
#: of ``bench/producer_overhead.py``; 4096 (one pass per block before) was slower for the
#: weight statistics of large layers.
BLOCK = 512
#: Count tables of the exponent histogram (see :func:`_block_hist`, unrolled for 4).
TABLES = 4

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
def _table_column(tables, c):  # pragma: no cover - compiled
    """Column ``c`` of the TABLES count tables of :func:`_block_hist`, summed."""
    width = tables.size // TABLES
    return tables[c] + tables[width + c] + tables[2 * width + c] + tables[3 * width + c]


@njit(cache=True, nogil=True)
def _block_hist(x, u, absmask, expmask, mant_bits, lut, hist_min, tables):  # pragma: no cover
    """Count one block's exponent columns into ``tables``; exact zero/subnormal fix-up.

    tables: int64[TABLES * (B + 2)], TABLES count tables of B + 2 columns side by side
    (element j goes to table j % TABLES, so a run of equal columns does not serialise on
    one counter); column B collects NaN/Inf (dropped from the histogram, counted as
    non-finite), column B + 1 the elements with a zero exponent field, which are re-binned
    here: zeros to column 0, subnormals to the column of their exponent (from frexp of the
    exact float64 value).
    """
    width = tables.size // TABLES
    nbins = width - 2
    col_exp0 = nbins + 1
    t0 = tables[:width]
    t1 = tables[width:2 * width]
    t2 = tables[2 * width:3 * width]
    t3 = tables[3 * width:]
    before = _table_column(tables, col_exp0)
    n = u.size
    i = 0
    while i + TABLES <= n:
        t0[lut[u[i] >> mant_bits]] += 1
        t1[lut[u[i + 1] >> mant_bits]] += 1
        t2[lut[u[i + 2] >> mant_bits]] += 1
        t3[lut[u[i + 3] >> mant_bits]] += 1
        i += TABLES
    while i < n:
        t0[lut[u[i] >> mant_bits]] += 1
        i += 1
    exp0 = _table_column(tables, col_exp0) - before
    if exp0 == 0:
        return
    zeros = _count_zeros(u, absmask)
    tables[0] += zeros
    if exp0 == zeros:
        return
    for j in range(n):
        b = u[j] & absmask
        if (b & expmask) == 0 and b != 0:
            k = math.frexp(abs(np.float64(x[j])))[1] - 1  # |g| in [2^k, 2^(k+1))
            tables[min(max(k - hist_min + 2, 1), nbins - 1)] += 1


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
    tables = np.zeros(TABLES * (nbins + 2) if hist else 0, dtype=np.int64)
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
            counts[i, c] = _table_column(tables, c)


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
def _wsums_fast(x, p, has_prev):  # pragma: no cover - compiled
    """Power sums S1..S4 of one run of weights and, with ``has_prev``, the update's
    sum (float32(w) - p)^2, all in float64; no finiteness test (a NaN/Inf weight makes S2
    non-finite, a NaN/Inf difference the update sum, and the caller redoes the run)."""
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    s4 = 0.0
    su = 0.0
    for j in range(x.size):
        v = np.float64(x[j])
        v2 = v * v
        s1 += v
        s2 += v2
        s3 += v2 * v
        s4 += v2 * v2
        if has_prev:
            d = np.float64(np.float32(x[j])) - np.float64(p[j])
            su += d * d
    return s1, s2, s3, s4, su


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _wsums_masked(x, u, p, expmask, has_prev):  # pragma: no cover - compiled
    """:func:`_wsums_fast` over the finite weights only (NaN/Inf: exponent field all ones,
    IEEE 754-2019 section 3.4) and the finite differences only."""
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    s4 = 0.0
    su = 0.0
    for j in range(x.size):
        ok = (u[j] & expmask) != expmask
        v = np.float64(x[j]) if ok else 0.0
        v2 = v * v
        s1 += v
        s2 += v2
        s3 += v2 * v
        s4 += v2 * v2
        if has_prev:
            d = np.float64(np.float32(x[j])) - np.float64(p[j])
            su += d * d if math.isfinite(d) else 0.0
    return s1, s2, s3, s4, su


def _cast_like(value, like):  # pragma: no cover - replaced by the overload when compiled
    """``value`` converted to the type of ``like`` (integers: two's-complement truncation)."""
    return type(like)(value)


@overload(_cast_like)
def _cast_like_numba(value, like):  # pragma: no cover - compiled
    """Compiled :func:`_cast_like`: a cast to the numba type of ``like``, so that keys of
    float32 bit patterns stay int32 in the loops (8 lanes of an AVX2 integer min / max
    instead of 4 emulated int64 lanes)."""
    target = like
    return lambda value, like: target(value)


@njit(cache=True, nogil=True)
def _wkeys(k, keymask, kmin, kmax):  # pragma: no cover - compiled
    """Smallest and largest order key (:func:`_order_key`, in the integer type of ``k``)
    of a block without NaN/Inf, starting from ``kmin`` / ``kmax`` (integer min / max, which
    vectorise where float min / max with NaN semantics do not)."""
    for j in range(k.size):
        kk = _cast_like(_order_key(k[j], keymask), kmin)
        kmin = min(kmin, kk)
        kmax = max(kmax, kk)
    return kmin, kmax


@njit(cache=True, nogil=True)
def _wkeys_masked(k, u, expmask, keymask, kmin, kmax):  # pragma: no cover - compiled
    """:func:`_wkeys` over the finite elements of a block only."""
    for j in range(k.size):
        ok = (u[j] & expmask) != expmask
        kk = _cast_like(_order_key(k[j], keymask), kmin)
        kmin = kk if (ok and kk < kmin) else kmin
        kmax = kk if (ok and kk > kmax) else kmax
    return kmin, kmax


@njit(cache=True, nogil=True)
def _refresh(x, p):  # pragma: no cover - compiled
    """p = float32(x), element by element (the kept copy becomes this step's weights)."""
    for j in range(x.size):
        p[j] = np.float32(x[j])


@njit(cache=True, nogil=True)
def _weights_into(
    x, u, k, absmask, expmask, keymask, mant_bits, bias, prev, has_prev, refresh, out,
    nonfinite, i, counts, lut, hist_min,
):  # pragma: no cover - compiled
    """One weight layer in one read of ``x`` (and of ``prev``): per block the vectorised
    power sums and update sum, redone masked only when they came out non-finite; then,
    while the block is in L1, the exponent histogram (whose NaN/Inf column tells whether
    the block's extremes need the masked variant), the extremes and, with ``refresh``, the
    copy ``prev = float32(x)``. Block sums are added with Neumaier compensation
    (:func:`_add`)."""
    n = x.size
    acc = np.zeros(5)  # S1..S4, update
    comp = np.zeros(5)
    # Key sentinels in the integer type of k: the largest / smallest integer are the keys
    # of NaN bit patterns, never of a finite weight.
    key_max = _cast_like(keymask, k[0])
    key_min = ~key_max
    kmin = key_max
    kmax = key_min
    nbins = counts.shape[1]
    tables = np.zeros(TABLES * (nbins + 2), dtype=np.int64)
    bad = 0
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        sums = _wsums_fast(x[lo:hi], prev[lo:hi], has_prev)
        if not (math.isfinite(sums[1]) and math.isfinite(sums[4])):
            # a NaN/Inf weight or difference (or an overflowing float64 square)
            sums = _wsums_masked(x[lo:hi], u[lo:hi], prev[lo:hi], expmask, has_prev)
        for r in range(5):
            acc[r], comp[r] = _add(acc[r], comp[r], sums[r])
        _block_hist(x[lo:hi], u[lo:hi], absmask, expmask, mant_bits, lut, hist_min, tables)
        block_bad = _table_column(tables, nbins) - bad
        bad += block_bad
        if block_bad == 0:
            kmin, kmax = _wkeys(k[lo:hi], keymask, kmin, kmax)
        else:
            kmin, kmax = _wkeys_masked(k[lo:hi], u[lo:hi], expmask, keymask, kmin, kmax)
        if refresh:
            _refresh(x[lo:hi], prev[lo:hi])
    for r in range(5):
        out[r, i] = acc[r] + comp[r] if math.isfinite(acc[r]) else acc[r]
    out[5, i] = _key_to_float(kmin, keymask, mant_bits, bias) if kmin != key_max else math.inf
    out[6, i] = _key_to_float(kmax, keymask, mant_bits, bias) if kmax != key_min else -math.inf
    for c in range(nbins):
        counts[i, c] = _table_column(tables, c)
    nonfinite[i] = bad


@njit(cache=True, nogil=True)
def weights_f32(
    x, prev, has_prev, refresh, out, nonfinite, i, counts, lut, hist_min,
):  # pragma: no cover - compiled
    """Weight statistics of the float32 layer ``x`` into column ``i`` of ``out``."""
    _weights_into(x, x.view(np.uint32), x.view(np.int32), np.uint32(0x7FFFFFFF),
                  np.uint32(0x7F800000), np.int64(0x7FFFFFFF), np.uint32(23), 127, prev,
                  has_prev, refresh, out, nonfinite, i, counts, lut, hist_min)


@njit(cache=True, nogil=True)
def weights_f64(
    x, prev, has_prev, refresh, out, nonfinite, i, counts, lut, hist_min,
):  # pragma: no cover - compiled
    """Weight statistics of the float64 layer ``x`` into column ``i`` of ``out``."""
    _weights_into(x, x.view(np.uint64), x.view(np.int64), np.uint64(0x7FFFFFFFFFFFFFFF),
                  np.uint64(0x7FF0000000000000), np.int64(0x7FFFFFFFFFFFFFFF),
                  np.uint64(52), 1023, prev, has_prev, refresh, out, nonfinite, i, counts,
                  lut, hist_min)


_WEIGHTS_DOC = """
    Args:
        x: {dtype}[n], C-contiguous, n >= 1 (the caller flattens any shape).
        prev: float32[n] the same layer at the previous recorded step (C-contiguous), or
            any float32 array when ``has_prev`` and ``refresh`` are False (not read).
        has_prev: compute the update's sum of squares.
        refresh: overwrite ``prev`` with float32(x) (round to nearest) in the same pass,
            after the update's sums of each block are final.
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
