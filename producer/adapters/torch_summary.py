"""A step's statistics from torch tensors, computed where the gradients live.

The statistics are those of :func:`producer.summary.summarize` (``numel``, ``sum_abs``,
``sum_sq``, ``max_abs`` over finite elements, ``nonfinite`` count), computed where the
gradients live (:func:`summarize_tensors`): on an accelerator by batched torch reductions
accumulating in float32 (:mod:`producer.adapters.torch_device`, which documents the error
bound), copied to the host as one small float64 tensor per device and step (a second,
equally small copy only in a step where some gradient holds NaN/Inf or overflows, for an
exact float64 recount); on the CPU by ``summarize`` itself over zero-copy NumPy views,
split over threads. ``emulate_device=True`` runs CPU gradients through the accelerator
code instead (tests, CPU smoke runs). The result goes to the producer as a ready
:class:`~producer.summary.LayerSummaries` through ``record_summaries``: the gradients
themselves never leave their device.

Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from producer.adapters import torch_device as device_path
from producer.adapters.optional import import_torch
from producer.summary import LayerSummaries, summarize

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def _values(grad: torch.Tensor, torch: Any) -> torch.Tensor:
    """Elements to reduce over: the stored values of a sparse tensor (zeros add nothing)."""
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().values()
    if grad.layout != torch.strided:
        return grad.to_dense()
    return grad


#: Accumulation dtype of the torch reductions, one of
#: :data:`producer.adapters.torch_device.ACCUMULATE` (error bound: that module).
Accumulate = str

#: Below this many elements in all, the CPU summary runs on one thread (a hand-off to a
#: worker thread costs more than it saves).
_PARALLEL_MIN_ELEMENTS = 1 << 20
#: Groups of elements per thread in the threaded CPU summary: more groups than threads let
#: a thread that runs take the share of one that does not (see :func:`_summarize_threads`).
_CHUNKS_PER_THREAD = 4
#: Every this many calls with the same layer sizes, the CPU summary re-times the mode
#: (threads or one thread) it is not using (see :func:`_summarize_host`).
_RETIME_EVERY = 256
#: Calls per mode in the CPU summary's initial trial (the first one untimed).
_TRIAL_CALLS = 3
_host_pool: Any = None
_host_timing: dict[tuple[int, ...], list[float]] = {}
_host_pool_size = 0
_keys: list[str] = []


def _key_names(count: int) -> list[str]:
    """``["0", "1", ...]`` of at least ``count`` names, built once (mapping keys for
    ``summarize`` on chunks)."""
    if len(_keys) < count:
        _keys.extend(str(i) for i in range(len(_keys), count))
    return _keys


@functools.lru_cache(maxsize=1)
def _cpu_count() -> int:
    """``os.cpu_count()``, read once (glibc reads a sysfs file on every call)."""
    return os.cpu_count() or 1


def _host_threads(torch: Any) -> int:
    """Threads for the CPU summary: torch's intra-op thread count, at most the CPU count."""
    return max(1, min(int(torch.get_num_threads()), _cpu_count()))


def _pool(workers: int) -> Any:
    """A process-wide thread pool of ``workers`` threads (rebuilt when the count changes)."""
    global _host_pool, _host_pool_size
    if _host_pool is None or _host_pool_size != workers:
        if _host_pool is not None:
            _host_pool.shutdown(wait=False)
        _host_pool = ThreadPoolExecutor(workers, thread_name_prefix="gradstream-tap")
        _host_pool_size = workers
    return _host_pool


