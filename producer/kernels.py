"""Numba kernels behind :func:`producer.summary.summarize` (the fast path).

This module imports numba at import time, so :mod:`producer.backend` imports it lazily, on
the first summary, and the producer falls back to its pure-NumPy path when numba is missing
or broken (see :func:`producer.backend.set_backend`). Every kernel is
``@njit(cache=True, nogil=True)``: compiled on first use for each (dtype, layout) and
cached on disk next to this file (or in ``NUMBA_CACHE_DIR``), and it releases the GIL so
the producer's sender thread keeps running while the training thread summarises.

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
   field is all ones (IEEE 754 NaN/Inf) are counted and excluded, the NaN among them (a
   non-zero mantissa) counted apart; a sum that still overflows (float64 squares above
   ~1.8e308) is +inf, as in the f64 arithmetic of the reference (trustformers-debug,
   gradient_flow), never a capped number.

Weight statistics (:func:`weights_f32`, :func:`weights_f64`) use the same scheme. Per
block: one vectorised pass for S1..S4 and, against the kept float32 copy, the update's
squared differences (all float64; the masked variant only for a block whose sums came out
non-finite, which a NaN/Inf weight always makes them); then, on the L1-resident block, the
min / max as integer order keys of the bit patterns (int32 lanes for float32, which
vectorise where float min / max with NaN semantics do not) with the smallest magnitude;
the exponent histogram; and, on request, the refresh of the kept copy
(``prev = float32(w)``), so stats + update norm + refresh read each weight once and read
and write the copy once.

The optional exponent histogram is counted in the same block loop, while the block is in L1:
each element's key, its sign and binary32 exponent field (the top 9 bits of a float32; a
clamped re-biasing for float64), is counted in one of ``TABLES`` interleaved int32 count
tables at fixed offsets; at the end of the layer the keys the layer can have touched are
folded into histogram columns (``schemas.stats.exponent_lut``). Elements below 2^-126
(zeros, subnormals) share key 0 and are re-binned exactly, only in blocks that hold one.
This scalar scatter is the largest single cost of the weight statistics (figures:
``bench/README.md``).

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
    "FOLD",
    "KEYS",
    "STRIDE",
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
#: block's passes run) and make a NaN cheap (the sizes compared: ``bench/README.md``).
BLOCK = 512
#: Count tables of the exponent histogram (see :func:`_block_hist`, unrolled for 8).
TABLES = 8
#: Keys of one count table: sign bit and the 8-bit binary32 exponent field (:func:`_hist_key`).
KEYS = 512
#: Distance between two count tables, in counters: KEYS plus one cache line of padding, so
#: that the same key in two tables is never a multiple of 4 KiB apart (loads 4 KiB apart
#: from a pending store wait for it on x86).
STRIDE = KEYS + 16
#: Elements between two folds of the int32 count tables into the int64 histogram, so that
#: no counter can overflow (each sees at most FOLD / TABLES < 2^31 increments).
FOLD = BLOCK << 20

# Only reassociation and FMA contraction: NaN/Inf semantics stay IEEE (no nnan/ninf/nsz).
# (numba wants a set here, not a frozenset.)
_FASTMATH = {"reassoc", "contract"}

# The histogram layout (EXP_HIST_MIN, number of columns, exponent lookup tables) is passed
# in by producer.summary at run time, never frozen into this module's cached machine code,
# so changing the layout there cannot leave a stale numba cache behind.


def _cast_like(value, like):  # pragma: no cover - replaced by the overload when compiled
    """``value`` converted to the type of ``like`` (integers: two's-complement truncation)."""
    return type(like)(value)


@overload(_cast_like)
def _cast_like_numba(value, like):  # pragma: no cover - compiled
    """Compiled :func:`_cast_like`: a cast to the numba type of ``like``. numba widens
    arithmetic on 32-bit integers to 64 bits; casting back keeps the running maxima /
    minima of the kernels in the format's width (8 AVX2 lanes for float32 instead of 4
    lanes of an emulated 64-bit compare)."""
    target = like
    return lambda value, like: target(value)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _block_fast(x, u, absmask):  # pragma: no cover - compiled
    # The magnitude bits stay in the width of the format (numba widens uint32 & uint32 to
    # 64 bits, and a 64-bit unsigned max is emulated on 4 AVX2 lanes), so the max / min
    # below are vpmaxud / vpminud on 8 lanes for float32.
    sum_abs = 0.0
    sum_sq = 0.0
    top = _cast_like(0, absmask)
    low = absmask
    for i in range(x.size):
        v = np.float64(x[i])
        sum_abs += abs(v)
        sum_sq += v * v
        b = _cast_like(u[i] & absmask, absmask)
        top = b if b > top else top
        low = b if b < low else low
    return sum_abs, sum_sq, top, low


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _block_masked(x, u, absmask, expmask):  # pragma: no cover - compiled
    sum_abs = 0.0
    sum_sq = 0.0
    zero = _cast_like(0, absmask)
    top = zero
    bad = 0
    nan = 0
    for i in range(x.size):
        b = _cast_like(u[i] & absmask, absmask)
        ok = (b & expmask) != expmask
        v = np.float64(x[i]) if ok else 0.0
        sum_abs += abs(v)
        sum_sq += v * v
        bad += 0 if ok else 1
        nan += 1 if b > expmask else 0  # exponent all ones and a non-zero mantissa
        b = b if ok else zero
        top = b if b > top else top
    return sum_abs, sum_sq, top, bad, nan


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


def _hist_key(bits):  # pragma: no cover - replaced by the overload when compiled
    """Histogram key (0..511) of an IEEE 754 bit pattern given as a NumPy unsigned or
    signed integer scalar of the format's width: see the compiled overload."""
    width = np.asarray(bits).dtype.itemsize * 8
    b = int(bits) & ((1 << width) - 1)
    if width == 32:
        return b >> 23
    e = (b >> 52) & 0x7FF
    k = 255 if e == 2047 else min(max(e - 896, 0), 254)
    return ((b >> 63) << 8) | k


@overload(_hist_key)
def _hist_key_numba(bits):  # pragma: no cover - compiled
    """Compiled :func:`_hist_key`: ``sign * 256 + e`` with ``e`` the binary32 biased
    exponent field of the value (IEEE 754-2019 section 3.4).

    binary32: the top 9 bits themselves (``bits >> 23``), no arithmetic and no lookup.
    binary64: the exponent field E is moved to the binary32 bias (``E - 896``) and clamped
    to ``[0, 254]``, 255 for the all-ones field (NaN/Inf): values below 2^-126 land on key 0
    with zeros and subnormals (re-binned exactly, :func:`_block_hist`), values above the
    binary32 range on 254, which is in the last (overflow) column like everything from
    2^EXP_HIST_MAX up.
    """
    if bits.bitwidth == 32:
        return lambda bits: bits >> np.uint32(23)

    def key64(bits):
        e = np.int64((bits >> np.uint64(52)) & np.uint64(0x7FF))
        k = min(max(e - 896, 0), 254)
        k = 255 if e == 2047 else k
        return (np.int64(bits >> np.uint64(63)) << 8) | k

    return key64


@njit(cache=True, nogil=True)
def _key_count(tables, key):  # pragma: no cover - compiled
    """Count of ``key`` (and of the same key with the sign bit set) over the TABLES count
    tables of :func:`_block_hist`."""
    total = 0
    for t in range(TABLES):
        total += tables[t * STRIDE + key] + tables[t * STRIDE + 256 + key]
    return total


@njit(cache=True, nogil=True)
def _block_hist(x, u, absmask, tables, row, hist_min, tiny):  # pragma: no cover - compiled
    """Count one block's histogram keys (:func:`_hist_key`) into ``tables``.

    tables: int32[TABLES * STRIDE], TABLES count tables of the KEYS keys, STRIDE apart;
    element j goes to table j % TABLES, so a run of equal keys (weights near one magnitude)
    does not serialise on one counter. The tables sit at compile-time offsets and every key
    is below KEYS, so the compiler can see that the increments of one round never alias
    and overlaps them, which a lookup table from the bit pattern to the column (one more
    load per element, at offsets the compiler cannot tell apart) would prevent.
    row: int64[B], the layer's histogram row. :func:`_fold_hist` puts every count of the
    zero key in column 0 (zeros); when ``tiny`` (the caller saw a magnitude below 2^-126,
    the smallest binary32 normal, in this block: a zero, a subnormal or, binary64, a
    normal below that), each such non-zero element found here moves one count from column
    0 to the column of its exponent (from frexp of the exact float64 value).
    """
    n = u.size
    i = 0
    while i + TABLES <= n:
        tables[_hist_key(u[i])] += 1
        tables[STRIDE + _hist_key(u[i + 1])] += 1
        tables[2 * STRIDE + _hist_key(u[i + 2])] += 1
        tables[3 * STRIDE + _hist_key(u[i + 3])] += 1
        tables[4 * STRIDE + _hist_key(u[i + 4])] += 1
        tables[5 * STRIDE + _hist_key(u[i + 5])] += 1
        tables[6 * STRIDE + _hist_key(u[i + 6])] += 1
        tables[7 * STRIDE + _hist_key(u[i + 7])] += 1
        i += TABLES
    for j in range(i, n):  # a for loop: a while loop here slows the unrolled loop above
        tables[_hist_key(u[j])] += 1
    if not tiny:
        return
    nbins = row.size
    for j in range(n):
        # (the key of u[j] itself: numba widens u[j] & absmask to 64 bits)
        if (u[j] & absmask) != 0 and (_hist_key(u[j]) & 255) == 0:
            k = math.frexp(abs(np.float64(x[j])))[1] - 1  # |g| in [2^k, 2^(k+1))
            row[min(max(k - hist_min + 2, 1), nbins - 1)] += 1
            row[0] -= 1


@njit(cache=True, nogil=True)
def _tiny_bits(mant_bits, bias):  # pragma: no cover - compiled
    """Magnitude bits (int64) of 2^-126, the smallest binary32 normal, in a format with
    ``mant_bits`` significand bits and exponent bias ``bias``: a block holds a magnitude
    below it (a zero key of :func:`_hist_key`) iff its smallest magnitude bits are below
    this (IEEE 754-2019 section 3.4: magnitudes order as their bit patterns)."""
    return np.int64(bias - 126) << np.int64(mant_bits)


@njit(cache=True, nogil=True)
def _fold_hist(tables, lut, row, low, top, absmask):  # pragma: no cover - compiled
    """Add the key counts of ``tables`` to the histogram row ``row`` (int64[B]) and zero
    the tables again.

    Only the keys that can hold counts are visited: the exponent fields from that of
    ``low`` to that of ``top`` (the smallest and largest finite magnitude bits counted so
    far, as integers; IEEE 754 magnitudes order as their bit patterns; both are cast to
    the type of ``absmask``, the format's unsigned bits, which picks the key function of
    :func:`_hist_key`, since numba widens 32-bit integer arithmetic), for both signs,
    and the NaN/Inf key (zeroed, not counted). Weights span some 30 of the 254 exponent
    fields, so the fold costs a tenth of a full one on a layer of a few thousand elements.
    Each key's TABLES counters are added and its column read from ``lut`` (the binary32
    table of ``schemas.stats.exponent_lut``): the zero exponent field goes to column 0.
    """
    nbins = row.size
    lo_key = _hist_key(_cast_like(low, absmask)) & 255
    hi_key = min(_hist_key(_cast_like(top, absmask)) & 255, 254)
    for sign in range(0, KEYS, 256):
        for key in range(sign + min(lo_key, hi_key), sign + hi_key + 1):
            total = 0
            for t in range(TABLES):
                total += tables[t * STRIDE + key]
                tables[t * STRIDE + key] = 0
            if total != 0:
                c = np.int64(lut[key])
                row[c if c < nbins else 0] += total  # c == B + 1: the zero field
        for t in range(TABLES):
            tables[t * STRIDE + sign + 255] = 0


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
    x, u, absmask, expmask, mant_bits, bias, out, i, counts, tables, lut, hist_min
):  # pragma: no cover - compiled
    """One layer in one read: per block the fast pass (+ histogram), and the masked pass
    over the same (L1-resident) block only when the block's sums came out non-finite."""
    n = x.size
    sum_abs = 0.0
    comp_abs = 0.0
    sum_sq = 0.0
    comp_sq = 0.0
    top = _cast_like(0, absmask)
    hist = counts.shape[0] > 0
    tiny_bits = _tiny_bits(mant_bits, bias)
    layer_low = absmask
    bad = 0
    nan = 0
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        a, q, t, low = _block_fast(x[lo:hi], u[lo:hi], absmask)
        if not (math.isfinite(a) and math.isfinite(q)):
            # A NaN/Inf element (or, float64 only, a square that overflowed): redo this
            # block, still in L1, with masking; the other blocks keep their fast sums.
            a, q, t, nb, nn = _block_masked(x[lo:hi], u[lo:hi], absmask, expmask)
            bad += nb
            nan += nn
        sum_abs, comp_abs = _add(sum_abs, comp_abs, a)
        sum_sq, comp_sq = _add(sum_sq, comp_sq, q)
        top = t if t > top else top
        if hist:
            layer_low = low if low < layer_low else layer_low
            tiny = np.int64(low) < tiny_bits
            _block_hist(x[lo:hi], u[lo:hi], absmask, tables, counts[i], hist_min, tiny)
            if hi % FOLD == 0:
                _fold_hist(tables, lut, counts[i], layer_low, top, absmask)
    sum_abs = sum_abs + comp_abs  # +inf when it overflowed (_add then keeps comp at 0)
    sum_sq = sum_sq + comp_sq
    out[0, i] = n
    out[1, i] = sum_abs
    out[2, i] = sum_sq
    out[3, i] = _bits_to_float(top, mant_bits, bias)
    out[4, i] = bad
    out[5, i] = nan
    if hist:
        _fold_hist(tables, lut, counts[i], layer_low, top, absmask)


