"""The store builder of the analysis tests: crafted gradient histories written into a real
DuckDB store.

- :func:`write_history` takes per-(layer, step) arrays, deriving the stored frame fields as
  the consumer does (``sum_sq = grad_norm^2``, ``mean_abs_grad = sum_abs / numel``, the
  run's thresholds for the flags). Weight statistics are computed from raw weight arrays
  with NumPy, the way the producer defines them (power sums, extremes, zeros, base-2
  exponent histogram over the finite weights).
- :class:`StoreBuilder` takes frames one by one, each layer a :class:`Stat` (mean |g|, max
  |g|, L2 norm, NaN/Inf count), and derives flow intensity and the flags.

Both write through :func:`write_run`: the tables of ``schemas.tables.SCHEMA_DDL`` and the
rows inserted in bulk from Arrow tables, as the consumer's sink does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from schemas.tables import FRAMES_COLUMNS, LAYER_STATS_COLUMNS, SCHEMA_DDL
from schemas.wire import EXP_HIST_BINS, EXP_HIST_MAX, EXP_HIST_MIN


def exp_hist(values: np.ndarray) -> tuple[list[int], list[int]]:
    """Sparse base-2 exponent histogram of the finite ``values`` (layout of
    ``schemas.wire``: column 0 exact zeros, 1 underflow, ``k - EXP_HIST_MIN + 2`` for
    ``|v|`` in ``[2^k, 2^(k+1))``, the last column overflow).

    Returns:
        ``(columns ascending, counts)``.
    """
    v = np.abs(np.asarray(values, dtype=np.float64))
    v = v[np.isfinite(v)]
    _, exponent = np.frexp(v)  # v = m 2^e, m in [0.5, 1): floor(log2 v) = e - 1
    col = np.clip(exponent - 1 - EXP_HIST_MIN + 2, 1, EXP_HIST_BINS - 1)
    col[v >= 2.0**EXP_HIST_MAX] = EXP_HIST_BINS - 1
    col[v == 0] = 0
    cols, counts = np.unique(col, return_counts=True)
    return cols.tolist(), counts.tolist()


def weight_row(w: np.ndarray) -> dict[str, object]:
    """The ``layer_stats`` weight columns of one layer's weights ``w`` (any shape)."""
    flat = np.asarray(w, dtype=np.float64).ravel()
    finite = flat[np.isfinite(flat)]
    cols, counts = exp_hist(finite)
    return {
        "weight_sum_sq": float(np.sum(finite**2)),
        "weight_sum": float(np.sum(finite)),
        "weight_sum_cube": float(np.sum(finite**3)),
        "weight_sum_quad": float(np.sum(finite**4)),
        "weight_min": float(finite.min()) if finite.size else 0.0,
        "weight_max": float(finite.max()) if finite.size else 0.0,
        "weight_zeros": int(np.sum(finite == 0)),
        "weight_nonfinite": int(flat.size - finite.size),
        "weight_exp_hist_columns": cols,
        "weight_exp_hist_counts": counts,
    }


