"""Layer names that do not depend on how the model was wrapped for training.

``model.named_parameters()`` spells the same parameter differently depending on the
wrappers around the model: DistributedDataParallel / DataParallel / DeepSpeed add
``module.``, FSDP (v1) adds ``_fsdp_wrapped_module.`` at every wrapped unit (and, in its
older FlattenParamsWrapper form, ``_fpw_module.``), ``torch.compile`` adds ``_orig_mod.``
and activation checkpointing / CPU-offload wrappers add ``_checkpoint_wrapped_module.``.
The same run must report the same layer names whether it is wrapped or not, so every
adapter passes names through :func:`normalize_name`, which removes these path components
wherever they occur in the dotted path.

Only whole components are removed (``mymodule.weight`` is left alone) and never the last
component (the parameter's own name). A model whose own submodule is called ``module``
loses that component too; adapters detect two parameters normalising to the same name and
raise, and accept a custom ``name_fn`` for such models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: Path components inserted by training wrappers (without the trailing dot).
WRAPPER_COMPONENTS: frozenset[str] = frozenset(
    {
        "module",  # torch DDP / DataParallel, DeepSpeed engine, HF accelerate wrappers
        "_fsdp_wrapped_module",  # torch FSDP (v1) FullyShardedDataParallel
        "_fpw_module",  # FSDP FlattenParamsWrapper (torch <= 1.12, fairscale)
        "_orig_mod",  # torch.compile OptimizedModule
        "_checkpoint_wrapped_module",  # torch activation checkpoint / offload wrappers
    }
)


def normalize_name(name: str) -> str:
    """Remove training-wrapper path components from a dotted parameter name.

    Args:
        name: a dotted name as produced by ``named_parameters()``, e.g.
            ``"module._orig_mod.encoder._fsdp_wrapped_module.fc.weight"``.

    Returns:
        The name with every wrapper component of :data:`WRAPPER_COMPONENTS` removed
        wherever it occurs before the last component, e.g. ``"encoder.fc.weight"``.
        Names without wrapper components are returned unchanged; the function is
        idempotent (``normalize_name(normalize_name(x)) == normalize_name(x)``).

    Raises:
        TypeError: ``name`` is not a ``str``.
    """
    if not isinstance(name, str):
        raise TypeError(f"parameter name must be a str, got {type(name).__name__}")
    parts = name.split(".")
    if len(parts) == 1:
        return name
    kept = [p for p in parts[:-1] if p not in WRAPPER_COMPONENTS]
    if len(kept) == len(parts) - 1:
        return name
    kept.append(parts[-1])
    return ".".join(kept)


def normalized_names(
    names: Iterable[str], name_fn: Callable[[str], str] = normalize_name
) -> list[str]:
    """Normalise many names and check that no two collide.

    Args:
        names: raw names, e.g. from ``named_parameters()``, in model order.
        name_fn: the ``str -> str`` normalisation to apply (default :func:`normalize_name`).

    Returns:
        The normalised names, in the input order.

    Raises:
        ValueError: two different raw names normalise to the same name (both are named;
            pass a different ``name_fn``, e.g. ``lambda n: n``, for such a model).
        TypeError: ``name_fn`` is not callable or returns a non-``str``.
    """
    if not callable(name_fn):
        raise TypeError("name_fn must be a callable str -> str")
    seen: dict[str, str] = {}
    out: list[str] = []
    for raw in names:
        norm = name_fn(raw)
        if not isinstance(norm, str):
            raise TypeError(f"name_fn({raw!r}) returned {type(norm).__name__}, expected str")
        if norm in seen:
            raise ValueError(
                f"parameters {seen[norm]!r} and {raw!r} both normalise to {norm!r}; "
                "pass name_fn= to keep them apart"
            )
        seen[norm] = raw
        out.append(norm)
    return out
