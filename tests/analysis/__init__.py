"""Tests of the ``analysis`` package, and the store builder they share.

:class:`StoreBuilder` writes a real DuckDB file through
:func:`tests.analysis.crafted.write_run` (the one writer of the analysis tests' stores),
deriving the frame fields (mean |g|, max |g|, L2 norm, flow intensity, vanishing / exploding
flags) from a few per-layer numbers per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from schemas.tables import FRAMES_COLUMNS, LAYER_STATS_COLUMNS


@dataclass(frozen=True)
class Stat:
    """One layer at one step: mean |g|, max |g|, L2 norm, NaN/Inf count."""

    mean: float = 1e-2
    max: float = 1.0
    norm: float = 1.0
    nonfinite: int = 0


@dataclass
class _Run:
    names: list[str]
    world_size: int
    vanishing_threshold: float
    exploding_threshold: float
    numel: int
    stats: list[dict[str, object]] = field(default_factory=list)
    frames: list[dict[str, object]] = field(default_factory=list)


class StoreBuilder:
    """Accumulates runs and frames, then writes them to a new store file in bulk.

    Args:
        path: the DuckDB file to create.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.runs: dict[str, _Run] = {}

    def add_run(
        self,
        run_id: str,
        names: list[str],
        world_size: int = 1,
        vanishing_threshold: float = 1e-7,
        exploding_threshold: float = 1e3,
        numel: int = 100,
    ) -> StoreBuilder:
        """Declare a run with its layer names in model order."""
        self.runs[run_id] = _Run(
            list(names), world_size, vanishing_threshold, exploding_threshold, numel
        )
        return self

    def add_frame(
        self,
        run_id: str,
        step: int,
        stats: dict[str, Stat],
        complete: bool = True,
    ) -> StoreBuilder:
        """Add one frame; ``stats`` maps layer name to :class:`Stat` (absent = no row)."""
        run = self.runs[run_id]
        max_norm = max((s.norm for s in stats.values()), default=0.0)
        vanishing = exploding = nonfinite = 0
        for name, s in stats.items():
            is_van = s.mean < run.vanishing_threshold
            is_exp = s.max > run.exploding_threshold
            vanishing += is_van
            exploding += is_exp
            nonfinite += s.nonfinite > 0
            run.stats.append(
                {
                    "run_id": run_id,
                    "step": step,
                    "layer_index": run.names.index(name),
                    "numel": run.numel,
                    "sum_abs": s.mean * run.numel,
                    "sum_sq": s.norm**2,
                    "max_abs_grad": s.max,
                    "nonfinite": s.nonfinite,
                    "mean_abs_grad": s.mean,
                    "grad_norm": s.norm,
                    "flow_intensity": min(max(s.norm / max_norm, 0.0), 1.0) if max_norm else 0.0,
                    "is_vanishing": is_van,
                    "is_exploding": is_exp,
                }
            )
        ranks = list(range(run.world_size if complete else max(run.world_size - 1, 0)))
        run.frames.append(
            {
                "run_id": run_id,
                "step": step,
                "health": "Healthy",
                "num_layers": len(stats),
                "vanishing_layers": vanishing,
                "exploding_layers": exploding,
                "nonfinite_layers": nonfinite,
                "complete": complete,
                "ranks_seen": ranks,
                "missing_ranks": [r for r in range(run.world_size) if r not in ranks],
                "wall_time": 1.7e9 + step,
                "finalized_at": 1.7e9 + step + 0.5,
            }
        )
        return self

    def add_steps(
        self, run_id: str, steps: range | list[int], stats: dict[str, Stat]
    ) -> StoreBuilder:
        """Add the same per-layer stats at every step of ``steps``."""
        for step in steps:
            self.add_frame(run_id, step, stats)
        return self

    def write(self) -> Path:
        """Write every run (:func:`tests.analysis.crafted.write_run`); return the path."""
        from tests.analysis.crafted import write_run

        for run_id, run in self.runs.items():
            stats = frames = None
            if run.stats:
                stats = pa.Table.from_pylist(run.stats).select(list(LAYER_STATS_COLUMNS[:13]))
                frames = pa.Table.from_pylist(run.frames).select(list(FRAMES_COLUMNS))
            write_run(self.path, run_id, run.names, [run.numel] * len(run.names),
                      stats=stats, frames=frames, world_size=run.world_size,
                      vanishing_threshold=run.vanishing_threshold,
                      exploding_threshold=run.exploding_threshold)
        return self.path


def healthy_stat(norm: float = 1.0) -> Stat:
    """A layer that is neither vanishing nor exploding nor non-finite."""
    return Stat(mean=1e-2, max=1.0, norm=norm)


VANISHING = Stat(mean=1e-9, max=1e-8, norm=1e-8)
EXPLODING = Stat(mean=10.0, max=5e3, norm=1e4)
NONFINITE = Stat(mean=1e-2, max=1.0, norm=1.0, nonfinite=3)

NASTY_NAMES: list[str] = [
    "encoder.layer,0",
    'say "hi"',
    "multi\nline",
    "crlf\r\nname",
    "ünïcødé.权重😀",
    "'single'",
    "[bold]markup[/bold]",
    "tab\tname",
    "",
]
"""Layer names exports and renderings must survive (commas, quotes, newlines, unicode)."""

__all__ = [
    "EXPLODING",
    "NASTY_NAMES",
    "NONFINITE",
    "VANISHING",
    "Stat",
    "StoreBuilder",
    "healthy_stat",
]
