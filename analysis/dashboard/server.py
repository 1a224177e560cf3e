"""The dashboard and read endpoint of a store: a Starlette application served by uvicorn on
a background thread.

The routes are those of :data:`analysis.read.routes.ROUTES` (the table, with each
route's parameters, is documented there); each names the :class:`Dashboard` method that
answers it. Every read runs on a worker thread of the server's pool with a fresh
read-only cursor of :class:`~analysis.read.cursors.ReadCursors` (the event loop only
routes), so a long read never blocks another request.

Access (the convention of Jupyter): the server holds one secret token (``gradstream serve``
and ``demo`` print ``http://HOST:PORT/?token=...``; ``<db>.serve.json`` holds it). A
request is answered when it carries the token as

- ``Authorization: Bearer <token>`` (scripts, :class:`analysis.read.reader.EndpointReader`), or
- the cookie :func:`cookie_name` (``gradstream-token-<port>``: cookies are shared by every
  port of a host, so each server names its own), which a page URL carrying
  ``?token=<token>`` sets (``HttpOnly; SameSite=Strict; Path=/``) before redirecting
  (303) to the same URL without the token, so the token leaves the address bar and
  history. The browser then sends the cookie with the page's own requests.

One middleware, :class:`TokenRequired`, applies these rules to every request before
routing. Tokens are compared with :func:`hmac.compare_digest`. Anything else (no token, a
wrong one, an unknown path) is refused with 401: a JSON error on ``/api/``, a short HTML
page saying where the URL is elsewhere. ``?token=`` is accepted on pages only, not on
``/api/`` (a script sends the header).

Every ``/api/`` read runs under one time limit: the server's ``query_timeout_s``, or the
request's ``timeout_s`` (query parameter or JSON field) when smaller. A route whose answer
is a pydantic model (``/api/report``, ``/api/analysis/<name>``) answers ``Accept:``
:data:`~analysis.read.endpoint_codec.MODEL_JSON` with the exact report (NaN kept), which
:class:`analysis.read.reader.EndpointReader` rebuilds.

Errors are JSON ``{"error": message, "kind": ...}`` with 400 (bad argument), 401
(``unauthorized``: no or wrong token), 403 (``read_only``: a write refused; ``refused``: a
file outside the store; ``forbidden``: a foreign Host/Origin), 404 (also an unknown run or
analysis), 405 (a route asked with another method), 408 (``timeout``: the read reached its
time limit), 413, 415, 503 (store closed).

Served on loopback by default. With a loopback bind the server also rejects requests
whose ``Host`` header is not a loopback name (DNS-rebinding defence) and cross-origin
requests (:class:`LoopbackOnly`); pages get a Content-Security-Policy allowing only their
own scripts.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from html import escape
from http import HTTPStatus
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, urlencode, urlsplit

import anyio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount
from starlette.routing import Route as StarletteRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from analysis.dashboard import api
from analysis.export import export_run, file_stem
from analysis.plots.colors import FLAG_COLORS, HEALTH_COLORS, LOSS_COLOR, norm_palette
from analysis.plots.page_json import page_json
from analysis.presentation import EXPORT_FORMATS
from analysis.read.connect import StoreError
from analysis.read.cursors import ReadCursors, StoreClosedError
from analysis.read.endpoint_codec import MODEL_JSON, model_to_json, table_to_ipc
from analysis.read.query import (
    ARROW_STREAM,
    QueryError,
    QueryTimeoutError,
    ReadOnlyViolationError,
    ReadRefusedError,
    execute_read_only,
    time_limit,
)
from analysis.read.routes import ROUTES, STATIC_FILES, NotFoundError, ParamError, Route, find
from analysis.read.sidecar import TOKEN_CHARS, sidecar_path
from schemas.flags import FLAG_BITS

REQUEST_THREADS = 256
"""Requests of the route table answered or waiting at once, each on its own worker
thread (:meth:`Dashboard._endpoint`). A read beyond the cursor provider's bound (``serve
--max-readers``) waits for a slot inside its thread, so this bounds queued requests, not the
load on the store; it is separate from the pool of anyio's default limiter (40 threads) that
serves the static files, so queued reads never hold up the page."""

log = logging.getLogger("gradstream.dashboard")

MAX_QUERY_BODY = 1 << 20
"""Largest accepted ``/api/query`` request body, bytes."""

CACHE_ENTRIES = 64
"""Grid and analysis responses kept (a few per open page); each is recomputed only when
its run's frames change (see :meth:`Dashboard.cached`)."""

