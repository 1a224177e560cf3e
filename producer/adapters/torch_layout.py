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

Every rank of a run must announce the same layer list: the consumer merges rank r's
statistics of layer i with the other ranks' statistics of layer i. When
``torch.distributed`` is initialised with as many ranks as the producer's ``world_size``,
``start_run`` compares the ranks' layer lists (one ``all_gather_object`` of a digest: every
rank must call it) and refuses the run on every rank when they differ, as they do when each
pipeline stage builds a tap on its own stage (not supported yet).

Importing this module does not import torch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from producer.adapters.optional import import_torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class UnsupportedParallelismError(RuntimeError):
    """The model is wrapped, or the ranks are laid out, in a way gradstream cannot turn
    into the statistics of whole parameters yet (FSDP v1 over tensor-parallel DTensors or
    with its unit outside the tapped model, ranks announcing different layer lists such as
    pipeline stages). Raised by :meth:`GradientTap.start_run`, before anything is sent; the
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


def check_ranks_agree(layer_numel: Mapping[str, int], world_size: object) -> None:
    """Refuse the run when the ranks of the default process group announce different
    layer lists (names and sizes), e.g. one tap per pipeline stage.

    Only when ``torch.distributed`` is initialised with ``world_size`` (> 1) ranks: one
    ``all_gather_object`` of (layer count, SHA-256 of the list), a collective every rank
    of the group must reach.

    Args:
        layer_numel: this rank's layer name -> full parameter size, in model order.
        world_size: the producer's ``world_size`` (anything but an int >= 2 skips the check).

    Raises:
        UnsupportedParallelismError: some rank's list differs from rank 0's (on every
            rank: all of them see the gathered digests).
    """
    torch = import_torch()
    dist = torch.distributed
    world = world_size
    if (not isinstance(world, int) or world < 2 or not dist.is_available()
            or not dist.is_initialized() or dist.get_world_size() != world):
        return
    listing = "\n".join(f"{name}\t{n}" for name, n in layer_numel.items())
    mine = (len(layer_numel), hashlib.sha256(listing.encode()).hexdigest())
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
