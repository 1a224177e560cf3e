"""A small, bounded cache of analysis results, shared by every registered analysis
(:meth:`analysis.registry.Analysis.run`): a dashboard or notebook that asks again for the
same run, step range and options gets the report computed before, until new rows arrive.

The key of a result is

- the store file's identity: ``(st_dev, st_ino, st_mtime_ns)`` of the file the connection
  reads (``duckdb_databases().path`` of the current database), so a file replaced or
  rewritten at the same path is another store;
- the analysis's name, the run, the inclusive step range as requested and the validated
  options (their JSON, :meth:`pydantic.BaseModel.model_dump_json`);
- the run's **row fingerprint**: ``count(*)``, ``max(step)`` and ``max(rowid)`` of its
  ``layer_stats`` rows and ``count(*)`` of its ``layers`` rows. A new step raises the
  count and the last step; a frame rewritten in place (the DuckDB output deletes a step's
  rows and appends the new ones) appends rows with new row ids, which raises
  ``max(rowid)``. One aggregate over integer columns of the run (about 0.05 s for 10 M
  rows), against seconds for the analysis itself.

A connection on a database without a file (an in-memory DuckDB, e.g. the Iceberg
reader's) has no identity: its results are never cached. The cache keeps the
:data:`RESULT_CACHE_SIZE` most recently used results (LRU) and is safe to use from the
dashboard's request threads; a cached report is returned as the same object, so callers
treat reports as read-only.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import duckdb

ResultT = TypeVar("ResultT")

RESULT_CACHE_SIZE = 32
"""Results kept (least recently used evicted first): a dashboard shows one run with a
handful of analyses and ranges at a time; 32 reports of a 1000-layer run are tens of MB,
small next to the gradient history one analysis reads."""

_FINGERPRINT_SQL = """
    SELECT (SELECT count(*) FROM layer_stats WHERE run_id = $run_id),
           (SELECT max(step) FROM layer_stats WHERE run_id = $run_id),
           (SELECT max(rowid) FROM layer_stats WHERE run_id = $run_id),
           (SELECT count(*) FROM layers WHERE run_id = $run_id)
"""

_PATH_SQL = "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"


class ResultCache:
    """An LRU map from (store, analysis, run, range, options, row fingerprint) to a result.

    Args:
        size: results kept (>= 0; 0 disables caching).

    Raises:
        ValueError: a negative ``size``.
    """

    def __init__(self, size: int = RESULT_CACHE_SIZE) -> None:
        if size < 0:
            raise ValueError(f"result cache size must be >= 0, got {size}")
        self.size = size
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Results held now."""
        return len(self._entries)

    def clear(self) -> None:
        """Drop every result (and reset :attr:`hits` and :attr:`misses`)."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def get_or_compute(
        self,
        con: duckdb.DuckDBPyConnection,
        run_id: str,
        key: Hashable,
        compute: Callable[[], ResultT],
    ) -> ResultT:
        """The cached result for ``key`` over the store and run of ``con``, or
        ``compute()`` (then kept).

        Args:
            con: the connection (or cursor) the analysis reads.
            run_id: the run (its row fingerprint is part of the key).
            key: the analysis's own part of the key (name, range, options), hashable.
            compute: builds the result; what it raises propagates and nothing is kept.

        Returns:
            The result, computed now or earlier for the same rows.
        """
        identity = store_identity(con) if self.size else None
        if identity is None:
            return compute()
        full = (identity, run_id, key, run_fingerprint(con, run_id))
        with self._lock:
            if full in self._entries:
                self._entries.move_to_end(full)
                self.hits += 1
                return self._entries[full]  # type: ignore[return-value]
            self.misses += 1
        result = compute()
        with self._lock:
            self._entries[full] = result
            self._entries.move_to_end(full)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return result


def store_identity(con: duckdb.DuckDBPyConnection) -> tuple[int, int, int] | None:
    """``(st_dev, st_ino, st_mtime_ns)`` of the file behind ``con``'s current database, or
    ``None`` for a database without a file (in-memory) or a file that cannot be stat'ed."""
    rows = con.execute(_PATH_SQL).fetchall()
    path = rows[0][0] if rows else None
    if not path:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_mtime_ns)


def run_fingerprint(
    con: duckdb.DuckDBPyConnection, run_id: str
) -> tuple[int, int | None, int | None, int]:
    """``(rows, last step, largest row id)`` of the run's ``layer_stats`` rows and the
    count of its ``layers`` rows: what changes when rows are added or rewritten."""
    count, last, rowid, layers = con.execute(_FINGERPRINT_SQL, {"run_id": run_id}).fetchall()[0]
    return (int(count), last, rowid, int(layers))


RESULTS = ResultCache()
"""The process's result cache, used by every registered analysis."""
