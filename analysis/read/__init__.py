"""The read path of the store, at the bottom of :mod:`analysis`: every other analysis
module reads through it.

- :mod:`analysis.read.connect`: open the store read-only, list runs, resolve a run argument.
- :mod:`analysis.read.exclusion`: the layers a reader leaves out (``ignore_layers``).
- :mod:`analysis.read.sql`: the SQL fragments every query uses (statistics in a step range,
  the step-range filter, the layer-name expression, step bucketing).
"""
