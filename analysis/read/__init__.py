"""The read path of the store, at the bottom of :mod:`analysis`: every other analysis
module reads through it, and it imports none of them when loaded.

- :mod:`analysis.read.connect`: open the store read-only, list runs, resolve a run argument.
- :mod:`analysis.read.exclusion`: the layers a reader leaves out (``ignore_layers``).
- :mod:`analysis.read.sql`: the SQL fragments every query uses (statistics in a step range,
  the step-range filter, the layer-name expression, step bucketing).
- :mod:`analysis.read.query`: one read-only statement, hardened, under a time limit.
- :mod:`analysis.read.query_output`: a result table as a terminal table, CSV or JSON.
- :mod:`analysis.read.cursors`: read-only cursors for a serving process's requests.
- :mod:`analysis.read.routes`: the one route table of the read endpoint and dashboard.
- :mod:`analysis.read.endpoint_codec`: how tables and reports travel over the endpoint.
- :mod:`analysis.read.sidecar`: ``<db>.serve.json``, by which a serving process is found.
- :mod:`analysis.read.reader`: the one reader (the file read-only, or the endpoint of the
  process that writes it).
- :mod:`analysis.read.store_url`: stores named by a URL (``<kind>+<url>``), one line per kind.
- :mod:`analysis.read.iceberg`: the reader of an Apache Iceberg table set (``iceberg+...``).
"""
