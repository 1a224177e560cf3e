"""The run's layer list as the union of what its ranks declare, and which ranks hold each
layer (pipeline parallelism, and every other layout).

Under data, fully sharded and tensor parallelism every rank builds its tap on the whole
model and declares the same layers. Under pipeline parallelism each stage builds its tap
on its own stage and declares only its own layers. :func:`gather_run_layers` (at
``GradientTap.start_run``, one ``all_gather_object`` over the default group, a collective
every rank must reach) makes every rank announce the same layer list:

- **the union** of the declared layers, in a global order: by the lowest rank that
  declares a layer, then by its position in that rank's list (pipeline stages are placed on
  ranks in stage order, so this is model order; under data parallelism it is rank 0's list);
- a layer is identified by its name: two ranks declaring one name with different sizes or
  dtypes refuse the run (:class:`UnsupportedParallelismError`) on every rank, as a name
  reused by two stages for different parameters would (give the stages distinct names,
  e.g. the unsplit model's qualified names, as ``torch.distributed.pipelining`` keeps them,
  or a ``name_fn`` that prefixes the stage);
- **who holds it**: a plain tensor is replicated on exactly the ranks that declare it (DDP
  over the whole group, or a pipeline stage's data-parallel ranks); a ``DTensor`` or an
  FSDP v1 original parameter carries its own layout (mesh). Each layer's replica count R
  and a key of its replica set (``replica_group``) let every rank compute the same owner
  of each layer for the in-band reduction (:mod:`producer.adapters.torch_reduce`).

Each rank then sends its statistics with the layer indices of the union, and the
consumer merges them like any pieces: a frame is complete when every rank reported, so
every stage's layers are in it.

Importing this module does not import torch.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.adapters.optional import import_torch
from producer.adapters.torch_layout import UnsupportedParallelismError


@dataclass(frozen=True, slots=True)
class RunLayers:
    """The run's layer list and, per layer, its replicas.

    Attributes:
        names: the L layer names in global order.
        numel: int64[L] full parameter sizes.
        dtypes: the L dtype names.
        replicas: int64[L] replicas of each piece of the layer (R).
        groups: int64[L] a key of the layer's replica set: equal keys, same ranks.
        positions: int64[k] the global position of each of this rank's k layers.
        declared_by: for each layer, the ascending ranks that declare it.
    """

    names: tuple[str, ...]
    numel: np.ndarray
    dtypes: tuple[str, ...]
    replicas: np.ndarray
    groups: np.ndarray
    positions: np.ndarray
    declared_by: tuple[tuple[int, ...], ...]


def replica_group(ranks: np.ndarray) -> int:
    """A key of a replica layout's rank table (int64[P, R]): R * 2^32 + CRC-32 of its shape
    and ranks (equal tables, equal keys; the same on every rank).

    >>> replica_group(np.array([[0, 1, 2, 3]])) == replica_group(np.array([[0, 1, 2, 3]]))
    True
    """
    table = np.ascontiguousarray(ranks, np.int64)
    crc = zlib.crc32(np.asarray(table.shape, np.int64).tobytes() + table.tobytes())
    return int(table.shape[1]) * (1 << 32) + crc


def gather_run_layers(
    names: Sequence[str], numel: Sequence[int], dtypes: Sequence[str],
    layouts: Sequence[tuple[int, int] | None], rank: int, world_size: int,
) -> RunLayers:
    """The union of the ranks' layer lists (see the module docstring).

    Args:
        names, numel, dtypes: this rank's k layers (model order), their full sizes and
            dtype names.
        layouts: per layer, ``(R, replica_group key)`` for a parameter that carries its own
            layout (DTensor, FSDP v1), or None for a plain tensor (replicated on the ranks
            that declare it).
        rank, world_size: this rank and the default group's size; with ``world_size == 1``
            nothing is gathered.

    Returns:
        The :class:`RunLayers`, identical on every rank (but ``positions``).

    Raises:
        UnsupportedParallelismError: two ranks declare one name with different sizes,
            dtypes or kinds of layout (raised on every rank).
    """
    own = list(zip(names, (int(n) for n in numel), dtypes, layouts, strict=True))
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        import_torch().distributed.all_gather_object(gathered, own)
    else:
        gathered = [own]
    index: dict[str, int] = {}
    table: list[tuple[str, int, str, Any]] = []
    holders: list[list[int]] = []
    for r, declared in enumerate(gathered):
        for name, size, dtype, layout in declared:
            at = index.get(name)
            if at is None:
                index[name] = len(table)
                table.append((name, size, dtype, None if layout is None else tuple(layout)))
                holders.append([r])
                continue
            first = table[at]
            mine = (size, dtype, None if layout is None else tuple(layout))
            if (first[1], first[2], first[3] is None) != (size, dtype, layout is None) or (
                    layout is not None and first[3] != mine[2]):
                raise UnsupportedParallelismError(
                    f"rank {r} declares layer {name!r} as {size} elements ({dtype}), rank "
                    f"{holders[at][0]} as {first[1]} ({first[2]}), or with another layout: "
                    "a layer name must mean one parameter across the ranks. Pipeline "
                    "stages whose modules reuse names for different parameters need "
                    "distinct names (the unsplit model's qualified names, or a name_fn "
                    "that prefixes the stage)")
            holders[at].append(r)
    replicas = np.empty(len(table), np.int64)
    groups = np.empty(len(table), np.int64)
    for i, (_, _, _, layout) in enumerate(table):
        if layout is None:
            ranks = np.asarray(holders[i], np.int64).reshape(1, -1)
            replicas[i], groups[i] = ranks.shape[1], replica_group(ranks)
        else:
            replicas[i], groups[i] = layout
    return RunLayers(
        names=tuple(t[0] for t in table),
        numel=np.array([t[1] for t in table], np.int64),
        dtypes=tuple(t[2] for t in table),
        replicas=replicas, groups=groups,
        positions=np.array([index[n] for n in names], np.int64),
        declared_by=tuple(tuple(h) for h in holders),
    )
