"""The dashboard's HTTP server (stdlib ``ThreadingHTTPServer``, one thread per request).

Routes (:data:`ROUTES`; all reads go through :class:`~analysis.read.cursors.ReadCursors`,
a fresh read-only cursor per request). Every route requires the token (see *Access* below):

============================  ======================================================================
``GET /``                     the dashboard page (``static/index.html``; also ``/index.html``)
``GET /static/{name}``        its script and style sheet, and the shared ``heatmap.js``
``GET /api/status``           store path, whether this process writes it, worker counters
``GET /api/runs``             runs with health, frames, issue ratio, alert counts
``GET /api/grid``             ``run``, ``max_steps``, ``max_layers``, ``from_step``, ``to_step``:
                              the downsampled heatmap grid (:mod:`analysis.plots.grid`); with
                              ``Accept: application/vnd.apache.arrow.stream`` the exact grid as
                              Arrow (:func:`analysis.read.wire.grid_to_arrow`)
``GET /api/report``           ``run``, ``from_step``, ``to_step``, ``ignore_layers`` (a JSON
                              list of patterns), ``exclude_rounding=true``, ``order``
                              (``model`` or ``name``), ``nonfinite_rule`` (``critical`` or
                              ``reference``): the run summary
                              (:func:`analysis.report.build_report`), the JSON of ``gradstream
                              report --format json``
``GET /api/heatmap``          ``run``, ``max_columns``, ``from_step``, ``to_step``: the ASCII
                              heatmap (:func:`analysis.heatmap.ascii_heatmap`), plain text;
                              ``style=reference``: the reference implementation's layout
``GET /api/layer``            ``run``, ``layer``, ``max_points``: one layer's norm series
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

Access (the convention of Jupyter): the server holds one secret token (``gradstream serve``
and ``demo`` print ``http://HOST:PORT/?token=...``; ``<db>.serve.json`` holds it). A
request is answered when it carries the token as

- ``Authorization: Bearer <token>`` (scripts, :class:`analysis.read.reader.EndpointReader`), or
- the cookie :func:`cookie_name` (``gradstream-token-<port>``: cookies are shared by every
  port of a host, so each server names its own), which a page URL carrying
  ``?token=<token>`` sets (``HttpOnly; SameSite=Strict; Path=/``) before redirecting
  (303) to the same URL without the token, so the token leaves the address bar and
  history. The browser then sends the cookie with the page's own requests.

Tokens are compared with :func:`hmac.compare_digest`. Anything else (no token, a wrong
one, an unknown path) is refused with 401 before routing: a JSON error on ``/api/``, a
short HTML page saying where the URL is elsewhere. ``?token=`` is accepted on pages only,
not on ``/api/`` (a script sends the header).

Every ``/api/`` read runs under one time limit: the server's ``query_timeout_s``, or the
request's ``timeout_s`` (query parameter or JSON field) when smaller. ``/api/report`` and
``/api/analysis/<name>`` answer ``Accept:`` :data:`~analysis.read.wire.MODEL_JSON`
with the exact report (NaN kept), which :class:`analysis.read.reader.EndpointReader` rebuilds.

Errors are JSON ``{"error": message, "kind": ...}`` with 400 (bad argument), 401
(``unauthorized``: no or wrong token), 403 (``read_only``: a write refused; ``refused``: a
file outside the store; ``forbidden``: a foreign Host/Origin), 404 (also an unknown run or
analysis), 405 (a route asked with another method), 408 (``timeout``: the read reached its
time limit), 413, 503 (store closed).

Served on loopback by default. With a loopback bind the server also rejects requests
whose ``Host`` header is not a loopback name (DNS-rebinding defence) and cross-origin
requests; pages get a Content-Security-Policy allowing only their own scripts.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html import escape
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, urlencode, urlsplit

from analysis.dashboard import api
from analysis.export import EXPORT_FORMATS, export_run
from analysis.plots.colors import FLAG_COLORS, HEALTH_COLORS, norm_palette
from analysis.read.connect import StoreError
from analysis.read.cursors import ReadCursors, StoreClosedError
from analysis.read.query import (
    ARROW_STREAM,
    QueryError,
    QueryTimeoutError,
    ReadOnlyViolationError,
    ReadRefusedError,
    execute_read_only,
    time_limit,
)
from analysis.read.sidecar import TOKEN_CHARS, sidecar_path
from analysis.read.wire import MODEL_JSON, grid_to_arrow, model_to_json, table_to_ipc
from analysis.registry import UnknownAnalysisError
from schemas.flags import FLAG_BITS

log = logging.getLogger("gradstream.dashboard")

LIMITS: dict[str, tuple[int, int]] = {
    "max_steps": (1, 8192),
    "max_layers": (1, 4096),
    "max_points": (1, 8192),
    "limit": (1, 1000),
    "max_columns": (1, 4096),
}
"""Accepted ranges of the size parameters (a canvas is at most a few thousand device
pixels wide; larger requests would only cost the writer's process time)."""

MAX_QUERY_BODY = 1 << 20
"""Largest accepted ``/api/query`` request body, bytes."""

CACHE_ENTRIES = 64
"""Grid and layer responses kept (a few per open page); each is recomputed only when its
run's frames change (see :meth:`Dashboard.cached`)."""

_FINGERPRINT_SQL = """
    SELECT count(*), max(step), sum(finalized_at) FROM frames WHERE run_id = $run_id
"""

_STATIC = {
    "dashboard.js": ("analysis.dashboard.static", "text/javascript; charset=utf-8"),
    "dashboard.css": ("analysis.dashboard.static", "text/css; charset=utf-8"),
    "heatmap.js": ("analysis.plots", "text/javascript; charset=utf-8"),
}
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
<p>Lost it? The token is the <code>token</code> field of <code>{sidecar}</code>, the file
beside the store (readable only by its owner): open this page's address with
<code>?{param}=</code> and that value.</p>
</body></html>
"""
"""The page answered (401) to a browser without the token; ``{sidecar}``: the sidecar's
file name."""
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
_JSON = "application/json; charset=utf-8"
_RANGE_PARAMS = ("run", "from_step", "to_step", "timeout_s")
"""Query parameters of ``/api/analysis/<name>`` that are not options of the analysis."""

TOKEN_PARAM = "token"
"""Query parameter of a page URL that carries the token (``/?token=...``)."""


@dataclass(frozen=True)
class Route:
    """One route of the server: ``method`` on ``path`` runs the request handler's method
    ``handler`` (with the ``{name}`` segment, "" for an exact path).

    Attributes:
        method: ``GET`` or ``POST``.
        path: an exact path, or a template ending in ``{name}``: any one non-empty path
            segment (``/static/{name}`` matches ``/static/dashboard.js``).
        handler: name of the :class:`_Handler` method that answers.
        page: a page for the browser (HTML and its assets): ``?token=`` logs in there, and
            a refusal is a short HTML page; else an ``/api/`` route (JSON errors).
    """

    method: str
    path: str
    handler: str
    page: bool = False

    def match(self, path: str) -> str | None:
        """The ``{name}`` segment of ``path`` ("" for an exact path), or None when
        ``path`` is not this route's."""
        if not self.path.endswith("{name}"):
            return "" if path == self.path else None
        prefix = self.path.removesuffix("{name}")
        name = path.removeprefix(prefix) if path.startswith(prefix) else ""
        return name if name and "/" not in name else None


ROUTES: tuple[Route, ...] = (
    Route("GET", "/", "_index", page=True),
    Route("GET", "/index.html", "_index", page=True),
    Route("GET", "/static/{name}", "_static", page=True),
    Route("GET", "/api/status", "_status"),
    Route("GET", "/api/runs", "_runs"),
    Route("GET", "/api/grid", "_grid"),
    Route("GET", "/api/report", "_report"),
    Route("GET", "/api/heatmap", "_heatmap"),
    Route("GET", "/api/layer", "_layer"),
    Route("GET", "/api/alerts", "_alerts"),
    Route("GET", "/api/analyses", "_analyses"),
    Route("GET", "/api/analysis/{name}", "_analysis"),
    Route("GET", "/api/export", "_export"),
    Route("POST", "/api/query", "_query"),
)
"""Every route the server answers, in the order they are matched (the table of the module
docstring). All of them require the token."""

STATIC_FILES: tuple[str, ...] = tuple(_STATIC)
"""The names ``/static/{name}`` serves."""


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
    applications on the same host (any port) may have set cookies that
    :class:`http.cookies.SimpleCookie` rejects, losing ours with them."""
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            yield name.strip(), value.strip().strip('"')


def _read_error(exc: QueryError) -> _HTTPError:
    """The HTTP answer to a refused or failed read (status and ``kind`` by cause)."""
    if isinstance(exc, QueryTimeoutError):
        return _HTTPError(HTTPStatus.REQUEST_TIMEOUT, str(exc), "timeout")
    if isinstance(exc, ReadRefusedError):
        return _HTTPError(HTTPStatus.FORBIDDEN, str(exc), "refused")
    if isinstance(exc, ReadOnlyViolationError):
        return _HTTPError(HTTPStatus.FORBIDDEN, str(exc), "read_only")
    return _HTTPError(HTTPStatus.BAD_REQUEST, str(exc), "invalid")


class _HTTPError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _patterns(value: str | None) -> tuple[str, ...]:
    """The ``ignore_layers`` query parameter: a JSON list of strings (absent = none).

    Raises:
        _HTTPError: 400 when it is not such a list.
    """
    if not value:
        return ()
    try:
        patterns = json.loads(value)
    except ValueError:
        patterns = None
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise _HTTPError(HTTPStatus.BAD_REQUEST,
                         'ignore_layers must be a JSON list of strings, e.g. ["*.key.bias"]')
    return tuple(patterns)


def _safe_stem(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._") or "run"


class Dashboard:
    """The dashboard application: routes requests to read-only cursors.

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
        self.token = token
        self.refresh_s = refresh_s
        self.query_timeout_s = query_timeout_s
        self.status = status
        self._cache: OrderedDict[tuple[object, ...], tuple[tuple[object, ...], bytes]] = (
            OrderedDict()
        )
        self._cache_lock = threading.Lock()

    def cached(
        self, cur: Any, run_id: str, key: tuple[object, ...], compute: Callable[[], object]
    ) -> bytes:
        """The JSON body for ``key``, recomputed only when the run's frames changed.

        The fingerprint is (frames stored, last step, sum of ``frames.finalized_at``): a new
        frame changes the count, a rewritten frame (late shard) gets a new
        ``finalized_at``, so the sum changes; both are written in the same transaction as
        the frame's ``layer_stats`` rows, so a fingerprint always matches its rows. A
        finished run costs one small aggregate per poll instead of a scan of its history.
        """
        fingerprint = tuple(cur.execute(_FINGERPRINT_SQL, {"run_id": run_id}).fetchone() or ())
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == fingerprint:
                self._cache.move_to_end(key)
                return hit[1]
        body = json.dumps(compute(), ensure_ascii=False, allow_nan=False).encode("utf-8")
        with self._cache_lock:
            self._cache[key] = (fingerprint, body)
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return body

    def index_html(self) -> bytes:
        """The page with its configuration (colours, the flag bits of
        ``schemas.flags.FLAG_BITS`` that ``heatmap.js`` reads, refresh interval) embedded as
        JSON."""
        from analysis.plots.animation import script_safe_json

        template = resources.files("analysis.dashboard.static").joinpath(
            "index.html").read_text(encoding="utf-8")
        config = {
            "palette": list(norm_palette()),
            "flag_colors": FLAG_COLORS,
            "flag_bits": FLAG_BITS,
            "health_colors": HEALTH_COLORS,
            "refresh_ms": round(self.refresh_s * 1000),
            "db": str(self.cursors.db),
            "writer": self.cursors.writer,
            "export_formats": list(EXPORT_FORMATS),
        }
        return template.replace("__CONFIG_JSON__", script_safe_json(config)).encode("utf-8")


class DashboardServer:
    """A :class:`Dashboard` served over HTTP on a background thread.

    Args:
        app: the application.
        host: address to bind (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`url`).

    Raises:
        OSError: the address is in use or cannot be bound.
    """

    def __init__(self, app: Dashboard, host: str = "127.0.0.1", port: int = 8765) -> None:
        self.app = app
        handler = type("Handler", (_Handler,), {"app": app, "loopback": _is_loopback(host)})
        family_server = _server_class(host)
        self.httpd = family_server((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8765`` (IPv6 hosts in brackets)."""
        host, port = self.httpd.server_address[:2]
        host = str(host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def start(self) -> None:
        """Serve on a daemon thread (returns at once)."""
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="gradstream-dashboard", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, wait for the thread, close the socket."""
        self.httpd.shutdown()
        if self._thread is not None:
            self._thread.join(10)
        self.httpd.server_close()


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    import socket

    if ":" in host:
        return type("V6Server", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6,
                                                         "daemon_threads": True})
    return type("V4Server", (ThreadingHTTPServer,), {"daemon_threads": True})


class _Handler(BaseHTTPRequestHandler):
    app: Dashboard
    loopback: bool
    server_version = "gradstream-dashboard"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        if self.command == "POST" and status >= 400:
            # The body may be unread (a refused request): do not parse it as the next one.
            self.close_connection = True
            self.send_header("Connection", "close")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload: object, status: int = 200) -> None:
        body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8")
        self._send(status, body, "application/json; charset=utf-8")

    def _error(self, exc: _HTTPError) -> None:
        self._json({"error": str(exc), "kind": exc.kind}, exc.status)

    def _check_host(self) -> None:
        if not self.loopback:
            return
        host = self.headers.get("Host", "")
        name = urlsplit(f"//{host}").hostname or ""
        if not _is_loopback(name):
            raise _HTTPError(HTTPStatus.FORBIDDEN, f"Host {host!r} is not a loopback name",
                             "forbidden")
        origin = self.headers.get("Origin")
        if origin and origin != "null":
            origin_host = urlsplit(origin).hostname or ""
            if not _is_loopback(origin_host):
                raise _HTTPError(HTTPStatus.FORBIDDEN, f"cross-origin request from {origin}",
                                 "forbidden")

    def _params(self) -> dict[str, str]:
        query = urlsplit(self.path).query
        return {k: v[-1] for k, v in parse_qs(query, keep_blank_values=False).items()}

    @staticmethod
    def _int(params: dict[str, str], name: str, default: int | None) -> int | None:
        raw = params.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer, got {raw!r}",
                             "invalid") from None
        if name in LIMITS:
            low, high = LIMITS[name]
            value = min(max(value, low), high)
        return value

    def _timeout(self, wanted: object) -> float:
        """The read's time limit: the server's, or ``wanted`` (seconds) when smaller."""
        limit = self.app.query_timeout_s
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
    def _read(self, timeout: float) -> Iterator[Any]:
        """A read-only cursor under the time limit; read errors become HTTP errors."""
        try:
            with self.app.cursors.cursor() as cur, time_limit(cur, timeout):
                yield cur
        except StoreClosedError as exc:
            raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "closed") from None
        except QueryError as exc:
            raise _read_error(exc) from None

    def _accepts(self, media: str) -> bool:
        return media in self.headers.get("Accept", "")

    @staticmethod
    def _run(params: dict[str, str]) -> str:
        run = params.get("run")
        if not run:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "the run parameter is required", "invalid")
        return run

    # -- access ------------------------------------------------------------------------

    def _port(self) -> int:
        return int(self.server.server_address[1])

    def _authorized(self) -> bool:
        """Whether the request carries the token: ``Authorization: Bearer`` or this
        server's cookie."""
        token = self.app.token
        scheme, _, supplied = self.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and _same_secret(supplied.strip(), token):
            return True
        name = cookie_name(self._port())
        return any(key == name and _same_secret(value, token)
                   for header in self.headers.get_all("Cookie") or ()
                   for key, value in _cookies(header))

    def _login(self, split: Any) -> bool:
        """A page URL carrying ``?token=``: when right, set the cookie and redirect (303)
        to the same URL without it, and return True; when wrong, False (refused next).
        The redirect stays on this server whatever the path (:func:`_same_origin_path`)."""
        pairs = parse_qsl(split.query, keep_blank_values=True)
        supplied = [value for key, value in pairs if key == TOKEN_PARAM]
        if not supplied or not _same_secret(supplied[-1], self.app.token):
            return False
        rest = urlencode([(key, value) for key, value in pairs if key != TOKEN_PARAM])
        cookie = (f"{cookie_name(self._port())}={self.app.token}; Path=/; HttpOnly; "
                  "SameSite=Strict")
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain; charset=utf-8",
                   {"Location": _same_origin_path(split.path) + (f"?{rest}" if rest else ""),
                    "Set-Cookie": cookie, "Referrer-Policy": "no-referrer"})
        return True

    def _refuse(self, page: bool) -> None:
        """401: no or wrong token. A page gets a short HTML page saying where the URL is,
        an ``/api/`` route a JSON error."""
        sidecar = sidecar_path(self.app.cursors.db).name
        extra = {"WWW-Authenticate": 'Bearer realm="gradstream"'}
        if not page:
            message = (f"missing or wrong token: send 'Authorization: Bearer <token>' (the "
                       f"token field of {sidecar}, beside the store), or open the URL "
                       "printed by `gradstream serve` / `gradstream demo`")
            body = json.dumps({"error": message, "kind": "unauthorized"}).encode("utf-8")
            self._send(HTTPStatus.UNAUTHORIZED, body, _JSON, extra)
            return
        body = _LOGIN_PAGE.format(sidecar=escape(sidecar), param=TOKEN_PARAM).encode("utf-8")
        self._send(HTTPStatus.UNAUTHORIZED, body, "text/html; charset=utf-8",
                   {**extra, "Content-Security-Policy": _CSP})

    # -- dispatch ----------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        """Host check, token check, then the route's handler (404 / 405 when none)."""
        try:
            self._check_host()
            split = urlsplit(self.path)
            path = split.path
            matches = [(route, name) for route in ROUTES
                       if (name := route.match(path)) is not None]
            page = (matches[0][0].page if matches
                    else not (path == "/api" or path.startswith("/api/")))
            if method == "GET" and page and self._login(split):
                return
            if not self._authorized():
                self._refuse(page)
                return
            chosen = [(route, name) for route, name in matches if route.method == method]
            if not chosen:
                if matches:
                    allowed = ", ".join(sorted({route.method for route, _ in matches}))
                    raise _HTTPError(HTTPStatus.METHOD_NOT_ALLOWED,
                                     f"{path} answers {allowed}, not {method}", "not_found")
                raise _HTTPError(HTTPStatus.NOT_FOUND, f"no page {path}", "not_found")
            route, name = chosen[0]
            getattr(self, route.handler)(self._params(), name)
        except _HTTPError as exc:
            self._error(exc)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # a bug: answer 500 rather than drop the connection
            log.exception("%s %s failed", method, self.path)
            self._error(_HTTPError(HTTPStatus.INTERNAL_SERVER_ERROR,
                                   f"internal error: {type(exc).__name__}: {exc}", "internal"))

    # -- pages -------------------------------------------------------------------------

    def _index(self, _params: dict[str, str], _name: str) -> None:
        self._send(200, self.app.index_html(), "text/html; charset=utf-8",
                   {"Content-Security-Policy": _CSP, "Referrer-Policy": "no-referrer"})

    def _static(self, _params: dict[str, str], name: str) -> None:
        entry = _STATIC.get(name)
        if entry is None:
            raise _HTTPError(HTTPStatus.NOT_FOUND, f"no file {name}", "not_found")
        package, media = entry
        body = resources.files(package).joinpath(name).read_bytes()
        self._send(200, body, media)

    # -- /api --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _api_read(self, params: dict[str, str]) -> Iterator[Any]:
        """A read cursor under the request's time limit; errors of the read become HTTP
        errors (unknown run or analysis 404, bad argument 400)."""
        try:
            with self._read(self._timeout(params.get("timeout_s"))) as cur:
                yield cur
        except UnknownAnalysisError as exc:
            raise _HTTPError(HTTPStatus.NOT_FOUND, str(exc), "not_found") from None
        except StoreError as exc:
            status = HTTPStatus.NOT_FOUND if "unknown run" in str(exc) else HTTPStatus.BAD_REQUEST
            raise _HTTPError(status, str(exc), "invalid") from None
        except ValueError as exc:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, str(exc), "invalid") from None

    def _status(self, _params: dict[str, str], _name: str) -> None:
        payload: dict[str, Any] = {
            "db": str(self.app.cursors.db),
            "writer": self.app.cursors.writer,
            "pid": os.getpid(),
        }
        if self.app.status is not None:
            payload.update(self.app.status())
        self._json(payload)

    def _runs(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            self._json(api.runs(cur))

    def _alerts(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            self._json(api.alerts(cur, params.get("run") or None,
                                  self._int(params, "limit", 50) or 50))

    def _grid(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            run = self._run(params)
            args = (self._int(params, "max_steps", 1000) or 1000,
                    self._int(params, "max_layers", 400) or 400,
                    self._int(params, "from_step", None),
                    self._int(params, "to_step", None))
            if self._accepts(ARROW_STREAM):
                table = grid_to_arrow(api.grid_model(cur, run, *args))
                self._send(200, table_to_ipc(table), ARROW_STREAM)
            else:
                body = self.app.cached(cur, run, ("grid", run, *args),
                                       lambda: api.grid(cur, run, *args))
                self._send(200, body, _JSON)

    def _report(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            run = self._run(params)
            summary = api.report(cur, run, self._int(params, "from_step", None),
                                 self._int(params, "to_step", None),
                                 _patterns(params.get("ignore_layers")),
                                 params.get("exclude_rounding", "false") == "true",
                                 params.get("order", "model"),
                                 params.get("nonfinite_rule", "critical"))
            self._model(summary)

    def _heatmap(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            run = self._run(params)
            drawing = api.heatmap(cur, run, self._int(params, "max_columns", 100) or 100,
                                  self._int(params, "from_step", None),
                                  self._int(params, "to_step", None),
                                  params.get("style", "gradstream"))
            self._send(200, drawing.encode("utf-8"), "text/plain; charset=utf-8")

    def _layer(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            run = self._run(params)
            layer = self._int(params, "layer", None)
            if layer is None:
                raise _HTTPError(HTTPStatus.BAD_REQUEST, "the layer parameter is required",
                                 "invalid")
            args = (layer, self._int(params, "max_points", 1000) or 1000,
                    self._int(params, "from_step", None),
                    self._int(params, "to_step", None))
            body = self.app.cached(cur, run, ("layer", run, *args),
                                   lambda: api.layer(cur, run, *args))
            self._send(200, body, _JSON)

    def _analyses(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params):
            self._json(api.analyses())

    def _model(self, report: Any) -> None:
        """A pydantic report: :data:`MODEL_JSON` when asked for, else the page's JSON."""
        if self._accepts(MODEL_JSON):
            self._send(200, model_to_json(report), MODEL_JSON)
        else:
            self._send(200, report.model_dump_json().encode("utf-8"), _JSON)

    def _analysis(self, params: dict[str, str], name: str) -> None:
        with self._api_read(params) as cur:
            run = self._run(params)
            steps = (self._int(params, "from_step", None), self._int(params, "to_step", None))
            options = {k: v for k, v in params.items() if k not in _RANGE_PARAMS}
            if self._accepts(MODEL_JSON):
                self._model(api.analysis_report(cur, name, run, *steps, options))
                return
            key = ("analysis", name, run, *steps, tuple(sorted(options.items())))
            body = self.app.cached(cur, run, key,
                                   lambda: api.analysis(cur, name, run, *steps, options))
            self._send(200, body, _JSON)

    def _export(self, params: dict[str, str], _name: str) -> None:
        with self._api_read(params) as cur:
            self._export_run(cur, params)

    def _export_run(self, cur: Any, params: dict[str, str]) -> None:
        run = self._run(params)
        fmt = params.get("format", "csv")
        if fmt not in EXPORT_FORMATS:
            raise _HTTPError(HTTPStatus.BAD_REQUEST,
                             f"format must be one of {', '.join(EXPORT_FORMATS)}", "invalid")
        order = params.get("order", "name")
        start, end = self._int(params, "from_step", None), self._int(params, "to_step", None)
        with tempfile.TemporaryDirectory(prefix="gradstream-export-") as tmp:
            target = Path(tmp) / f"export.{fmt}"
            rows = export_run(cur, run, target, fmt, start, end, order,  # type: ignore[arg-type]
                              style=params.get("style", "gradstream"))  # type: ignore[arg-type]
            size = target.stat().st_size
            name = f"{_safe_stem(run)}.{fmt}"
            self.send_response(200)
            self.send_header("Content-Type", _MEDIA[fmt])
            self.send_header("Content-Length", str(size))
            self.send_header("X-Gradstream-Rows", str(rows))
            self.send_header("Content-Disposition",
                             f"attachment; filename=\"{name}\"; filename*=UTF-8''{quote(name)}")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            with target.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    self.wfile.write(chunk)

    def _query(self, _params: dict[str, str], _name: str) -> None:
        if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            raise _HTTPError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                             "send the query as application/json", "invalid")
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_QUERY_BODY:
            raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"query body over {MAX_QUERY_BODY} bytes", "invalid")
        try:
            request = json.loads(self.rfile.read(length).decode("utf-8"))
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
            with self.app.cursors.cursor() as cur:
                table = execute_read_only(cur, sql, timeout, params)
        except StoreClosedError as exc:
            raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "closed") from None
        except QueryError as exc:
            raise _read_error(exc) from None
        self._send(200, table_to_ipc(table), ARROW_STREAM)


@contextlib.contextmanager
def serving(app: Dashboard, host: str = "127.0.0.1", port: int = 8765):  # type: ignore[no-untyped-def]
    """Context manager: a started :class:`DashboardServer`, stopped on exit."""
    server = DashboardServer(app, host, port)
    server.start()
    try:
        yield server
    finally:
        server.stop()
