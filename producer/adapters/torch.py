"""PyTorch adapter: one gradient summary per optimiser step, computed on the gradients' device.

:class:`GradientTap` watches a model's parameters. Attached to an optimiser with
:meth:`GradientTap.attach_optimizer`, it summarises the accumulated ``.grad`` of every
selected parameter right before ``optimizer.step()`` consumes them (through
``optimizer.register_step_pre_hook``), so gradient accumulation over several ``backward()``
calls gives exactly one summary per optimiser step. :meth:`GradientTap.step` does the same
by hand.

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

What a frame means across ranks: the statistics of the gradient the optimiser applies.
Every rank reports every watched parameter it holds, tagged with the piece of the parameter
it covers (:func:`gradient_piece`): a plain tensor is the whole parameter (under DDP every
rank holds the same all-reduced gradient, a replica the consumer counts once); a
``DTensor`` (FSDP2 ``fully_shard``, HSDP, tensor parallelism) is summarised through its
local shard, its ``Shard`` mesh dimensions cutting the parameter into disjoint pieces that
add up, its ``Replicate`` dimensions holding replicas. A gradient with a pending
(``Partial``) reduction is not reported. ``numel`` in ``start_run`` is the full (global)
parameter size. FSDP v1's flat parameters are not resolved into the original parameters:
a model wrapped in ``FullyShardedDataParallel`` is refused at ``start_run``
(:class:`UnsupportedParallelismError`); use FSDP2 (``fully_shard``), or DDP, whose wrapper
prefixes are normalised away.

Every rank of a run must announce the same layer list: the consumer merges rank r's
statistics of layer i with the other ranks' statistics of layer i. When
``torch.distributed`` is initialised with as many ranks as the producer's ``world_size``,
``start_run`` compares the ranks' layer lists (one ``all_gather_object`` of a digest: every
rank must call it) and refuses the run on every rank when they differ, as they do when each
pipeline stage builds a tap on its own stage (not supported yet).

The per-rank local view (DDP): :meth:`GradientTap.attach_ddp` registers a communication
hook that summarises each bucket's local gradients (this rank's own, before the
all-reduce) and then runs DDP's default all-reduce; the next summary carries them as the
local view. Under FSDP the local gradient exists only inside the reduce-scatter of the
unsharded gradient: it is not exposed cheaply, so FSDP runs have no local view.

Importing this module does not import torch; torch is imported when a tap is built or a
function here is called.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from producer.adapters import torch_device as device_path
from producer.adapters.naming import normalize_name, normalized_names
from producer.summary import LayerSummaries, summarize

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

log = logging.getLogger("gradstream.adapters.torch")



class SummaryRecorder(Protocol):
    """What a tap needs from a producer (``GradientProducer`` satisfies it)."""

    def start_run(
        self,
        layer_numel: Mapping[str, int],
        *,
        vanishing_threshold: float = ...,
        exploding_threshold: float = ...,
        config: Mapping[str, Any] | None = ...,
        dtypes: Mapping[str, str] | None = ...,
        ignore_layers: Sequence[str] = ...,
    ) -> None:
        """Announce the layer list (see ``GradientProducer.start_run``)."""

    def record_summaries(self, step: int, summaries: LayerSummaries) -> None:
        """Queue precomputed statistics of one step (see ``GradientProducer``)."""


class RunRecorder(SummaryRecorder, Protocol):
    """What the framework callbacks need from a producer: a :class:`SummaryRecorder` that
    can also finish the run and close (``GradientProducer`` satisfies it)."""

    def finish_run(self, timeout: float | None = ...) -> bool:
        """Send the run's end and flush (see ``GradientProducer.finish_run``)."""

    def close(self, timeout: float | None = ...) -> Any:
        """Flush and stop the producer (see ``GradientProducer.close``)."""


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "gradstream's PyTorch adapter needs PyTorch: pip install torch "
            "(or pip install 'gradstream[torch]')"
        ) from exc
    return torch


class UnsupportedParallelismError(RuntimeError):
    """The model is wrapped, or the ranks are laid out, in a way gradstream cannot turn
    into the statistics of whole parameters yet (FSDP v1, ranks announcing different layer
    lists such as pipeline stages). Raised by :meth:`GradientTap.start_run`, before
    anything is sent; the message says what to use instead."""


