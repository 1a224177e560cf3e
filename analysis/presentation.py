"""The presentation choices of the report, the ASCII heatmap and the exports, defined once:
layer order, style and export format.

Standard library only, so that the command line builds its choices from these tuples
without loading DuckDB (``gradstream --help``).
"""

from __future__ import annotations

from typing import Literal

LayerOrder = Literal["name", "model"]
"""Order of the layers within a step: by name (code-point order, the reference's) or in
model order (``layers.layer_index``)."""

LAYER_ORDERS: tuple[str, ...] = ("name", "model")
"""The values of :data:`LayerOrder`."""

Style = Literal["gradstream", "reference"]
"""Presentation of the ASCII heatmap and the CSV / JSON exports: gradstream's, or byte for
byte the reference's (trustformers-debug, ``gradient_flow``); what each means is in the
docs of :mod:`analysis.export` and :mod:`analysis.heatmap`."""

STYLES: tuple[str, ...] = ("gradstream", "reference")
"""The values of :data:`Style`."""

EXPORT_FORMATS: tuple[str, ...] = ("csv", "json", "parquet", "jsonl")
"""Formats of :func:`analysis.export.export_run` (also the file extensions)."""


def check_choice(what: str, value: object, choices: tuple[str, ...]) -> None:
    """Refuse a value outside ``choices``.

    Args:
        what: the argument's name, quoted in the error (``"order"``).
        value: the value given.
        choices: the allowed values (:data:`LAYER_ORDERS`, :data:`STYLES`,
            :data:`EXPORT_FORMATS`).

    Raises:
        ValueError: ``value`` is not in ``choices``; the message lists them.
    """
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, choices))}, "
                         f"got {value!r}")