def write_history(
    path: str | os.PathLike[str],
    norms: np.ndarray,
    *,
    run_id: str = "r",
    names: Sequence[str] | None = None,
    numel: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
    mean_abs: np.ndarray | None = None,
    max_abs: np.ndarray | None = None,
    nonfinite: np.ndarray | None = None,
    norms_only: bool = False,
    vanishing_threshold: float = 1e-7,
    exploding_threshold: float = 1e3,
    world_size: int = 1,
    weights: Mapping[tuple[int, int], np.ndarray] | None = None,
    update_sum_sq: np.ndarray | None = None,
    grad_hist: Mapping[tuple[int, int], tuple[list[int], list[int]]] | None = None,
) -> Path:
    """Write one run into the store at ``path`` (created if absent; other runs are kept).

    Args:
        path: DuckDB file.
        norms: float64 ``[L, T]`` gradient L2 norms; NaN = the layer has no row at that step.
        run_id: the run.
        names: layer names in model order (default ``layer0..``).
        numel: parameters per layer (default 100 each).
        steps: the T optimiser steps (default ``0..T-1``).
        mean_abs: ``[L, T]`` mean |g| (default ``norm / sqrt(numel)``, i.e. equal magnitudes).
        max_abs: ``[L, T]`` max |g| (default equal to ``mean_abs``).
        nonfinite: ``[L, T]`` NaN/Inf element counts (default 0).
        norms_only: leave ``sum_abs``, ``max_abs_grad``, ``mean_abs_grad`` NULL (the
            producer's norms mode).
        vanishing_threshold, exploding_threshold, world_size: the run's settings.
        weights: ``(layer, step) -> raw weights`` for the weight statistics.
        update_sum_sq: ``[L, T]`` squared update norms (NaN = NULL).
        grad_hist: ``(layer, step) -> (columns, counts)`` gradient exponent histograms.

    Returns:
        ``path``.
    """
    norms = np.asarray(norms, dtype=np.float64)
    count, length = norms.shape
    names = list(names) if names is not None else [f"layer{i}" for i in range(count)]
    numel_arr = np.asarray(numel if numel is not None else [100] * count, dtype=np.int64)
    step_arr = np.asarray(steps if steps is not None else range(length), dtype=np.int64)
    root = np.sqrt(numel_arr.astype(np.float64))[:, None]
    mean = np.asarray(mean_abs, np.float64) if mean_abs is not None else norms / root
    peak = np.asarray(max_abs, np.float64) if max_abs is not None else mean
    bad = (np.asarray(nonfinite, np.int64) if nonfinite is not None
           else np.zeros(norms.shape, np.int64))
    present = ~np.isnan(norms)
    li, ti = np.nonzero(present)
    rows: dict[str, object] = {
        "run_id": [run_id] * li.size,
        "step": step_arr[ti],
        "layer_index": li.astype(np.int32),
        "numel": numel_arr[li],
        "sum_sq": norms[li, ti] ** 2,
        "nonfinite": bad[li, ti],
        "grad_norm": norms[li, ti],
    }
    frame_max = np.nanmax(np.where(present, norms, 0.0), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rows["flow_intensity"] = np.where(
            frame_max[ti] > 0, np.clip(norms[li, ti] / frame_max[ti], 0, 1), 0.0
        )
    mean_v, peak_v = mean[li, ti], peak[li, ti]
    rows["is_vanishing"] = (mean_v < vanishing_threshold) & (bad[li, ti] == 0)
    rows["is_exploding"] = peak_v > exploding_threshold
    if norms_only:
        for key in ("sum_abs", "max_abs_grad", "mean_abs_grad"):
            rows[key] = pa.nulls(li.size, pa.float64())
    else:
        rows["sum_abs"] = mean_v * numel_arr[li]
        rows["max_abs_grad"] = peak_v
        rows["mean_abs_grad"] = mean_v
    if update_sum_sq is not None:
        upd = np.asarray(update_sum_sq, np.float64)[li, ti]
        rows["update_sum_sq"] = pa.array(upd, pa.float64(), from_pandas=True)
    extra: list[dict[str, object]] = [{} for _ in range(li.size)]
    position = {(int(a), int(b)): k for k, (a, b) in enumerate(zip(li, ti, strict=True))}
    for (layer, t), w in (weights or {}).items():
        extra[position[(layer, t)]] = weight_row(w)
    for (layer, t), (cols, counts) in (grad_hist or {}).items():
        extra[position[(layer, t)]].update(exp_hist_columns=cols, exp_hist_counts=counts)
    for k, e in enumerate(extra):
        if update_sum_sq is not None and "weight_sum_sq" in e:
            upd = float(np.asarray(update_sum_sq, np.float64)[li[k], ti[k]])
            if math.isfinite(upd) and e["weight_sum_sq"] > 0:  # type: ignore[operator]
                e["update_to_weight"] = math.sqrt(upd / e["weight_sum_sq"])  # type: ignore[operator]
    table = pa.table(rows)
    extra_keys = sorted({k for e in extra for k in e})
    for key in extra_keys:
        values = [e.get(key) for e in extra]
        if key.endswith("_columns"):
            column = pa.array(values, pa.list_(pa.int16()))
        elif key.endswith("_counts"):
            column = pa.array(values, pa.list_(pa.int64()))
        elif key in ("weight_zeros", "weight_nonfinite"):
            column = pa.array(values, pa.int64())
        else:
            column = pa.array(values, pa.float64())
        table = table.append_column(key, column)

    seen = np.flatnonzero(present.any(axis=0))
    frames = pa.table({
        "run_id": [run_id] * seen.size,
        "step": step_arr[seen],
        "health": ["Healthy"] * seen.size,
        "num_layers": pa.array(present[:, seen].sum(axis=0), pa.int32()),
        "vanishing_layers": pa.array(np.zeros(seen.size), pa.int32()),
        "exploding_layers": pa.array(np.zeros(seen.size), pa.int32()),
        "nonfinite_layers": pa.array(np.zeros(seen.size), pa.int32()),
        "complete": [True] * seen.size,
        "ranks_seen": [list(range(world_size))] * seen.size,
        "missing_ranks": [[]] * seen.size,
        "wall_time": 1.7e9 + step_arr[seen].astype(np.float64),
        "finalized_at": 1.7e9 + step_arr[seen].astype(np.float64),
    })
    return write_run(path, run_id, names, numel_arr.tolist(), stats=table, frames=frames,
                     world_size=world_size, vanishing_threshold=vanishing_threshold,
                     exploding_threshold=exploding_threshold)


def create_store(path: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """A read-write connection to the store at ``path``, its tables
    (``schemas.tables.SCHEMA_DDL``) created if absent; the caller closes it."""
    con = duckdb.connect(str(path))
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    return con


def write_run(
    path: str | os.PathLike[str],
    run_id: str,
    names: Sequence[str],
    numel: Sequence[int],
    *,
    stats: pa.Table | None,
    frames: pa.Table | None,
    world_size: int = 1,
    vanishing_threshold: float = 1e-7,
    exploding_threshold: float = 1e3,
) -> Path:
    """Write one run into the store at ``path``, the one writer of the analysis tests'
    stores: the tables of ``schemas.tables.SCHEMA_DDL`` created if absent (other runs are
    kept), then the run's ``runs`` row, its ``layers`` rows (``names`` in model order, with
    ``numel``) and the ``layer_stats`` / ``frames`` rows of ``stats`` / ``frames`` (Arrow
    tables, inserted by column name, as the consumer's sink does).

    Returns:
        ``path``.
    """
    con = create_store(path)
    try:
        con.execute(
            "INSERT INTO runs (run_id, world_size, num_layers, vanishing_threshold, "
            "exploding_threshold, host, start_time) VALUES (?, ?, ?, ?, ?, 'test', 0)",
            [run_id, world_size, len(names), vanishing_threshold, exploding_threshold],
        )
        rows = {"layers": pa.table({
            "run_id": [run_id] * len(names),
            "layer_index": pa.array(range(len(names)), pa.int32()),
            "name": list(names),
            "numel": pa.array(numel, pa.int64()),
        }), "layer_stats": stats, "frames": frames}
        for table, incoming in rows.items():
            if incoming is not None and incoming.num_rows:
                con.register("incoming", incoming)
                con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM incoming")
                con.unregister("incoming")
    finally:
        con.close()
    return Path(path)


def write_scalars(
    path: str | os.PathLike[str],
    run_id: str,
    step_rows: Sequence[tuple[int, str, float]] = (),
    rank_rows: Sequence[tuple[int, int, str, float]] = (),
) -> Path:
    """Insert training scalars of ``run_id`` into the store at ``path`` (its tables from
    ``schemas.tables.SCHEMA_DDL``): ``step_rows`` ``(step, name, value)`` into
    ``step_scalars``, ``rank_rows`` ``(step, rank, name, value)`` into ``rank_scalars``
    (NaN / Inf kept), in bulk from Arrow tables as the consumer's sink does.

    Returns:
        ``path``.
    """
    con = create_store(path)
    try:
        tables = {
            "step_scalars": pa.table({
                "run_id": [run_id] * len(step_rows),
                "step": pa.array([r[0] for r in step_rows], pa.int64()),
                "name": [r[1] for r in step_rows],
                "value": pa.array([r[2] for r in step_rows], pa.float64()),
            }),
            "rank_scalars": pa.table({
                "run_id": [run_id] * len(rank_rows),
                "step": pa.array([r[0] for r in rank_rows], pa.int64()),
                "rank": pa.array([r[1] for r in rank_rows], pa.int32()),
                "name": [r[2] for r in rank_rows],
                "value": pa.array([r[3] for r in rank_rows], pa.float64()),
            }),
        }
        for table, incoming in tables.items():
            if incoming.num_rows:
                con.register("incoming", incoming)
                con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM incoming")
                con.unregister("incoming")
    finally:
        con.close()
    return Path(path)


def drop_scalar_tables(path: str | os.PathLike[str]) -> Path:
    """Make the store at ``path`` look written by a version before the training scalars:
    drop ``step_scalars`` and ``rank_scalars``. Returns ``path``."""
    con = duckdb.connect(str(path))
    try:
        con.execute("DROP TABLE IF EXISTS step_scalars")
        con.execute("DROP TABLE IF EXISTS rank_scalars")
    finally:
        con.close()
    return Path(path)


def open_read(path: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """The store opened read-only through :func:`analysis.read.connect.open_store`."""
    from analysis.read.connect import open_store

    return open_store(path)


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
        """Write every run (:func:`write_run`; a builder without runs writes the empty
        tables); return the path."""
        if not self.runs:
            create_store(self.path).close()
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
