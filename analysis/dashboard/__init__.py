"""The live dashboard, served by the process that owns the DuckDB store.

- :mod:`analysis.read.cursors`: read-only cursors on the store (one per request).
- :mod:`analysis.dashboard.api`: the JSON data of the endpoints.
- :mod:`analysis.dashboard.server`: the HTTP server (stdlib ``ThreadingHTTPServer``).
- :mod:`analysis.read.sidecar`: ``<db>.serve.json``, by which ``gradstream query``
  finds the server of a store that another process holds.
- ``static/``: the page, its script and style sheet (no external resources).

The package does not import the consumer: it is given a cursor provider, so the same
server runs beside a consumer worker (``gradstream serve``, :mod:`deploy.serve`) or
on a store no one writes (``gradstream serve --no-consume``). This module imports nothing.
"""
