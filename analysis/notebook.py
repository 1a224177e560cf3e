"""The gradient history of a store as DataFrames, reports and figures, for notebooks.

::

    from analysis import Store

    store = Store("out/demo.duckdb")        # the file, or whichever process writes it now
    store.runs()                            # one row per run: health, counts
    run = store.run("demo-exploding-")      # an exact run id or a unique prefix
    run.layer_stats(steps=(100, 200), layers="encoder.*")   # long DataFrame
    run.frames(); run.alerts(); run.rank_stats()
    run.scalars()                           # loss, lr, ... one column each, by step
    run.report(); run.analyze("flow")       # the pydantic models the CLI prints
    run.plot()                              # the heatmap figure (matplotlib), loss above
    store.sql("SELECT ...")                 # one read-only statement

Every read goes through :func:`analysis.read.reader.open_reader`: the store's file opened
read-only when no process writes it, otherwise the loopback endpoint of the process that
does. A reader is opened for each call and closed after it, so a notebook never holds the
file between cells: a ``gradstream consume`` started later can still take it, and the next
call follows it to its endpoint.

Tables come back as pandas (the default), Arrow or polars (``as_="pandas" | "arrow" |
"polars"``, registered in :data:`TABLE_FLAVOURS`), with the same rows and columns in the
same order. ``steps=(first, last)`` is an inclusive optimiser-step range (either bound may
be ``None``); ``layers=`` is an ``fnmatch`` pattern (``"encoder.*"``, case-sensitive, as
:func:`fnmatch.fnmatchcase`), a list of exact layer names, or ``None`` for every layer.
Values reach DuckDB as bound parameters, never inside the SQL text.

A :class:`Run` and its :class:`RunReport` render in Jupyter (``_repr_html_``): the health
badge, the flagged layers, the recommendations and the heatmap as an inline PNG.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import PrivateAttr

from analysis.notebook_html import report_html
from analysis.notebook_sql import (
    ALERTS_SQL,
    FRAMES_SQL,
    LAYER_STATS_SQL,
    RANK_SCALARS_SQL,
    RANK_STATS_SQL,
    RUNS_SQL,
    STEP_SCALARS_SQL,
    Layers,
    ScalarNames,
    Steps,
    layer_params,
    scalar_name_params,
    step_params,
)
from analysis.read.connect import StoreError
from analysis.read.query import QueryError
from analysis.read.reader import open_reader
from analysis.read.store_url import store_url_scheme
from analysis.report import GradientFlowSummary
from schemas.scalars import LOSS

if TYPE_CHECKING:
    import pyarrow as pa
    from matplotlib.figure import Figure
    from pydantic import BaseModel

    from analysis.plots.grid import GradientGrid
    from analysis.plots.scalars import ScalarBins
    from analysis.read.reader import StoreReader

TableFlavour = Literal["pandas", "arrow", "polars"]
"""Name of a table type returned by the table methods (``as_=``)."""


def _to_arrow(table: pa.Table) -> pa.Table:
    return table


def _to_pandas(table: pa.Table) -> Any:
    """``table`` as a pandas DataFrame: NumPy dtypes (``int64``, ``float64``, ``bool``);
    an integer column holding NULLs becomes pandas' nullable ``Int64`` instead of float."""
    import pandas as pd
    import pyarrow as pa

    frame = table.to_pandas()
    for field in table.schema:
        if pa.types.is_integer(field.type) and table.column(field.name).null_count:
            frame[field.name] = table.select([field.name]).to_pandas(
                types_mapper={field.type: pd.Int64Dtype()}.get)[field.name]
    return frame


def _to_polars(table: pa.Table) -> Any:
    import polars as pl

    return pl.from_arrow(table)


TABLE_FLAVOURS: dict[str, Callable[[pa.Table], Any]] = {
    "pandas": _to_pandas,
    "arrow": _to_arrow,
    "polars": _to_polars,
}
"""``as_`` value -> conversion of the Arrow result. Add an entry to offer another type."""


