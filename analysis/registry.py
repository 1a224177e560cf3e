"""The analyses of a stored run, registered in one place: ``gradstream analyze`` and the
dashboard's ``/api/analyses`` and ``/api/analysis/<name>`` are generic over this list.

An analysis is one folder, ``analysis/analyses/<name>/``, whose ``__init__.py`` ends with
an :class:`Analysis` entry named ``ANALYSIS``:

- ``name`` and ``help``: the ``--kind`` value and a one-line description;
- ``options``: a frozen pydantic model whose fields are the analysis's options, each with a
  default and its constraints (``window: int = Field(50, ge=1)``);
- ``build(con, run_id, from_step, to_step, options)``: reads the store through ``con`` and
  returns a pydantic report model (what ``--format json`` and the dashboard serialise);
- ``render(report)``: the report as a rich renderable (``--format table``).

How to add an analysis
----------------------

1. Write the folder ``analysis/analyses/<name>/`` in the shape of the others
   (:mod:`analysis.analyses`): ``models.py`` (the pydantic report models), ``render.py``
   (the rich rendering), modules only it needs (``compute.py``, ``load.py``,
   ``reference.py``), and ``__init__.py`` with the options model, the build function and
   ``ANALYSIS = Analysis(name="<name>", help=..., options=..., build=..., render=...)``.
   What more than one analysis uses comes from :mod:`analysis.blocks`.
2. Add one line ``"<name>": "analysis.analyses.<name>",`` to :data:`ANALYSES` below.

Nothing else changes: ``gradstream analyze --kind <name>`` accepts it, its options are set
with the existing flags whose names match its fields (``--window``, ``--alpha``,
``--threshold``, ``--interaction-window``, ``--color-scheme``, ``--ignore-layers``: the
``ignore_layers`` field, patterns joined by commas) or with ``--option field=value``,
and the dashboard serves it at ``GET /api/analysis/<name>?run=...&field=...``.

Option values arrive as one flat mapping (every flag of the command line, or every query
parameter of the request); :meth:`Analysis.options_from` keeps the fields its own model
declares and validates them, so one vocabulary of option names serves every analysis.

The registry maps names to module paths and imports a module only when its entry is asked
for (:func:`get`): the analyses pull in NumPy, SciPy, pydantic and DuckDB, which ``gradstream
--help`` must not pay for. This module itself imports only the standard library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import duckdb
    from pydantic import BaseModel
    from rich.console import RenderableType

OptionsT = TypeVar("OptionsT", bound="BaseModel")
ReportT = TypeVar("ReportT", bound="BaseModel")

ANALYSES: dict[str, str] = {
    "flow": "analysis.analyses.flow",
    "enhanced": "analysis.analyses.enhanced",
    "explosion": "analysis.analyses.explosion",
    "weights": "analysis.analyses.weights",
}
"""Registered analyses in display order: name -> module whose ``ANALYSIS`` is the entry."""


class UnknownAnalysisError(LookupError):
    """No analysis of that name is registered (the dashboard answers 404)."""


@dataclass(frozen=True)
class Analysis(Generic[OptionsT, ReportT]):
    """One registered analysis (see the module docstring for the contract).

    Attributes:
        name: registry key and ``--kind`` value (lower case, no spaces).
        help: one sentence for ``gradstream analyze --help`` and ``GET /api/analyses``.
        options: pydantic model class of the options; every field has a default, so
            ``options()`` is the default configuration.
        build: ``(con, run_id, from_step, to_step, options) -> report``; ``con`` is a
            DuckDB connection or cursor on the store, the step range is inclusive (``None``
            = open). Raises ``analysis.read.connect.StoreError`` (unknown run, empty range, missing
            data) or ``ValueError`` (a value out of range).
        render: ``report -> rich renderable`` for the terminal.
    """

    name: str
    help: str
    options: type[OptionsT]
    build: Callable[[duckdb.DuckDBPyConnection, str, int | None, int | None, OptionsT], ReportT]
    render: Callable[[ReportT], RenderableType]

    @property
    def option_names(self) -> tuple[str, ...]:
        """Field names of :attr:`options`, in declaration order."""
        return tuple(self.options.model_fields)

    def options_from(self, values: Mapping[str, object]) -> OptionsT:
        """Validate the entries of ``values`` that :attr:`options` declares.

        Other keys are ignored (they belong to other analyses). Strings are converted
        (pydantic's lax mode: ``"5"`` -> 5), so query parameters can be passed as they are.

        Args:
            values: option name -> value.

        Returns:
            The options model; fields absent from ``values`` keep their defaults.

        Raises:
            ValueError: a value fails its field's type or constraint; the message names
                the analysis, the field and the rule (``invalid flow options: window: Input
                should be greater than or equal to 1``).
        """
        from pydantic import ValidationError

        own = {k: v for k, v in values.items() if k in self.options.model_fields}
        try:
            return self.options.model_validate(own)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"invalid {self.name} options: {problems}") from None

    def run(
        self,
        con: duckdb.DuckDBPyConnection,
        run_id: str,
        from_step: int | None,
        to_step: int | None,
        values: Mapping[str, object],
    ) -> ReportT:
        """:meth:`options_from` ``values``, then :attr:`build` the report, or return the
        report built before for the same store, run, range and options while the run has
        no new or rewritten rows (:data:`analysis.read.result_cache.RESULTS`: one bounded
        LRU cache for every analysis; the returned report is shared, treat it as
        read-only).

        Raises:
            ValueError: an invalid option (or what :attr:`build` raises).
            analysis.read.connect.StoreError: see :attr:`build`.
        """
        from analysis.read.result_cache import RESULTS

        options = self.options_from(values)
        key = (self.name, from_step, to_step, options.model_dump_json())
        return RESULTS.get_or_compute(
            con, run_id, key, lambda: self.build(con, run_id, from_step, to_step, options)
        )


def get(name: str) -> Analysis[Any, Any]:
    """The registered analysis ``name``, importing its module on first use.

    Raises:
        UnknownAnalysisError: ``name`` is not in :data:`ANALYSES`.
        TypeError: the module's ``ANALYSIS`` is missing, not an :class:`Analysis`, or
            carries another name (a registration mistake, caught by the tests).
    """
    module_path = ANALYSES.get(name)
    if module_path is None:
        raise UnknownAnalysisError(
            f"no analysis {name!r}; registered: {', '.join(ANALYSES)}"
        )
    entry = getattr(importlib.import_module(module_path), "ANALYSIS", None)
    if not isinstance(entry, Analysis) or entry.name != name:
        raise TypeError(f"{module_path}.ANALYSIS must be an Analysis named {name!r}")
    return entry


def all_analyses() -> list[Analysis[Any, Any]]:
    """Every registered analysis, in :data:`ANALYSES` order (imports them all)."""
    return [get(name) for name in ANALYSES]
