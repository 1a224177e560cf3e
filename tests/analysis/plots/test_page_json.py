"""analysis.plots.page_json writes what the standard library writes for the same values as
Python lists with ``None`` for non-finite floats (the encoding the pages had before), for
any shape, dtype and stride of array."""

from __future__ import annotations

import doctest
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import analysis.plots.page_json as page_json_module
from analysis.plots.page_json import page_json


def as_lists(value: object) -> object:
    """The reference encoding: arrays as nested Python lists, non-finite floats None."""
    if isinstance(value, np.ndarray):
        return as_lists(value.tolist())
    if isinstance(value, list):
        return [as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


arrays = hnp.arrays(
    dtype=st.sampled_from([np.float64, np.float32, np.int64, np.uint8, np.bool_]),
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5),
    elements={"allow_nan": True, "allow_infinity": True},
)


@settings(max_examples=60, deadline=None)
@given(cells=arrays, step=st.integers(1, 2), name=st.text(max_size=8))
def test_equals_the_list_encoding(cells: np.ndarray, step: int, name: str) -> None:
    view = cells[..., ::step]  # strided views too
    payload = {"name": name, "cells": view, "n": int(view.size), "top": float("nan")}
    got = json.loads(page_json(payload))
    want = json.loads(json.dumps(as_lists(payload), allow_nan=False))
    if view.dtype == np.float32:  # float32 written at its own shortest precision
        np.testing.assert_array_equal(
            np.array(as_lists(got["cells"]), dtype=object).astype(float).astype(np.float32),
            np.array(want["cells"], dtype=object).astype(float).astype(np.float32))
        got["cells"] = want["cells"]
    assert got == want


def test_refuses_what_json_cannot_say() -> None:
    with pytest.raises(TypeError):
        page_json({1: "a key that is not a string"})
    with pytest.raises(TypeError):
        page_json({"x": object()})


def test_examples() -> None:
    result = doctest.testmod(page_json_module)
    assert result.attempted >= 2 and result.failed == 0