STOP_GRACE_S = 5.0
"""Seconds :meth:`DashboardServer.stop` lets requests in flight finish."""

TOKEN_PARAM = "token"
"""Query parameter of a page URL that carries the token (``/?token=...``)."""

_FINGERPRINT_SQL = """
    SELECT count(*), max(step), sum(finalized_at) FROM frames WHERE run_id = $run_id
"""
_MEDIA = {
    "csv": "text/csv; charset=utf-8",
    "json": "application/json",
    "parquet": "application/vnd.apache.parquet",
    "jsonl": "application/x-ndjson",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gradstream: token required</title></head>
<body><h1>This gradstream dashboard needs its token</h1>
<p>Open the URL printed by <code>gradstream serve</code> (or <code>gradstream demo</code>)
when it started, <code>http://HOST:PORT/?{param}=...</code>: it lets this browser in until
it closes.</p>
<p>Lost it? {lost}</p>
</body></html>
"""
"""The page answered (401) to a browser without the token; ``{lost}``: where else the token
is (:data:`_LOST_IN_SIDECAR` or :data:`_LOST_NO_SIDECAR`)."""
_LOST_IN_SIDECAR = """The token is the <code>token</code> field of <code>{sidecar}</code>, the
file beside the store (readable only by its owner): open this page's address with
<code>?{param}=</code> and that value."""
_LOST_NO_SIDECAR = """A store named by a URL has no file beside it to hold the token: restart
<code>gradstream serve</code> with a token you choose (<code>GRADSTREAM_TOKEN</code>) and open
this page's address with <code>?{param}=</code> and that value."""
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
_JSON = "application/json; charset=utf-8"


def cookie_name(port: int) -> str:
    """Name of the cookie holding the token of the server on ``port``:
    ``gradstream-token-<port>``. Browsers share cookies between every port of a host, so
    two servers on one machine (``serve`` and ``demo``) each keep their own."""
    return f"gradstream-token-{port}"


def _same_secret(supplied: str, token: str) -> bool:
    """Whether ``supplied`` is ``token``, in time independent of where they differ
    (:func:`hmac.compare_digest` on their UTF-8 bytes)."""
    return hmac.compare_digest(supplied.encode("utf-8", "surrogatepass"),
                               token.encode("utf-8", "surrogatepass"))


def _same_origin_path(path: str) -> str:
    """``path`` made a path on this server, for a ``Location`` header: every leading ``/``
    and ``\\`` (and any whitespace among them) collapsed into one ``/``.

    A redirect to ``//host/...`` (or ``/\\host/...``, which browsers read the same way) is
    a protocol-relative URL: it leaves the server (an open redirect). Collapsing keeps the
    target on this origin: ``////evil.example/x`` -> ``/evil.example/x``, a path here.
    """
    return "/" + path.lstrip("/\\ \t\r\n")


def _cookies(header: str) -> Iterator[tuple[str, str]]:
    """(name, value) of each cookie of a ``Cookie:`` header. Split by hand: other
    applications on the same host (any port) may have set cookies that a strict parser
    rejects, losing ours with them."""
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            yield name.strip(), value.strip().strip('"')


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _HTTPError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> Response:
    """The JSON error answer ``{"error": message, "kind": kind}`` (UTF-8, as every JSON
    answer of the server)."""
    return JSONResponse({"error": message, "kind": kind}, status, headers,
                        media_type="application/json; charset=utf-8")


def _read_error(exc: StoreError) -> _HTTPError:
    """The HTTP answer to a refused or failed read (status and ``kind`` by cause)."""
    if isinstance(exc, QueryTimeoutError):
        return _HTTPError(HTTPStatus.REQUEST_TIMEOUT, str(exc), "timeout")
    if isinstance(exc, ReadRefusedError):
        return _HTTPError(HTTPStatus.FORBIDDEN, str(exc), "refused")
    if isinstance(exc, ReadOnlyViolationError):
        return _HTTPError(HTTPStatus.FORBIDDEN, str(exc), "read_only")
    if isinstance(exc, QueryError | ParamError):
        return _HTTPError(HTTPStatus.BAD_REQUEST, str(exc), "invalid")
    if isinstance(exc, NotFoundError):
        return _HTTPError(HTTPStatus.NOT_FOUND, str(exc), "not_found")
    status = HTTPStatus.NOT_FOUND if "unknown run" in str(exc) else HTTPStatus.BAD_REQUEST
    return _HTTPError(status, str(exc), "invalid")


def _page(path: str) -> bool:
    """Whether ``path`` is a page for the browser (a page route, or no ``/api`` path)."""
    matches = find(path)
    return matches[0][0].page if matches else not (path == "/api" or path.startswith("/api/"))


class _StaticFiles(StaticFiles):
    """Starlette's static files, serving only the names of
    :data:`~analysis.read.routes.STATIC_FILES` (their folders hold other files)."""

    def lookup_path(self, path: str) -> tuple[str, os.stat_result | None]:
        if path not in STATIC_FILES:
            return "", None
        return super().lookup_path(path)


class Dashboard:
    """The dashboard application: answers the routes of
    :data:`~analysis.read.routes.ROUTES` from read-only cursors.

    Args:
        cursors: provider of read-only cursors on the store.
        token: the secret every route requires (see the module docstring, *Access*).
        refresh_s: polling interval of the page, seconds.
        query_timeout_s: longest read of any ``/api/`` route, seconds (then interrupted).
        status: returns extra JSON for ``/api/status`` (e.g. the worker's counters).

    Raises:
        ValueError: ``token`` is empty (it would let every request in) or has a character
            other than those of :data:`~analysis.read.sidecar.TOKEN_CHARS` (it could not
            sit in a URL and a cookie unquoted).
    """

    def __init__(
        self,
        cursors: ReadCursors,
        token: str,
        refresh_s: float = 1.0,
        query_timeout_s: float = 120.0,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        if not TOKEN_CHARS.fullmatch(token):
            raise ValueError("the dashboard's token must be non-empty, of A-Z a-z 0-9 . _ ~ -")
        self.cursors = cursors
        self._request_threads = anyio.CapacityLimiter(REQUEST_THREADS)
        self.token = token
        self.refresh_s = refresh_s
        self.query_timeout_s = query_timeout_s
        self.status = status
        self._cache: OrderedDict[tuple[object, ...], tuple[tuple[object, ...], bytes]] = (
            OrderedDict()
        )
        self._cache_lock = threading.Lock()
        self._static_files = _StaticFiles(packages=sorted(set(STATIC_FILES.values())))

    # -- the ASGI application -----------------------------------------------------------

    def asgi(self, port: int, loopback: bool) -> Starlette:
        """The Starlette application of the server on ``port`` (the cookie's name);
        ``loopback``: the server is bound to a loopback address (Host and Origin checks)."""
        routes: list[BaseRoute] = []
        for route in ROUTES:
            if route.answer == "static":
                routes.append(Mount(route.path.removesuffix("/{name}"), app=self._static))
            else:
                routes.append(StarletteRoute(route.path, self._endpoint(route),
                                             methods=[route.method]))
        app = Starlette(
            routes=routes,
            middleware=[Middleware(ResponseHeaders), Middleware(LoopbackOnly, enabled=loopback),
                        Middleware(TokenRequired, token=self.token, port=port,
                                   sidecar=self._sidecar())],
            exception_handlers={HTTPException: self._http_exception},
        )
        app.router.redirect_slashes = False  # a path with a stray "/" is unknown: 404
        return app

    def _endpoint(self, route: Route) -> Callable[[Request], Awaitable[Response]]:
        """The Starlette endpoint of ``route``: parse the query, read a POST body, then run
        the handler on a worker thread; errors become JSON answers."""
        handler = getattr(self, route.handler)

        async def endpoint(request: Request) -> Response:
            try:
                args: dict[str, Any] = {"query": _query(request),
                                        "accept": request.headers.get("accept", "")}
                if route.method == "POST":
                    args["body"] = await _body(request)
                name = str(request.path_params.get("name", ""))
                return await anyio.to_thread.run_sync(  # type: ignore[no-any-return]
                    handler, route, name, args, limiter=self._request_threads)
            except _HTTPError as exc:
                return _error(exc.status, str(exc), exc.kind)
            except Exception as exc:  # a bug: answer 500 rather than drop the connection
                log.exception("%s %s failed", request.method, request.url.path)
                return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal")

        return endpoint

    def _sidecar(self) -> str | None:
        """The name of the sidecar that holds the token: ``<db>.serve.json`` beside a
        store file; None for a store named by a store URL (``cursors.db`` a ``str``),
        which :class:`deploy.serve.ReadEndpoint` does not advertise."""
        db = self.cursors.db
        return sidecar_path(db).name if isinstance(db, os.PathLike) else None

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Starlette's 404 (no route) and 405 (another method) as JSON errors."""
        assert isinstance(exc, HTTPException)
        path = request.url.path
        if exc.status_code == 405:
            allowed = ", ".join(sorted({route.method for route, _ in find(path)}))
            method = request.method
            return _error(405, f"{path} answers {allowed}, not {method}", "not_found",
                          {"Allow": allowed})
        if exc.status_code == 404:
            return _error(404, f"no page {path}", "not_found")
        return _error(exc.status_code, str(exc.detail), "error")

    # -- helpers -------------------------------------------------------------------------

    def cached(
        self, cur: Any, run_id: str, key: tuple[object, ...], compute: Callable[[], object]
    ) -> bytes:
        """The JSON body for ``key``, recomputed only when the run's frames changed.

        The fingerprint is (frames stored, last step, sum of ``frames.finalized_at``): a new
        frame changes the count, a rewritten frame (late shard) gets a new
        ``finalized_at``, so the sum changes; both are written in the same transaction as
        the frame's ``layer_stats`` rows, so a fingerprint always matches its rows. A
        finished run costs one small aggregate per poll instead of a scan of its history.
        The fingerprint begins with the cursors' ``snapshot_key(cur)``: a store re-read as
        a whole (:class:`analysis.read.snapshots.SnapshotCursors`) numbers its loaded
        snapshots, so an entry computed on one snapshot is never served for another.
        """
        fingerprint = (self.cursors.snapshot_key(cur),
                       *(cur.execute(_FINGERPRINT_SQL, {"run_id": run_id}).fetchone() or ()))
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == fingerprint:
                self._cache.move_to_end(key)
                return hit[1]
        body = page_json(compute())
        with self._cache_lock:
            self._cache[key] = (fingerprint, body)
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return body

    def index_html(self) -> bytes:
        """The page with its configuration (colours, the loss curve's included, the flag bits of
        ``schemas.flags.FLAG_BITS`` that ``heatmap.js`` reads, refresh interval, the paths
        of the ``/api/`` routes by read or handler name) embedded as JSON."""
        from analysis.plots.animation import script_safe_json

        template = resources.files("analysis.dashboard.static").joinpath(
            "index.html").read_text(encoding="utf-8")
        config = {
            "palette": list(norm_palette()),
            "flag_colors": FLAG_COLORS,
            "flag_bits": FLAG_BITS,
            "health_colors": HEALTH_COLORS,
            "loss_color": LOSS_COLOR,
            "refresh_ms": round(self.refresh_s * 1000),
            "db": str(self.cursors.db),
            "writer": self.cursors.writer,
            "export_formats": list(EXPORT_FORMATS),
            "routes": {route.read or route.handler.lstrip("_"): route.path
                       for route in ROUTES if not route.page},
        }
        return template.replace("__CONFIG_JSON__", script_safe_json(config)).encode("utf-8")

    def _timeout(self, wanted: object) -> float:
        """The read's time limit: the server's, or ``wanted`` (seconds) when smaller."""
        limit = self.query_timeout_s
        if isinstance(wanted, str):
            try:
                wanted = float(wanted)
            except ValueError:
                raise _HTTPError(HTTPStatus.BAD_REQUEST,
                                 f"timeout_s must be a number, got {wanted!r}", "invalid") from None
        if isinstance(wanted, int | float) and math.isfinite(wanted) and wanted > 0:
            limit = min(limit, float(wanted))
        return limit

    @contextlib.contextmanager
    def _cursor(self, query: dict[str, str]) -> Iterator[Any]:
        """A read-only cursor under the request's time limit; errors of the read become
        HTTP errors (unknown run or analysis 404, bad argument 400, closed store 503)."""
        timeout = self._timeout(query.get("timeout_s"))
        try:
            with self.cursors.cursor() as cur, time_limit(cur, timeout):
                yield cur
        except StoreClosedError as exc:
            raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "closed") from None
        except StoreError as exc:
            raise _read_error(exc) from None
        except ValueError as exc:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, str(exc), "invalid") from None

    @staticmethod
    def _parse(route: Route, query: dict[str, str]) -> dict[str, object]:
        try:
            return route.parse(query)
        except ParamError as exc:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, str(exc), "invalid") from None

    # -- pages ---------------------------------------------------------------------------

    def _index(self, _route: Route, _name: str, _args: dict[str, Any]) -> Response:
        return Response(self.index_html(), 200, {"Content-Security-Policy": _CSP,
                                                 "Referrer-Policy": "no-referrer"},
                        "text/html; charset=utf-8")

    async def _static(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/static/{name}``: Starlette's static files, the names of
        :data:`~analysis.read.routes.STATIC_FILES` only."""
        await self._static_files(scope, receive, send)

    # -- /api ----------------------------------------------------------------------------

    def _status(self, _route: Route, _name: str, _args: dict[str, Any]) -> Response:
        payload: dict[str, Any] = {
            "db": str(self.cursors.db),
            "writer": self.cursors.writer,
            "pid": os.getpid(),
        }
        if self.status is not None:
            payload.update(self.status())
        return _json(payload)

    def _runs(self, _route: Route, _name: str, args: dict[str, Any]) -> Response:
        with self._cursor(args["query"]) as cur:
            return _json(api.runs(cur))

    def _alerts(self, route: Route, _name: str, args: dict[str, Any]) -> Response:
        values = self._parse(route, args["query"])
        with self._cursor(args["query"]) as cur:
            return _json(api.alerts(cur, values["run"] or None, values["limit"]))  # type: ignore[arg-type]

    def _layer(self, route: Route, _name: str, args: dict[str, Any]) -> Response:
        values = self._parse(route, args["query"])
        run = str(values.pop("run"))
        with self._cursor(args["query"]) as cur:
            key = ("layer", run, *values.values())
            body = self.cached(cur, run, key, lambda: api.layer(cur, run, **values))  # type: ignore[arg-type]
            return Response(body, 200, media_type=_JSON)

    def _scalars(self, route: Route, _name: str, args: dict[str, Any]) -> Response:
        values = self._parse(route, args["query"])
        run = str(values.pop("run"))
        with self._cursor(args["query"]) as cur:
            key = ("scalars", run, *(str(v) for v in values.values()))
            body = self.cached(cur, run, key, lambda: api.scalars(cur, run, **values))  # type: ignore[arg-type]
            return Response(body, 200, media_type=_JSON)

    def _analyses(self, _route: Route, _name: str, args: dict[str, Any]) -> Response:
        with self._cursor(args["query"]):
            return _json(api.analyses())

    def _read(self, route: Route, name: str, args: dict[str, Any]) -> Response:
        """A reader's read (:attr:`Route.read`): the route's builder on a cursor, answered
        as :attr:`Route.answer` says and the ``Accept`` header asks."""
        values = self._parse(route, args["query"])
        accept = args["accept"]
        with self._cursor(args["query"]) as cur:
            if route.answer == "text":
                text = route.run(cur, name, values)
                return Response(text.encode("utf-8"), 200, media_type="text/plain; charset=utf-8")
            if route.answer == "grid" and ARROW_STREAM in accept:
                grid = route.run(cur, name, values)
                return Response(table_to_ipc(grid.to_arrow()), 200, media_type=ARROW_STREAM)
            if route.answer == "model" and MODEL_JSON in accept:
                return Response(model_to_json(route.run(cur, name, values)), 200,
                                media_type=MODEL_JSON)

            def answer() -> object:
                result = route.run(cur, name, values)
                return result.to_json() if route.answer == "grid" else json.loads(
                    result.model_dump_json())

            if not route.cached:
                return _json(answer())
            run = str(values["run"])
            key = (route.path, name, *sorted((k, str(v)) for k, v in values.items()))
            return Response(self.cached(cur, run, key, answer), 200, media_type=_JSON)

    def _export(self, route: Route, _name: str, args: dict[str, Any]) -> Response:
        values = self._parse(route, args["query"])
        fmt = str(values["format"])
        if fmt not in EXPORT_FORMATS:
            raise _HTTPError(HTTPStatus.BAD_REQUEST,
                             f"format must be one of {', '.join(EXPORT_FORMATS)}", "invalid")
        run = str(values["run"])
        folder = tempfile.mkdtemp(prefix="gradstream-export-")
        try:
            target = Path(folder) / f"export.{fmt}"
            with self._cursor(args["query"]) as cur:
                rows = export_run(cur, run, target, fmt, values["from_step"],  # type: ignore[arg-type]
                                  values["to_step"], values["order"],  # type: ignore[arg-type]
                                  style=values["style"])  # type: ignore[arg-type]
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        name = f"{file_stem(run)}.{fmt}"
        headers = {
            "X-Gradstream-Rows": str(rows),
            "Content-Disposition":
                f"attachment; filename=\"{name}\"; filename*=UTF-8''{quote(name)}",
        }
        return FileResponse(target, headers=headers, media_type=_MEDIA[fmt],
                            background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True))

    def _query(self, _route: Route, _name: str, args: dict[str, Any]) -> Response:
        try:
            request = json.loads(args["body"].decode("utf-8"))
            sql = request["sql"]
            wanted = request.get("timeout_s")
            params = request.get("params")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
            raise _HTTPError(HTTPStatus.BAD_REQUEST, 'send {"sql": "..."}', "invalid") from None
        if not isinstance(sql, str):
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "sql must be a string", "invalid")
        if params is not None and not isinstance(params, dict | list):
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "params must be an object or an array",
                             "invalid")
        timeout = self._timeout(wanted)
        try:
            with self.cursors.cursor() as cur:
                table = execute_read_only(cur, sql, timeout, params)
        except StoreClosedError as exc:
            raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "closed") from None
        except QueryError as exc:
            raise _read_error(exc) from None
        return Response(table_to_ipc(table), 200, media_type=ARROW_STREAM)


def _json(payload: object, status: int = 200) -> Response:
    return Response(page_json(payload), status, media_type=_JSON)


def _query(request: Request) -> dict[str, str]:
    """The URL's query parameters, the last value of each; blank values dropped."""
    query = request.scope.get("query_string", b"").decode("latin-1")
    return {k: v[-1] for k, v in parse_qs(query, keep_blank_values=False).items()}


async def _body(request: Request) -> bytes:
    """The JSON body of a POST (at most :data:`MAX_QUERY_BODY` bytes).

    Raises:
        _HTTPError: 415 not JSON, 413 too large.
    """
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise _HTTPError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send the query as application/json",
                         "invalid")
    declared = request.headers.get("content-length") or "0"
    if not declared.isdigit() or int(declared) > MAX_QUERY_BODY:
        raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"query body over {MAX_QUERY_BODY} bytes", "invalid")
    return await request.body()


