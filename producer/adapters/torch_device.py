"""The accelerator path of the torch adapter: batched norm reductions and one staged copy.

For a set of gradients on one device this module computes, per tensor, ``sum |g|``,
``sqrt(sum g^2)`` and ``max |g|`` with one batched ``torch._foreach_norm`` per statistic
and dtype (ord 1, 2 and inf; ord 2 only in norms mode; on CUDA a single multi-tensor
kernel each for dense same-dtype tensors), stacks the results into one small float64
``[k, 3]`` tensor on the device and starts one device->host copy of it (:func:`stage`).
The training stream is never synchronised here: on CUDA the copy is ``non_blocking`` into
page-locked memory followed by a recorded CUDA event; the reader waits for that event.
A second, equally small copy happens only for tensors whose fast statistics came out
NaN/Inf (a NaN/Inf element, or a float32 square that overflowed): those are recounted
exactly in float64 over their finite elements (:func:`finite_stats`).

The same code runs on CPU tensors when asked (``emulate=True`` in :func:`stage` and
:func:`accumulation_dtype`): float32 accumulation as on an accelerator and a real copy of
the stacked statistics into a separate host buffer, so that tests on a machine without a
GPU exercise what a GPU runs, less the CUDA stream semantics.

Accumulation error (float32, the accelerator default): every term of ``sum |g|`` and
``sum g^2`` is non-negative, so whatever the summation order the relative error of a
float32 sum of n terms is at most gamma_h = h*u / (1 - h*u), u = 2^-24, where h <= n - 1
is the height of the summation tree (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., section 4.2). Rounding |g|, g^2 and the norm to float32 adds at most
3u to ``sum_sq`` and u to ``sum_abs``: a bound of (h + 3)u relative, <= 6e-8 * (n + 2) for
any order. ``max |g|`` is exact (bfloat16/float16 -> float32 is exact). Float64 tensors
always accumulate in float64 (relative error ~1e-15).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: The accepted values of ``accumulate``: "auto" is float64 on the CPU host path and
#: float32 on an accelerator (and on the CPU when the accelerator path is emulated).
ACCUMULATE = ("auto", "float32", "float64")


def check_accumulate(accumulate: str) -> None:
    """Raise ValueError unless ``accumulate`` is one of :data:`ACCUMULATE`."""
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be 'auto', 'float32' or 'float64', got {accumulate!r}")


def accumulation_dtype(
    accumulate: str, device: Any, dtype: Any, torch: Any, emulate: bool = False
) -> Any:
    """The ``dtype=`` of the norm reductions for tensors of ``dtype`` on ``device``.

    Args:
        accumulate: one of :data:`ACCUMULATE`.
        device: the tensors' ``torch.device``.
        dtype: the tensors' floating-point dtype.
        torch: the torch module.
        emulate: the CPU runs the accelerator path: "auto" resolves to float32 there too.

    Returns:
        ``torch.float64`` for float64 tensors, for ``"float64"`` and for ``"auto"`` on a
        CPU device without ``emulate``; ``torch.float32`` otherwise.

    Raises:
        ValueError: an unknown ``accumulate``.
    """
    check_accumulate(accumulate)
    if dtype == torch.float64:
        return torch.float64
    wide = accumulate == "float64" or (
        accumulate == "auto" and device.type == "cpu" and not emulate
    )
    return torch.float64 if wide else torch.float32


def batched_norms(
    tensors: Sequence[torch.Tensor], ord_: float, dtype: Any, torch: Any
) -> list[torch.Tensor]:
    """Vector norms of each tensor as 0-d tensors of ``dtype``.

    One ``torch._foreach_norm`` call (a single multi-tensor kernel on CUDA for same-dtype
    dense tensors); where torch refuses it (an older torch, an unsupported layout) one
    ``torch.linalg.vector_norm`` per tensor.

    Args:
        tensors: k >= 1 floating-point tensors on one device, of one dtype.
        ord_: 1.0, 2.0 or ``math.inf``.
        dtype: the accumulation and result dtype.
        torch: the torch module.

    Returns:
        k 0-d tensors of ``dtype`` on the tensors' device.
    """
    foreach = getattr(torch, "_foreach_norm", None)
    if foreach is not None:
        try:
            return list(foreach(list(tensors), ord_, dtype=dtype))
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return [torch.linalg.vector_norm(t, ord_, dtype=dtype) for t in tensors]


def stats_on_device(
    tensors: Sequence[torch.Tensor], torch: Any, *, norms_only: bool = False,
    accumulate: str = "auto", emulate: bool = False,
) -> tuple[torch.Tensor, np.ndarray]:
    """Per-tensor ``(sum |g|, sqrt(sum g^2), max |g|)`` of same-device tensors, on the device.

    Per dtype, one batched norm reduction per statistic (:func:`batched_norms`, ord 1, 2
    and inf; only ord 2 with ``norms_only``); all the 0-d results are stacked by one
    ``torch.stack`` per dtype and converted to float64 once. Nothing here waits for the
    device, and nothing is copied between host and device.

    Args:
        tensors: k >= 1 dense floating-point tensors with at least one element each, on one
            device.
        torch: the torch module.
        norms_only: compute only the L2 norm; columns 0 and 2 are NaN.
        accumulate: one of :data:`ACCUMULATE` (see :func:`accumulation_dtype`).
        emulate: CPU tensors take the accelerator's accumulation (see
            :func:`accumulation_dtype`).

    Returns:
        ``(stats, order)``: ``stats`` is a float64 ``[k, 3]`` tensor on the device whose
        row ``j`` holds the statistics of ``tensors[order[j]]`` (``order``: int64[k], the
        tensors grouped by dtype; the identity when all share one dtype).
    """
    device = tensors[0].device
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    ords = (2.0,) if norms_only else (1.0, 2.0, math.inf)
    blocks = []
    for dtype, idx in by_dtype.items():
        group = list(tensors) if len(by_dtype) == 1 else [tensors[i] for i in idx]
        acc = accumulation_dtype(accumulate, device, dtype, torch, emulate)
        norms = [n for o in ords for n in batched_norms(group, o, acc, torch)]
        block = torch.stack(norms).view(len(ords), len(group)).t().to(
            torch.float64, memory_format=torch.contiguous_format
        )
        if norms_only:
            nan = torch.full_like(block, math.nan)
            block = torch.cat([nan, block, nan], dim=1)
        blocks.append(block)
    if len(blocks) == 1:
        return blocks[0], np.arange(len(tensors), dtype=np.int64)
    order = np.concatenate([np.asarray(idx, dtype=np.int64) for idx in by_dtype.values()])
    return torch.cat(blocks), order


def finite_stats(tensors: Sequence[torch.Tensor], torch: Any) -> torch.Tensor:
    """Exact statistics over the finite elements, for the rare tensors holding NaN/Inf.

    Each tensor's NaN/Inf elements are replaced by 0 (one ``torch.where`` per tensor, run
    only for the tensors whose fast statistics were non-finite), then the three norms are
    taken in float64 by batched reductions (:func:`batched_norms`) and the non-finite
    elements counted, the NaN among them apart (``torch.isnan``).

    Args:
        tensors: k >= 1 floating-point tensors on one device.
        torch: the torch module.

    Returns:
        A float64 ``[k, 5]`` tensor on the device: ``(sum |g|, sqrt(sum g^2), max |g|,
        nonfinite count, NaN count)`` over the finite elements (0.0 sums and max when none
        is finite).
    """
    finite = [torch.isfinite(t) for t in tensors]
    clean = [
        torch.where(ok, t, torch.zeros((), dtype=t.dtype, device=t.device))
        for ok, t in zip(finite, tensors, strict=True)
    ]
    norms = [
        n for o in (1.0, 2.0, math.inf) for n in batched_norms(clean, o, torch.float64, torch)
    ]
    cols = torch.stack(norms).view(3, len(clean)).t().contiguous()
    bad = torch.stack(
        [(t.numel() - ok.sum()).to(torch.float64) for ok, t in zip(finite, tensors, strict=True)]
    )
    nan = torch.stack([torch.isnan(t).sum().to(torch.float64) for t in tensors])
    return torch.cat([cols, bad.view(-1, 1), nan.view(-1, 1)], dim=1)


def stage(stats: torch.Tensor, torch: Any, emulate: bool = False) -> tuple[torch.Tensor, Any]:
    """Start the one device->host copy of a small statistics tensor.

    On CUDA: a ``non_blocking`` copy into page-locked (pinned) host memory and a CUDA event
    recorded after it on the current stream; the host does not wait here (read the buffer
    after ``event.synchronize()``). On the CPU with ``emulate``: a copy into a separate
    host buffer (a CPU copy completes at once; no event). Otherwise ``stats.cpu()`` (no
    copy for a CPU tensor) and no event.

    Args:
        stats: a small tensor (the ``[k, 3]`` or ``[k, 4]`` statistics).
        torch: the torch module.
        emulate: copy a CPU tensor as the accelerator path copies a device tensor.

    Returns:
        ``(host tensor, event or None)``.
    """
    if stats.device.type == "cuda":
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
    if emulate and stats.device.type == "cpu":
        host = torch.empty(stats.shape, dtype=stats.dtype)
        host.copy_(stats)
        return host, None
    return stats.cpu(), None