@functools.lru_cache(maxsize=32)
def _chunk_plan(
    sizes: tuple[int, ...], threads: int
) -> tuple[tuple[tuple[tuple[int, int, int], ...], ...], np.ndarray]:
    """Cut layers of ``sizes`` elements into ``threads`` groups of contiguous chunks with
    (nearly) equal element counts, in layer order.

    Returns:
        ``(groups, starts)``: ``groups[t]`` is a tuple of ``(layer, lo, hi)`` chunks (element
        ranges of the flattened layer); concatenated in group order the chunks are sorted by
        layer, and ``starts`` (int64[L]) is the index of each layer's first chunk in that
        sequence (the ``reduceat`` offsets that merge chunks back into layers).
    """
    target = -(-sum(sizes) // threads)
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    starts = np.empty(len(sizes), dtype=np.int64)
    group, fill, chunk = 0, 0, 0
    for layer, size in enumerate(sizes):
        starts[layer] = chunk
        lo = 0
        while lo < size:
            last = group == threads - 1
            take = size - lo if last else min(size - lo, target - fill)
            groups[group].append((layer, lo, lo + take))
            chunk += 1
            lo += take
            fill += take
            if not last and fill >= target:
                group, fill = group + 1, 0
    return tuple(tuple(g) for g in groups), starts


def _summarize_host(
    arrays: Sequence[np.ndarray], torch: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(sum_abs, sum_sq, max_abs, nonfinite, nan)`` of dense CPU NumPy arrays, one read
    pass (``nan``: the NaN among the non-finite elements).

    Runs :func:`producer.summary.summarize` (one fused, GIL-free pass per array, float64
    accumulation) on ``threads`` threads at once (torch's intra-op thread count): the
    elements are cut into equal contiguous chunks (:func:`_chunk_plan`, cached per layer
    sizes), each thread summarises its chunks, and the chunk results are merged per layer
    (sums add, maxima take the max, counts add: exact for max and counts, one more float64
    addition per chunk for the sums). The training thread runs one group itself.

    Threads help only when they get a core: on an oversubscribed machine each GIL hand-off
    between the threads (one per chunk) can wait for a scheduler slice. So the call times
    itself: for each set of layer sizes the first ``_TRIAL_CALLS`` calls use the threads,
    the next ``_TRIAL_CALLS`` one thread, then whichever mode has the lower moving-average
    time, re-timing the other every ``_RETIME_EVERY`` calls. The first call of each mode is
    not timed: it pays one-off costs (the numba kernels' load, the pool threads' start, up
    to a second) that would otherwise hold the moving average of that mode up for hundreds
    of calls. Both modes give the same statistics up to the float64
    rounding of the chunk merge (relative ~1e-16).

    Args:
        arrays: float16/32/64 arrays of any shape, each with at least one element.

    Returns:
        float64[L], float64[L], float64[L], int64[L], int64[L], aligned with ``arrays``.
    """
    flat = [a.reshape(-1) for a in arrays]
    sizes = tuple(a.size for a in flat)
    threads = _host_threads(torch)
    keys = _key_names(len(flat) + threads)
    if threads == 1 or sum(sizes) < _PARALLEL_MIN_ELEMENTS:
        one = summarize(dict(zip(keys, flat, strict=False)))
        return one.sum_abs, one.sum_sq, one.max_abs, one.nonfinite, one.nan  # type: ignore[return-value]
    # timing: [calls, moving-average seconds with threads, with one thread]
    timing = _host_timing.setdefault(sizes, [0.0, math.inf, math.inf])
    calls = int(timing[0])
    timing[0] += 1
    if calls < 2 * _TRIAL_CALLS:
        parallel = calls < _TRIAL_CALLS
    else:
        parallel = timing[1] <= timing[2]
        if calls % _RETIME_EVERY == 0:
            parallel = not parallel
    t0 = time.perf_counter()
    if parallel:
        stats = _summarize_threads(flat, sizes, threads, keys)
    else:
        one = summarize(dict(zip(keys, flat, strict=False)))
        stats = one.sum_abs, one.sum_sq, one.max_abs, one.nonfinite, one.nan  # type: ignore[assignment]
    spent = time.perf_counter() - t0
    if calls % _TRIAL_CALLS or calls >= 2 * _TRIAL_CALLS:  # a mode's first call: untimed
        slot = 1 if parallel else 2
        timing[slot] = spent if math.isinf(timing[slot]) else 0.7 * timing[slot] + 0.3 * spent
    return stats  # type: ignore[return-value]


def _summarize_threads(
    flat: list[np.ndarray], sizes: tuple[int, ...], threads: int, keys: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The threaded branch of :func:`_summarize_host`, with work sharing.

    The elements are cut into ``_CHUNKS_PER_THREAD * threads`` groups of equal size
    (:func:`_chunk_plan`); the training thread and ``threads - 1`` pool threads take the
    groups one at a time from a shared iterator (``next`` on a range iterator is atomic
    under the GIL) until none is left. A pool thread that the scheduler starts late (a
    busy machine) then takes fewer groups instead of holding the training thread up: the
    training thread waits only for groups already taken, never for a thread to start.

    Raises:
        Whatever ``summarize`` raises on any thread (the first such error).
    """
    groups, starts = _chunk_plan(sizes, threads * _CHUNKS_PER_THREAD)
    jobs = [
        {keys[k]: flat[layer][lo:hi] for k, (layer, lo, hi) in enumerate(group)}
        for group in groups
        if group
    ]
    parts: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    remaining = [len(jobs)]
    lock = threading.Lock()
    finished = threading.Event()
    shared = iter(range(len(jobs)))

    def drain() -> None:
        for k in shared:
            try:
                parts[k] = summarize(jobs[k])
            except BaseException as exc:  # re-raised on the training thread
                errors.append(exc)
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    finished.set()

    pool = _pool(threads - 1)
    for _ in range(threads - 1):
        pool.submit(drain)
    drain()
    finished.wait()
    if errors:
        raise errors[0]
    sum_abs = np.add.reduceat(np.concatenate([q.sum_abs for q in parts]), starts)  # type: ignore[misc]
    sum_sq = np.add.reduceat(np.concatenate([q.sum_sq for q in parts]), starts)
    max_abs = np.maximum.reduceat(np.concatenate([q.max_abs for q in parts]), starts)  # type: ignore[misc]
    nonfinite = np.add.reduceat(np.concatenate([q.nonfinite for q in parts]), starts)
    nan = np.add.reduceat(np.concatenate([q.nan for q in parts]), starts)  # type: ignore[misc]
    return sum_abs, sum_sq, max_abs, nonfinite, nan  # +inf where a float64 sum overflowed


class PendingSummaries:
    """Statistics of one set of gradients whose device part may still be in flight.

    Built by :func:`launch_summaries`; :meth:`result` waits for the copies (if any) and
    returns the :class:`~producer.summary.LayerSummaries`. Holding one does not keep the
    gradients alive unless it was launched with ``keep_gradients=True``.

    Attributes:
        names: the layer names, in the order of the summaries.
        copies: device->host copies made so far: one per device batch at launch, plus one
            per batch whose statistics needed the non-finite recount (in :meth:`result`).
        inexact: after :meth:`result`, the number of layers whose fast statistics were
            non-finite but could not be recounted (launched without ``keep_gradients``):
            they are reported with ``nonfinite = numel`` and zero sums (see
            :func:`launch_summaries`), and the summaries then carry no NaN count (the
            NaN/Inf split unknown, ``LayerSummaries.nan`` None).
    """

    def __init__(
        self, names: tuple[str, ...], numel: np.ndarray, norms_only: bool,
        host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        batches: list[tuple[np.ndarray, torch.Tensor, Any, list[torch.Tensor] | None]],
        emulate: bool = False,
    ) -> None:
        self.names = names
        self._numel = numel
        self._norms_only = norms_only
        self._host = host
        self._batches = batches
        self._emulate = emulate
        self._result: LayerSummaries | None = None
        self.copies = len(batches)
        self.inexact = 0

    def ready(self) -> bool:
        """True when every device->host copy has completed (never waits)."""
        return all(event is None or event.query() for _, _, event, _ in self._batches)

    def result(self) -> LayerSummaries:
        """Wait for the copies (``event.synchronize()``, a no-op once complete), recount
        the layers whose statistics came out non-finite, and return the summaries (the
        same object on later calls)."""
        if self._result is not None:
            return self._result
        torch = import_torch()
        sum_abs, sum_sq, max_abs, nonfinite, nan = self._host
        for sel, host, event, values in self._batches:
            if event is not None:
                event.synchronize()
            stats = host.numpy()
            bad = ~np.isfinite(stats[:, 1] if self._norms_only else stats)
            bad = bad.reshape(len(sel), -1).any(axis=1)
            if bad.any():
                stats = stats.copy()
                redo = np.flatnonzero(bad)
                if values is not None:
                    with torch.no_grad():
                        again_dev = device_path.finite_stats([values[j] for j in redo], torch)
                        again_host, again_event = device_path.stage(again_dev, torch,
                                                                    self._emulate)
                    self.copies += 1
                    if again_event is not None:
                        again_event.synchronize()
                    again = again_host.numpy()
                    stats[redo] = again[:, :3]
                    nonfinite[sel[redo]] = again[:, 3].astype(np.int64)
                    nan[sel[redo]] = again[:, 4].astype(np.int64)
                else:
                    stats[redo] = 0.0
                    nonfinite[sel[redo]] = self._numel[sel[redo]]
                    self.inexact += len(redo)
            sum_abs[sel] = stats[:, 0]
            with np.errstate(over="ignore"):  # +inf when the sum of squares overflows
                sum_sq[sel] = stats[:, 1] * stats[:, 1]
            max_abs[sel] = stats[:, 2]
        self._batches = []
        result = LayerSummaries(self.names, self._numel, sum_abs, sum_sq, max_abs, nonfinite,
                                nan=None if self.inexact else nan)
        self._result = result.norms_only() if self._norms_only else result
        return self._result


def _launch_on_devices(
    values: list[Any], by_device: Mapping[Any, list[int]], torch: Any, *, norms_only: bool,
    accumulate: Accumulate, keep_gradients: bool, emulate: bool,
) -> list[tuple[np.ndarray, Any, Any, list[Any] | None]]:
    """Queue the batched reductions and the one staged copy of each device's tensors.

    Args:
        values: the dense (or sparse-values) tensors of all layers.
        by_device: device -> indices into ``values`` of the tensors on it.

    Returns:
        One ``(layer indices of the rows, host tensor, event or None, tensors of the rows
        or None)`` per device batch, for :class:`PendingSummaries`.
    """
    batches = []
    with torch.no_grad():
        for idx in by_device.values():
            nonempty = [i for i in idx if values[i].numel() > 0]
            if not nonempty:
                continue
            tensors = [values[i] for i in nonempty]
            stats_dev, order = device_path.stats_on_device(
                tensors, torch, norms_only=norms_only, accumulate=accumulate, emulate=emulate,
            )
            host, event = device_path.stage(stats_dev, torch, emulate)
            ordered = [tensors[j] for j in order] if keep_gradients else None
            batches.append((np.asarray(nonempty, dtype=np.int64)[order], host, event, ordered))
    return batches


def _check_subclass(name: str, grad: Any, tensor_type: type) -> None:
    """Reject what is not a plain tensor: a non-tensor, or a DTensor (TypeError, naming
    the gradient)."""
    if not isinstance(grad, tensor_type):
        raise TypeError(f"gradient {name!r} is a {type(grad).__name__}, not a torch.Tensor")
    if hasattr(grad, "placements") and hasattr(grad, "to_local"):
        raise TypeError(
            f"gradient {name!r} is a DTensor: pass gradient_piece(grad)[0] (its local shard)"
        )


def launch_summaries(
    gradients: Mapping[str, torch.Tensor], *, host_numpy: bool = True,
    norms_only: bool = False, accumulate: Accumulate = "auto", keep_gradients: bool = True,
    emulate_device: bool = False,
) -> PendingSummaries:
    """Start :func:`summarize_tensors` without waiting for the device.

    Same statistics, arguments and errors as :func:`summarize_tensors`; CPU tensors on the
    NumPy path are summarised at once, device tensors get their batched reductions and one
    asynchronous copy per device queued (:func:`producer.adapters.torch_device.stage`),
    and :meth:`PendingSummaries.result` finishes.

    Args:
        keep_gradients: keep references to the device tensors until ``result()`` so that
            a layer whose fast statistics are NaN/Inf (or overflow in float32) is recounted
            exactly over its finite elements. False frees them at once (for a result read
            at the next step, when the gradients are gone): such a layer is then reported
            with ``nonfinite = numel`` and sums 0 (an upper bound on the count; the sums over
            the finite elements are unknown), counted in ``PendingSummaries.inexact``.

    Raises:
        ValueError / TypeError: as :func:`summarize_tensors`; ValueError also for an
            unknown ``accumulate``.
    """
    torch = import_torch()
    if not gradients:
        raise ValueError("no gradients to summarise (empty mapping)")
    device_path.check_accumulate(accumulate)
    numpy_dtypes = (torch.float16, torch.float32, torch.float64)
    strided = torch.strided
    numpy_cpu = host_numpy and not emulate_device
    names = tuple(gradients)
    count = len(names)
    numel = np.empty(count, dtype=np.int64)
    values: list[Any] = []
    on_host: list[int] = []
    by_device: dict[Any, list[int]] = {}
    tensor_type = torch.Tensor
    cpu = torch.device("cpu")
    for i, (name, grad) in enumerate(gradients.items()):
        # A plain torch.Tensor (every .grad of a plain parameter) skips the subclass checks.
        if type(grad) is not tensor_type:
            _check_subclass(name, grad, tensor_type)
        if not grad.is_floating_point():
            raise TypeError(
                f"gradient {name!r} has dtype {grad.dtype}; expected a floating-point dtype"
            )
        n = grad.numel()
        if n == 0:
            raise ValueError(f"gradient {name!r} is empty (0 elements)")
        numel[i] = n
        vals = grad.detach() if grad.requires_grad else grad
        if vals.layout != strided:
            vals = _values(vals, torch)
        values.append(vals)
        device = vals.device
        if numpy_cpu and device == cpu and vals.dtype in numpy_dtypes:
            on_host.append(i)
        else:
            by_device.setdefault(device, []).append(i)

    sum_abs = np.zeros(count, dtype=np.float64)
    sum_sq = np.zeros(count, dtype=np.float64)
    max_abs = np.zeros(count, dtype=np.float64)
    nonfinite = np.zeros(count, dtype=np.int64)
    nan = np.zeros(count, dtype=np.int64)
    if on_host:
        sel = np.asarray(on_host, dtype=np.int64)
        stats = _summarize_host([values[i].numpy() for i in on_host], torch)
        sum_abs[sel], sum_sq[sel], max_abs[sel], nonfinite[sel], nan[sel] = stats
    batches = (
        _launch_on_devices(values, by_device, torch, norms_only=norms_only,
                           accumulate=accumulate, keep_gradients=keep_gradients,
                           emulate=emulate_device)
        if by_device else []
    )
    return PendingSummaries(names, numel, norms_only,
                            (sum_abs, sum_sq, max_abs, nonfinite, nan), batches, emulate_device)


def summarize_tensors(
    gradients: Mapping[str, torch.Tensor], *, host_numpy: bool = True, norms_only: bool = False,
    accumulate: Accumulate = "auto", emulate_device: bool = False,
) -> LayerSummaries:
    """Summarise torch gradients where they live; the torch twin of ``summarize``.

    Per tensor: ``numel`` (all elements; the dense size for a sparse COO gradient);
    over the finite elements ``sum_abs`` = sum |g| and ``sum_sq`` = sum g^2 (both +inf
    when the float64 sum overflows, as in the reference (trustformers-debug,
    gradient_flow)) and ``max_abs`` =
    max |g| (exact; 0.0 when none); ``nonfinite`` = number of NaN/+-Inf elements.

    CPU (default): dense float16/32/64 tensors are summarised by
    :func:`producer.summary.summarize` on zero-copy NumPy views, one fused float64 pass
    per element, split over torch's intra-op threads (:func:`_summarize_host`).

    Devices (accelerators, every tensor with ``host_numpy=False`` or
    ``emulate_device=True``): :mod:`producer.adapters.torch_device`, per device and dtype
    one batched ``torch._foreach_norm`` per statistic (ord 1, 2 and inf; ord 2 only in
    norms mode), the results stacked into one float64[k, 3] tensor and copied to the host
    at once (one small transfer per device; a second one only when some tensor holds
    NaN/Inf or a sum overflows, for an exact float64 recount of those tensors over their
    finite elements). The norms accumulate in ``accumulate``:

    - ``"float64"``: relative error of ``sum_abs``/``sum_sq`` ~1e-15 (the CPU default).
    - ``"float32"`` (the accelerator default under ``"auto"``; float64 arithmetic is 32-64x
      slower than float32 on most non-datacenter GPUs): relative error of ``sum_abs`` and
      ``sum_sq`` at most (h + 3) * 2^-24, h <= n - 1 the height of the summation tree
      (the bound and its source: :mod:`producer.adapters.torch_device`); ``max_abs``
      exact. Float64 tensors always accumulate in float64.
    - ``"auto"``: float64 on the CPU, float32 on accelerators and with ``emulate_device``.

    Args:
        gradients: name -> floating-point tensor of any shape with at least one element,
            in the order the summaries should have. Plain tensors only: turn DTensors
            into their local part first (:func:`gradient_piece`).
        host_numpy: summarise dense CPU tensors with NumPy (default True); False uses
            the torch reductions for CPU tensors too (float64 under ``"auto"``).
        norms_only: the producer's norms mode: only ``sum_sq`` and ``nonfinite`` (one norm
            kernel per device batch instead of three); ``sum_abs``/``max_abs`` are None.
        accumulate: ``"auto"``, ``"float32"`` or ``"float64"`` (see above).
        emulate_device: run CPU tensors through the accelerator path exactly as a GPU
            would (float32 under ``"auto"``, the stacked statistics copied into a separate
            host buffer): for tests and CPU smoke runs on machines without a GPU.

    Returns:
        LayerSummaries aligned with the mapping's order (int64 ``numel``/``nonfinite``,
        float64 ``sum_abs``/``sum_sq``/``max_abs``).

    Raises:
        ValueError: the mapping is empty, or a tensor has no elements (names it); an
            unknown ``accumulate``.
        TypeError: a value is not a torch tensor, is a DTensor, or is not of a
            floating-point dtype (names it).
    """
    return launch_summaries(
        gradients, host_numpy=host_numpy, norms_only=norms_only, accumulate=accumulate,
        keep_gradients=True, emulate_device=emulate_device,
    ).result()
