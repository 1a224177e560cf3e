"""How results travel between a serving process and :class:`analysis.read.reader.EndpointReader`.

Three encodings, each written once and used by both ends:

- tables (``/api/query``): the Arrow IPC streaming format (:data:`~analysis.read.query.
  ARROW_STREAM`), :func:`table_to_ipc` / :func:`table_from_ipc`;
- pydantic reports (``/api/report``, ``/api/analysis/<name>`` asked with ``Accept:``
  :data:`MODEL_JSON`): the model's JSON with non-finite floats kept as the literals
  ``NaN`` / ``Infinity`` / ``-Infinity`` (Python's :mod:`json` extension, which pydantic
  parses), so the rebuilt model equals the one built on the server; the page's JSON (NaN
  as ``null``) would not validate back into ``float`` fields;
- heatmap grids (``/api/grid`` asked with ``Accept: ARROW_STREAM``): the grid's own Arrow
  codec (:meth:`analysis.plots.grid.GradientGrid.to_arrow` / ``from_arrow``), exact
  float64 values instead of the page's rounded log10, sent as a table.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from pydantic import BaseModel

    from analysis.registry import Analysis

MODEL_JSON = "application/vnd.gradstream.model+json"
"""Media type of a pydantic report with non-finite floats as JSON literals (see above)."""


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
