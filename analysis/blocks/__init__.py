"""Building blocks shared by the analyses (:mod:`analysis.analyses`) and the reports.

- :mod:`analysis.blocks.run_range`: the preamble of every build (check the step range,
  resolve the run, apply the report's exclusion).
- :mod:`analysis.blocks.gradient_arrays`: one run's gradient history from the store as
  dense ``layers x steps`` NumPy arrays (model order), loaded in one SQL pass.
- :mod:`analysis.blocks.series`: per-layer time-series statistics vectorised over layers
  (moments, percentiles, trends, turning points, correlations), each O(layers x steps).
- :mod:`analysis.blocks.significance`: significance thresholds (quantiles of the normal
  and t distributions, family-wise levels), Tukey fences and orders of magnitude, which
  turn numbers into classes without made-up constants.
- :mod:`analysis.blocks.rules`: the ``rules`` option (``"gradstream"`` or
  ``"reference"``) every analysis takes.
- :mod:`analysis.blocks.terminal`: cells, tables and name lists of the terminal
  renderings (rich), with the one "... and N more" truncation.
"""
