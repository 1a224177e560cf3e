"""JSON for the pages that draw the pictures: the dashboard's answers and the data the
animation page embeds, encoded in one place by orjson.

The payloads are dicts of the pictures' ``to_json`` methods, whose cell arrays (a 1,000 x
1,000 heatmap is a million cells) stay NumPy arrays: orjson writes them from their
buffers (``OPT_SERIALIZE_NUMPY``) about ten times faster than :mod:`json` writes the same
values as Python lists. JSON has no non-finite numbers; NaN and +-inf (Python or NumPy)
are written as ``null``, which the pages read as "no value" (orjson's documented rule).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _fallback(value: Any) -> Any:
    """What orjson cannot write itself: a strided NumPy view (orjson takes C-contiguous
    arrays only) is copied into a contiguous array of the same values."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def page_json(value: object) -> bytes:
    """``value`` as compact UTF-8 JSON (no spaces), non-finite floats as ``null``.

    Args:
        value: dicts with ``str`` keys, lists, tuples, ``str``, ``int`` (64-bit),
            ``float``, ``bool``, ``None``, NumPy arrays (any shape, numeric or bool
            dtype; nested lists in the output) and NumPy scalars.

    Returns:
        The JSON text, UTF-8 (non-ASCII characters written as themselves).

    Raises:
        TypeError: a value of another type, a non-``str`` key or an integer beyond 64
            bits (``orjson.JSONEncodeError`` is a ``TypeError``).

    >>> page_json({"log_norm": np.array([[0.5, np.nan]]), "flags": np.array([1], np.uint8)})
    b'{"log_norm":[[0.5,null]],"flags":[1]}'
    >>> page_json({"cells": np.arange(6.0).reshape(2, 3)[:, 1:], "top": float("inf")})
    b'{"cells":[[1.0,2.0],[4.0,5.0]],"top":null}'
    """
    return orjson.dumps(value, default=_fallback, option=_OPTIONS)