def _order_key(bits):  # pragma: no cover - replaced by the overload when compiled
    """Order key of an IEEE 754 bit pattern given as a NumPy signed integer scalar of the
    format's width (same type returned): see the compiled overload."""
    ity = np.asarray(bits).dtype.type
    width = np.dtype(ity).itemsize * 8
    b = int(bits)
    return ity(b ^ ((b >> (width - 1)) & ((1 << (width - 1)) - 1)))


@overload(_order_key)
def _order_key_numba(bits):  # pragma: no cover - compiled
    """Compiled :func:`_order_key`: the signed-integer key of an IEEE 754 bit pattern
    (given as a signed integer of its width) whose integer order is the numeric order of
    finite values (IEEE 754-2019 section 3.4: sign-magnitude encoding): negative values get
    their magnitude bits flipped, ``bits ^ ((bits >> (w - 1)) & (2^(w-1) - 1))``. The map is
    its own inverse; -0 sorts just below +0. Every step is cast back to the input's width:
    numba widens int32 arithmetic to int64, and int32 keys are what lets the min / max
    loops run on 8 AVX2 lanes instead of 4."""
    ity = bits
    shift = bits.bitwidth - 1
    mask = (1 << shift) - 1

    def impl(bits):
        return ity(bits ^ ity(ity(bits >> ity(shift)) & ity(mask)))

    return impl


