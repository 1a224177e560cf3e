"""Pictures of a run's gradient flow, drawn from the store (``gradstream plot``).

Modules, one job each:

- :mod:`analysis.plots.grid`: DuckDB SQL that reduces ``layer_stats`` to a bounded
  layers x steps grid (downsampling large runs in SQL, and saying so) and one layer's
  norm series.
- :mod:`analysis.plots.scalars`: DuckDB SQL that bins the run's step scalars (the loss) on
  the grid's step columns, for the loss curve above the heatmap.
- :mod:`analysis.plots.png`: matplotlib PNGs: the heatmap (log10 gradient norm, vanishing
  and exploding cells marked, the loss above it when the run has one) and the per-layer
  norm time series.
- :mod:`analysis.plots.animation`: the gradient-flow animation (per-layer flow intensity,
  frame by frame) as one offline HTML file (embedded data and JavaScript, step slider and
  play button).
- :mod:`analysis.plots.colors`: the colour map shared by the PNGs, the animation and the
  dashboard.
- :mod:`analysis.plots.files`: ``gradstream plot``'s work: the three picture files of one
  run written to a directory.

Nothing here is imported by ``analysis/__init__``; matplotlib loads only when drawing.
"""
