"""Tests of :mod:`analysis.read`."""