def _canonical(name: bytes) -> bytes:
    """A header name in its usual spelling (``content-type`` -> ``Content-Type``), as
    clients that compare names case-sensitively expect."""
    text = name.decode("latin-1")
    if text.lower() == "www-authenticate":
        return b"WWW-Authenticate"
    return "-".join(part.capitalize() for part in text.split("-")).encode("latin-1")


class ResponseHeaders:
    """ASGI middleware: every answer gets ``X-Content-Type-Options: nosniff`` and
    ``Cache-Control: no-store``; a refused POST (status >= 400) closes the connection, so
    that its body, maybe unread, is never taken for the next request. Header names go out
    in their usual spelling (:func:`_canonical`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("X-Content-Type-Options", "nosniff")
                headers.setdefault("Cache-Control", "no-store")
                if scope["method"] == "POST" and message["status"] >= 400:
                    headers["Connection"] = "close"
                message["headers"] = [(_canonical(k), v) for k, v in message["headers"]]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class LoopbackOnly:
    """ASGI middleware of a loopback-bound server (``enabled``): a request whose ``Host``
    is not a loopback name (DNS rebinding) or whose ``Origin`` is another host is refused
    (403 ``forbidden``)."""

    def __init__(self, app: ASGIApp, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.enabled:
            headers = Headers(scope=scope)
            host = headers.get("host", "")
            refusal = None
            if not _is_loopback(urlsplit(f"//{host}").hostname or ""):
                refusal = f"Host {host!r} is not a loopback name"
            origin = headers.get("origin")
            if refusal is None and origin and origin != "null" and not _is_loopback(
                    urlsplit(origin).hostname or ""):
                refusal = f"cross-origin request from {origin}"
            if refusal is not None:
                await _error(403, refusal, "forbidden")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class TokenRequired:
    """ASGI middleware: the token rules of the module docstring (*Access*), before routing.

    A page URL with the right ``?token=`` gets the cookie and a 303 to the same URL
    without it; a request with the token (``Authorization: Bearer`` or the cookie
    :func:`cookie_name` of ``port``) goes on; any other is refused with 401 (a page: the
    HTML page naming ``sidecar``, the file holding the token, None when there is none; an
    ``/api/`` route: a JSON error).
    """

    def __init__(self, app: ASGIApp, token: str, port: int, sidecar: str | None) -> None:
        self.app = app
        self.token = token
        self.cookie = cookie_name(port)
        self.sidecar = sidecar

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_path = (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1")
        page = _page(scope["path"])
        if scope["method"] == "GET" and page:
            login = self._login(raw_path, scope.get("query_string", b"").decode("latin-1"))
            if login is not None:
                await login(scope, receive, send)
                return
        if not self._authorized(Headers(scope=scope)):
            await self._refusal(page)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: Headers) -> bool:
        """Whether the request carries the token: ``Authorization: Bearer`` or this
        server's cookie."""
        scheme, _, supplied = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and _same_secret(supplied.strip(), self.token):
            return True
        return any(key == self.cookie and _same_secret(value, self.token)
                   for header in headers.getlist("cookie")
                   for key, value in _cookies(header))

    def _login(self, path: str, query: str) -> Response | None:
        """The 303 that sets the cookie, for a page URL carrying the right ``?token=``;
        ``None`` otherwise. The redirect stays on this server whatever the path
        (:func:`_same_origin_path`)."""
        pairs = parse_qsl(query, keep_blank_values=True)
        supplied = [value for key, value in pairs if key == TOKEN_PARAM]
        if not supplied or not _same_secret(supplied[-1], self.token):
            return None
        rest = urlencode([(key, value) for key, value in pairs if key != TOKEN_PARAM])
        return Response(b"", HTTPStatus.SEE_OTHER, {
            "Location": _same_origin_path(path) + (f"?{rest}" if rest else ""),
            "Set-Cookie": f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict",
            "Referrer-Policy": "no-referrer"}, "text/plain; charset=utf-8")

    def _refusal(self, page: bool) -> Response:
        """401: no or wrong token. A page gets a short HTML page saying where the URL is,
        an ``/api/`` route a JSON error."""
        extra = {"WWW-Authenticate": 'Bearer realm="gradstream"'}
        if not page:
            where = (f"the token field of {self.sidecar}, beside the store"
                     if self.sidecar is not None else "the token `gradstream serve` printed")
            message = (f"missing or wrong token: send 'Authorization: Bearer <token>' "
                       f"({where}), or open the URL printed by `gradstream serve` / "
                       "`gradstream demo`")
            return _error(401, message, "unauthorized", extra)
        lost = (_LOST_IN_SIDECAR.format(sidecar=escape(self.sidecar), param=TOKEN_PARAM)
                if self.sidecar is not None else _LOST_NO_SIDECAR.format(param=TOKEN_PARAM))
        body = _LOGIN_PAGE.format(lost=lost, param=TOKEN_PARAM)
        return Response(body.encode("utf-8"), 401, {**extra, "Content-Security-Policy": _CSP},
                        "text/html; charset=utf-8")


