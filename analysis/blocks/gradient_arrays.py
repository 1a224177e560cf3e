"""One run's gradient history, loaded from the store into dense NumPy arrays.

The reference (trustformers-debug's ``gradient_visualization`` and
``enhanced_analysis`` modules) keeps a ``HashMap<String, GradientHistory>`` per process and
iterates it in hash order. Here a run's ``layer_stats`` rows in a step range become
``layers x steps`` arrays in **model order** (``layers.layer_index`` from RunStarted), read
in one SQL pass plus one per-layer aggregate (both O(rows)).

Per (layer, step) flags (:data:`FLAG_VANISHING` ...) are the row's stored flags, read
through the one definition of each bit and predicate (:mod:`schemas.flags`): the flags the
consumer computed for the frame with the run's thresholds (in norms mode from the RMS, in
the direction that never raises a false flag), so that the analyses agree with the frames,
the alerts and ``gradstream report`` of the run on which layers vanish, explode or hold
NaN/Inf. The report's explicit exclusion applies here too, by the same definition
(:func:`analysis.read.exclusion.run_exclusion`): the layers the run's ``ignore_layers`` (and the
reader's own patterns) match keep their rows, norms and NaN/Inf flag, but their vanishing,
exploding and dead bits are cleared, so that no analysis counts what the report leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from analysis.blocks.run_range import open_run_range
from analysis.read.connect import StoreError
from analysis.read.exclusion import Exclusion
from analysis.read.sql import step_range

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb

# The flag bits, defined once (schemas.flags); re-exported for the analyses.
from schemas.flags import FLAG_DEAD as FLAG_DEAD
from schemas.flags import FLAG_EXPLODING as FLAG_EXPLODING
from schemas.flags import FLAG_ISSUE as FLAG_ISSUE
from schemas.flags import FLAG_NONFINITE as FLAG_NONFINITE
from schemas.flags import FLAG_VANISHING as FLAG_VANISHING
from schemas.flags import flag_bits_sql

_RMS = "s.grad_norm / sqrt(greatest(s.numel - s.nonfinite, 1))"

ROW_BATCH = 1 << 20
"""Rows per Arrow batch when :func:`load_history` streams a run's rows (and per layer
chunk of the derived arrays, in elements): 2^20 rows are about 25 MB in flight, small next
to the ``layers x steps`` arrays they fill, and large enough that the per-batch overhead
(one NumPy scatter) is negligible."""

_ROWS_SQL = f"""
    SELECT s.layer_index, s.step, s.grad_norm, {flag_bits_sql("s")} AS flags
    FROM layer_stats AS s
    WHERE s.run_id = $run_id AND {step_range("s")}
"""

_LAYER_SQL = f"""
    WITH s AS (
        SELECT s.*, {_RMS} AS rms,
               CASE WHEN s.exp_hist_columns IS NOT NULL AND s.numel > s.nonfinite THEN
                   1.0 - (CASE WHEN s.exp_hist_columns[1] = 0 THEN s.exp_hist_counts[1]
                          ELSE 0 END) / (s.numel - s.nonfinite)
               END AS active_fraction
        FROM layer_stats AS s
        WHERE s.run_id = $run_id AND {step_range("s")}
    ),
    a AS (
        SELECT layer_index,
               count(*) AS rows,
               avg(ln(coalesce(mean_abs_grad, rms)))
                   FILTER (WHERE nonfinite = 0 AND coalesce(mean_abs_grad, rms) > 0) AS log_mag,
               max(coalesce(max_abs_grad, rms)) AS peak_mag,
               avg(active_fraction) AS active_fraction,
               avg(update_to_weight) AS update_to_weight,
               max(numel) AS max_row_numel
        FROM s GROUP BY layer_index
    )
    SELECT a.*, l.name, l.numel
    FROM a LEFT JOIN layers AS l ON l.run_id = $run_id AND l.layer_index = a.layer_index
    ORDER BY a.layer_index