def _magnitude(bits):  # pragma: no cover - replaced by the overload when compiled
    """Magnitude bits (sign bit cleared, same type) of an IEEE 754 bit pattern given as a
    NumPy integer scalar: see the compiled overload."""
    ity = np.asarray(bits).dtype.type
    width = np.dtype(ity).itemsize * 8
    return ity(int(bits) & ((1 << (width - 1)) - 1))


@overload(_magnitude)
def _magnitude_numba(bits):  # pragma: no cover - compiled
    """Compiled :func:`_magnitude`: ``bits & (2^(w-1) - 1)`` (sign bit cleared) in the
    integer type of ``bits`` (see :func:`_order_key_numba` for why the width is kept)."""
    ity = bits
    mask = (1 << (bits.bitwidth - 1)) - 1

    def impl(bits):
        return ity(bits & ity(mask))

    return impl


@njit(cache=True, nogil=True)
def _key_to_float(key, absmask, mant_bits, bias):  # pragma: no cover - compiled
    """Value (float64, exact) of a finite order key of :func:`_order_key`."""
    b = np.int64(_order_key(key))  # back to the bit pattern, sign-extended
    value = _bits_to_float(b & np.int64(absmask), mant_bits, bias)
    return -value if b < 0 else value


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


@njit(cache=True, nogil=True)
def _wkeys(k, kmin, kmax, amin):  # pragma: no cover - compiled
    """Smallest and largest order key (:func:`_order_key`, in the integer type of ``k``)
    of a block without NaN/Inf, starting from ``kmin`` / ``kmax`` (integer min / max, which
    vectorise where float min / max with NaN semantics do not), and the smallest magnitude
    bits (:func:`_magnitude`), starting from ``amin``."""
    for j in range(k.size):
        kk = _order_key(k[j])
        kmin = kk if kk < kmin else kmin
        kmax = kk if kk > kmax else kmax
        a = _magnitude(k[j])
        amin = a if a < amin else amin
    return kmin, kmax, amin


