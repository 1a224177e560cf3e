"""JAX adapter: gradient pytrees -> ``{layer name: NumPy array}`` for ``record_step``.

Layer names join the pytree path with dots: a dict key contributes the key, a sequence
position its index, an attribute (dataclass / registered node) its name. A leading
``"params"`` collection (Flax ``{"params": {...}}``) is dropped, so a Flax gradient
``params/Dense_0/kernel`` is the layer ``"Dense_0.kernel"``.

Usage::

    gp.start_run(layer_numel(params))
    grads = jax.grad(loss_fn)(params, batch)
    gp.record_step(step, flatten_gradients(grads))

The whole tree is copied to the host with one ``jax.device_get``. Arrays are summarised on
the host in float64 (JAX computes in float32 unless ``jax_enable_x64`` is set). In a
multi-process JAX job an array that is not fully addressable contributes the shards this
process holds with ``replica_id == 0``, so the consumer's merge of all processes gives the
statistics of the global array.

Importing this module does not import jax; the functions import it when called.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from producer.adapters.optional import import_jax

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _key_name(key: Any) -> str:
    """One pytree path entry as a name component."""
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[Any, ...]) -> str:
    """Dotted layer name of one pytree path (as from ``tree_flatten_with_path``).

    Args:
        path: a tuple of key entries (``DictKey``, ``SequenceKey``, ``GetAttrKey``,
            ``FlattenedIndexKey``).

    Returns:
        The components joined by ``"."``; a leading ``"params"`` dict key is dropped when
        more components follow. An empty path (the tree is a single array) gives
        ``"params"``.
    """
    parts = [_key_name(k) for k in path]
    if len(parts) > 1 and parts[0] == "params" and hasattr(path[0], "key"):
        parts = parts[1:]
    return ".".join(parts) if parts else "params"


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    jax = import_jax()
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not with_path:
        raise ValueError("the pytree has no array leaves")
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for path, leaf in with_path:
        name = path_name(path)
        if name in seen:
            raise ValueError(f"two pytree leaves map to the layer name {name!r}")
        seen.add(name)
        out.append((name, leaf))
    return out


def _local_part(leaf: Any) -> Any:
    """This process's share of a non-fully-addressable array (replica 0 shards, raveled)."""
    if getattr(leaf, "is_fully_addressable", True):
        return leaf
    shards = [s.data.reshape(-1) for s in leaf.addressable_shards if s.replica_id == 0]
    if not shards:
        return None
    jnp = import_jax().numpy
    return jnp.concatenate(shards) if len(shards) > 1 else shards[0]


def _host_float(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype in _FLOATS:
        return arr
    jnp = import_jax().numpy
    if jnp.issubdtype(arr.dtype, jnp.floating):  # bfloat16, float8_*: exact in float32
        return arr.astype(np.float32)
    raise TypeError(f"gradient {name!r} has dtype {arr.dtype}; expected a floating-point dtype")


def flatten_gradients(grads: Any) -> dict[str, np.ndarray]:
    """Flatten a gradient pytree into ``{layer name: host NumPy array}`` in pytree order.

    Args:
        grads: any pytree of arrays (nested dicts / lists / tuples / Flax ``FrozenDict`` /
            registered dataclasses) of floating dtypes, e.g. the result of ``jax.grad``.

    Returns:
        Layer name (see :func:`path_name`) -> NumPy array with the leaf's shape. float16,
        float32 and float64 keep their dtype; bfloat16 and other narrow float types are
        widened to float32 (exactly). Leaves copied with one ``jax.device_get``. A leaf
        that is not fully addressable gives its replica-0 local shards, raveled; a leaf
        this process holds no replica-0 shard of is left out.

    Raises:
        ValueError: the tree has no leaves, or two leaves map to the same name.
        TypeError: a leaf of a non-floating dtype (names it).
        ImportError: jax is not installed.
    """
    jax = import_jax()
    named = [(name, _local_part(leaf)) for name, leaf in _named_leaves(grads)]
    named = [(name, leaf) for name, leaf in named if leaf is not None]
    host = jax.device_get([leaf for _, leaf in named])
    return {name: _host_float(name, value) for (name, _), value in zip(named, host, strict=True)}


def layer_numel(params: Any) -> dict[str, int]:
    """Layer name -> number of elements, for ``GradientProducer.start_run``.

    Args:
        params: the parameter pytree (same structure as the gradients); leaves may be
            arrays or anything with a ``shape`` (e.g. ``jax.ShapeDtypeStruct``). Nothing is
            copied to the host.

    Returns:
        Names as in :func:`flatten_gradients`, in pytree order, mapped to the global
        (full array) element count.

    Raises:
        ValueError: the tree has no leaves, two leaves map to the same name, or a leaf has
            no elements.
        ImportError: jax is not installed.
    """
    out: dict[str, int] = {}
    for name, leaf in _named_leaves(params):
        shape = getattr(leaf, "shape", None)
        n = int(math.prod(shape)) if shape is not None else int(np.asarray(leaf).size)
        if n == 0:
            raise ValueError(f"parameter {name!r} has no elements")
        out[name] = n
    return out
