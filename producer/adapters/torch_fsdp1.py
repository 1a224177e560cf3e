"""FSDP v1 (``torch.distributed.fsdp.FullyShardedDataParallel``): a wrapped model's original
parameters, and each one's piece of the gradient on this rank.

FSDP v1 flattens the parameters of every wrapped unit into one ``FlatParameter`` per unit
(the unit's handle, ``unit._handle.flat_param``), pads it to a multiple of the sharding
group's size and gives rank ``r`` of that group the contiguous chunk ``r``. A chunk can
start or end inside an original parameter, hold several of them, or none. The flat
parameter's own metadata (``torch/distributed/fsdp/_flat_param.py``, ``FlatParameter``)
says where each original parameter lies:

- ``_param_infos[i]`` = (``param_name``, ``module``, ...): the parameter's own name and the
  module that registered it (still in the model's module tree, under the
  ``_fsdp_wrapped_module.`` components that :func:`~producer.adapters.naming.normalize_name`
  removes);
- ``_numels[i]``: its full element count (padding excluded);
- ``_shard_param_infos[i]`` = (``in_shard``, ``offset_in_shard``, ``numel_in_shard``, ...):
  whether this rank's chunk holds part of it, and where (padding is never inside such a
  range).

A rank's piece of original parameter ``i`` is therefore ``flat.grad[offset:offset + n]``
with ``use_orig_params=False`` (the model's parameters are the flat parameters; their
``.grad`` is this rank's reduce-scattered chunk, padding included), and the original
parameter's own ``.grad`` with ``use_orig_params=True`` (FSDP sets it to that same
1-D view, or to None when the chunk holds none of it). The pieces of the ranks of one
sharding group are disjoint and add up to the parameter: ``shard_index`` = the rank's index
in the group (``handle.rank``), ``shard_count`` = the group's size (``handle.world_size``);
under ``HYBRID_SHARD`` the replicate dimension holds replicas of the same piece;
``NO_SHARD`` gives every rank the whole parameter (piece 0 of 1, a replica, as DDP).

Refused (:func:`unsupported_fsdp1`): a flattened parameter whose FSDP unit is not inside the
model given to the tap (its layout cannot be read), and FSDP v1 over tensor-parallel
``DTensor`` parameters (parameter extensions: ``_numels`` are then local sizes).

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from producer.adapters.optional import import_torch
from producer.adapters.torch_layout import full_numel, gradient_piece
from producer.adapters.torch_reduce import ReplicaLayout, replica_layout

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


@dataclass(frozen=True, slots=True, eq=False)
class OriginalParameter:
    """One original parameter of an FSDP v1 model (or a parameter FSDP does not manage),
    and where this rank's piece of its gradient lies.

    Attributes:
        raw_name: its dotted name in the wrapped model, wrapper components included
            (``_fsdp_wrapped_module.0._fsdp_wrapped_module.weight``).
        numel: the full parameter's element count (> 0 for every parameter FSDP manages).
        dtype: the parameter's dtype (a ``torch.dtype``).
        tensor: the tensor whose ``.grad`` holds the piece: the flat parameter
            (``use_orig_params=False``), the original parameter (``use_orig_params=True``)
            or the parameter itself (``managed`` False).
        managed: FSDP v1 manages it; False for a parameter outside every unit (ignored
            modules or parameters), whose piece is :func:`gradient_piece` of its gradient.
        flat: ``tensor`` is a flat parameter shared by several original parameters.
        offset: start of the piece inside this rank's flat chunk; -1 when the chunk holds
            none of it.
        length: elements of the piece (0 when the chunk holds none of it).
        chunk: elements of this rank's flat chunk, padding included (the size the gradient
            the optimiser applies has; another size is an unreduced gradient).
        shard_index: this rank's index in the sharding group (0 under ``NO_SHARD``).
        shard_count: the sharding group's size (1 under ``NO_SHARD``).
        shard_ranks: global ranks of this rank's sharding group, by piece index (this rank
            alone under ``NO_SHARD``).
        replica_ranks: global ranks holding this rank's piece, by replica index: the
            replicate group under ``HYBRID_SHARD``, the whole group under ``NO_SHARD``,
            this rank alone otherwise.
    """

    raw_name: str
    numel: int
    dtype: Any
    tensor: Any
    managed: bool = False
    flat: bool = False
    offset: int = -1
    length: int = 0
    chunk: int = 0
    shard_index: int = 0
    shard_count: int = 1
    shard_ranks: tuple[int, ...] = ()
    replica_ranks: tuple[int, ...] = ()

    @property
    def local(self) -> bool:
        """This rank holds a piece of the parameter (always True when not managed)."""
        return not self.managed or self.length > 0

    def piece(self, grad: torch.Tensor | None) -> tuple[torch.Tensor, int, int] | None:
        """This rank's piece of the gradient, as :func:`gradient_piece` returns it.

        Args:
            grad: ``tensor.grad`` (the flat chunk's gradient, float[chunk]; the original
                parameter's 1-D view, float[length]; or any gradient when not managed).

        Returns:
            ``(1-D view of length elements, shard_index, shard_count)``; for an unmanaged
            parameter what :func:`gradient_piece` returns; None when this rank holds none
            of the parameter, ``grad`` is None, or ``grad`` does not have the sharded size
            (an unreduced gradient, e.g. inside ``no_sync``: not what the optimiser
            applies).
        """
        if grad is None:
            return None
        if not self.managed:
            return gradient_piece(grad)
        if self.length == 0:
            return None
        if self.flat:
            if grad.numel() != self.chunk:
                return None
            view = grad.reshape(-1).narrow(0, self.offset, self.length)
        else:
            if grad.numel() != self.length:
                return None
            view = grad.reshape(-1)
        return view, self.shard_index, self.shard_count

    def replica_layout(self, rank: int, world_size: int) -> ReplicaLayout:
        """Where this parameter's pieces and their replicas live, for the in-band
        reduction (:func:`producer.adapters.torch_reduce.replica_layout` asks the
        parameter).

        ``table[p, s]`` is the global rank holding piece ``p`` in replica slot ``s``. This
        rank knows its own row (``replica_ranks``) and column (``shard_ranks``); the other
        entries are taken as translates of its sharding group by the replica's offset
        (``shard_ranks[p] + replica_ranks[s] - rank``), the layout FSDP's own
        ``HYBRID_SHARD`` groups and a 2-D device mesh have. They only name ranks in a
        ``replica_divergence`` report; what is counted depends on the slot alone.

        Args:
            rank: this rank in the default group. world_size: the default group's size.

        Returns:
            The :class:`~producer.adapters.torch_reduce.ReplicaLayout`; for an unmanaged
            parameter, the one :func:`~producer.adapters.torch_reduce.replica_layout`
            gives its tensor.
        """
        if not self.managed:
            return replica_layout(self.tensor, rank, world_size)
        shard = np.asarray(self.shard_ranks or (rank,), np.int64)
        replica = np.asarray(self.replica_ranks or (rank,), np.int64)
        table = shard[:, None] + (replica - rank)[None, :]
        slot = int(np.flatnonzero(replica == rank)[0])
        return ReplicaLayout(table, slot)


def fsdp1_units(model: Any) -> list[Any]:
    """The ``FullyShardedDataParallel`` (FSDP v1) modules inside ``model`` (itself
    included), in module order; empty when torch has no FSDP or none is used.

    Args:
        model: a ``torch.nn.Module``.
    """
    torch = import_torch()
    if not torch.distributed.is_available():  # pragma: no cover - builds without dist
        return []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without FSDP
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def _flattened(tensor: Any) -> bool:
    """FSDP v1 marked the tensor as flattened (a flat parameter, or an original parameter
    of one under ``use_orig_params=True``)."""
    return bool(getattr(tensor, "_fsdp_flattened", False))


def unsupported_fsdp1(model: Any) -> str | None:
    """Why the FSDP v1 parameters of ``model`` cannot be resolved into original parameters,
    or None when they can (or FSDP v1 is not used).

    Args:
        model: the ``torch.nn.Module`` given to the tap.

    Returns:
        One sentence naming the problem and what to do instead, or None.
    """
    units = fsdp1_units(model)
    known: set[int] = set()
    for unit in units:
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        known.add(id(flat))
        known.update(id(p) for p in (getattr(flat, "_params", None) or ()))
        known.update(id(p) for p in (getattr(flat, "_shared_params", None) or ()))
        if any(ext is not None for ext in getattr(flat, "_param_extensions", ())):
            return ("FSDP v1 shards tensor-parallel DTensor parameters here (parameter "
                    "extensions): its flat parameters then hold local tensor-parallel "
                    "pieces whose full sizes gradstream cannot read; use FSDP2 "
                    "(torch.distributed.fsdp.fully_shard) on a 2-D device mesh, whose "
                    "DTensor gradients gradstream summarises exactly")
    stray = [name for name, p in model.named_parameters()
             if _flattened(p) and id(p) not in known]
    if stray:
        return (f"{len(stray)} parameter(s) (first {stray[0]!r}) were flattened by a "
                "FullyShardedDataParallel (FSDP v1) unit that is not inside the model "
                "given to the tap, so where each original parameter lies cannot be read; "
                "build the tap on the FSDP-wrapped model itself")
    return None


def original_parameters(model: Any) -> list[OriginalParameter] | None:
    """The parameters of an FSDP v1 model as they were before wrapping, in model order.

    Model order is ``named_parameters()`` order of the unwrapped model: the modules in
    pre-order (the wrapping keeps the module tree, adding wrappers), each module's own
    parameters in registration order (a flat parameter keeps them in that order);
    parameters FSDP does not manage follow the managed ones of their module. A
    parameter shared by several modules is listed once, as FSDP lists it.

    Args:
        model: a ``torch.nn.Module``, normally the root ``FullyShardedDataParallel``.

    Returns:
        One :class:`OriginalParameter` per parameter, or None when ``model`` holds no
        FSDP v1 unit (the tap then reads ``named_parameters()`` as they are).

    Raises:
        ValueError: a flat parameter names a module that is not in ``model`` (a model
            whose layout :func:`unsupported_fsdp1` refuses).
    """
    units = fsdp1_units(model)
    if not units:
        return None
    order: dict[int, tuple[int, str]] = {}
    for position, (path, module) in enumerate(model.named_modules()):
        order.setdefault(id(module), (position, path))
    keyed: list[tuple[tuple[int, int, int], OriginalParameter]] = []
    managed: set[int] = set()
    for unit in units:
        handle = getattr(unit, "_handle", None)
        if handle is None:  # a unit without parameters of its own
            continue
        flat = handle.flat_param
        managed.add(id(flat))
        originals = getattr(flat, "_params", None)  # use_orig_params=True only
        managed.update(id(p) for p in (originals or ()))
        managed.update(id(p) for p in (getattr(flat, "_shared_params", None) or ()))
        sharded = bool(handle.uses_sharded_strategy)
        index, count = (int(handle.rank), int(handle.world_size)) if sharded else (0, 1)
        shard_ranks, replica_ranks = _group_ranks(unit, handle, sharded)
        chunk = int(flat._sharded_size.numel())
        for i, (info, numel, where) in enumerate(zip(
                flat._param_infos, flat._numels, flat._shard_param_infos, strict=True)):
            place = order.get(id(info.module))
            if place is None:
                raise ValueError(
                    f"FSDP v1 parameter {info.param_name!r} belongs to a module outside the "
                    "model given to the tap")
            raw = f"{place[1]}.{info.param_name}" if place[1] else info.param_name
            tensor = originals[i] if originals is not None else flat
            length = int(where.numel_in_shard) if where.in_shard else 0
            keyed.append(((place[0], 0, i), OriginalParameter(
                raw_name=raw, numel=int(numel), dtype=tensor.dtype, tensor=tensor,
                managed=True, flat=originals is None,
                offset=int(where.offset_in_shard) if where.in_shard else -1,
                length=length, chunk=chunk, shard_index=index, shard_count=count,
                shard_ranks=shard_ranks, replica_ranks=replica_ranks)))
    for j, (raw, param) in enumerate(model.named_parameters()):
        if id(param) in managed:
            continue
        owner = raw.rpartition(".")[0]
        place = order[id(model.get_submodule(owner))] if owner else order[id(model)]
        keyed.append(((place[0], 1, j), OriginalParameter(
            raw_name=raw, numel=full_numel(param), dtype=param.dtype, tensor=param)))
    keyed.sort(key=lambda item: item[0])
    return [parameter for _, parameter in keyed]


def _group_ranks(unit: Any, handle: Any, sharded: bool) -> tuple[tuple[int, ...],
                                                                  tuple[int, ...]]:
    """(sharding group's global ranks by piece index, global ranks holding this rank's
    piece by replica index) of one FSDP v1 unit (see :class:`OriginalParameter`)."""
    dist = import_torch().distributed
    me = (dist.get_rank(),)

    def ordered(group: Any) -> tuple[int, ...]:
        ranks = dist.get_process_group_ranks(group)
        return tuple(sorted(ranks, key=lambda r: dist.get_group_rank(group, r)))

    if not sharded:  # NO_SHARD: one piece, replicated on the whole group
        return me, ordered(handle.process_group)
    inter = getattr(unit, "_inter_node_pg", None)  # HYBRID_SHARD's replicate group
    return ordered(handle.process_group), (ordered(inter) if inter is not None else me)