_FSDP1_ADVICE = (
    "gradstream cannot resolve FSDP v1's flat parameters into the original parameters yet "
    "(each rank holds a flat slice spanning several parameters; with use_orig_params=True "
    "each rank's parameters are its local slices, so ranks would announce different layer "
    "lists and summarise pieces that are not the parameters'). Wrap the model with FSDP2 "
    "instead (torch.distributed.fsdp.fully_shard), whose DTensor parameters gradstream "
    "summarises exactly, or use DistributedDataParallel"
)


def unsupported_wrapping(model: Any, params: Sequence[Any]) -> str | None:
    """Why a tap on ``model`` would summarise gradients that are not those of whole
    parameters, or None when every watched parameter is summarised exactly.

    Refused: FSDP v1 (``torch.distributed.fsdp.FullyShardedDataParallel``, with or
    without ``use_orig_params``), found as a wrapper module or as a parameter FSDP v1
    flattened (its ``_fsdp_flattened`` mark): the tap would report flat slices as the
    parameters' statistics.

    Args:
        model: the ``torch.nn.Module`` given to the tap. params: the watched parameters.

    Returns:
        One sentence naming the wrapping and what to use instead, or None.
    """
    torch = _import_torch()
    fsdp1: type | None = None
    if torch.distributed.is_available():
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel
        except ImportError:  # pragma: no cover - builds without FSDP
            pass
        else:
            fsdp1 = FullyShardedDataParallel
    wrapped = fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules())
    flattened = [p for p in params if getattr(p, "_fsdp_flattened", False)]
    if not wrapped and not flattened:
        return None
    where = ("the model holds a FullyShardedDataParallel (FSDP v1) module" if wrapped
             else f"{len(flattened)} watched parameter(s) were flattened by FSDP v1")
    return f"{where}: {_FSDP1_ADVICE}"


