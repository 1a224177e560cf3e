"""Everything that reads the gradstream store (DuckDB): reports, heatmaps, exports.

Modules, one job each:

- :mod:`analysis.store`: open the store read-only, list runs, resolve a run argument.
- :mod:`analysis.report`: run summary (health, flagged layers, recommendations).
- :mod:`analysis.heatmap`: ASCII heatmap of flow intensity (layers x steps).
- :mod:`analysis.export`: CSV and JSON exports (plus Parquet and JSON Lines), written by
  DuckDB ``COPY``.
- :mod:`analysis.registry`: the analyses (``flow``, ``enhanced``, ``explosion``,
  ``weights``), one module each, registered in one place and used by ``gradstream analyze``
  and the dashboard.
- :mod:`analysis.dashboard`: the live dashboard's HTTP server and read cursors.

The commands that read the store are wired in :mod:`deploy.cli`.

``analysis`` imports ``schemas`` and never ``producer`` or ``consumer``: what runs a worker
and the dashboard together is :mod:`deploy.serve`. This package module imports nothing, so
that ``gradstream --help`` does not load DuckDB.
"""
