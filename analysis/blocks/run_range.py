"""The preamble every analysis's build runs first: check the step range, resolve the run,
and apply the report's explicit exclusion (:func:`analysis.read.exclusion.run_exclusion`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from analysis.read.connect import require_run
from analysis.read.exclusion import Exclusion, run_exclusion
from analysis.read.sql import stats_params

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb


@dataclass(frozen=True)
class RunRange:
    """One stored run's inclusive step range, checked.

    Attributes:
        params: the named parameters of :data:`analysis.read.sql.STATS_SQL` and
            :func:`analysis.read.sql.step_range` (``run_id``, ``from_step``, ``to_step``).
        exclusion: the layers the run's ``ignore_layers`` and the reader's patterns match.
    """

    params: dict[str, object]
    exclusion: Exclusion

    def report_header(self) -> dict[str, Any]:
        """The run, range and exclusion fields of a report over this range, as keyword
        arguments of its model: ``run_id``, ``from_step``, ``to_step`` (as requested),
        ``ignore_layers`` (the exclusion's patterns) and ``layers_excluded`` (the run's
        layers they match, model order)."""
        return {
            "run_id": self.params["run_id"],
            "from_step": self.params["from_step"],
            "to_step": self.params["to_step"],
            "ignore_layers": self.exclusion.patterns,
            "layers_excluded": self.exclusion.names,
        }


def open_run_range(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    ignore_layers: Sequence[str] = (),
) -> RunRange:
    """Check ``from_step``/``to_step``, check that ``run_id`` is stored, and resolve the
    exclusion.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store` (or a cursor).
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``.

    Raises:
        StoreError: invalid step range, or unknown run.
    """
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    return RunRange(params, run_exclusion(con, run_id, ignore_layers))