@njit(cache=True, nogil=True)
def _wkeys_masked(k, u, expmask, kmin, kmax, amin):  # pragma: no cover - compiled
    """:func:`_wkeys` over the finite elements of a block only (the smallest magnitude
    over all: a NaN/Inf magnitude is above every finite one)."""
    for j in range(k.size):
        ok = (u[j] & expmask) != expmask
        kk = _order_key(k[j])
        kmin = kk if (ok and kk < kmin) else kmin
        kmax = kk if (ok and kk > kmax) else kmax
        a = _magnitude(k[j])
        amin = a if a < amin else amin
    return kmin, kmax, amin


@njit(cache=True, nogil=True)
def _top_magnitude(kmin, kmax, key_max):  # pragma: no cover - compiled
    """Largest magnitude bits (int64) of the finite values whose order keys
    (:func:`_order_key`) span ``kmin..kmax``; 0 when there is none (``kmin == key_max``)."""
    if kmin == key_max:
        return np.int64(0)
    return max(np.int64(_magnitude(_order_key(kmin))), np.int64(_magnitude(_order_key(kmax))))


@njit(cache=True, nogil=True)
def _refresh(x, p):  # pragma: no cover - compiled
    """p = float32(x), element by element (the kept copy becomes this step's weights)."""
    for j in range(x.size):
        p[j] = np.float32(x[j])


