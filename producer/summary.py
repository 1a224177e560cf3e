"""Per-layer gradient summaries: the statistics every rank sends for every optimiser step.

For each layer the summary holds ``numel``, ``sum_abs`` = sum |g|, ``sum_sq`` = sum g^2,
``max_abs`` = max |g| and ``nonfinite`` = number of NaN/+-Inf elements. NaN and Inf are
counted and left out of the three float statistics, which accumulate in float64 whatever
the input dtype. They merge exactly across ranks (sums add, max takes the max, counts add),
which is what lets the consumer rebuild a full-tensor frame from per-rank shards
(``schemas.wire``; the frame fields derived from them: ``consumer.frames``).

Optionally (``summarize(..., histogram=True)``) each layer also gets an exponent histogram:
counts of elements per power-of-two magnitude band, which merge across ranks by addition
and answer "what fraction of this gradient would underflow in fp16 / bf16"
(:func:`producer.histogram.underflow_fraction`).

The statistics are computed by the numba kernels or by pure NumPy, whichever
:mod:`producer.backend` chose. Both give the same ``numel``, ``max_abs``, ``nonfinite``
and histogram counts exactly, and sums equal to within a few ulps (different summation
order). Either result converts to the mergeable statistics of :mod:`schemas.stats`
(:meth:`LayerSummaries.gradient_sums`, :meth:`LayerSummaries.exponent_histogram`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from producer import backend
from schemas.stats import (
    ExponentHistogram,
    GradientSums,
    gradient_sums_of_layers,
)
from schemas.wire import EXP_HIST_BINS, EXP_HIST_MIN

__all__ = [
    "LayerSummaries",
    "as_float_array",
    "summarize",
    "warmup",
]

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_FLOAT_KINDS = {_F16, _F32, _F64}

# ---------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayerSummaries:
    """Columnar summaries of L layers, aligned with ``names``.

    Attributes:
        names: layer names, length L, in the order of the input mapping.
        numel: int64[L], elements per layer (finite or not).
        sum_abs: float64[L], sum of |g| over finite elements (+inf when the float64 sum
            overflows, as in the reference (trustformers-debug, gradient_flow); only
            float64 input can get
            there); None in norms mode (``summarize(..., norms_only=True)``).
        sum_sq: float64[L], sum of g^2 over finite elements (+inf when it overflows:
            float64 elements above ~1.34e154 in magnitude square past the largest double).
        max_abs: float64[L], max |g| over finite elements (0.0 when there are none); None
            in norms mode.
        nonfinite: int64[L], count of NaN/+-Inf elements.
        exp_hist: int64[L, EXP_HIST_BINS] exponent histogram of the finite elements (layout
            in :func:`producer.histogram.exp_hist_edges`; each row sums to
            numel - nonfinite), or None when not requested.
        shard_index, shard_count: int64[L] shard layout (see :meth:`with_layout`), or None:
            each rank's statistics are a disjoint shard of their own.
        local: the summaries of this rank's own gradient before the cross-rank reduction
            (the per-rank local view; its own ``names``), or None.
        nan: int64[L], how many of the ``nonfinite`` elements are NaN (the others are
            +-Inf), or None when the backend did not count them.
        reduced_ranks: int64[2k] rank ranges ``[start, stop)`` flattened when these are
            the whole parameters' statistics reduced in-band over those ranks
            (:meth:`with_reduction`), else None.
        replica_divergence: int64[d, 3] rows (layer_index, rank, reference_rank) of the
            replicas the in-band cross-check found to disagree, or None.
    """

    names: tuple[str, ...]
    numel: np.ndarray
    sum_abs: np.ndarray | None
    sum_sq: np.ndarray
    max_abs: np.ndarray | None
    nonfinite: np.ndarray
    exp_hist: np.ndarray | None = None
    shard_index: np.ndarray | None = None
    shard_count: np.ndarray | None = None
    local: LayerSummaries | None = None
    nan: np.ndarray | None = None
    reduced_ranks: np.ndarray | None = None
    replica_divergence: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def from_statistics(
        cls, names: tuple[str, ...], sums: GradientSums,
        histogram: ExponentHistogram | None = None,
    ) -> LayerSummaries:
        """Summaries of the layers ``names`` from their :class:`schemas.stats.GradientSums`
        (full mode: ``sum_abs``/``max_abs`` must cover every element) and optional
        :class:`schemas.stats.ExponentHistogram`, both over ``len(names)`` layers.

        Raises:
            ValueError: a statistic over another number of layers, or sums without
                ``sum_abs``/``max_abs`` for some layer.
        """
        if sums.num_layers != len(names) or (
            histogram is not None and histogram.num_layers != len(names)
        ):
            raise ValueError(f"statistics must cover the {len(names)} layers named")
        if not sums.has_abs().all():
            raise ValueError("sums without sum_abs/max_abs: use norms_only() instead")
        return cls(names, sums.numel, sums.sum_abs, sums.sum_sq, sums.max_abs, sums.nonfinite,
                   None if histogram is None else histogram.counts,
                   nan=sums.nan if sums.has_nan().all() else None)

    def gradient_sums(self) -> GradientSums:
        """These statistics as a mergeable :class:`schemas.stats.GradientSums` (a copy;
        norms mode leaves ``sum_abs``/``max_abs`` unknown)."""
        return GradientSums.from_columns(self.numel, self.sum_abs, self.sum_sq, self.max_abs,
                                         self.nonfinite, self.nan)

    def exponent_histogram(self) -> ExponentHistogram | None:
        """The histogram as a mergeable :class:`schemas.stats.ExponentHistogram` (a copy),
        or None when it was not requested."""
        if self.exp_hist is None:
            return None
        return ExponentHistogram(self.exp_hist.copy(), self.nonfinite.copy())

    def norms_only(self) -> LayerSummaries:
        """The same summaries without ``sum_abs`` and ``max_abs`` (the producer's norms
        mode: only the gradient norm and the non-finite count leave the rank)."""
        return dataclasses.replace(self, sum_abs=None, max_abs=None)

    def with_layout(
        self, shard_index: np.ndarray | int, shard_count: np.ndarray | int
    ) -> LayerSummaries:
        """The same summaries with a shard layout: layer i's parameter is cut into
        ``shard_count[i]`` disjoint pieces and these statistics cover piece
        ``shard_index[i]``. Ranks giving the same (layer, index) hold replicas of that
        piece, which the consumer counts once (DDP: ``0`` of ``1`` on every rank).

        Args:
            shard_index, shard_count: int or int[L] (a scalar applies to every layer).

        Raises:
            ValueError: an index outside ``[0, count)`` or a count < 1.
        """
        index = np.broadcast_to(np.asarray(shard_index, np.int64), (len(self),)).copy()
        count = np.broadcast_to(np.asarray(shard_count, np.int64), (len(self),)).copy()
        if np.any(count < 1) or np.any(index < 0) or np.any(index >= count):
            raise ValueError("shard_index must be in [0, shard_count) and shard_count >= 1")
        return dataclasses.replace(self, shard_index=index, shard_count=count)

    def with_reduction(
        self, reduced_ranks: np.ndarray, replica_divergence: np.ndarray | None = None
    ) -> LayerSummaries:
        """The same summaries marked as reduced in-band over ``reduced_ranks`` (int64[2k]
        ``[start, stop)`` pairs), with the cross-check's disagreeing replicas
        ``replica_divergence`` (int64[d, 3] rows (layer_index, rank, reference_rank))."""
        return dataclasses.replace(self, reduced_ranks=np.asarray(reduced_ranks, np.int64),
                                   replica_divergence=replica_divergence)

    def with_local(self, local: LayerSummaries | None) -> LayerSummaries:
        """The same summaries carrying ``local``, the rank's pre-reduction view."""
        return dataclasses.replace(self, local=local)

    def select(self, keep: np.ndarray) -> LayerSummaries:
        """The layers where the bool[L] mask ``keep`` is True, in the same order (the
        local view is kept whole)."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[keep]

        return LayerSummaries(
            tuple(n for n, k in zip(self.names, keep, strict=True) if k), self.numel[keep],
            pick(self.sum_abs), self.sum_sq[keep], pick(self.max_abs), self.nonfinite[keep],
            pick(self.exp_hist), pick(self.shard_index), pick(self.shard_count), self.local,
            pick(self.nan), self.reduced_ranks, self.replica_divergence,
        )


def warmup(histogram: bool = True) -> str:
    """Import and compile (or load from numba's disk cache) the kernels now.

    Call once at start-up so that the first training step does not pay the JIT cost
    (printed by ``bench/producer_overhead.py``). Harmless with the NumPy backend.

    Args:
        histogram: also prepare the histogram path.

    Returns:
        The active backend name.
    """
    grads = {
        "f16": np.ones(3, np.float16),
        "f32": np.ones(3, np.float32),
        "f64": np.ones(3, np.float64),
    }
    summarize(grads)
    if histogram:
        summarize(grads, histogram=True)
    return backend.active_backend()


def _dtype_error(name: str, dtype: np.dtype) -> TypeError:
    return TypeError(f"gradient {name!r} has dtype {dtype}; expected float16, float32 or float64")


def _empty_error(name: str) -> ValueError:
    return ValueError(f"gradient {name!r} is empty (0 elements)")


def as_float_array(name: str, value: object) -> np.ndarray:
    """``value`` as a NumPy array of a float dtype with at least one element (no copy when
    it is one already).

    Args:
        name: the layer name, for the error messages.
        value: an array or array-like.

    Raises:
        TypeError: a dtype other than float16, float32 or float64.
        ValueError: no elements.
    """
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if arr.dtype not in _FLOAT_KINDS:
        raise _dtype_error(name, arr.dtype)
    if arr.size == 0:
        raise _empty_error(name)
    return arr


def summarize(
    gradients: Mapping[str, np.ndarray], *, histogram: bool = False, norms_only: bool = False,
) -> LayerSummaries:
    """Summarise a mapping of layer name -> gradient array.

    Statistics per layer (``schemas.wire.StepSummary``): ``numel``; over the finite elements,
    ``sum_abs`` = sum |g|, ``sum_sq`` = sum g^2 (float64 accumulation, relative error
    ~1e-15, +inf on overflow), ``max_abs`` = max |g| (exact; 0.0 if none);
    ``nonfinite`` = count of NaN/+-Inf.

    Args:
        gradients: name -> NumPy array (or array-like) of any shape, dtype float16, float32
            or float64 (native byte order). Arrays are read, never modified; non-contiguous
            arrays are copied once, float16 layers are converted to float32 (exact).
        histogram: also fill ``exp_hist`` (int64[L, EXP_HIST_BINS], see
            :func:`producer.histogram.exp_hist_edges`); off by default, it costs about one
            more read pass.
        norms_only: return ``sum_abs`` and ``max_abs`` as None (the producer's norms
            mode). On the CPU the fused pass reads each element once whichever statistics
            are kept, so this saves message bytes, not summary time; on a GPU the PyTorch
            adapter then runs one norm kernel per layer instead of three.

    Returns:
        LayerSummaries with one entry per layer, in the mapping's order.

    Raises:
        TypeError: an array is not of a float dtype (names the layer).
        ValueError: the mapping is empty or an array has no elements (names the layer).
        ImportError: backend ``"numba"`` was forced and cannot be imported.
    """
    if not gradients:
        raise ValueError("no gradients to summarise (empty mapping)")
    module = backend.kernels()
    result: LayerSummaries | None = None
    if module is not None:
        try:
            result = _summarize_numba(module, gradients, histogram)
        except backend.KernelError as exc:
            backend.kernel_failed(exc)  # re-raises when numba was forced
    if result is None:
        result = _summarize_numpy(gradients, histogram)
    return result.norms_only() if norms_only else result


def _summarize_numba(
    kernels: ModuleType, gradients: Mapping[str, np.ndarray], histogram: bool
) -> LayerSummaries:
    names = tuple(gradients)
    count = len(names)
    # Columns of out: numel, sum_abs, sum_sq, max_abs, nonfinite, nan (counts exact below
    # 2^53).
    out = np.empty((6, count), dtype=np.float64)
    counts = np.zeros((count, EXP_HIST_BINS), np.int64) if histogram else None
    if counts is None:
        f32, f64, extra32, extra64 = kernels.summarize_f32, kernels.summarize_f64, (), ()
    else:
        f32, f64 = kernels.summarize_hist_f32, kernels.summarize_hist_f64
        # both dtypes count binary32 keys, folded through the binary32 table
        extra32 = extra64 = (counts, backend.histogram_tables(kernels),
                             backend.BINARY32_EXPONENT_LUT, EXP_HIST_MIN)
    # One compiled call per layer, no other per-layer work: unboxing an array argument is
    # the cheapest way to hand numba the layers (the alternatives: bench/README.md).
    for i, (name, value) in enumerate(gradients.items()):
        arr = value if type(value) is np.ndarray else np.asarray(value)
        dtype = arr.dtype
        if dtype is _F32 or dtype == _F32:
            kernel, flat, extra = f32, arr.ravel(), extra32  # ravel: C-contiguous
        elif dtype == _F64:
            kernel, flat, extra = f64, arr.ravel(), extra64
        elif dtype == _F16:  # float16 -> float32 is exact (NaN/Inf kept); numba has no f16
            kernel, flat, extra = f32, arr.astype(_F32, order="C").reshape(-1), extra32
        else:
            raise _dtype_error(name, dtype)
        if flat.size == 0:
            raise _empty_error(name)
        try:
            kernel(flat, out, i, *extra)
        except Exception as exc:  # compilation/typing failure: never break training
            raise backend.KernelError(f"{type(exc).__name__}: {exc}") from exc
    return LayerSummaries(
        names,
        out[0].astype(np.int64),
        out[1],
        out[2],
        out[3],
        out[4].astype(np.int64),
        counts,
        nan=out[5].astype(np.int64),
    )


# -- pure NumPy backend -------------------------------------------------------------------


def _summarize_numpy(gradients: Mapping[str, np.ndarray], histogram: bool) -> LayerSummaries:
    """The NumPy backend: the sums of :func:`schemas.stats.gradient_sums_of_layers` (what
    :meth:`schemas.stats.GradientSums.from_layers` computes; a sum that overflows is +inf,
    never capped) and the histogram of :meth:`schemas.stats.ExponentHistogram.from_layers`."""
    names = tuple(gradients)
    flats = [as_float_array(name, gradients[name]).reshape(-1) for name in names]
    sums, nonfinite, nan = gradient_sums_of_layers(flats)
    counts = ExponentHistogram.from_layers(flats).counts if histogram else None
    return LayerSummaries(names, np.array([f.size for f in flats], np.int64), sums[0],
                          sums[1], sums[2], nonfinite, counts, nan=nan)
