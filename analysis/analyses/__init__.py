"""Building blocks of the gradient-flow network, enhanced, explosion and weight analyses
(``analysis.flow``, ``analysis.enhanced``, ``analysis.explosion``, ``analysis.weights``).

- :mod:`analysis.analyses.history`: loads one run's gradient history from the store into
  dense ``layers x steps`` NumPy arrays (model order), in one SQL pass.
- :mod:`analysis.analyses.series`: per-layer time-series statistics vectorised over layers
  (moments, percentiles, trends, turning points, correlations), each O(layers x steps).
- :mod:`analysis.analyses.stats`: scalar statistics (quantiles of the normal and t
  distributions, Tukey fences, orders of magnitude) used to turn numbers into classes
  without made-up constants.
- :mod:`analysis.analyses.regions`: runs of adjacent layers (model order) sharing a flag.
- :mod:`analysis.analyses.flow_models`, :mod:`analysis.analyses.enhanced_models`: the
  pydantic report models of the gradient-flow network and enhanced analyses, with the
  formula of every field.
- :mod:`analysis.analyses.layer_facts`, :mod:`analysis.analyses.network`,
  :mod:`analysis.analyses.hierarchy`: the per-layer, network-level and hierarchy parts of
  the enhanced analysis.
- :mod:`analysis.analyses.render`: helpers shared by the terminal renderings.
- :mod:`analysis.analyses.reference`: the ``rules`` option (``"gradstream"`` or
  ``"reference"``) shared by the four analyses; :mod:`analysis.analyses.flow_reference` and
  :mod:`analysis.analyses.enhanced_reference`: the reference implementation's rules
  behind ``rules="reference"``. Every difference from the reference is listed in
  ``analysis/REFERENCE_DIFFERENCES.md``.
"""
