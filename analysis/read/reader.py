"""The one way to read the store, whether or not another process writes it.

DuckDB lets one process open a database file for writing, and while it does no other
process can open the file, not even read-only. :func:`open_reader` therefore returns one
of two :class:`StoreReader` implementations with the same methods and the same results:

- :class:`FileReader` when the file is free: ``duckdb.connect(path, read_only=True)``,
  hardened (:func:`analysis.read.query.harden`: no file access outside the store, locked
  configuration), and the analysis builders (``build_report``, ``ascii_heatmap``, the
  registered analyses, ``load_grid``, ``export_run``) run on it in this process;
- :class:`EndpointReader` when another process holds the file and advertises a live
  endpoint in ``<db>.serve.json`` (:mod:`analysis.read.sidecar`): the same builders
  run in that process, on its hardened read-only cursors
  (:class:`analysis.read.cursors.ReadCursors`), and the results come back over HTTP
  (:mod:`analysis.read.endpoint_codec`: Arrow IPC for tables and grids, the pydantic JSON for
  reports).

A store named by a URL (``iceberg+...``, :mod:`analysis.read.store_url`) is opened by the
reader of its kind (:class:`analysis.read.iceberg.IcebergReader`, a ``FileReader`` on the
table set's snapshot).

With the file held and no live endpoint, :func:`open_reader` raises
:class:`~analysis.read.query.StoreHeldError`, a :class:`~analysis.read.connect.StoreError` that says
what to do. Every read, on either path, is one statement or one builder call under one
time limit (:func:`analysis.read.query.resolve_timeout`: ``timeout_s``, else
``GRADSTREAM_QUERY_TIMEOUT_S``, else 60 s).

Each read but ``sql`` and ``export`` is a route of :data:`analysis.read.routes.READS`, made
by the one method :meth:`StoreReader.read`: a file reader runs the route's builder, an
endpoint reader asks the route and decodes the answer.

Example::

    with open_reader("gradstream.duckdb") as reader:
        run = reader.resolve_run(None)            # the only run, or raises
        table = reader.sql("SELECT * FROM frames WHERE run_id = $run", {"run": run})
        summary = reader.report(run)
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from analysis.read.connect import (
    TABLE_EXISTS_SQL,
    StoreError,
    StoreLockedError,
    open_store,
    pick_run,
)
from analysis.read.query import (
    ARROW_STREAM,
    Params,
    QueryError,
    QueryTimeoutError,
    ReadOnlyViolationError,
    ReadRefusedError,
    StoreHeldError,
    execute_read_only,
    harden,
    resolve_timeout,
    time_limit,
)
from analysis.read.routes import EXPORT, QUERY, READS, Route, checked_analysis
from analysis.read.sidecar import ServeInfo, read_sidecar
from analysis.read.store_url import open_url_reader, store_url_scheme

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa
    from pydantic import BaseModel

    from analysis.export import Progress
    from analysis.plots.grid import GradientGrid
    from analysis.report import GradientFlowSummary

T = TypeVar("T")

VIA_FILE = "read-only file"
""":attr:`StoreReader.via` of a :class:`FileReader`."""

CLIENT_SLACK_S = 30.0
"""Seconds an :class:`EndpointReader` waits for an answer beyond the read's time limit
(the server interrupts the read at the limit and still has to answer)."""

DOWNLOAD_CHUNK_BYTES = 1 << 20
"""Bytes copied per write when an export is downloaded from an endpoint."""


class StoreReader(ABC):
    """Read access to one gradstream store (see the module docstring).

    Attributes:
        db: the store's file, or its URL (a ``str``, password hidden; e.g. an Iceberg table
            set, :mod:`analysis.read.store_url`).
        via: how reads are answered: ``"read-only file"``, ``"gradstream <command> (pid
            N) at <url>"`` or ``"Iceberg snapshot ..."``.
        timeout_s: the time limit of each read, seconds.

    Every method raises :class:`~analysis.read.connect.StoreError` (or a subclass) with a one-line
    message: unknown or ambiguous run, invalid range, refused statement
    (:class:`~analysis.read.query.ReadOnlyViolationError`,
    :class:`~analysis.read.query.ReadRefusedError`), time limit reached
    (:class:`~analysis.read.query.QueryTimeoutError`), endpoint gone. Use it as a context
    manager, or call :meth:`close`.
    """

    db: Path | str
    via: str
    timeout_s: float

    @abstractmethod
    def sql(
        self, sql: str, params: Params | None = None, timeout_s: float | None = None
    ) -> pa.Table:
        """Run one read-only SQL statement.

        Args:
            sql: exactly one statement (tables: runs, layers, layer_stats, frames, alerts,
                run_ranks, kafka_offsets, step_scalars, rank_scalars, ...).
            params: the statement's parameters: by name (``{"run": ...}`` for ``$run``) or
                by position (a list, for ``?``); JSON-representable values.
            timeout_s: time limit of this statement (``None``: :attr:`timeout_s`).

        Returns:
            The rows as a ``pyarrow.Table`` (DuckDB's column names and types; no columns
            for a statement without a result set).
        """

    def has_table(self, table: str) -> bool:
        """Whether the store has ``table`` (one statement,
        :data:`analysis.read.connect.TABLE_EXISTS_SQL`): a store written before an optional
        table existed, and never opened by a newer writer, lacks it."""
        found = self.sql(TABLE_EXISTS_SQL, {"table": table})
        return bool(found.num_rows and found.column("n")[0].as_py())

    def run_ids(self) -> list[str]:
        """Every run id of the store, ascending (code-point order)."""
        table = self.sql("SELECT run_id FROM runs ORDER BY run_id")
        return [str(r) for r in table.column("run_id").to_pylist()]

    def resolve_run(self, run: str | None) -> str:
        """The run meant by ``run``: an exact id, a prefix of exactly one id, or ``None`` for
        the store's only run (:func:`analysis.read.connect.pick_run`).

        Raises:
            StoreError: unknown run, ambiguous prefix, or no/several runs with ``None``
                (the message lists the candidates).
        """
        return pick_run(self.run_ids(), run)

    @abstractmethod
    def read(self, route: Route, run_id: str, name: str = "", **values: object) -> Any:
        """The read of ``route`` (a route of :data:`analysis.read.routes.READS`) for
        ``run_id``: its builder's result, built in this process or by the endpoint.

        Args:
            route: which read.
            run_id: the run.
            name: the analysis of an ``options`` route.
            values: the route's other parameters by name (``None`` = default).

        Raises:
            StoreError: see the class docstring.
        """

    def report(
        self, run_id: str, from_step: int | None = None, to_step: int | None = None,
        ignore_layers: Sequence[str] = (), exclude_rounding: bool = False,
        order: str = "model", nonfinite_rule: str = "critical",
    ) -> GradientFlowSummary:
        """The run's summary (:func:`analysis.report.build_report`) over the inclusive step
        range ``[from_step, to_step]`` (``None`` = open); ``ignore_layers`` (patterns added to
        the run's own), ``exclude_rounding``, ``order`` (of the layer lists: ``model`` or
        ``name``, the reference's) and ``nonfinite_rule`` (``critical`` or ``reference``,
        ``schemas.health.NONFINITE_VERDICTS``) as there."""
        return self.read(READS["report"], run_id, from_step=from_step, to_step=to_step,
                         ignore_layers=tuple(ignore_layers), exclude_rounding=exclude_rounding,
                         order=order, nonfinite_rule=nonfinite_rule)  # type: ignore[no-any-return]

    def heatmap(
        self, run_id: str, max_columns: int = 100, from_step: int | None = None,
        to_step: int | None = None, style: str = "gradstream",
    ) -> str:
        """The ASCII flow-intensity heatmap (:func:`analysis.heatmap.ascii_heatmap`), at most
        ``max_columns`` step columns; ``style="reference"`` draws the reference's layout
        exactly (name order, one column per frame)."""
        return self.read(READS["heatmap"], run_id, max_columns=max_columns,  # type: ignore[no-any-return]
                         from_step=from_step, to_step=to_step, style=style)

    def analysis(
        self, name: str, run_id: str, from_step: int | None = None, to_step: int | None = None,
        options: Mapping[str, str] | None = None,
    ) -> BaseModel:
        """The report of the registered analysis ``name`` (:mod:`analysis.registry`).

        Args:
            options: option values by field name, as strings (validated by the analysis's
                options model); an option it does not declare raises ``StoreError``.

        Raises:
            StoreError: unknown analysis, invalid option, unknown run, empty range.
        """
        return self.read(READS["analysis"], run_id, name, from_step=from_step,  # type: ignore[no-any-return]
                         to_step=to_step, options=dict(options or {}))

    def grid(
        self, run_id: str, max_steps: int = 1000, max_layers: int = 400,
        from_step: int | None = None, to_step: int | None = None,
    ) -> GradientGrid:
        """The run's layers x steps grid (:func:`analysis.plots.grid.load_grid`), at most
        ``max_layers x max_steps`` cells (an endpoint caps them at 4096 x 8192)."""
        return self.read(READS["grid"], run_id, max_steps=max_steps,  # type: ignore[no-any-return]
                         max_layers=max_layers, from_step=from_step, to_step=to_step)

    @abstractmethod
    def export(
        self, run_id: str, fmt: str, path: str | os.PathLike[str], from_step: int | None = None,
        to_step: int | None = None, order: str = "name", progress: Progress | None = None,
        style: str = "gradstream",
    ) -> int:
        """Write the run in ``fmt`` (csv, json, parquet, jsonl) to ``path``
        (:func:`analysis.export.export_run`; parent directories created); ``style``: see
        :data:`analysis.export.Style` (csv and json).

        Returns:
            Rows written (frames for ``json``).
        """

    @abstractmethod
    def close(self) -> None:
        """Release the connection (a :class:`FileReader`'s file lock); idempotent."""

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {str(self.db)!r} via {self.via}>"


class FileReader(StoreReader):
    """Reads on the store's file opened ``read_only=True`` and hardened, in this process.

    Args:
        db: the store's file.
        timeout_s: time limit of each read (``None``: :func:`~analysis.read.query.resolve_timeout`).

    Each read runs on a new cursor of the connection, interrupted at the limit, so one
    reader may serve several threads.

    Raises:
        StoreLockedError: another process (or this one, read-write) holds the file.
        StoreError: missing file, not a gradstream store; QueryError: invalid time limit.
    """

    def __init__(self, db: str | os.PathLike[str], timeout_s: float | None = None) -> None:
        self.db = Path(db)
        self.via = VIA_FILE
        self.timeout_s = resolve_timeout(timeout_s)
        self._con: duckdb.DuckDBPyConnection | None = open_store(self.db, read_only=True)
        harden(self._con)

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """A new cursor of the connection, on which one read runs (the caller closes it).

        Raises:
            StoreError: the reader is closed.
        """
        if self._con is None:
            raise StoreError(f"the reader of {str(self.db)!r} is closed")
        return self._con.cursor()

    def _call(self, work: Callable[[duckdb.DuckDBPyConnection], T],
              timeout_s: float | None = None) -> T:
        """``work(cursor)`` on a new cursor, under the time limit; DuckDB errors classified."""
        cur = self._cursor()
        try:
            with time_limit(cur, self.timeout_s if timeout_s is None else
                            resolve_timeout(timeout_s)):
                return work(cur)
        finally:
            cur.close()

    def sql(
        self, sql: str, params: Params | None = None, timeout_s: float | None = None
    ) -> pa.Table:
        """See :meth:`StoreReader.sql`."""
        limit = self.timeout_s if timeout_s is None else resolve_timeout(timeout_s)
        cur = self._cursor()
        try:
            return execute_read_only(cur, sql, limit, params)
        finally:
            cur.close()

    def read(self, route: Route, run_id: str, name: str = "", **values: object) -> Any:
        """See :meth:`StoreReader.read` (the route's builder on a cursor of the file)."""
        if route.options:
            checked_analysis(name, dict(values.get("options") or {}))  # type: ignore[call-overload]
        return self._call(lambda cur: route.run(cur, name, {"run": run_id, **values}))

    def export(
        self, run_id: str, fmt: str, path: str | os.PathLike[str], from_step: int | None = None,
        to_step: int | None = None, order: str = "name", progress: Progress | None = None,
        style: str = "gradstream",
    ) -> int:
        """See :meth:`StoreReader.export`."""
        from analysis.export import export_run

        try:
            return self._call(lambda cur: export_run(
                cur, run_id, path, fmt, from_step, to_step, order, progress,
                style))  # type: ignore[arg-type]
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    def close(self) -> None:
        """See :meth:`StoreReader.close`."""
        if self._con is not None:
            self._con.close()
            self._con = None


_ERROR_KINDS: dict[str, type[StoreError]] = {
    "read_only": ReadOnlyViolationError,
    "refused": ReadRefusedError,
    "timeout": QueryTimeoutError,
}
"""Error ``kind`` of an endpoint's JSON error body -> the exception raised here (any other
kind, e.g. ``invalid`` or ``not_found``: :class:`~analysis.read.query.QueryError`, a
``StoreError``)."""


class EndpointReader(StoreReader):
    """Reads answered by the process that holds the store, over its loopback endpoint.

    Args:
        db: the store's file.
        info: the live sidecar of the process (URL, token, pid, command).
        timeout_s: time limit of each read (``None``: :func:`~analysis.read.query.resolve_timeout`);
            sent to the server, which keeps the smaller of it and its own limit.
    """

    def __init__(
        self, db: str | os.PathLike[str], info: ServeInfo, timeout_s: float | None = None
    ) -> None:
        self.db = Path(db)
        self.info = info
        self.via = f"gradstream {info.command} (pid {info.pid}) at {info.url}"
        self.timeout_s = resolve_timeout(timeout_s)

    def _open(
        self, route: str, query: Mapping[str, object] | None = None,
        body: dict[str, object] | None = None, accept: str = "application/json",
        timeout_s: float | None = None,
    ) -> Any:
        """Send a request to ``route``; returns the open response (the caller closes it).

        Raises:
            StoreError (by error kind) / QueryError: the server's refusal, or it is gone.
        """
        limit = self.timeout_s if timeout_s is None else resolve_timeout(timeout_s)
        fields = {k: str(v) for k, v in (query or {}).items() if v is not None}
        fields["timeout_s"] = repr(limit)
        url = f"{self.info.url}{route}?{urllib.parse.urlencode(fields)}"
        headers = {"Accept": accept, "Authorization": f"Bearer {self.info.token}"}
        data = None
        if body is not None:
            data = json.dumps(body | {"timeout_s": limit}).encode("utf-8")
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers,
                                         method="POST" if data is not None else "GET")
        try:
            return urllib.request.urlopen(request, timeout=limit + CLIENT_SLACK_S)
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read().decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                detail = {"error": f"HTTP {exc.code} {exc.reason}", "kind": "error"}
            error = _ERROR_KINDS.get(str(detail.get("kind")), QueryError)
            raise error(str(detail.get("error", f"HTTP {exc.code}"))) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise QueryError(
                f"{self.via} holds the store {str(self.db)!r} but does not answer: {reason}"
            ) from None

    def _get(self, route: str, query: Mapping[str, object] | None = None,
             accept: str = "application/json", timeout_s: float | None = None,
             body: dict[str, object] | None = None) -> bytes:
        with self._open(route, query, body, accept, timeout_s) as response:
            try:
                return response.read()
            except OSError as exc:
                raise QueryError(f"{self.via} stopped answering: {exc}") from None

    def sql(
        self, sql: str, params: Params | None = None, timeout_s: float | None = None
    ) -> pa.Table:
        """See :meth:`StoreReader.sql` (``POST /api/query``, Arrow IPC back)."""
        from analysis.read.endpoint_codec import table_from_ipc

        payload: dict[str, object] = {"sql": sql}
        if params:
            payload["params"] = params
        return table_from_ipc(self._get(QUERY.path, accept=ARROW_STREAM,
                                        timeout_s=timeout_s, body=payload))

    def read(self, route: Route, run_id: str, name: str = "", **values: object) -> Any:
        """See :meth:`StoreReader.read` (``GET`` the route; the answer decoded as
        :attr:`~analysis.read.routes.Route.answer` says: a pydantic model, text or a grid)."""
        from analysis.read.endpoint_codec import MODEL_JSON, model_from_json, table_from_ipc

        if route.options:
            checked_analysis(name, dict(values.get("options") or {}))  # type: ignore[call-overload]
        query = route.query({"run": run_id, **values})
        accept = {"model": MODEL_JSON, "grid": ARROW_STREAM}.get(route.answer, "text/plain")
        body = self._get(route.url(name), query, accept)
        if route.answer == "model":
            return model_from_json(route.model_type(name), body)
        if route.answer == "grid":
            from analysis.plots.grid import GradientGrid

            return GradientGrid.from_arrow(table_from_ipc(body))
        return body.decode("utf-8")

    def export(
        self, run_id: str, fmt: str, path: str | os.PathLike[str], from_step: int | None = None,
        to_step: int | None = None, order: str = "name", progress: Progress | None = None,
        style: str = "gradstream",
    ) -> int:
        """See :meth:`StoreReader.export` (``GET /api/export``, streamed to ``<path>.part``
        and renamed when complete); ``progress`` gets the fraction of bytes received."""
        from analysis.export import written_atomically

        target = Path(path)
        if target.is_dir():
            raise StoreError(f"output path {str(target)!r} is a directory")
        query = EXPORT.query({"run": run_id, "format": fmt, "order": order,
                              "from_step": from_step, "to_step": to_step, "style": style})
        failure = f"export through {self.via} failed"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{failure}: {exc}") from None
        with written_atomically(target, failure) as part, \
                self._open(EXPORT.path, query, accept="*/*") as response, \
                part.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            rows = int(response.headers.get("X-Gradstream-Rows") or 0)
            done = 0
            while chunk := response.read(DOWNLOAD_CHUNK_BYTES):
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done / total if total else None)
        if progress is not None:
            progress(1.0)
        return rows

    def close(self) -> None:
        """Nothing to release (each read is one HTTP request)."""