"""

_RUN_SQL = """
    SELECT vanishing_threshold, exploding_threshold, world_size, num_layers,
           (SELECT min(step) FROM layer_stats WHERE run_id = $run_id) AS first_step
    FROM runs WHERE run_id = $run_id
"""

_STEPS_SQL = f"""
    SELECT DISTINCT step FROM layer_stats
    WHERE run_id = $run_id AND {step_range()}
    ORDER BY step
"""

_UPDATE_SQL = f"""
    SELECT step, sqrt(sum(update_sum_sq) / sum(weight_sum_sq)) AS ratio
    FROM layer_stats
    WHERE run_id = $run_id AND {step_range()}
      AND update_sum_sq IS NOT NULL AND weight_sum_sq IS NOT NULL
    GROUP BY step HAVING sum(weight_sum_sq) > 0
    ORDER BY step
"""


@dataclass(frozen=True)
class Packed:
    """Per-layer series right-aligned: row ``l`` holds layer ``l``'s usable samples (rows
    with a finite norm) in step order in its last ``counts[l]`` columns, NaN (values,
    steps) or 0 (flags) before them.

    With every layer present at every step this is the history itself; otherwise a layer
    recorded only every n-th step still has consecutive samples next to each other, so
    "consecutive" always means "consecutive samples of that layer" (as in the reference
    implementation's per-layer ``VecDeque``).

    Attributes:
        values: float64 ``[L, W]`` gradient norms (``W = max(counts)``).
        steps: float64 ``[L, W]`` optimiser steps of the samples.
        flags: uint8 ``[L, W]`` the ``FLAG_*`` bits of the samples.
        counts: int64 ``[L]`` samples per layer (0 for a layer whose every row held
            NaN/Inf).
    """

    values: np.ndarray
    steps: np.ndarray
    flags: np.ndarray
    counts: np.ndarray

    def window(self, size: int) -> Packed:
        """The last ``size`` samples of every layer (fewer where a layer has fewer).

        Args:
            size: window length (>= 1).

        Returns:
            A :class:`Packed` of width ``min(size, W)``.
        """
        width = min(max(size, 1), self.values.shape[1])
        return Packed(
            self.values[:, -width:],
            self.steps[:, -width:],
            self.flags[:, -width:],
            np.minimum(self.counts, width),
        )


@dataclass(frozen=True)
class GradientHistory:
    """A run's per-layer gradient norms over a step range, in model order.

    Only layers with at least one ``layer_stats`` row in the range are included.

    Attributes:
        run_id: the run.
        names: ``[L]`` layer names (``layers.name``; ``layer[i]`` if the name is missing).
        layer_index: int64 ``[L]`` ascending model-order indices.
        numel: int64 ``[L]`` parameters per layer (``layers.numel`` from RunStarted; the
            largest merged row ``numel`` if the layer row is missing).
        row_numel: int64 ``[L]`` largest ``layer_stats.numel`` of the layer in the range:
            the gradient elements merged over ranks (``world_size x numel`` for
            data-parallel replicas), the count behind ``grad_norm``.
        steps: int64 ``[T]`` ascending optimiser steps with at least one row.
        norms: float64 ``[L, T]`` ``grad_norm`` (L2 norm of the gradient, merged over
            ranks); NaN where the layer has no row at that step, and where the row holds
            NaN/Inf elements (its ``grad_norm`` then covers only the finite part, which is
            not the layer's gradient norm; the row still counts through its flags).
        flags: uint8 ``[L, T]`` ``FLAG_*`` bits; 0 where absent.
        present: bool ``[L, T]`` the layer has a row at that step.
        valid: bool ``[L, T]`` ``norms`` is a number there (present and finite).
        log_magnitude: float64 ``[L]`` mean over finite steps with a non-zero gradient of
            ``ln(mean_abs_grad)`` (``ln(rms)`` for norms-only rows): the log of the layer's
            geometric-mean per-element gradient magnitude; NaN if every such step was zero.
        peak_magnitude: float64 ``[L]`` largest ``max_abs_grad`` (``rms`` for norms-only
            rows) in the range.
        active_fraction: float64 ``[L]`` mean over steps with an exponent histogram of the
            fraction of finite gradient elements that are non-zero; NaN without histograms.
        update_to_weight: float64 ``[L]`` mean ``update_to_weight`` (NaN without weight
            statistics).
        update_ratio_steps, update_ratio: int64/float64 ``[U]`` steps and network-wide
            update-to-weight ratio ``sqrt(sum_l update_sum_sq / sum_l weight_sum_sq)``
            at the steps where some layer sent both.
        vanishing_threshold, exploding_threshold: the run's thresholds (RunStarted).
        world_size: ranks of the run.
        run_first_step: the first step of the whole run (``None`` without rows).
        from_step, to_step: the inclusive range requested (``None`` = open).
        exclusion: the layers left out of the verdict by explicit setting
            (:class:`analysis.read.exclusion.Exclusion`: the run's ``ignore_layers`` and the
            reader's own patterns); ``excluded``: bool ``[L]``, the layers of the history
            it names. Their ``flags`` hold no :data:`FLAG_VANISHING`,
            :data:`FLAG_EXPLODING` or :data:`FLAG_DEAD` bit (:data:`FLAG_NONFINITE` stays).
    """

    run_id: str
    names: list[str]
    layer_index: np.ndarray
    numel: np.ndarray
    row_numel: np.ndarray
    steps: np.ndarray
    norms: np.ndarray
    flags: np.ndarray
    present: np.ndarray
    valid: np.ndarray
    log_magnitude: np.ndarray
    peak_magnitude: np.ndarray
    active_fraction: np.ndarray
    update_to_weight: np.ndarray
    update_ratio_steps: np.ndarray
    update_ratio: np.ndarray
    vanishing_threshold: float
    exploding_threshold: float
    world_size: int
    run_first_step: int | None = None
    from_step: int | None = None
    to_step: int | None = None
    exclusion: Exclusion = field(default_factory=Exclusion)
    excluded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    _cache: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        """``L``, the layers with data in the range."""
        return len(self.names)

    @property
    def num_steps(self) -> int:
        """``T``, the steps with data in the range."""
        return int(self.steps.size)

    @property
    def last_step(self) -> int | None:
        """The last step with data, or ``None`` for an empty history."""
        return int(self.steps[-1]) if self.steps.size else None

    def report_header(self) -> dict[str, Any]:
        """The fields every report built from a history carries, as keyword arguments
        of its model: ``run_id``, ``from_step`` and ``to_step`` (the range requested),
        ``steps`` and ``layers`` (``T`` and ``L``), ``ignore_layers`` (the exclusion's
        patterns) and ``layers_excluded`` (the layers of the history it names, model
        order)."""
        return {
            "run_id": self.run_id,
            "from_step": self.from_step,
            "to_step": self.to_step,
            "steps": self.num_steps,
            "layers": self.num_layers,
            "ignore_layers": self.exclusion.patterns,
            "layers_excluded": [n for n, x in zip(self.names, self.excluded.tolist(),
                                                  strict=True) if x],
        }

    @cached_property
    def counts(self) -> np.ndarray:
        """int64 ``[L]`` samples per layer: rows with a usable norm (``valid``)."""
        return self.valid.sum(axis=1).astype(np.int64)

    @cached_property
    def rows(self) -> np.ndarray:
        """int64 ``[L]`` rows per layer in the range (``present``), the denominator of
        the flag fractions."""
        return self.present.sum(axis=1).astype(np.int64)

    @cached_property
    def packed(self) -> Packed:
        """The right-aligned per-layer series (see :class:`Packed`); no copy when every
        layer has a row at every step, else one stable O(L x T) radix sort of the
        presence mask."""
        steps = np.broadcast_to(self.steps.astype(np.float64), self.norms.shape)
        if self.valid.all():
            return Packed(self.norms, steps, self.flags, self.counts)
        width = int(self.counts.max(initial=0))
        values = np.empty((self.num_layers, width))
        packed_steps = np.empty((self.num_layers, width))
        flags = np.empty((self.num_layers, width), dtype=np.uint8)
        # Row by row the sort is independent of the other rows: done a chunk of layers
        # at a time, the int64 order array never exceeds one chunk.
        for rows in layer_chunks(self.num_layers, self.num_steps):
            valid = self.valid[rows]
            order = np.argsort(valid.view(np.uint8), axis=1, kind="stable")
            order = order[:, order.shape[1] - width :]
            values[rows] = np.take_along_axis(self.norms[rows], order, axis=1)
            packed_steps[rows] = np.where(
                np.take_along_axis(valid, order, axis=1),
                np.take_along_axis(steps[rows], order, axis=1),
                np.nan,
            )
            flags[rows] = np.take_along_axis(self.flags[rows], order, axis=1)
        return Packed(values, packed_steps, flags, self.counts)

    @cached_property
    def global_norm(self) -> np.ndarray:
        """float64 ``[T]`` the whole-model gradient norm per step,
        ``sqrt(sum_l grad_norm[l, t]^2)`` over the layers with a usable norm (what
        ``torch.nn.utils.clip_grad_norm_`` measures); NaN at a step without any."""
        if self.norms.size <= ROW_BATCH or self.num_steps == 1:
            total = np.sqrt(np.nansum(np.square(self.norms), axis=0))
        else:
            # NumPy sums a C-contiguous [L, T] array over axis 0 one row after the other;
            # adding the rows in the same order, a chunk of squares at a time, gives the
            # same bits without an [L, T] temporary.
            acc = np.zeros(self.num_steps)
            for rows in layer_chunks(self.num_layers, self.num_steps):
                squares = np.square(self.norms[rows])
                squares[np.isnan(squares)] = 0.0
                for row in squares:
                    acc += row
            total = np.sqrt(acc)
        return np.where(self.valid.any(axis=0), total, np.nan)


def layer_chunks(layers: int, width: int) -> list[slice]:
    """Consecutive slices of ``range(layers)`` of at most :data:`ROW_BATCH` elements each
    for rows ``width`` wide (at least one layer per slice), covering every layer in order.

    A per-layer (row-wise) computation done chunk by chunk gives the same bits as over the
    whole array (NumPy reduces each row of a C-contiguous block on its own) while its
    temporaries stay within one chunk.

    Args:
        layers: ``L``, rows of the array.
        width: ``W``, columns per row.

    Returns:
        The slices; empty for ``layers == 0``.
    """
    size = max(1, ROW_BATCH // max(width, 1))
    return [slice(start, min(start + size, layers)) for start in range(0, layers, size)]


def load_history(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    ignore_layers: Sequence[str] = (),
) -> GradientHistory:
    """Read one run's gradient history in an inclusive step range.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run.
        from_step: first step (inclusive), ``None`` = from the start.
        to_step: last step (inclusive), ``None`` = to the end.
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``
            (``analyze --ignore-layers``; module doc).

    Returns:
        The :class:`GradientHistory` (possibly with ``L = T = 0``).

    Raises:
        StoreError: unknown run, invalid step range.
    """
    run_range = open_run_range(con, run_id, from_step, to_step, ignore_layers)
    params = run_range.params
    run_rows = con.execute(_RUN_SQL, {"run_id": run_id}).fetchall()
    # The run exists (checked by require_run).
    van, exp, world, _num_layers, run_first_step = run_rows[0]
    steps = np.asarray(con.sql(_STEPS_SQL, params=params).fetchnumpy()["step"], dtype=np.int64)
    layers = con.sql(_LAYER_SQL, params=params).fetchnumpy()
    update = con.sql(_UPDATE_SQL, params=params).fetchnumpy()

    layer_index = np.asarray(layers["layer_index"], dtype=np.int64)
    count = layer_index.size
    position = np.full(int(layer_index.max(initial=-1)) + 1, -1, dtype=np.int64)
    position[layer_index] = np.arange(count)
    dense_steps = bool(steps.size) and int(steps[-1] - steps[0] + 1) == steps.size
    norms = np.full((count, steps.size), np.nan)
    flags = np.zeros((count, steps.size), dtype=np.uint8)
    present = np.zeros((count, steps.size), dtype=bool)
    # The rows stream in Arrow batches of ROW_BATCH and are scattered into the arrays
    # as they come: the memory beyond the L x T arrays is one batch, whatever the run's size.
    reader = con.sql(_ROWS_SQL, params=params).to_arrow_reader(batch_size=ROW_BATCH)
    for batch in reader:
        row_layer = position[batch.column(0).to_numpy(zero_copy_only=False).astype(np.int64)]
        row_step = batch.column(1).to_numpy(zero_copy_only=False).astype(np.int64)
        row_pos = row_step - steps[0] if dense_steps else np.searchsorted(steps, row_step)
        # NULL arrives as NaN (Arrow -> NumPy of a nullable float column).
        row_norm = batch.column(2).to_numpy(zero_copy_only=False).astype(np.float64)
        row_flags = batch.column(3).to_numpy(zero_copy_only=False).astype(np.uint8)
        if np.isnan(row_norm).any():
            raise StoreError(f"run {run_id!r} has NULL or NaN grad_norm values in layer_stats")
        row_norm[(row_flags & FLAG_NONFINITE) != 0] = np.nan
        norms[row_layer, row_pos] = row_norm
        flags[row_layer, row_pos] = row_flags
        present[row_layer, row_pos] = True
    valid = ~np.isnan(norms)
    exclusion = run_range.exclusion
    excluded = np.isin(layer_index, np.asarray(exclusion.layer_index, dtype=np.int64))
    flags[excluded] &= np.uint8(~(FLAG_VANISHING | FLAG_EXPLODING | FLAG_DEAD) & 0xFF)

    names = [
        name if name is not None else f"layer[{index}]"
        for name, index in zip(_column(layers, "name"), layer_index.tolist(), strict=True)
    ]
    numel = np.where(
        _masked(layers["numel"]),
        np.asarray(_filled(layers["max_row_numel"], 0), dtype=np.int64),
        np.asarray(_filled(layers["numel"], 0), dtype=np.int64),
    )
    return GradientHistory(
        run_id=run_id,
        names=names,
        layer_index=layer_index,
        numel=numel.astype(np.int64),
        row_numel=np.asarray(_filled(layers["max_row_numel"], 0), dtype=np.int64),
        steps=steps,
        norms=norms,
        flags=flags,
        present=present,
        valid=valid,
        log_magnitude=_floats(layers["log_mag"]),
        peak_magnitude=_floats(layers["peak_mag"]),
        active_fraction=_floats(layers["active_fraction"]),
        update_to_weight=_floats(layers["update_to_weight"]),
        update_ratio_steps=np.asarray(update["step"], dtype=np.int64),
        update_ratio=_floats(update["ratio"]),
        vanishing_threshold=float(van),
        exploding_threshold=float(exp),
        world_size=int(world),
        run_first_step=None if run_first_step is None else int(run_first_step),
        from_step=from_step,
        to_step=to_step,
        exclusion=exclusion,
        excluded=excluded,
    )


def _masked(column: np.ndarray) -> np.ndarray:
    """bool mask of the NULL entries of a fetchnumpy column (masked array when NULLs)."""
    if np.ma.isMaskedArray(column):
        return np.ma.getmaskarray(column)
    return np.zeros(np.shape(column), dtype=bool)


def _filled(column: np.ndarray, fill: object) -> np.ndarray:
    if np.ma.isMaskedArray(column):
        return column.filled(fill)
    return column


def _floats(column: np.ndarray) -> np.ndarray:
    """A DuckDB numeric column as float64 with NULL -> NaN."""
    if np.ma.isMaskedArray(column):
        return column.astype(np.float64).filled(np.nan)
    return np.asarray(column, dtype=np.float64)


def _column(table: dict[str, np.ndarray], name: str) -> list[object]:
    column = table[name]
    if np.ma.isMaskedArray(column):
        mask = np.ma.getmaskarray(column)
        return [None if m else v for v, m in zip(column.data.tolist(), mask.tolist(), strict=True)]
    return list(column.tolist())
