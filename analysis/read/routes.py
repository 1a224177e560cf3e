"""The routes of a store's read endpoint and dashboard: one table, :data:`ROUTES`, which the
server (:mod:`analysis.dashboard.server`) serves and :class:`analysis.read.reader.
EndpointReader` calls, so that no path, parameter or encoding is spelled twice.

============================  ======================================================================
``GET /``                     the dashboard page (``static/index.html``; also ``/index.html``)
``GET /static/{name}``        its script and style sheet, and the shared ``heatmap.js``
``GET /api/status``           store path, whether this process writes it, worker counters
``GET /api/runs``             runs with health, frames, issue ratio, alert counts
``GET /api/grid``             ``run``, ``max_steps``, ``max_layers``, ``from_step``, ``to_step``:
                              the downsampled heatmap grid (:mod:`analysis.plots.grid`); with
                              ``Accept: application/vnd.apache.arrow.stream`` the exact grid as
                              Arrow (:meth:`analysis.plots.grid.GradientGrid.to_arrow`)
``GET /api/report``           ``run``, ``from_step``, ``to_step``, ``ignore_layers`` (a JSON
                              list of patterns), ``exclude_rounding=true``, ``order``
                              (``model`` or ``name``), ``nonfinite_rule`` (``critical`` or
                              ``reference``): the run summary
                              (:func:`analysis.report.build_report`), the JSON of ``gradstream
                              report --format json``
``GET /api/heatmap``          ``run``, ``max_columns``, ``from_step``, ``to_step``: the ASCII
                              heatmap (:func:`analysis.heatmap.ascii_heatmap`), plain text;
                              ``style=reference``: the reference's layout
``GET /api/layer``            ``run``, ``layer``, ``max_points``: one layer's norm series
``GET /api/scalars``          ``run``, ``max_steps``, ``names`` (a JSON list; absent: all),
                              ``from_step``, ``to_step``: the run's step scalars (loss, lr,
                              ...) binned on the columns of the grid of the same
                              ``max_steps`` (:mod:`analysis.plots.scalars`)
``GET /api/alerts``           ``run`` (optional), ``limit``: newest alerts first
``GET /api/analyses``         the registered analyses (:mod:`analysis.registry`): name, help,
                              JSON Schema of the options
``GET /api/analysis/{name}``  ``run``, ``from_step``, ``to_step`` and the analysis's options by
                              field name (``window=10``): its report, the JSON of ``gradstream
                              analyze --kind <name> --format json``
``GET /api/export``           ``run``, ``format`` (csv/json/parquet/jsonl), ``from_step``,
                              ``to_step``, ``order``, ``style`` (csv): a download
                              (:mod:`analysis.export`;
                              header ``X-Gradstream-Rows``: rows written)
``POST /api/query``           JSON ``{"sql": ..., "params": {...} | [...], "timeout_s": ...}``:
                              one read-only statement, Arrow IPC stream back
============================  ======================================================================

Every route requires the server's token (:mod:`analysis.dashboard.server`, *Access*).
Every ``/api/`` route also takes ``timeout_s``: the read's time limit when smaller than
the server's. The reads a :class:`~analysis.read.reader.StoreReader` offers (``report``,
``heatmap``, ``grid``, ``analysis``) are the routes with a :attr:`Route.read` name: the
table names the function that builds the result on a cursor (:attr:`Route.build`), which
a file reader calls in its own process and the server calls for an endpoint reader, and
how the result travels (:attr:`Route.answer`, :mod:`analysis.read.endpoint_codec`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from analysis.read.connect import StoreError

if TYPE_CHECKING:
    import duckdb
    from pydantic import BaseModel


class ParamError(StoreError, ValueError):
    """A query parameter is missing or malformed; ``str(exc)`` says which (HTTP 400)."""


class NotFoundError(StoreError):
    """The read names something the store or the registry does not have (HTTP 404)."""


@dataclass(frozen=True)
class Param:
    """One query parameter of a route.

    Attributes:
        name: the parameter's name, in the URL and as the builder's keyword argument.
        kind: ``int``, ``str``, ``flag`` (``true`` or absent) or ``patterns`` (a JSON list
            of strings: layer-name patterns, scalar names).
        default: the value when absent (or empty).
        bounds: ``(low, high)`` of an ``int``: the server clamps into it; a reader refuses
            a value below ``low``.
        required: absent is an error.
    """

    name: str
    kind: str = "int"
    default: object = None
    bounds: tuple[int, int] | None = None
    required: bool = False

    def parse(self, raw: str | None) -> object:
        """The value of the URL's text ``raw`` (``None`` or "" = absent).

        Raises:
            ParamError: required and absent, or not of :attr:`kind`.
        """
        if raw is None or raw == "":
            if self.required:
                raise ParamError(f"the {self.name} parameter is required")
            return self.default
        if self.kind == "str":
            return raw
        if self.kind == "flag":
            return raw == "true"
        if self.kind == "patterns":
            return _patterns(self.name, raw)
        try:
            value = int(raw)
        except ValueError:
            raise ParamError(f"{self.name} must be an integer, got {raw!r}") from None
        if self.bounds is not None:
            value = min(max(value, self.bounds[0]), self.bounds[1])
        return value

    def encode(self, value: object) -> str | None:
        """``value`` as URL text (``None``: leave the parameter out).

        Raises:
            StoreError: an ``int`` below :attr:`bounds`.
        """
        if value is None:
            return None
        if self.kind == "flag":
            return "true" if value else None
        if self.kind == "patterns":
            patterns = list(value)  # type: ignore[call-overload]
            return json.dumps(patterns) if patterns else None
        if self.kind == "int" and self.bounds is not None and int(value) < self.bounds[0]:  # type: ignore[call-overload]
            raise StoreError(f"{self.name} must be >= {self.bounds[0]}, got {value}")
        return str(value)


def _patterns(name: str, raw: str) -> tuple[str, ...]:
    """A ``patterns`` parameter (``ignore_layers``, ``names``) named ``name``: a JSON list
    of strings.

    Raises:
        ParamError: not such a list.
    """
    try:
        patterns = json.loads(raw)
    except ValueError:
        patterns = None
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ParamError(f'{name} must be a JSON list of strings, e.g. ["a", "b.*"]')
    return tuple(patterns)


RUN = Param("run", "str", required=True)
FROM_STEP = Param("from_step")
TO_STEP = Param("to_step")
STEPS = (FROM_STEP, TO_STEP)


@dataclass(frozen=True)
class Route:
    """One route: ``method`` on ``path`` is answered by the server's handler ``handler``.

    Attributes:
        method: ``GET`` or ``POST``.
        path: an exact path, or a template ending in ``{name}``: any one non-empty path
            segment (``/static/{name}`` matches ``/static/dashboard.js``).
        handler: name of the :class:`analysis.dashboard.server.Dashboard` method that
            answers.
        page: a page for the browser (HTML and its assets): ``?token=`` logs in there, and
            a refusal is a short HTML page; else an ``/api/`` route (JSON errors).
        params: the query parameters, parsed by the server and sent by the reader.
        options: the route also takes the registered analysis's options, by field name.
        answer: how the result travels: ``page``, ``static``, ``json``, ``model`` (a
            pydantic report: :data:`~analysis.read.endpoint_codec.MODEL_JSON` when asked, else the
            page's JSON), ``text``, ``grid`` (Arrow when asked, else the page's JSON),
            ``download``, ``arrow``.
        read: the :class:`~analysis.read.reader.StoreReader` method that makes this read
            (``None``: not a reader's read).
        build: ``"module:function"`` building the result: ``function(cursor, run_id,
            **params)`` (and ``name=``, ``options=`` on an ``options`` route).
        model: ``"module:Class"`` of a ``model`` answer (``None``: the analysis's own,
            :func:`analysis.read.endpoint_codec.report_model`).
        cached: the page's JSON is kept until the run's frames change.
    """

    method: str
    path: str
    handler: str
    page: bool = False
    params: tuple[Param, ...] = ()
    options: bool = False
    answer: str = "json"
    read: str | None = None
    build: str | None = None
    model: str | None = None
    cached: bool = False

    def match(self, path: str) -> str | None:
        """The ``{name}`` segment of ``path`` ("" for an exact path), or None when
        ``path`` is not this route's."""
        if not self.path.endswith("{name}"):
            return "" if path == self.path else None
        prefix = self.path.removesuffix("{name}")
        name = path.removeprefix(prefix) if path.startswith(prefix) else ""
        return name if name and "/" not in name else None

    def url(self, name: str = "") -> str:
        """The path of this route, ``{name}`` filled with ``name`` (URL-quoted)."""
        from urllib.parse import quote

        return self.path.replace("{name}", quote(name, safe=""))

    def parse(self, query: Mapping[str, str]) -> dict[str, object]:
        """The builder's keyword arguments from the URL's ``query`` (one value each);
        with :attr:`options`, the other parameters (``timeout_s`` aside) as ``options``.

        Raises:
            ParamError: a parameter missing or malformed.
        """
        values = {p.name: p.parse(query.get(p.name)) for p in self.params}
        if self.options:
            declared = {p.name for p in self.params} | {"timeout_s"}
            values["options"] = {k: v for k, v in query.items() if k not in declared}
        return values

    def query(self, values: Mapping[str, object]) -> dict[str, str]:
        """The URL's query for the builder's keyword arguments ``values`` (absent and
        ``None`` values left out; an ``options`` route's options added as they are).

        Raises:
            StoreError: an ``int`` below its bounds.
        """
        out = {p.name: text for p in self.params
               if (text := p.encode(values.get(p.name))) is not None}
        if self.options:
            out.update({k: str(v) for k, v in dict(values.get("options") or {}).items()})
        return out

    def builder(self) -> Callable[..., Any]:
        """The function :attr:`build` names (imported on first use).

        Raises:
            TypeError: the route builds nothing.
        """
        if self.build is None:
            raise TypeError(f"{self.method} {self.path} builds nothing")
        module, _, name = self.build.partition(":")
        return getattr(importlib.import_module(module), name)

    def run(self, cur: duckdb.DuckDBPyConnection, name: str, values: Mapping[str, object]) -> Any:
        """Build the result on ``cur``: :meth:`builder` with the run, ``values`` (the
        parsed parameters) and, on an ``options`` route, ``name``.

        Raises:
            StoreError: what the builder raises, a ``ValueError`` included.
        """
        kwargs = dict(values)
        run_id = kwargs.pop("run")
        if self.options:
            kwargs["name"] = name
        try:
            return self.builder()(cur, run_id, **kwargs)
        except StoreError:
            raise
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    def model_type(self, name: str = "") -> type[BaseModel]:
        """The pydantic class of a ``model`` answer (for an analysis: its report's)."""
        if self.model is not None:
            module, _, cls = self.model.partition(":")
            return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]
        from analysis.read.endpoint_codec import report_model

        return report_model(checked_analysis(name, {}))  # type: ignore[arg-type]


