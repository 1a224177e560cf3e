"""Tests of the ``analysis`` package. Their stores are written by
:mod:`tests.analysis.crafted` (:class:`~tests.analysis.crafted.StoreBuilder` frame by frame,
:func:`~tests.analysis.crafted.write_history` from arrays), both through its one writer.
"""