def _convert(table: pa.Table, as_: str) -> Any:
    """``table`` converted by :data:`TABLE_FLAVOURS` ``[as_]``.

    Raises:
        ValueError: ``as_`` is not registered.
    """
    try:
        convert = TABLE_FLAVOURS[as_]
    except KeyError:
        raise ValueError(
            f"as_={as_!r} is not a table type; choose one of {', '.join(TABLE_FLAVOURS)}"
        ) from None
    return convert(table)


STEP_COLUMN = "step"
"""The step column of :meth:`Run.scalars`' wide table."""

STEP_SCALAR_RENAMED = "step (scalar)"
"""The column of a training scalar named ``step`` in :meth:`Run.scalars`' wide table (a
space and parentheses are never part of a scalar name, ``schemas.scalars``, so it cannot
meet another column)."""


def _wide_scalars(long: pa.Table) -> pa.Table:
    """The long rows ``(step, name, value)`` of :data:`~analysis.notebook_sql.STEP_SCALARS_SQL`
    as one row per step (ascending) and one float64 column per name (code-point order): a
    step without a value of that name holds null; NaN and +-Inf stay as stored."""
    import numpy as np
    import pyarrow as pa

    steps = long.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
    names = np.asarray(long.column("name").to_pylist(), dtype=object)
    values = long.column("value").to_numpy(zero_copy_only=False).astype(np.float64)
    step_values, col = np.unique(steps, return_inverse=True)
    columns: dict[str, pa.Array] = {STEP_COLUMN: pa.array(step_values, pa.int64())}
    if not len(steps):
        return pa.table(columns)
    name_values, row = np.unique(names, return_inverse=True)
    cells = np.full((len(name_values), len(step_values)), np.nan)
    present = np.zeros(cells.shape, bool)
    cells[row, col] = values
    present[row, col] = True
    for i, name in enumerate(name_values):
        column = STEP_SCALAR_RENAMED if name == STEP_COLUMN else str(name)
        columns[column] = pa.array(cells[i], pa.float64(), mask=~present[i])
    return pa.table(columns)


