"""The live dashboard and read endpoint, served by the process that owns the DuckDB store.

- :mod:`analysis.dashboard.server`: the ASGI application (Starlette) of the routes of
  :data:`analysis.read.routes.ROUTES`, its token middleware, and the uvicorn server
  thread.
- :mod:`analysis.dashboard.api`: the JSON data of the dashboard's own routes.
- ``static/``: the page, its script and style sheet (no external resources).

The read path it serves (cursors, endpoint codec, sidecar, routes) is :mod:`analysis.read`. The
package does not import the consumer: it is given a cursor provider, so the same server
runs beside a consumer worker (``gradstream serve``, :mod:`deploy.serve`) or on a store no
one writes (``gradstream serve --no-consume``). This module imports nothing.
"""