@njit(cache=True, nogil=True)
def _weights_into(
    x, u, k, absmask, expmask, keymask, mant_bits, bias, prev, has_prev, refresh, out, i,
    counts, tables, lut, hist_min,
):  # pragma: no cover - compiled
    """One weight layer in one read of ``x`` (and of ``prev``): per block the vectorised
    power sums and update sum, redone masked only when they came out non-finite (then the
    block's NaN/Inf weights are counted from the histogram's NaN/Inf key and its extremes
    take the masked variant); then, while the block is in L1, the exponent histogram, the
    extremes and, with ``refresh``, the copy ``prev = float32(x)``. Block sums are added
    with Neumaier compensation (:func:`_add`); the histogram's count tables are folded
    into ``counts[i]`` at the end (and every FOLD elements)."""
    n = x.size
    acc = np.zeros(5)  # S1..S4, update
    comp = np.zeros(5)
    # Key sentinels in the integer type of k: the largest / smallest integer are the keys
    # of NaN bit patterns, never of a finite weight.
    key_max = _cast_like(keymask, k[0])
    key_min = _cast_like(~key_max, k[0])  # (~ alone widens an int32 to int64)
    kmin = key_max
    kmax = key_min
    tiny_bits = _tiny_bits(mant_bits, bias)
    layer_low = key_max  # smallest magnitude bits so far
    bad = 0
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        sums = _wsums_fast(x[lo:hi], prev[lo:hi], has_prev)
        finite = math.isfinite(sums[1]) and math.isfinite(sums[4])
        if not finite:
            # a NaN/Inf weight or difference (or an overflowing float64 square)
            sums = _wsums_masked(x[lo:hi], u[lo:hi], prev[lo:hi], expmask, has_prev)
        for r in range(5):
            acc[r], comp[r] = _add(acc[r], comp[r], sums[r])
        # A NaN/Inf weight makes S2 non-finite, so a block with finite sums has none; the
        # others count theirs from the histogram's NaN/Inf key.
        if finite:
            kmin, kmax, amin = _wkeys(k[lo:hi], kmin, kmax, key_max)
            nan_before = 0
        else:
            kmin, kmax, amin = _wkeys_masked(k[lo:hi], u[lo:hi], expmask, kmin, kmax, key_max)
            nan_before = _key_count(tables, 255)
        _block_hist(x[lo:hi], u[lo:hi], absmask, tables, counts[i], hist_min,
                    np.int64(amin) < tiny_bits)
        if not finite:
            bad += _key_count(tables, 255) - nan_before
        layer_low = amin if amin < layer_low else layer_low
        if hi % FOLD == 0:
            _fold_hist(tables, lut, counts[i], layer_low,
                       _top_magnitude(kmin, kmax, key_max), absmask)
        if refresh:
            _refresh(x[lo:hi], prev[lo:hi])
    for r in range(5):
        out[r, i] = acc[r] + comp[r] if math.isfinite(acc[r]) else acc[r]
    out[5, i] = _key_to_float(kmin, absmask, mant_bits, bias) if kmin != key_max else math.inf
    out[6, i] = _key_to_float(kmax, absmask, mant_bits, bias) if kmax != key_min else -math.inf
    _fold_hist(tables, lut, counts[i], layer_low,
                       _top_magnitude(kmin, kmax, key_max), absmask)
    out[7, i] = bad


