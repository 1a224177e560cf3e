"""The layers a reader of one run leaves out of the verdict by explicit setting
(``ignore_layers`` patterns: the run's own and the reader's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import duckdb

from analysis.read.connect import has_column
from schemas.health import match_layers


@dataclass(frozen=True)
class Exclusion:
    """The layers a reader of one run leaves out of the verdict by explicit setting: their
    vanishing and exploding flags count nowhere (a NaN/Inf gradient still counts). The one
    definition used by ``gradstream report`` (:func:`analysis.report.build_report`) and
    every analysis (:func:`analysis.blocks.gradient_arrays.load_history`, the explosion analysis).

    Attributes:
        run_patterns: the run's own patterns (``runs.ignore_layers``: ``start_run(...,
            ignore_layers=...)`` and the consumer's ``--ignore-layers``), as stored.
        given_patterns: the reader's own patterns (``report --ignore-layers``, ``analyze
            --ignore-layers``, ``GRADSTREAM_IGNORE_LAYERS``) not already among the run's.
        layer_index: ascending indices of the layers any pattern matches.
        names: their names, model order.
        by_run: for each of those layers, whether a run pattern matches it (else only a
            given pattern does).
    """

    run_patterns: list[str] = field(default_factory=list)
    given_patterns: list[str] = field(default_factory=list)
    layer_index: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    by_run: list[bool] = field(default_factory=list)

    @property
    def patterns(self) -> list[str]:
        """Every pattern applied: the run's, then the given ones."""
        return [*self.run_patterns, *self.given_patterns]

    @property
    def names_by_run(self) -> list[str]:
        """Excluded layers that a run pattern matches (model order)."""
        return [n for n, r in zip(self.names, self.by_run, strict=True) if r]

    @property
    def names_by_given(self) -> list[str]:
        """Excluded layers that only a given pattern matches (model order)."""
        return [n for n, r in zip(self.names, self.by_run, strict=True) if not r]


def run_exclusion(
    con: duckdb.DuckDBPyConnection, run_id: str, ignore_layers: Sequence[str] = ()
) -> Exclusion:
    """The layers of a run excluded by its own ``runs.ignore_layers`` and by
    ``ignore_layers`` (:class:`Exclusion`; patterns as in
    :func:`schemas.health.match_layers`).

    Args:
        con: a store connection. run_id: an existing run.
        ignore_layers: the reader's patterns, added to the run's own.

    Returns:
        The :class:`Exclusion`; empty without patterns (then no query of the layers).
    """
    stored: list[str] = []
    if has_column(con, "runs", "ignore_layers"):
        row = con.execute("SELECT coalesce(ignore_layers, []) FROM runs WHERE run_id = $r",
                          {"r": run_id}).fetchone()
        stored = list(dict.fromkeys(row[0])) if row else []
    given = [p for p in dict.fromkeys(ignore_layers) if p not in stored]
    if not stored and not given:
        return Exclusion()
    rows = con.execute(
        "SELECT layer_index, name FROM layers WHERE run_id = $r ORDER BY layer_index",
        {"r": run_id},
    ).fetchall()
    names = [name for _, name in rows]
    hit = match_layers(names, [*stored, *given]).tolist()
    by_run = match_layers(names, stored).tolist()
    chosen = [(i, n, r) for (i, n), h, r in zip(rows, hit, by_run, strict=True) if h]
    return Exclusion(stored, given, [i for i, _, _ in chosen], [n for _, n, _ in chosen],
                     [r for _, _, r in chosen])


def split_patterns(text: str) -> tuple[str, ...]:
    """Comma-separated layer-name patterns as a tuple, surrounding blanks and empty items
    dropped: the ``ignore_layers`` option of the analyses (one string, so that it travels
    as one query parameter of ``/api/analysis/<name>``), written as
    ``GRADSTREAM_IGNORE_LAYERS`` is."""
    return tuple(p.strip() for p in text.split(",") if p.strip())
