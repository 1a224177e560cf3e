"""Everything that reads the gradstream store (DuckDB): reports, heatmaps, exports.

In a notebook::

    from analysis import Store

    store = Store("out/demo.duckdb")
    run = store.run("demo-exploding-")
    run.layer_stats(steps=(10, 30), layers="layers.0.*")

Modules, one job each:

- :mod:`analysis.notebook`: the notebook API (:class:`~analysis.notebook.Store`,
  :class:`~analysis.notebook.Run`): runs, per-layer and per-rank statistics, frames and
  alerts as pandas / Arrow / polars tables, reports, analyses and the heatmap figure; its
  SQL in :mod:`analysis.notebook_sql`, its Jupyter HTML in :mod:`analysis.notebook_html`.
- :mod:`analysis.read`: the read path, at the bottom of the package: open the store
  read-only and name runs, the SQL fragments every query uses, the hardened statement,
  the request cursors, the route table, the endpoint codec and sidecar, and the one reader
  (:func:`analysis.read.reader.open_reader`: the file read-only, or the writing
  process's endpoint).
- :mod:`analysis.report`: run summary (health, flagged layers, recommendations).
- :mod:`analysis.heatmap`: ASCII heatmap of flow intensity (layers x steps).
- :mod:`analysis.nonfinite`: the reference's values of layers holding NaN/Inf elements
  (for the reference styles and verdict).
- :mod:`analysis.presentation`: the choices of the report, the heatmap and the exports
  (layer order, style, export format), standard library only.
- :mod:`analysis.export`: CSV and JSON exports (plus Parquet and JSON Lines), streamed
  from the read connection as Arrow batches and written by this process (read connections
  have no file access).
- :mod:`analysis.analyses`: the analyses (``flow``, ``enhanced``, ``explosion``,
  ``weights``), one folder each of the same shape, registered in one place
  (:mod:`analysis.registry`) and used by ``gradstream analyze`` and the dashboard;
  :mod:`analysis.blocks`: the building blocks they share.
- :mod:`analysis.plots`: the heatmap grid, its PNG figures and the HTML animation.
- :mod:`analysis.dashboard`: the read endpoint and live dashboard every writing process
  serves (a Starlette application of the routes of :mod:`analysis.read.routes`).

The commands that read the store are wired in :mod:`deploy.cli`.

``analysis`` imports ``schemas`` and never ``producer`` or ``consumer``: what runs a worker
and the dashboard together is :mod:`deploy.serve`. This package module imports nothing, so
that ``gradstream --help`` does not load DuckDB: ``Store``, ``Run`` and ``RunReport`` are
imported from :mod:`analysis.notebook` on first access (module ``__getattr__``, PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from analysis.notebook import Run, RunReport, Store

__all__ = ["Run", "RunReport", "Store"]

_LAZY: dict[str, str] = {"Store": "analysis.notebook", "Run": "analysis.notebook",
                         "RunReport": "analysis.notebook"}
"""Name exported by this package -> the module that defines it (imported when used)."""


def __getattr__(name: str) -> Any:
    """``analysis.Store`` and the other names of :data:`_LAZY`, imported on first use.

    Raises:
        AttributeError: ``name`` is not exported.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
