"""Tests of the benchmark scripts (smoke runs of their small modes)."""