def _patterns(value: str | Iterable[str] | None, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{what} patterns must be str, got {type(p).__name__}")
    return out


def select_names(
    names: Iterable[str],
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
) -> list[str]:
    """Filter layer names with fnmatch-style glob patterns (case-sensitive).

    Args:
        names: layer names (normalised), in model order.
        include: a pattern or patterns; when given, a name is kept only if it matches at
            least one (``None`` keeps every name). ``*`` matches across dots, e.g.
            ``"encoder.*"`` or ``"*.weight"``.
        exclude: a pattern or patterns; a name matching any of them is dropped (applied
            after ``include``).

    Returns:
        The kept names, in the input order.

    Raises:
        TypeError: a pattern is not a ``str``.
    """
    inc = _patterns(include, "include")
    exc = _patterns(exclude, "exclude")
    kept = []
    for name in names:
        if inc is not None and not any(fnmatch.fnmatchcase(name, p) for p in inc):
            continue
        if exc is not None and any(fnmatch.fnmatchcase(name, p) for p in exc):
            continue
        kept.append(name)
    return kept


def full_numel(param: torch.Tensor) -> int:
    """Number of elements of the full (unsharded) parameter.

    Args:
        param: a parameter or tensor; a ``DTensor`` reports its global size.

    Returns:
        The element count, an ``int >= 0``.
    """
    return int(math.prod(param.shape))


def gradient_piece(grad: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """The part of a gradient this rank holds, and which piece of the parameter it is.

    A parameter is cut into ``shard_count`` disjoint pieces that together make the whole
    tensor; ranks holding the same piece are replicas of it, which the consumer counts once
    and checks for agreement (schema 1.3 shard layout).

    - A plain tensor is the whole parameter: piece 0 of 1. Under DDP every rank holds the
      same all-reduced gradient (a replica); in a single process, or when one pipeline
      stage owns the parameter, one rank does.
    - A ``DTensor`` (FSDP2 ``fully_shard``, HSDP, tensor parallelism) is its local part
      ``grad.to_local()``; the mesh dimensions with a ``Shard`` placement cut it, so the
      piece index is this rank's coordinate flattened (row-major) over those dimensions and
      the count is the product of their sizes; ``Replicate`` dimensions hold replicas.

    Args:
        grad: a plain tensor, a sparse COO tensor or a ``DTensor``.

    Returns:
        ``(local tensor, shard_index, shard_count)``, or ``None`` when this rank is not in
        the DTensor's mesh or the DTensor holds a pending ``Partial`` reduction (its local
        parts do not merge into statistics of the applied gradient).
    """
    to_local = getattr(grad, "to_local", None)
    if to_local is None or not callable(to_local) or not hasattr(grad, "placements"):
        return grad, 0, 1
    coordinate = grad.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    shape = grad.device_mesh.shape
    index, count = 0, 1
    for mesh_dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            return None
        if placement.is_shard():
            index = index * shape[mesh_dim] + coordinate[mesh_dim]
            count *= shape[mesh_dim]
    return to_local(), index, count


def dtype_name(dtype: Any) -> str:
    """A torch dtype's short name (``torch.bfloat16`` -> ``"bfloat16"``), as on the wire."""
    return str(dtype).removeprefix("torch.")


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
#: worker thread costs tens of microseconds).
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
        torch = _import_torch()
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
    torch = _import_torch()
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
    when the float64 sum overflows, as in the reference implementation) and ``max_abs`` =
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


class GradientTap:
    """Summarise a torch model's gradients once per optimiser step and hand them to a producer.

    Typical use::

        tap = GradientTap(model, producer, exclude="*.bias")
        tap.start_run()                    # producer.start_run(tap.layer_numel())
        tap.attach_optimizer(optimizer)    # summary taken in optimizer.step()'s pre-hook
        for step, batch in ...:
            for micro in chunks(batch):    # gradient accumulation: still one summary
                loss(model, micro).backward()
            optimizer.step()
            optimizer.zero_grad()

    The layer list is fixed when the tap is built: every parameter of
    ``model.named_parameters()`` (model order, shared parameters once) whose normalised
    name passes ``include``/``exclude``, frozen ones (``requires_grad=False``) included so
    that unfreezing later is picked up. A parameter whose ``.grad`` is ``None`` at a step
    is left out of that step's summary and counted in :attr:`skipped_without_grad`.

    With ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` skips ``optimizer.step()``
    when the gradients hold Inf/NaN, so the pre-hook does not see those steps; call
    ``scaler.unscale_(optimizer)`` then :meth:`step` by hand to see them.

    Args:
        model: a ``torch.nn.Module`` (possibly wrapped in DDP, ``torch.compile``,
            FSDP2, checkpoint wrappers: names are normalised with ``name_fn``).
        producer: an object with ``start_run(layer_numel, ...)`` and
            ``record_summaries(step, summaries)``, normally a ``GradientProducer``.
        every_n_steps: summarise only the optimiser steps whose number is a multiple of
            n (n >= 1; step 0 included). When the producer has ``settings.every_n_steps``
            (a ``GradientProducer`` does) the tap uses the least common multiple of both,
            so it never computes a summary the producer would drop; default: the
            producer's value (else 1).
        include: fnmatch glob pattern(s) on normalised names; only matching parameters are
            watched (default all). The producer's ``settings.include`` / ``exclude``, when
            present, are applied as well.
        exclude: fnmatch glob pattern(s) on normalised names; matching parameters are not
            watched.
        name_fn: ``str -> str`` applied to raw parameter names (default
            :func:`~producer.adapters.naming.normalize_name`).
        host_numpy: summarise CPU gradients with NumPy (see :func:`summarize_tensors`);
            False uses torch reductions for them too.
        accumulate: accumulation dtype of the torch reductions, ``"auto"`` (float64 on the
            CPU, float32 on accelerators), ``"float32"`` or ``"float64"``; error bound in
            :func:`summarize_tensors`.
        defer: read a step's statistics at the next summarised step (or :meth:`flush`)
            instead of waiting for the device: the training thread then never waits for
            the GPU; the one small copy per step is ``non_blocking`` into pinned memory with
            a CUDA event. The gradients are not kept, so a layer whose fast statistics are
            NaN/Inf is reported with ``nonfinite = numel`` and zero sums (counted in
            :attr:`inexact_layers`) and the tap switches to synchronous reads for the rest
            of the run (exact counts from then on). Off by default (exact counts at every
            step); opt in where the wait for the device shows in the step time. Call
            :meth:`flush` (the framework callbacks do) before ``finish_run``.
        emulate_device: summarise CPU gradients with the accelerator path, exactly as on
            a GPU (see :func:`summarize_tensors`): for tests and CPU smoke runs.

    Training-thread time: everything :meth:`step` does (collecting the gradients,
    reductions, copies, ``record_summaries``) is counted in the producer's
    ``stats().training_thread_s`` when the producer has ``add_training_time`` (a
    ``GradientProducer`` does).

    Raises:
        TypeError: ``model`` has no ``named_parameters``; a pattern is not a ``str``.
        ValueError: ``every_n_steps < 1``; no parameter selected; two parameters normalise
            to the same name.

    A model gradstream cannot summarise exactly (FSDP v1) builds a tap whose
    :attr:`unsupported` says why; :meth:`start_run`, :meth:`layer_numel` and :meth:`step`
    then raise :class:`UnsupportedParallelismError`.

    Attributes:
        skipped_without_grad: (parameter, step) pairs left out because ``.grad`` was
            ``None``, over the steps that were summarised.
        skipped_not_local: (parameter, step) pairs left out because the gradient is a
            DTensor with a pending ``Partial`` reduction, this rank is outside its mesh, or
            its local shard is empty.
        steps_recorded: summaries handed to the producer.
        steps_without_gradients: summarised steps where no watched parameter had a
            gradient (nothing is sent for them).
        inexact_layers: (layer, step) pairs reported without an exact non-finite count
            (deferred mode only, see ``defer``).
        every_n_steps: the effective sampling period (see the argument).
        next_step: the step number :meth:`step` uses when called without one.
        unsupported: why this model cannot be summarised exactly (FSDP v1), or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        producer: SummaryRecorder,
        *,
        every_n_steps: int | None = None,
        include: str | Iterable[str] | None = None,
        exclude: str | Iterable[str] | None = None,
        name_fn: Callable[[str], str] = normalize_name,
        host_numpy: bool = True,
        accumulate: Accumulate = "auto",
        defer: bool = False,
        emulate_device: bool = False,
    ) -> None:
        _import_torch()
        device_path.check_accumulate(accumulate)
        if not hasattr(model, "named_parameters"):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        own_n = 1 if every_n_steps is None else every_n_steps
        if isinstance(own_n, bool) or not isinstance(own_n, int):
            raise TypeError(f"every_n_steps must be an int, got {every_n_steps!r}")
        if own_n < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        settings = getattr(producer, "settings", None)
        producer_n = getattr(settings, "every_n_steps", 1) or 1
        named = list(model.named_parameters())
        names = normalized_names([raw for raw, _ in named], name_fn)
        by_name = {name: param for name, (_, param) in zip(names, named, strict=True)}
        kept = select_names(names, include, exclude)
        kept = select_names(
            kept, getattr(settings, "include", None) or None, getattr(settings, "exclude", None)
        )
        self._params = [(name, by_name[name]) for name in kept if full_numel(by_name[name]) > 0]
        if not self._params:
            raise ValueError(
                f"no parameters selected (model has {len(named)}; include={include!r}, "
                f"exclude={exclude!r})"
            )
        self._layer_numel = {name: full_numel(param) for name, param in self._params}
        self.unsupported = unsupported_wrapping(model, [p for _, p in self._params])
        self.producer = producer
        self.every_n_steps = math.lcm(own_n, int(producer_n))
        self.host_numpy = host_numpy
        self.next_step = 0
        self.skipped_without_grad = 0
        self.skipped_not_local = 0
        self.steps_recorded = 0
        self.steps_without_gradients = 0
        self._handles: list[Any] = []
        self._name_of = {id(param): name for name, param in self._params}
        self._local_rows: dict[str, tuple[int, float, float, float, int]] = {}
        self.accumulate = accumulate
        self.emulate_device = emulate_device
        self._inside = 0.0
        self.defer = defer
        self.inexact_layers = 0
        self._pending: tuple[int, PendingSummaries, np.ndarray, np.ndarray,
                             LayerSummaries | None] | None = None
        # The hot path: plain (non-DTensor) parameters, all with a gradient, need no
        # per-parameter work beyond reading .grad (layout arrays built once).
        self._tensors = [param for _, param in self._params]
        self._names = tuple(name for name, _ in self._params)
        self._plain = not any(
            hasattr(param, "placements") and hasattr(param, "to_local")
            for param in self._tensors
        )
        self._whole_index = np.zeros(len(self._params), dtype=np.int64)
        self._whole_count = np.ones(len(self._params), dtype=np.int64)

    @property
    def layer_names(self) -> list[str]:
        """Normalised names of the watched parameters, in model order."""
        return [name for name, _ in self._params]

    def layer_numel(self) -> dict[str, int]:
        """Layer name -> full parameter size, in model order (the ``start_run`` argument).

        Returns:
            A new dict; a DTensor parameter counts its global size.

        Raises:
            UnsupportedParallelismError: the model is wrapped in FSDP v1 (:attr:`unsupported`).
        """
        self._refuse_unsupported()
        return dict(self._layer_numel)

    def _refuse_unsupported(self) -> None:
        """Raise :class:`UnsupportedParallelismError` when :attr:`unsupported` is set."""
        if self.unsupported is not None:
            raise UnsupportedParallelismError(self.unsupported)

    def _check_ranks_agree(self) -> None:
        """Refuse the run when the ranks of the default process group announce different
        layer lists (names and sizes), e.g. one tap per pipeline stage.

        Only when ``torch.distributed`` is initialised with as many ranks as the producer's
        ``world_size`` (> 1): one ``all_gather_object`` of (layer count, SHA-256 of the
        list), a collective every rank of the group must reach.

        Raises:
            UnsupportedParallelismError: some rank's list differs from rank 0's (on every
                rank: all of them see the gathered digests).
        """
        torch = _import_torch()
        dist = torch.distributed
        world = getattr(self.producer, "world_size", None)
        if (not isinstance(world, int) or world < 2 or not dist.is_available()
                or not dist.is_initialized() or dist.get_world_size() != world):
            return
        listing = "\n".join(f"{name}\t{n}" for name, n in self._layer_numel.items())
        mine = (len(self._layer_numel), hashlib.sha256(listing.encode()).hexdigest())
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        differ = [r for r, theirs in enumerate(gathered) if tuple(theirs) != tuple(gathered[0])]
        if differ:
            r = differ[0]
            raise UnsupportedParallelismError(
                f"the ranks announce different layer lists: rank {r} watches "
                f"{gathered[r][0]} layer(s), rank 0 {gathered[0][0]} (or the same count with "
                f"other names or sizes; {len(differ)} rank(s) differ from rank 0). Every rank "
                "must report the same parameters (the consumer merges rank r's layer i with "
                "the others' layer i): pipeline stages that each watch their own layers are "
                "not supported yet; build the tap on the same model on every rank (DDP, "
                "FSDP2 fully_shard, tensor parallel), or run one gradstream run per stage "
                "with its own run id and world_size"
            )

    def layer_name_of(self, param: Any) -> str | None:
        """The layer name this tap gives a parameter (the object itself, not a copy), or
        None when the tap does not watch it (not selected, or not a parameter of the
        model)."""
        return self._name_of.get(id(param))

    def start_run(
        self,
        *,
        vanishing_threshold: float = 1e-7,
        exploding_threshold: float = 1e3,
        config: Mapping[str, Any] | None = None,
        ignore_layers: Sequence[str] = (),
    ) -> None:
        """Call ``producer.start_run`` with this tap's layer list.

        Args:
            vanishing_threshold: mean |g| below which a layer is vanishing.
            exploding_threshold: max |g| above which a layer is exploding.
            config: free-form JSON-serialisable run configuration.
            ignore_layers: layer-name patterns the run leaves out of its health,
                explicitly (``GradientProducer.start_run``).

        Raises:
            UnsupportedParallelismError: the model is wrapped in FSDP v1, or the ranks'
                layer lists differ (see the class); nothing is sent.
            Whatever ``producer.start_run`` raises (e.g. RuntimeError if already started).
        """
        self._refuse_unsupported()
        self._check_ranks_agree()
        self.producer.start_run(
            self.layer_numel(),
            vanishing_threshold=vanishing_threshold,
            exploding_threshold=exploding_threshold,
            config=config,
            dtypes={name: dtype_name(param.dtype) for name, param in self._params},
            ignore_layers=list(ignore_layers),
        )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Take a summary in every ``optimizer.step()``, before it reads the gradients.

        Registers ``optimizer.register_step_pre_hook``; the hook calls :meth:`step` with
        the tap's own step counter (0, 1, 2, ... one per ``optimizer.step()``). When
        ``step`` is given a closure (``LBFGS``, or any ``optimizer.step(closure)``), the
        gradients do not exist yet when the pre-hook runs: the hook then wraps the closure
        and takes the summary right after its first call (the gradient at the step's
        starting point), once per ``optimizer.step()``. Attach one optimiser per tap; with
        several optimisers call :meth:`step` by hand.

        Args:
            optimizer: a ``torch.optim.Optimizer`` (torch >= 2.0).

        Returns:
            The hook handle (``handle.remove()`` detaches it; :meth:`detach` removes all).

        Raises:
            TypeError: the optimiser has no ``register_step_pre_hook``.
        """
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is None:
            raise TypeError(
                f"{type(optimizer).__name__} has no register_step_pre_hook "
                "(needs a torch.optim.Optimizer, torch >= 2.0); call tap.step() by hand"
            )

        def _pre_hook(hooked: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # torch passes step()'s own positional arguments, which start with the optimiser.
            pos = 1 if args and args[0] is hooked else 0
            closure = kwargs.get("closure", args[pos] if len(args) > pos else None)
            if closure is None:
                self.step()
                return None
            fired = False

            def summarising_closure() -> Any:
                nonlocal fired
                loss = closure()
                if not fired:
                    fired = True
                    self.step()
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": summarising_closure}
            return (*args[:pos], summarising_closure, *args[pos + 1 :]), kwargs

        handle = register(_pre_hook)
        self._handles.append(handle)
        return handle

    def attach_ddp(self, ddp_model: Any, process_group: Any = None) -> None:
        """Turn on the per-rank local view for a ``DistributedDataParallel`` model.

        Registers :meth:`comm_hook` with ``ddp_model.register_comm_hook`` (one hook per DDP
        model, before the first backward). Lightning users pass the hook instead:
        ``DDPStrategy(ddp_comm_hook=tap.comm_hook)``.

        Args:
            ddp_model: the DDP-wrapped model whose parameters this tap watches.
            process_group: the group DDP all-reduces over (None: the default group); handed
                to DDP's default all-reduce as its state.

        Raises:
            TypeError: ``ddp_model`` has no ``register_comm_hook`` (not DDP).
        """
        register = getattr(ddp_model, "register_comm_hook", None)
        if register is None:
            raise TypeError(
                f"{type(ddp_model).__name__} has no register_comm_hook: attach_ddp needs a "
                "torch.nn.parallel.DistributedDataParallel model"
            )
        register(process_group, self.comm_hook)

    @property
    def comm_hook(self) -> Callable[..., Any]:
        """This tap's DDP communication hook, ``hook(state, bucket)`` (see
        :meth:`summarize_bucket`); DDP refuses a hook whose ``bucket`` is annotated with
        anything but ``GradBucket``, so the hook itself carries no annotations."""
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            return self.summarize_bucket(state, bucket)

        return hook

    def summarize_bucket(self, state: Any, bucket: Any) -> Any:
        """DDP communication hook: summarise the bucket's local gradients, then all-reduce.

        The bucket holds this rank's own gradients of its parameters before the reduction
        (with ``no_sync`` gradient accumulation, the sum of the step's micro-batches;
        without it, DDP reduces at every micro-batch and the last reduction's input is
        kept). They are summarised like the frame statistics (:func:`summarize_tensors`,
        one small device-to-host copy per bucket on an accelerator) and handed to the next
        :meth:`step` as the local view; then DDP's default ``allreduce_hook`` runs.

        Args:
            state: the process group for the all-reduce (None: default group).
            bucket: the ``torch.distributed.GradBucket`` DDP passes.

        Returns:
            The all-reduce future of DDP's default hook.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        names = []
        views = []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            name = self._name_of.get(id(param))
            if name is not None and grad is not None and grad.numel() > 0:
                names.append(name)
                views.append(grad)
        if names:
            local = summarize_tensors(dict(zip(names, views, strict=True)),
                                      host_numpy=self.host_numpy, accumulate=self.accumulate,
                                      emulate_device=self.emulate_device)
            for i, name in enumerate(local.names):
                self._local_rows[name] = (
                    int(local.numel[i]), float(local.sum_abs[i]),  # type: ignore[index]
                    float(local.sum_sq[i]), float(local.max_abs[i]),  # type: ignore[index]
                    int(local.nonfinite[i]),
                )
        return default_hooks.allreduce_hook(state, bucket)

    def _take_local(self) -> LayerSummaries | None:
        """The local view gathered by :meth:`comm_hook` since the last step (model
        order), then forgotten; None when no hook ran."""
        if not self._local_rows:
            return None
        rows = self._local_rows
        self._local_rows = {}
        names = tuple(n for n, _ in self._params if n in rows)
        table = np.array([rows[n] for n in names], dtype=np.float64).reshape(len(names), 5)
        return LayerSummaries(
            names, table[:, 0].astype(np.int64), table[:, 1], table[:, 2], table[:, 3],
            table[:, 4].astype(np.int64),
        )

    def detach(self) -> None:
        """Remove every optimiser hook this tap registered (a deferred summary still
        waiting is handed over first, see :meth:`flush`)."""
        self.flush()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def flush(self) -> LayerSummaries | None:
        """Hand a deferred summary (``defer``) to the producer now, waiting for its copy.

        Returns:
            The summaries handed over, or None when none was waiting.

        Raises:
            Whatever ``producer.record_summaries`` raises.
        """
        t0 = time.perf_counter()
        handed, inside = self._hand_over_pending()
        self._count_time(time.perf_counter() - t0 - inside)
        return handed

    def _hand_over_pending(self) -> tuple[LayerSummaries | None, float]:
        """Finish the waiting deferred summary and record it; (summaries or None, seconds
        spent inside ``record_summaries``)."""
        if self._pending is None:
            return None, 0.0
        step, pending, index, count, local = self._pending
        self._pending = None
        summaries = pending.result()
        if pending.inexact:
            self.inexact_layers += pending.inexact
            self.defer = False
            log.warning(
                "step %d: %d layer(s) had NaN/Inf gradients read after the step (deferred "
                "mode); reported with nonfinite = numel; reading synchronously from now on",
                step, pending.inexact,
            )
        return self._record(step, summaries, index, count, local)

    def _record(
        self, step: int, summaries: LayerSummaries, index: np.ndarray, count: np.ndarray,
        local: LayerSummaries | None,
    ) -> tuple[LayerSummaries, float]:
        """Attach layout and local view, call ``record_summaries``; (the summaries handed
        over, seconds spent inside ``record_summaries``: the producer counts those)."""
        summaries = summaries.with_layout(index, count)
        if local is not None:
            summaries = summaries.with_local(local)
        t0 = time.perf_counter()
        self.producer.record_summaries(step, summaries)
        inside = time.perf_counter() - t0
        self.steps_recorded += 1
        return summaries, inside

    def _count_time(self, seconds: float) -> None:
        """Add the tap's own training-thread seconds to the producer's accounting."""
        add = getattr(self.producer, "add_training_time", None)
        if add is not None and seconds > 0:
            add(seconds)

    def step(self, step: int | None = None) -> LayerSummaries | None:
        """Summarise the current ``.grad`` of the watched parameters for one optimiser step.

        Call it after the last ``backward()`` of the step and before ``optimizer.step()``
        (or let :meth:`attach_optimizer` do it).

        Args:
            step: the optimiser step number, >= 0; default :attr:`next_step`. Afterwards
                :attr:`next_step` is ``step + 1``.

        Returns:
            The summaries handed to ``producer.record_summaries`` in this call, or ``None``
            when the step is not a multiple of ``every_n_steps``, no watched parameter has a
            gradient, or (deferred mode) nothing was waiting: in deferred mode a summarised
            step hands over the previous summarised step's statistics and queues its own.

        Raises:
            ValueError: a negative or non-integer step.
            TypeError: a gradient of a non-floating-point dtype.
            Whatever ``producer.record_summaries`` raises (e.g. RuntimeError before
            ``start_run``).
        """
        t0 = time.perf_counter()
        self._inside = 0.0
        try:
            return self._step(step)
        finally:
            self._count_time(time.perf_counter() - t0 - self._inside)

    def _step(self, step: int | None) -> LayerSummaries | None:
        """:meth:`step` without the time accounting (``self._inside`` collects the seconds
        spent inside ``record_summaries``)."""
        self._refuse_unsupported()
        if step is None:
            step = self.next_step
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step = int(step)
        self.next_step = step + 1
        if step % self.every_n_steps:
            return None
        handed, inside = self._hand_over_pending()
        self._inside += inside
        grads: dict[str, Any]
        current = [param.grad for param in self._tensors]
        if self._plain and not any(grad is None for grad in current):
            grads = dict(zip(self._names, current, strict=True))
            index, count = self._whole_index, self._whole_count
        else:
            grads = {}
            index_list: list[int] = []
            count_list: list[int] = []
            for (name, _), grad in zip(self._params, current, strict=True):
                if grad is None:
                    self.skipped_without_grad += 1
                    continue
                piece = gradient_piece(grad)
                if piece is None or piece[0].numel() == 0:
                    self.skipped_not_local += 1
                    continue
                grads[name] = piece[0]
                index_list.append(piece[1])
                count_list.append(piece[2])
            index, count = np.asarray(index_list), np.asarray(count_list)
        local = self._take_local()
        if not grads:
            self.steps_without_gradients += 1
            return handed
        settings = getattr(self.producer, "settings", None)
        norms_only = getattr(settings, "mode", "full") == "norms"
        pending = launch_summaries(
            grads, host_numpy=self.host_numpy, norms_only=norms_only,
            accumulate=self.accumulate, keep_gradients=not self.defer,
            emulate_device=self.emulate_device,
        )
        if self.defer:
            self._pending = (step, pending, index, count, local)
            return handed
        handed, inside = self._record(step, pending.result(), index, count, local)
        self._inside += inside
        return handed


class _TapSession:
    """Shared logic of the framework callbacks (Hugging Face, Lightning): build the tap at
    train start, one summary per optimiser step, finish the run at train end."""

    def __init__(
        self,
        producer: RunRecorder,
        *,
        every_n_steps: int | None,
        include: str | Iterable[str] | None,
        exclude: str | Iterable[str] | None,
        name_fn: Callable[[str], str],
        vanishing_threshold: float,
        exploding_threshold: float,
        config: Mapping[str, Any] | None,
        finish_run: bool,
        close_producer: bool,
        ignore_layers: Iterable[str] = (),
        structural_ignore: Callable[[Any], Iterable[Any]] | None = None,
        structural_reason: str = "",
    ) -> None:
        if isinstance(ignore_layers, str):
            ignore_layers = [ignore_layers]
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
        ):
            raise TypeError(f"every_n_steps must be an int, got {every_n_steps!r}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.producer = producer
        self.every_n_steps = every_n_steps
        self.include = include
        self.exclude = exclude
        self.name_fn = name_fn
        self.vanishing_threshold = vanishing_threshold
        self.exploding_threshold = exploding_threshold
        self.config = dict(config or {})
        self.finish_run = finish_run
        self.close_producer = close_producer
        self.ignore_layers = list(ignore_layers)
        self.structural_ignore = structural_ignore
        self.structural_reason = structural_reason
        self.tap: GradientTap | None = None

    def begin(
        self, model: Any, *, rank: int, world_size: int, framework: Mapping[str, Any]
    ) -> GradientTap:
        if model is None:
            raise ValueError("the trainer passed no model to the gradstream callback")
        for what, mine, theirs in (
            ("world_size", getattr(self.producer, "world_size", None), world_size),
            ("rank", getattr(self.producer, "rank", None), rank),
        ):
            if mine is not None and int(mine) != int(theirs):
                raise ValueError(
                    f"the producer's {what} is {mine} but the trainer's is {theirs}: build "
                    f"the GradientProducer with rank={rank}, world_size={world_size}"
                )
        if self.tap is not None:
            raise RuntimeError("this gradstream callback already started a run; use one "
                               "callback and one producer per training run")
        tap = GradientTap(
            model,
            self.producer,
            every_n_steps=self.every_n_steps,
            include=self.include,
            exclude=self.exclude,
            name_fn=self.name_fn,
        )
        config = {"framework": dict(framework), **self.config}
        ignore = list(self.ignore_layers)
        if self.structural_ignore is not None:
            # Parameters the adapter knows by the model's structure, never by magnitude:
            # named exactly (glob.escape keeps [, *, ? in names literal).
            names = [n for n in map(tap.layer_name_of, self.structural_ignore(model))
                     if n is not None]
            ignore += [glob.escape(n) for n in names]
            config.setdefault("ignore_layers_structural", {
                "reason": self.structural_reason, "layers": names})
        tap.start_run(
            vanishing_threshold=self.vanishing_threshold,
            exploding_threshold=self.exploding_threshold,
            config=config,
            ignore_layers=ignore,
        )
        self.tap = tap
        return tap

    def step(self, step: int) -> LayerSummaries | None:
        if self.tap is None:
            raise RuntimeError("gradstream callback: optimiser step before the train start hook")
        return self.tap.step(int(step))

    def end(self) -> None:
        if self.tap is None:
            return
        self.tap.flush()
        if self.finish_run:
            self.producer.finish_run()
        if self.close_producer:
            self.producer.close()