class Store:
    """A gradstream store read from a notebook or a script.

    Args:
        db: the DuckDB file written by ``gradstream consume`` / ``store`` / ``serve`` /
            ``demo``, or a store URL as a ``str`` (:mod:`analysis.read.store_url`): an
            Apache Iceberg table set is ``"iceberg+sqlite:////abs/catalog.db?warehouse=
            file:///abs/wh"`` (:mod:`analysis.read.iceberg`; S3 settings from the AWS_*
            variables), read from its current snapshot, each reader loading the whole
            table set (``with store:`` loads it once for many calls).
        timeout_s: time limit of each read, seconds (``None``: ``GRADSTREAM_QUERY_TIMEOUT_S``,
            else the reader's default of 60 s).

    A reader (:func:`analysis.read.reader.open_reader`) is opened for each call and closed after
    it: the store's file read-only when it is free, otherwise the endpoint of the process
    writing it. Nothing stays open between calls, so a writer can start at any time.
    Inside ``with store:`` one reader serves every call instead (no reader opened per
    call), and a writer cannot take a free file until the block ends.

    Raises:
        StoreError: the file is missing or not a gradstream store, or it is held by a
            process that answers no reads (checked once here, and again by every call).
    """

    def __init__(self, db: str | os.PathLike[str], timeout_s: float | None = None) -> None:
        self.db: Path | str = os.fspath(db) if store_url_scheme(db) is not None else Path(db)
        self.timeout_s = timeout_s
        self._held: StoreReader | None = None
        with self.reader():
            pass

    @contextmanager
    def reader(self) -> Iterator[StoreReader]:
        """A reader of the store for one block of reads: the one held by ``with store:``,
        else a new one closed at the block's end.

        Yields:
            :class:`analysis.read.reader.StoreReader` (``via`` says which path answers).

        Raises:
            StoreError: see the class.
        """
        if self._held is not None:
            yield self._held
            return
        reader = open_reader(self.db, self.timeout_s)
        try:
            yield reader
        finally:
            reader.close()

    def __enter__(self) -> Store:
        """Hold one reader until the block ends (see the class).

        Raises:
            StoreError: the store cannot be opened; RuntimeError: already inside ``with``.
        """
        if self._held is not None:
            raise RuntimeError(f"{self!r} is already held by a `with` block")
        self._held = open_reader(self.db, self.timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()

    @property
    def via(self) -> str:
        """How reads are answered now: ``"read-only file"``, ``"gradstream <command> (pid
        N) at <url>"`` or ``"Iceberg snapshot of namespace <ns> in <catalog>"``."""
        with self.reader() as reader:
            return reader.via

    def sql(self, sql: str, params: Mapping[str, object] | None = None,
            as_: TableFlavour = "pandas", timeout_s: float | None = None) -> Any:
        """Run one read-only SQL statement on the store.

        Args:
            sql: exactly one statement; tables ``runs``, ``layers``, ``layer_stats``,
                ``local_layer_stats``, ``frames``, ``alerts``, ``run_ranks``,
                ``step_scalars``, ``rank_scalars``, ``kafka_offsets`` (columns in
                ``schemas.tables``).
            params: named parameters, written ``$name`` in ``sql``.
            as_: ``"pandas"``, ``"arrow"`` or ``"polars"``.
            timeout_s: time limit of this statement (``None``: the store's).

        Returns:
            The rows, with DuckDB's column names and types.

        Raises:
            StoreError: several statements, a statement that would write or touch files
                outside the store, invalid SQL, the time limit
                (:mod:`analysis.read.query`'s subclasses).
            ValueError: unknown ``as_``.
        """
        with self.reader() as reader:
            table = reader.sql(sql, dict(params) if params else None, timeout_s)
        return _convert(table, as_)

    def runs(self, as_: TableFlavour = "pandas") -> Any:
        """One row per run, in run-id order: what ``gradstream report`` lists.

        Columns: ``run_id``; ``health`` (the worker's live classification, ``runs.health``:
        Healthy, MinorIssues, ProblemsDetected, Critical); ``frames`` and ``issue_frames``
        (frames classified, and those with a vanishing, exploding or NaN/Inf layer) and
        ``issue_ratio = issue_frames / frames`` (float64, 0 with no frame);
        ``partial_frames`` (stored before every rank reported); ``last_step``,
        ``first_nonfinite_step`` (nullable Int64 in pandas); ``world_size``, ``num_layers``;
        ``ranks_finished`` and ``dropped_summaries`` (from each rank's RunFinished);
        ``alerts`` (incidents fired) and ``open_alerts`` (fired, not resolved);
        ``vanishing_threshold`` / ``exploding_threshold`` (float64); ``host``;
        ``start_time`` / ``end_time`` (unix seconds, float64). Counts are int64.

        Raises:
            StoreError: the store cannot be read. ValueError: unknown ``as_``.
        """
        return self.sql(RUNS_SQL, as_=as_)

    def run(self, run: str | None = None) -> Run:
        """One run, by exact id or unique prefix (``None``: the store's only run).

        Raises:
            StoreError: unknown run, ambiguous prefix, or ``None`` with zero or several runs;
                the message lists the candidates.
        """
        with self.reader() as reader:
            return Run(self, reader.resolve_run(run))

    def __repr__(self) -> str:
        return f"Store({str(self.db)!r})"


class Run:
    """One run of a :class:`Store` (from :meth:`Store.run`).

    Attributes:
        store: the store.
        run_id: the run's id.
    """

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = store
        self.run_id = run_id

    def _table(self, sql: str, params: Mapping[str, object], as_: str) -> Any:
        return self.store.sql(sql, {"run_id": self.run_id, **params}, as_=as_)

    def layer_stats(self, steps: Steps = None, layers: Layers = None,
                    as_: TableFlavour = "pandas") -> Any:
        """The run's per-(step, layer) gradient statistics, merged over ranks: one row per
        stored frame and layer, in step then model order.

        Columns (int64 unless said): ``run_id`` (str), ``step``, ``layer_index`` (model
        order), ``layer`` (name, str), ``numel`` (elements of the parameter); float64:
        ``grad_norm = sqrt(sum g^2)`` (L2 norm of the gradient the optimiser applies),
        ``rms_grad = sqrt(sum g^2 / numel)``, ``mean_abs_grad = sum |g| / numel``,
        ``max_abs_grad``, ``flow_intensity = grad_norm / max grad_norm of the step's
        layers``; ``nonfinite`` (NaN/Inf elements); ``is_vanishing`` / ``is_exploding``
        (bool, against the run's thresholds); ``sum_abs``, ``sum_sq`` (the mergeable sums);
        ``weight_norm = sqrt(sum w^2)`` and ``update_to_weight`` (NaN unless the producer
        sent weight statistics). ``mean_abs_grad``, ``max_abs_grad`` and ``sum_abs`` are
        NaN for layers sent in norms mode. Formulas: ``schemas.tables`` (``layer_stats``).

        Args:
            steps: inclusive ``(first, last)`` step range, or ``None``.
            layers: an fnmatch pattern (``"encoder.*"``), a list of names, or ``None``.
            as_: ``"pandas"``, ``"arrow"`` or ``"polars"``.

        Raises:
            StoreError: invalid ``steps`` or ``layers``; the store cannot be read.
            ValueError: unknown ``as_``.
        """
        return self._table(LAYER_STATS_SQL, {**step_params(steps), **layer_params(layers)},
                           as_)

    def rank_stats(self, steps: Steps = None, layers: Layers = None,
                   as_: TableFlavour = "pandas") -> Any:
        """Each rank's local gradient before the cross-rank reduction (the per-rank local
        view, ``local_layer_stats``): one row per (step, rank, layer). Empty when the
        producers sent no local view; with their flight recorders (the producer's default
        ``local_view="recorder"``) only the steps a local trigger sent (the last K steps
        up to NaN/Inf, an explosion or a norm spike, and sampled steps) have rows.

        Columns (int64 unless said): ``run_id``, ``step``, ``rank``, ``layer_index``,
        ``layer`` (str), ``numel``; float64 ``grad_norm = sqrt(sum g^2)``,
        ``rms_grad = sqrt(sum g^2 / numel)``, ``mean_abs_grad = sum |g| / numel``,
        ``max_abs_grad``, ``sum_abs``, ``sum_sq``; ``nonfinite`` (NaN/Inf elements). The
        first non-finite step per rank is ``df[df.nonfinite > 0].groupby("rank").step.min()``.

        Args and raises: as :meth:`layer_stats`.
        """
        return self._table(RANK_STATS_SQL, {**step_params(steps), **layer_params(layers)},
                           as_)

    def frames(self, steps: Steps = None, as_: TableFlavour = "pandas") -> Any:
        """One row per stored frame (optimiser step), in step order.

        Columns: ``run_id``, ``step`` (int64), ``health`` (run health after this frame),
        ``num_layers``, ``vanishing_layers``, ``exploding_layers``, ``nonfinite_layers``
        (int64 counts of the frame), ``complete`` (bool: every rank reported),
        ``ranks_seen`` / ``missing_ranks`` (lists of ranks), ``wall_time`` (producer time)
        and ``finalized_at`` (when the worker closed the frame), unix seconds, float64.

        Raises:
            StoreError: invalid ``steps``; the store cannot be read. ValueError: ``as_``.
        """
        return self._table(FRAMES_SQL, step_params(steps), as_)

    def alerts(self, steps: Steps = None, as_: TableFlavour = "pandas") -> Any:
        """The run's alert events (firing and resolved), in step order.

        Columns: ``run_id``, ``step`` (int64, the frame of the event), ``first_step``
        (step the incident began), ``rule``, ``severity``, ``state`` (``firing`` /
        ``resolved``), ``layers`` and ``ranks`` (lists), ``message``, ``alert_id``,
        ``incident_id`` (shared by an incident's two events), ``created_at`` /
        ``wall_time`` (unix seconds), ``frame_values`` (JSON text of the values behind
        the event).

        Raises:
            StoreError: invalid ``steps``; the store cannot be read. ValueError: ``as_``.
        """
        return self._table(ALERTS_SQL, step_params(steps), as_)

    def scalars(self, steps: Steps = None, names: ScalarNames = None, ranks: bool = False,
                as_: TableFlavour = "pandas") -> Any:
        """The run's training scalars (``schemas.scalars``): loss, learning rates, loss
        scale, tokens, timings, and any name the training loop sent.

        ``ranks=False`` (default): the step scalars (``step_scalars``) wide, one row per
        step that has any (ascending), columns ``step`` (int64) then one float64 column per
        scalar name in code-point order (``compute_time_s``, ``loss``, ``loss_scale``,
        ``lr``, ``lr/1``, ``samples``, ``step_time_s``, ``tokens``, user names; a scalar
        named ``step`` becomes the column ``"step (scalar)"``). The per-rank scalars appear
        here as the step's value over the ranks that sent one
        (``schemas.scalars.RANK_AGGREGATES``): ``loss`` the mean (a NaN on one rank makes
        the step's NaN), ``tokens`` / ``samples`` the sum, ``step_time_s`` /
        ``compute_time_s`` the slowest rank's, in seconds; ``lr`` in the optimiser's units,
        ``loss_scale`` the AMP scale. A name absent at a step is null in Arrow and polars
        and NaN in pandas (which cannot tell it from a stored NaN: use ``as_="arrow"`` or
        ``"polars"``, or ``ranks=True``); a stored NaN or +-Inf is kept (``np.isinf``
        tells Inf apart).
        ``df.plot(x="step", y="loss")`` draws the loss curve.

        ``ranks=True``: the per-rank rows (``rank_scalars``) long, in step, rank, name
        order: ``step``, ``rank`` (int64), ``name`` (str), ``value`` (float64, NaN/Inf as
        sent): each rank's own loss, tokens, samples and its ``step_time_s`` /
        ``compute_time_s`` (seconds, measured by its SDK; ``compute_time_s`` ends when the
        rank's backward pass produced its last local gradient, so a straggler shows
        here). The slowest rank of each step:
        ``df[df.name == "compute_time_s"].pivot(index="step", columns="rank",
        values="value").idxmax(axis=1)``.

        Empty (no rows; the wide table only its ``step`` column) when the producers sent
        no scalars, or the store was written before the training-scalar tables existed
        and no newer writer has opened it since.

        Args:
            steps: inclusive ``(first, last)`` step range, or ``None``.
            names: an fnmatch pattern (``"lr*"``), a list of exact names, or ``None``.
            ranks: the per-rank rows instead of the step values.
            as_: ``"pandas"``, ``"arrow"`` or ``"polars"``.

        Raises:
            StoreError: invalid ``steps`` or ``names``; the store cannot be read.
            ValueError: unknown ``as_``.
        """
        import pyarrow as pa

        params = {"run_id": self.run_id, **step_params(steps), **scalar_name_params(names)}
        table, sql = ("rank_scalars", RANK_SCALARS_SQL) if ranks else (
            "step_scalars", STEP_SCALARS_SQL)
        with self.store.reader() as reader:
            try:
                rows = reader.sql(sql, params)
            except QueryError:
                if reader.has_table(table):
                    raise
                rows = pa.table({"step": pa.array([], pa.int64()),
                                 **({"rank": pa.array([], pa.int64())} if ranks else {}),
                                 "name": pa.array([], pa.string()),
                                 "value": pa.array([], pa.float64())})
        return _convert(rows if ranks else _wide_scalars(rows), as_)

    def report(self, steps: Steps = None) -> RunReport:
        """The run's summary, as ``gradstream report`` prints it
        (:func:`analysis.report.build_report`): health, flagged layers, recommendations.

        Returns:
            A :class:`RunReport` (a :class:`~analysis.report.GradientFlowSummary` with the
            same fields and JSON) that renders in Jupyter with the run's heatmap.

        Raises:
            StoreError: invalid ``steps``; the store cannot be read.
        """
        bounds = step_params(steps)
        with self.store.reader() as reader:
            summary = reader.report(self.run_id, bounds["from_step"], bounds["to_step"])
        report = RunReport.model_validate(summary.model_dump())
        report._heatmap = lambda: self._heatmap_png(steps)
        return report

    def analyze(self, name: str, steps: Steps = None, **options: object) -> BaseModel:
        """A registered analysis of the run, as ``gradstream analyze --kind NAME --format
        json`` returns it (:mod:`analysis.registry`: ``flow``, ``enhanced``, ``explosion``,
        ``weights``).

        Args:
            name: the analysis.
            steps: inclusive step range, or ``None``.
            options: the analysis's options by field name (``window=50``); booleans are
                sent as ``true`` / ``false``, other values as ``str(value)``, and validated
                by the analysis's options model.

        Returns:
            The analysis's pydantic report.

        Raises:
            StoreError: unknown analysis or option, invalid value, empty range, the store
                cannot be read.
        """
        bounds = step_params(steps)
        values = {key: (str(value).lower() if isinstance(value, bool) else str(value))
                  for key, value in options.items()}
        with self.store.reader() as reader:
            return reader.analysis(name, self.run_id, bounds["from_step"], bounds["to_step"],
                                   values)

    def grid(self, steps: Steps = None, max_steps: int = 1000,
             max_layers: int = 400) -> GradientGrid:
        """The layers x steps grid behind the heatmap (:func:`analysis.plots.grid.load_grid`:
        consecutive frames / layers binned by maximum beyond ``max_steps`` / ``max_layers``).

        Raises:
            StoreError: invalid ``steps`` or limits; the store cannot be read.
        """
        bounds = step_params(steps)
        with self.store.reader() as reader:
            return reader.grid(self.run_id, max_steps, max_layers, bounds["from_step"],
                               bounds["to_step"])

    def _heatmap_png(self, steps: Steps = None, max_steps: int = 1000, max_layers: int = 400,
                     width_px: int = 1600) -> bytes:
        from analysis.plots.png import heatmap_png

        grid, scalars = self._grid_and_loss(steps, max_steps, max_layers)
        return heatmap_png(grid, width_px, scalars)

    def _grid_and_loss(self, steps: Steps, max_steps: int,
                       max_layers: int) -> tuple[GradientGrid, ScalarBins]:
        """The heatmap's grid and the run's loss on its columns, read with one reader
        (:func:`analysis.plots.scalars.grid_scalar_bins`)."""
        from analysis.plots.scalars import grid_scalar_bins

        bounds = step_params(steps)
        with self.store.reader() as reader:
            grid = reader.grid(self.run_id, max_steps, max_layers, bounds["from_step"],
                               bounds["to_step"])
            return grid, grid_scalar_bins(reader, grid, (LOSS,))

    def plot(self, steps: Steps = None, max_steps: int = 1000, max_layers: int = 400,
             width_px: int = 1600) -> Figure:
        """The heatmap of log10 gradient norm (layers in model order x steps, vanishing,
        exploding and NaN/Inf cells marked), as ``gradstream plot`` draws it
        (:func:`analysis.plots.png.plot_heatmap`); when the run sent a loss, the loss curve
        above it on the same step columns (a second axes sharing the heatmap's x axis:
        ``fig.axes[0]`` the loss, ``fig.axes[1]`` the heatmap; binned as the heatmap's
        columns are, the title says how).

        Args:
            steps: inclusive step range, or ``None``.
            max_steps / max_layers: most columns / rows (more are binned by maximum; the
                caption says so).
            width_px: image width in pixels (height follows the number of rows).

        Returns:
            The matplotlib ``Figure`` (axes and colour bar live; not registered with
            pyplot, so it shows once in Jupyter and drawing it leaves the backend alone).

        Raises:
            StoreError: no frame in the range, invalid limits, the store cannot be read.
        """
        from analysis.plots.png import heatmap_figure

        grid, scalars = self._grid_and_loss(steps, max_steps, max_layers)
        return heatmap_figure(grid.require_frames(), width_px, scalars=scalars)

    def _repr_html_(self) -> str:
        return self.report()._repr_html_()

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, store={self.store!r})"


class RunReport(GradientFlowSummary):
    """A :class:`~analysis.report.GradientFlowSummary` (same fields, same JSON as ``gradstream
    report --format json``) that renders in Jupyter: health badge, flagged layers,
    recommendations and the run's heatmap as an inline PNG (drawn when displayed)."""

    _heatmap: Callable[[], bytes] | None = PrivateAttr(default=None)

    def _repr_html_(self) -> str:
        image: bytes | None = None
        note = ""
        if self._heatmap is not None:
            try:
                image = self._heatmap()
            except StoreError as exc:
                note = f"heatmap unavailable: {exc}"
        return report_html(self, image, note)