@njit(cache=True, nogil=True)
def weights_f32(
    x, prev, has_prev, refresh, out, i, counts, tables, lut, hist_min,
):  # pragma: no cover - compiled
    """Weight statistics of the float32 layer ``x`` into column ``i`` of ``out``."""
    _weights_into(x, x.view(np.uint32), x.view(np.int32), np.uint32(0x7FFFFFFF),
                  np.uint32(0x7F800000), np.int64(0x7FFFFFFF), np.uint32(23), 127, prev,
                  has_prev, refresh, out, i, counts, tables, lut, hist_min)


@njit(cache=True, nogil=True)
def weights_f64(
    x, prev, has_prev, refresh, out, i, counts, tables, lut, hist_min,
):  # pragma: no cover - compiled
    """Weight statistics of the float64 layer ``x`` into column ``i`` of ``out``."""
    _weights_into(x, x.view(np.uint64), x.view(np.int64), np.uint64(0x7FFFFFFFFFFFFFFF),
                  np.uint64(0x7FF0000000000000), np.int64(0x7FFFFFFFFFFFFFFF),
                  np.uint64(52), 1023, prev, has_prev, refresh, out, i, counts, tables,
                  lut, hist_min)


_WEIGHTS_DOC = """
    Args:
        x: {dtype}[n], C-contiguous, n >= 1 (the caller flattens any shape).
        prev: float32[n] the same layer at the previous recorded step (C-contiguous), or
            any float32 array when ``has_prev`` and ``refresh`` are False (not read).
        has_prev: compute the update's sum of squares.
        refresh: overwrite ``prev`` with float32(x) (round to nearest) in the same pass,
            after the update's sums of each block are final.
        out: float64[8, L]; column i receives, over the finite weights, S1..S4 = sum w^k
            (float64 accumulation, not saturated: +-inf on overflow), then
            sum (float32(w) - prev)^2 over the finite differences (0 without ``prev``;
            computed in float64, so exact differences of float32 values), then min and max
            (exact; +inf / -inf when the layer has no finite weight), then the number of
            NaN/+-Inf weights (exact as float64 up to 2^53).
        i: layer index, 0 <= i < L (not checked: the caller guarantees it).
"""

