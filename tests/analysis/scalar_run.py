"""A crafted run with training scalars, written into a real DuckDB store.

Three ranks, 40 frames of two layers (:func:`tests.analysis.crafted.write_history`). Each
rank sends its own loss, tokens, compute time and (from step 1, as the SDK measures it) step
time; the run sends a learning rate, an AMP loss scale from step 2 on (backing off at steps
10 and 30, growing back at 20) and a user scalar ``eval:ppl`` every 10 steps. Rank 2's loss
is NaN at step 25 and rank 0's is +Inf at step 30; rank 1 computes slowly from step 5 to 30.
The step values are made by ``schemas.scalars.step_scalars``, the function the worker uses
(mean loss, summed tokens, the slowest rank's times).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from schemas.scalars import RankScalars, step_scalars
from tests.analysis.crafted import write_history, write_scalars

WORLD = 3
STEPS = 40
LAYERS = ["embed", "head"]
NAN_STEP, NAN_RANK = 25, 2
INF_STEP, INF_RANK = 30, 0
SLOW_RANK, SLOW_STEPS = 1, range(5, 31)
SCALE_FROM = 2


def rank_loss(step: int, rank: int) -> float:
    if (step, rank) == (NAN_STEP, NAN_RANK):
        return math.nan
    if (step, rank) == (INF_STEP, INF_RANK):
        return math.inf
    return 3.0 / (1 + step) + 0.01 * rank + (0.5 if step == 33 else 0.0)


def compute_time(step: int, rank: int) -> float:
    return 0.5 if rank == SLOW_RANK and step in SLOW_STEPS else 0.1 + 0.001 * rank


def loss_scale(step: int) -> float | None:
    if step < SCALE_FROM:
        return None
    if step < 10:
        return 65536.0
    if step < 20:
        return 32768.0
    if step < 30:
        return 65536.0
    return 16384.0


def rank_values(step: int, rank: int) -> dict[str, float]:
    """One rank's per-rank scalars of ``step``."""
    out = {"loss": rank_loss(step, rank), "tokens": 128.0 * (rank + 1),
           "compute_time_s": compute_time(step, rank)}
    if step:
        out["step_time_s"] = 0.6 + 0.01 * rank
    return out


def shared_values(step: int) -> dict[str, float]:
    """The step scalars every rank sends alike."""
    out = {"lr": 1e-3 * 0.95**step}
    scale = loss_scale(step)
    if scale is not None:
        out["loss_scale"] = scale
    if step % 10 == 0:
        out["eval:ppl"] = 20.0 - step / 4
    return out


def step_values(step: int) -> dict[str, float]:
    """The stored ``step_scalars`` of ``step`` (name -> value)."""
    ranks = RankScalars()
    for rank in range(WORLD):
        ranks += RankScalars.of_rank(rank, rank_values(step, rank))
    return step_scalars(shared_values(step), ranks)


def write_scalar_run(path: str | os.PathLike[str], run_id: str = "r") -> Path:
    """Write the run (frames and scalars) into the store at ``path``; returns ``path``."""
    norms = np.vstack([np.linspace(1.0, 2.0, STEPS), np.linspace(0.5, 0.1, STEPS)])
    write_history(path, norms, run_id=run_id, names=LAYERS, world_size=WORLD)
    step_rows = [(s, name, v) for s in range(STEPS) for name, v in step_values(s).items()]
    rank_rows = [(s, r, name, v) for s in range(STEPS) for r in range(WORLD)
                 for name, v in rank_values(s, r).items()]
    return write_scalars(path, run_id, step_rows, rank_rows)