def checked_analysis(name: str, options: Mapping[str, object]) -> object:
    """The registered analysis ``name`` (:func:`analysis.registry.get`), once ``options``
    are known to be among its own.

    Raises:
        NotFoundError: no analysis ``name``.
        ParamError: an option it does not declare.
    """
    from analysis.registry import UnknownAnalysisError, get

    try:
        entry = get(name)
    except UnknownAnalysisError as exc:
        raise NotFoundError(str(exc)) from None
    unknown = sorted(set(options) - set(entry.option_names))
    if unknown:
        raise ParamError(
            f"{name} has no option {', '.join(unknown)}; its options: "
            f"{', '.join(entry.option_names) or 'none'}"
        )
    return entry


def build_analysis(
    cur: duckdb.DuckDBPyConnection, run_id: str, *, name: str, from_step: int | None = None,
    to_step: int | None = None, options: Mapping[str, object] | None = None,
) -> BaseModel:
    """The report of the registered analysis ``name`` over an inclusive step range
    (``None`` = open), with ``options`` by field name (strings converted by its options
    model).

    Raises:
        StoreError: unknown analysis, undeclared or invalid option, unknown run, empty
            range.
    """
    entry = checked_analysis(name, options or {})
    return entry.run(cur, run_id, from_step, to_step, dict(options or {}))  # type: ignore[attr-defined,no-any-return]


