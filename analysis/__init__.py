"""Everything that reads the gradstream store (DuckDB): reports, heatmaps, exports.

Modules, one job each:

- :mod:`analysis.store`: open the store read-only, list runs, resolve a run argument.
- :mod:`analysis.report`: seed-001 run summary (health, flagged layers, recommendations).
- :mod:`analysis.heatmap`: seed-001 ASCII heatmap of flow intensity (layers x steps).
- :mod:`analysis.export`: seed-001 CSV and JSON exports, written by DuckDB ``COPY``.
- :mod:`analysis.cli`: the ``report`` and ``export`` subcommands (``register(app)``).

``analysis`` imports ``schemas`` and never ``producer`` or ``consumer``. This package
module imports nothing, so that ``gradstream --help`` does not load DuckDB.
"""
