"""What a worker knows about a run: its layer list and thresholds from RunStarted."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.health import match_layers
from schemas.rounding import unit_roundoff
from schemas.wire import RunStarted


@dataclass(frozen=True, slots=True)
class RunInfo:
    """A run's static description (from the first RunStarted seen, or the store).

    Attributes:
        run_id: the run. world_size: ranks per step.
        layer_names: L names, model order. numel: int64[L] full-tensor element counts.
        vanishing_threshold, exploding_threshold: per-layer flag thresholds on mean |g|
            and max |g| (|g| units).
        dtypes: L gradient dtype names (``RunStarted.dtypes``; None entries
            unknown), or None when the producer sent none.
        ignore_layers: the run's ``ignore_layers`` patterns (``RunStarted.ignore_layers``):
            layers it excludes from its health, explicitly.
    """

    run_id: str
    world_size: int
    layer_names: tuple[str, ...]
    numel: np.ndarray
    vanishing_threshold: float
    exploding_threshold: float
    dtypes: tuple[str | None, ...] | None = None
    ignore_layers: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.layer_names)

    @property
    def roundoff(self) -> np.ndarray:
        """float64[L] unit roundoff of each layer's gradient dtype
        (:func:`schemas.rounding.unit_roundoff`; unknown = float32)."""
        return unit_roundoff(self.dtypes, self.num_layers)

    def excluded(self, extra: tuple[str, ...] = ()) -> np.ndarray:
        """bool[L]: layers matched by :attr:`ignore_layers` or by ``extra`` (the consumer's
        own ``--ignore-layers``; :func:`schemas.health.match_layers`)."""
        return match_layers(self.layer_names, (*self.ignore_layers, *extra))

    @classmethod
    def from_message(cls, msg: RunStarted) -> RunInfo:
        """Build from a RunStarted message."""
        return cls(
            run_id=msg.run_id,
            world_size=msg.world_size,
            layer_names=tuple(msg.layer_names),
            numel=np.asarray(msg.numel, dtype=np.int64),
            vanishing_threshold=msg.vanishing_threshold,
            exploding_threshold=msg.exploding_threshold,
            dtypes=None if msg.dtypes is None else tuple(msg.dtypes),
            ignore_layers=tuple(msg.ignore_layers),
        )

    def conflict_with(self, msg: RunStarted) -> str | None:
        """Why ``msg`` contradicts this run (a reason for the dead-letter topic), or None."""
        if msg.world_size != self.world_size:
            return (
                f"RunStarted for run {self.run_id!r} from rank {msg.rank} has world_size "
                f"{msg.world_size}, but the run was started with {self.world_size}"
            )
        if tuple(msg.layer_names) != self.layer_names or not np.array_equal(
            np.asarray(msg.numel), self.numel
        ):
            return (
                f"RunStarted for run {self.run_id!r} from rank {msg.rank} lists different "
                "layers (names or numel) than the run's first RunStarted: "
                + _layer_difference(tuple(msg.layer_names), np.asarray(msg.numel, np.int64),
                                    self.layer_names, self.numel)
            )
        return None


def _layer_difference(names: tuple[str, ...], numel: np.ndarray,
                      run_names: tuple[str, ...], run_numel: np.ndarray) -> str:
    """Where a layer list (``names``, int64 ``numel``) first differs from the run's, in
    words: the layer counts and the first index whose name or size differs."""
    n = min(len(names), len(run_names))
    same = (np.asarray(names[:n], object) == np.asarray(run_names[:n], object)) & (
        numel[:n] == run_numel[:n])
    i = int(np.argmin(same)) if not same.all() else n
    if i == n:
        where = f"the first {n} layers agree"
    else:
        where = (f"first difference at layer {i}: {names[i]!r} ({int(numel[i])} elements) "
                 f"where the run has {run_names[i]!r} ({int(run_numel[i])} elements)")
    return f"{len(names)} layers against the run's {len(run_names)}, {where}"
