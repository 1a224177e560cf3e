"""How a rank's gradients map onto whole parameters under torch.distributed, and the
layouts gradstream refuses.

What a frame means across ranks: the statistics of the gradient the optimiser applies.
Every rank reports every watched parameter it holds, tagged with the piece of the parameter
it covers (:func:`gradient_piece`): a plain tensor is the whole parameter (under DDP every
rank holds the same all-reduced gradient, a replica the consumer counts once); a
``DTensor`` (FSDP2 ``fully_shard``, HSDP, tensor parallelism) is summarised through its
local shard, its ``Shard`` mesh dimensions cutting the parameter into disjoint pieces that
add up, its ``Replicate`` dimensions holding replicas. A gradient with a pending
(``Partial``) reduction is not reported. ``numel`` in ``start_run`` is the full (global)
parameter size. FSDP v1 (``FullyShardedDataParallel``, flat parameters or
``use_orig_params=True``) is resolved into the original parameters by
:mod:`producer.adapters.torch_fsdp1`, which also names the FSDP v1 layouts refused at
``start_run`` (:class:`UnsupportedParallelismError`).

Every rank of a run announces the same layer list: the union of what the ranks declare
(:mod:`producer.adapters.torch_run_layers`, e.g. pipeline stages each declaring their own
layers), so that rank r's statistics of layer i are merged with the other ranks' statistics
of the same parameter.

Importing this module does not import torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class UnsupportedParallelismError(RuntimeError):
    """The model is wrapped, or the ranks are laid out, in a way gradstream cannot turn
    into the statistics of whole parameters yet (FSDP v1 over tensor-parallel DTensors or
    with its unit outside the tapped model, ranks declaring one layer name for different
    parameters). Raised by :meth:`GradientTap.start_run`, before anything is sent; the
    message says what to use instead."""


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
    and checks for agreement (``StepSummary.shard_index`` / ``shard_count``).

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