weights_f32.__doc__ += _WEIGHTS_DOC.format(dtype="float32") + "{hist}"
weights_f64.__doc__ += _WEIGHTS_DOC.format(dtype="float64") + "{hist}"


_ARGS_DOC = """
    Args:
        x: {dtype}[n], C-contiguous, n >= 1 (the caller flattens any shape).
        out: float64[6, L]; column i receives numel, sum |g|, sum g^2 (both over the
            finite elements, float64 accumulation, +inf on overflow),
            max |g| over the finite elements (0 when none), the number of NaN/+-Inf
            elements and the number of NaN among them (counted in the masked pass of the
            blocks that hold a non-finite element; the fast pass is unchanged). The counts
            are exact as float64 up to 2^53.
        i: layer index, 0 <= i < L (not checked: the caller guarantees it).
"""


@njit(cache=True, nogil=True)
def summarize_f32(x, out, i):  # pragma: no cover - compiled
    """Summarise the float32 layer ``x`` into column ``i`` of ``out``."""
    _summarize_into(x, x.view(np.uint32), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000),
                    np.uint32(23), 127, out, i, np.zeros((0, 1), dtype=np.int64),
                    np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint16), 0)


@njit(cache=True, nogil=True)
def summarize_f64(x, out, i):  # pragma: no cover - compiled
    """Summarise the float64 layer ``x`` into column ``i`` of ``out``."""
    _summarize_into(x, x.view(np.uint64), np.uint64(0x7FFFFFFFFFFFFFFF),
                    np.uint64(0x7FF0000000000000), np.uint64(52), 1023, out, i,
                    np.zeros((0, 1), dtype=np.int64), np.zeros(0, dtype=np.int32),
                    np.zeros(0, dtype=np.uint16), 0)


@njit(cache=True, nogil=True)
def summarize_hist_f32(x, out, i, counts, tables, lut, hist_min):  # pragma: no cover
    """:func:`summarize_f32` plus the exponent histogram of ``x`` into ``counts[i]``."""
    _summarize_into(x, x.view(np.uint32), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000),
                    np.uint32(23), 127, out, i, counts, tables, lut, hist_min)


@njit(cache=True, nogil=True)
def summarize_hist_f64(x, out, i, counts, tables, lut, hist_min):  # pragma: no cover
    """:func:`summarize_f64` plus the exponent histogram of ``x`` into ``counts[i]``."""
    _summarize_into(x, x.view(np.uint64), np.uint64(0x7FFFFFFFFFFFFFFF),
                    np.uint64(0x7FF0000000000000), np.uint64(52), 1023, out, i,
                    counts, tables, lut, hist_min)


_HIST_ARGS_DOC = """
        counts: int64[L, B]; the layer's exponent histogram is added to row i (layout:
            ``producer.histogram.exp_hist_edges``; NaN/Inf not counted): pass zeros.
        tables: int32[TABLES * STRIDE] scratch count tables, all zero; left all zero (one
            allocation serves every layer of a call).
        lut: uint16[512], ``schemas.stats.exponent_lut(8, 127)``: the histogram column of
            each key (sign and binary32 exponent field, :func:`_hist_key`; both dtypes
            count binary32 keys), with B + 1 for a zero field (zero or subnormal,
            re-binned exactly) and B for the all-ones field (NaN/Inf, dropped).
        hist_min: EXP_HIST_MIN, the exponent of column 2 (used to bin subnormals).
"""

summarize_f32.__doc__ += _ARGS_DOC.format(dtype="float32")
summarize_f64.__doc__ += _ARGS_DOC.format(dtype="float64")
summarize_hist_f32.__doc__ += _ARGS_DOC.format(dtype="float32") + _HIST_ARGS_DOC
summarize_hist_f64.__doc__ += _ARGS_DOC.format(dtype="float64") + _HIST_ARGS_DOC
weights_f32.__doc__ = weights_f32.__doc__.format(hist=_HIST_ARGS_DOC)
weights_f64.__doc__ = weights_f64.__doc__.format(hist=_HIST_ARGS_DOC)