def open_reader(db: str | os.PathLike[str], timeout_s: float | None = None) -> StoreReader:
    """A reader of the store ``db``: its file when free, else the endpoint of the process
    that holds it; or, for a store URL, that URL's reader.

    Args:
        db: the DuckDB file written by the consumer's sink, or a store URL as a ``str``
            (:mod:`analysis.read.store_url`: ``iceberg+sqlite:////abs/catalog.db?warehouse=
            file:///abs/wh``, an Apache Iceberg table set, :mod:`analysis.read.iceberg`).
        timeout_s: time limit of each read, seconds (``None``:
            ``GRADSTREAM_QUERY_TIMEOUT_S``, else 60).

    Returns:
        A :class:`FileReader`, an :class:`EndpointReader` or the reader of the URL's kind
        (:data:`analysis.read.store_url.STORE_URL_SCHEMES`); the caller closes it.

    Raises:
        StoreHeldError: another process holds the file and advertises no live endpoint.
        StoreError: missing file, not a gradstream store, a store URL that cannot be read
            (the message says what to do); QueryError: invalid time limit.
    """
    if store_url_scheme(db) is not None:
        return open_url_reader(os.fspath(db), timeout_s)
    file = Path(db)
    try:
        return FileReader(file, timeout_s)
    except StoreLockedError:
        info = read_sidecar(file)
        if info is None:
            raise StoreHeldError(
                f"the store {str(file)!r} is held by another process that answers no reads "
                f"(no live endpoint in {file.name}.serve.json). Wait for it to finish or stop "
                "it, or run the writer with its read endpoint (e.g. `gradstream serve`)."
            ) from None
        return EndpointReader(file, info, timeout_s)