ROUTES: tuple[Route, ...] = (
    Route("GET", "/", "_index", page=True, answer="page"),
    Route("GET", "/index.html", "_index", page=True, answer="page"),
    Route("GET", "/static/{name}", "_static", page=True, answer="static"),
    Route("GET", "/api/status", "_status"),
    Route("GET", "/api/runs", "_runs"),
    Route("GET", "/api/grid", "_read", answer="grid", read="grid", cached=True,
          build="analysis.plots.grid:load_grid",
          params=(RUN, Param("max_steps", default=1000, bounds=(1, 8192)),
                  Param("max_layers", default=400, bounds=(1, 4096)), *STEPS)),
    Route("GET", "/api/report", "_read", answer="model", read="report",
          build="analysis.report:build_report", model="analysis.report:GradientFlowSummary",
          params=(RUN, *STEPS, Param("ignore_layers", "patterns", ()),
                  Param("exclude_rounding", "flag", False), Param("order", "str", "model"),
                  Param("nonfinite_rule", "str", "critical"))),
    Route("GET", "/api/heatmap", "_read", answer="text", read="heatmap",
          build="analysis.heatmap:ascii_heatmap",
          params=(RUN, Param("max_columns", default=100, bounds=(1, 4096)), *STEPS,
                  Param("style", "str", "gradstream"))),
    Route("GET", "/api/layer", "_layer",
          params=(RUN, Param("layer", required=True),
                  Param("max_points", default=1000, bounds=(1, 8192)), *STEPS)),
    Route("GET", "/api/scalars", "_scalars",
          params=(RUN, Param("max_steps", default=1000, bounds=(1, 8192)),
                  Param("names", "patterns", ()), *STEPS)),
    Route("GET", "/api/alerts", "_alerts",
          params=(Param("run", "str"), Param("limit", default=50, bounds=(1, 1000)))),
    Route("GET", "/api/analyses", "_analyses"),
    Route("GET", "/api/analysis/{name}", "_read", answer="model", read="analysis",
          options=True, cached=True, build="analysis.read.routes:build_analysis",
          params=(RUN, *STEPS)),
    Route("GET", "/api/export", "_export", answer="download",
          params=(RUN, Param("format", "str", "csv"), *STEPS, Param("order", "str", "name"),
                  Param("style", "str", "gradstream"))),
    Route("POST", "/api/query", "_query", answer="arrow"),
)
"""Every route the server answers, in the order they are matched (the table of the module
docstring). All of them require the token."""

READS: dict[str, Route] = {route.read: route for route in ROUTES if route.read is not None}
"""The routes of :class:`~analysis.read.reader.StoreReader`'s reads, by read name."""

EXPORT: Route = next(route for route in ROUTES if route.handler == "_export")
"""The export download (``GET /api/export``)."""

QUERY: Route = next(route for route in ROUTES if route.handler == "_query")
"""The one-statement query (``POST /api/query``)."""

STATIC_FILES: dict[str, tuple[str, str]] = {
    "dashboard.js": ("analysis.dashboard", "static"),
    "dashboard.css": ("analysis.dashboard", "static"),
    "heatmap.js": ("analysis.plots", "."),
}
"""The names ``/static/{name}`` serves: name -> (package, folder in it)."""


def find(path: str) -> list[tuple[Route, str]]:
    """The routes whose path matches ``path``, with the ``{name}`` segment of each."""
    return [(route, name) for route in ROUTES if (name := route.match(path)) is not None]
