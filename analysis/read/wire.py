"""How results travel between a serving process and :class:`analysis.read.reader.EndpointReader`.

Three encodings, each written once and used by both ends:

- tables (``/api/query``): the Arrow IPC streaming format (:data:`~analysis.read.query.
  ARROW_STREAM`), :func:`table_to_ipc` / :func:`table_from_ipc`;
- pydantic reports (``/api/report``, ``/api/analysis/<name>`` asked with ``Accept:``
  :data:`MODEL_JSON`): the model's JSON with non-finite floats kept as the literals
  ``NaN`` / ``Infinity`` / ``-Infinity`` (Python's :mod:`json` extension, which pydantic
  parses), so the rebuilt model equals the one built on the server; the page's JSON (NaN
  as ``null``) would not validate back into ``float`` fields;
- heatmap grids (``/api/grid`` asked with ``Accept: ARROW_STREAM``): one Arrow table
  holding the cell arrays row-major (:func:`grid_to_arrow` / :func:`grid_from_arrow`),
  exact float64 values instead of the page's rounded log10.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from analysis.plots.grid import GradientGrid

if TYPE_CHECKING:
    import pyarrow as pa
    from pydantic import BaseModel

    from analysis.registry import Analysis

MODEL_JSON = "application/vnd.gradstream.model+json"
"""Media type of a pydantic report with non-finite floats as JSON literals (see above)."""

_GRID_META = b"gradstream.grid"
"""Schema-metadata key of the grid's scalar fields and row/column vectors (JSON)."""


def table_to_ipc(table: pa.Table) -> bytes:
    """``table`` as an Arrow IPC stream (schema, then its record batches)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def table_from_ipc(source: Any) -> pa.Table:
    """The table of an Arrow IPC stream (``bytes`` or a readable binary file object)."""
    import pyarrow as pa

    return pa.ipc.open_stream(source).read_all()


def model_to_json(model: BaseModel) -> bytes:
    """``model`` as :data:`MODEL_JSON` (UTF-8; NaN and infinities as literals)."""
    return json.dumps(model.model_dump(mode="json"), ensure_ascii=False,
                      allow_nan=True).encode("utf-8")


def model_from_json(model_type: type[BaseModel], body: bytes) -> BaseModel:
    """Rebuild a report of ``model_type`` from :func:`model_to_json`'s bytes.

    Raises:
        pydantic.ValidationError: the body does not fit ``model_type``.
    """
    return model_type.model_validate_json(body)


def report_model(entry: Analysis[Any, Any]) -> type[BaseModel]:
    """The pydantic class of the reports of the registered analysis ``entry``: the return
    annotation of its ``build`` function, resolved in the module that defines it.

    Raises:
        TypeError: ``build`` has no return annotation naming a pydantic model.
    """
    from pydantic import BaseModel

    annotation = inspect.signature(entry.build).return_annotation
    if isinstance(annotation, str):
        module = sys.modules[entry.build.__module__]
        annotation = getattr(module, annotation, None)
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        raise TypeError(f"the build function of analysis {entry.name!r} must be annotated "
                        "with the pydantic model it returns")
    return annotation


def grid_to_arrow(grid: GradientGrid) -> pa.Table:
    """``grid`` as one Arrow table: columns ``max_norm``, ``max_flow`` (float64) and
    ``flags`` (uint8), each ``R x C`` cells row-major; the other fields as JSON in the
    schema metadata."""
    import pyarrow as pa

    meta = grid.fields()
    table = pa.table({
        "max_norm": pa.array(np.ascontiguousarray(grid.max_norm, np.float64).ravel()),
        "max_flow": pa.array(np.ascontiguousarray(grid.max_flow, np.float64).ravel()),
        "flags": pa.array(np.ascontiguousarray(grid.flags, np.uint8).ravel()),
    })
    return table.replace_schema_metadata({_GRID_META: json.dumps(meta, allow_nan=True)})


def grid_from_arrow(table: pa.Table) -> GradientGrid:
    """Rebuild the :class:`GradientGrid` written by :func:`grid_to_arrow`.

    Raises:
        ValueError: the table carries no grid metadata, or its cell count is not R x C.
    """
    raw = (table.schema.metadata or {}).get(_GRID_META)
    if raw is None:
        raise ValueError("the response is not a gradstream grid (no grid metadata)")
    meta = json.loads(raw)
    shape = (len(meta["row_labels"]), len(meta["col_first_step"]))
    if table.num_rows != shape[0] * shape[1]:
        raise ValueError(f"grid of {table.num_rows} cells, expected {shape[0]} x {shape[1]}")

    def cells(name: str, dtype: type) -> np.ndarray:
        column = table.column(name).to_numpy(zero_copy_only=False)
        return np.asarray(column, dtype=dtype).reshape(shape).copy()

    return GradientGrid.from_fields(meta, cells("max_norm", np.float64),
                                    cells("max_flow", np.float64), cells("flags", np.uint8))
