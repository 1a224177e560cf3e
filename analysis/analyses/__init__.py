"""The analyses of a stored run, one folder each, every folder of the same shape:

- ``__init__.py``: the options model, ``build_*`` (store connection, run, step range,
  options -> report) and ``ANALYSIS``, the entry that :data:`analysis.registry.ANALYSES`
  names in one line;
- ``models.py``: the pydantic report models, with the formula of every field;
- ``render.py``: the report as a rich renderable for the terminal;
- modules only that analysis needs: ``compute.py`` (the report from the loaded data),
  ``load.py`` (its SQL), ``reference.py`` (the reference's rules behind
  ``rules="reference"``), and parts of a larger computation.

The analyses: :mod:`analysis.analyses.flow` (gradient-flow network),
:mod:`analysis.analyses.enhanced` (enhanced per-layer analysis),
:mod:`analysis.analyses.explosion` (gradient explosion) and
:mod:`analysis.analyses.weights` (weight distribution and drift). What more than one of
them uses is in :mod:`analysis.blocks`. Every difference from the reference is listed in
``analysis/REFERENCE_DIFFERENCES.md``.
"""
