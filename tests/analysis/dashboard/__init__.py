"""Tests of :mod:`analysis.dashboard`."""