class DashboardServer:
    """A :class:`Dashboard` served by uvicorn on a background thread.

    Args:
        app: the application.
        host: address to bind (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`url`).

    The socket is bound here, so that a busy address fails at once; :meth:`start` serves
    it and :meth:`stop` stops serving.

    Raises:
        OSError: the address is in use or cannot be bound.
    """

    def __init__(self, app: Dashboard, host: str = "127.0.0.1", port: int = 8765) -> None:
        import uvicorn

        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
        except OSError:
            self._socket.close()
            raise
        bound = self._socket.getsockname()[1]
        config = uvicorn.Config(app.asgi(bound, _is_loopback(host)), log_config=None,
                                access_log=False, lifespan="off", server_header=False,
                                timeout_graceful_shutdown=int(STOP_GRACE_S))
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8765`` (IPv6 hosts in brackets)."""
        host, port = self._socket.getsockname()[:2]
        host = str(host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Serve on a daemon thread; returns once the server accepts connections.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout_s``.
        """
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="gradstream-dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the dashboard's server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving (requests in flight get :data:`STOP_GRACE_S` to finish), wait for
        the thread, close the socket."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(STOP_GRACE_S + 10)
            if self._thread.is_alive():  # a request outlived the grace: close it anyway
                self._server.force_exit = True
                self._thread.join(10)
        self._socket.close()
