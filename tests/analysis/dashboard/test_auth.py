"""Every route of the dashboard server requires its token.

The routes are enumerated from the one route table
(:data:`analysis.read.routes.ROUTES`; ``{name}`` filled with every static file and
every registered analysis), so a route added later is covered without editing this file.
Each is refused (401) without the token, with a wrong one (header or cookie, or the right
value under another server's cookie name), and answered (200) with ``Authorization:
Bearer`` and with the cookie that a page URL carrying ``?token=`` sets. Requests go over
raw ``http.client`` so that redirects and ``Set-Cookie`` are seen as sent.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest

from analysis.dashboard import server as server_module
from analysis.dashboard.server import Dashboard, DashboardServer, cookie_name
from analysis.read import routes as routes_module
from analysis.read.cursors import ReadCursors
from analysis.read.routes import ROUTES, STATIC_FILES, Route
from analysis.read.sidecar import check_token, dashboard_url, new_token
from analysis.registry import ANALYSES
from tests.analysis.crafted import write_history

TOKEN = new_token()
RUN = "r"

NAMES: dict[str, tuple[str, ...]] = {
    "/static/{name}": STATIC_FILES,
    "/api/analysis/{name}": tuple(ANALYSES),
}
"""The values of each ``{name}`` template of the routing table."""

QUERIES: dict[str, str] = {
    "/api/layer": f"run={RUN}&layer=1",
}
"""Query string of a route that needs more than ``run`` to answer 200."""

QUERY_BODY = json.dumps({"sql": "SELECT count(*) AS n FROM runs"}).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A dashboard on a store holding one run with weight statistics (so that every
    analysis, the weight one included, answers 200). Yields (host, port)."""
    tmp = tmp_path_factory.mktemp("auth")
    rng = np.random.default_rng(0)
    weights = {(i, s): rng.normal(0, 1, 40) for i in range(3) for s in (0, 5)}
    norms = np.array([[1.0, 2, 3, 2, 1, 2], [0.5, 0.6, 0.4, 0.5, 0.6, 0.5],
                      [3.0, 3, 2, 3, 4, 3]])
    db = write_history(tmp / "a.duckdb", norms, run_id=RUN, names=["x", "y", "z"],
                       numel=[40, 40, 40], weights=weights)
    cursors = ReadCursors.open_read_only(Path(db))
    server = DashboardServer(Dashboard(cursors, TOKEN), "127.0.0.1", 0)
    server.start()
    try:
        address = urlsplit(server.url)
        assert address.hostname is not None and address.port is not None
        yield address.hostname, address.port
    finally:
        server.stop()
        cursors.close()


def concrete(route: Route) -> list[tuple[str, str, bytes | None]]:
    """(method, path with query, body) of the requests that exercise ``route``: each
    ``{name}`` value, the query that makes it answer 200."""
    if "{name}" in route.path:
        assert route.path in NAMES, f"add the names of {route.path} to NAMES"
        paths = [route.path.replace("{name}", name) for name in NAMES[route.path]]
    else:
        paths = [route.path]
    out: list[tuple[str, str, bytes | None]] = []
    for path in paths:
        if route.method == "POST":
            out.append((route.method, path, QUERY_BODY))
        elif route.page:
            out.append((route.method, path, None))
        else:
            query = QUERIES.get(route.path, f"run={RUN}")
            out.append((route.method, f"{path}?{query}", None))
    return out


REQUESTS = [(route, *request) for route in ROUTES for request in concrete(route)]
IDS = [f"{method} {path}" for _route, method, path, _body in REQUESTS]


def send(address: tuple[str, int], method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPMessage]:
    """One request on a fresh connection: (status, body, headers); redirects not followed."""
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        sent = dict(headers or {})
        if body is not None:
            sent.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.read(), response.headers
    finally:
        conn.close()


def test_the_table_covers_the_routes() -> None:
    """Every route of the table is documented in the module docstring, every handler
    exists, and every page / API route is exercised below (at least one request each)."""
    doc = routes_module.__doc__ or ""
    for route in ROUTES:
        assert f"``{route.method} {route.path}``" in doc or route.path == "/index.html", route
        assert callable(getattr(Dashboard, route.handler, None)), route
        assert route.page == (not route.path.startswith("/api/")), route
    assert {r for r, *_ in REQUESTS} == set(ROUTES)
    assert len(REQUESTS) >= len(ROUTES) + len(STATIC_FILES) + len(ANALYSES) - 2


@pytest.mark.parametrize(("route", "method", "path", "body"), REQUESTS, ids=IDS)
def test_each_route_requires_the_token(served, route: Route, method: str, path: str,
                                       body: bytes | None) -> None:
    port = served[1]
    refusals = {
        "no token": {},
        "wrong bearer": {"Authorization": f"Bearer {new_token()}"},
        "token without Bearer": {"Authorization": TOKEN},
        "wrong cookie": {"Cookie": f"{cookie_name(port)}={new_token()}"},
        "another port's cookie": {"Cookie": f"{cookie_name(port + 1)}={TOKEN}"},
        "token prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    }
    for why, headers in refusals.items():
        status, answer, got = send(served, method, path, body, headers)
        assert status == 401, (why, status, answer[:200])
        assert got["WWW-Authenticate"].startswith("Bearer")
        if route.page:
            assert got["Content-Type"].startswith("text/html"), why
            text = answer.decode()
            assert "gradstream serve" in text and "a.duckdb.serve.json" in text, text
            assert TOKEN not in text
        else:
            error = json.loads(answer)
            assert error["kind"] == "unauthorized", error
            assert "Authorization: Bearer" in error["error"] and "a.duckdb.serve.json" in (
                error["error"])

    answered = {
        "bearer": {"Authorization": f"Bearer {TOKEN}"},
        "cookie": {"Cookie": f"theme=dark; {cookie_name(port)}={TOKEN}; other=\"x y\""},
    }
    for how, headers in answered.items():
        status, answer, got = send(served, method, path, body, headers)
        assert status == 200, (how, status, answer[:300])
        assert "Set-Cookie" not in got


def test_a_page_url_with_the_token_sets_the_cookie(served) -> None:
    port = served[1]
    url = dashboard_url(f"http://127.0.0.1:{port}", TOKEN)
    status, _body, got = send(served, "GET", url.removeprefix(f"http://127.0.0.1:{port}"))
    assert status == 303 and got["Location"] == "/"
    cookie = got["Set-Cookie"]
    attributes = [part.strip() for part in cookie.split(";")]
    assert attributes[0] == f"{cookie_name(port)}={TOKEN}"
    assert set(attributes[1:]) == {"Path=/", "HttpOnly", "SameSite=Strict"}
    assert got["Referrer-Policy"] == "no-referrer"

    # The other parameters are kept, the token dropped from the address.
    status, _body, got = send(served, "GET", f"/?run=a%2F1&token={TOKEN}&x=1")
    assert status == 303 and got["Location"] == "/?run=a%2F1&x=1"
    status, _body, got = send(served, "GET", f"/static/dashboard.js?token={TOKEN}")
    assert status == 303 and got["Location"] == "/static/dashboard.js"

    # The cookie it set opens the page.
    status, page, _ = send(served, "GET", "/", headers={"Cookie": attributes[0]})
    assert status == 200 and b'id="heatmap"' in page

    # A wrong token in the URL sets nothing.
    for wrong in (new_token(), "", TOKEN.upper() if TOKEN.upper() != TOKEN else TOKEN + "x"):
        status, page, got = send(served, "GET", f"/?token={wrong}")
        assert status == 401 and "Set-Cookie" not in got and b"gradstream serve" in page


def test_the_login_redirect_never_leaves_the_server(served) -> None:
    """A page URL whose path starts with several slashes or a backslash (``//host``,
    ``/\\host``: protocol-relative to a browser) still redirects to a path of this server,
    never to another host (no open redirect), keeping the other parameters."""
    for target, location in (
            (f"//evil.example/?token={TOKEN}", "/evil.example/"),
            (f"////evil.example/x?token={TOKEN}&run=r", "/evil.example/x?run=r"),
            (f"/\\evil.example/?token={TOKEN}", "/evil.example/"),
            (f"/\\/\\//evil.example?token={TOKEN}", "/evil.example"),
            (f"/%2F%2Fevil.example?token={TOKEN}", "/%2F%2Fevil.example")):
        status, _body, got = send(served, "GET", target)
        assert status == 303, (target, status)
        assert got["Location"] == location, (target, got["Location"])
        assert urlsplit(got["Location"]).netloc == ""
    assert server_module._same_origin_path("/\t//\\evil.example") == "/evil.example"
    assert server_module._same_origin_path("") == "/"


def test_api_routes_do_not_take_the_token_in_the_url(served) -> None:
    """``?token=`` logs a browser in on a page only; a script sends the header."""
    status, body, got = send(served, "GET", f"/api/runs?token={TOKEN}")
    assert status == 401 and "Set-Cookie" not in got
    assert json.loads(body)["kind"] == "unauthorized"


def test_unknown_paths_and_methods(served) -> None:
    """Refused before routing (no route is revealed without the token); with it, 404 for
    an unknown path and 405 for a known path asked with another method."""
    for path in ("/nothing", "/api/nothing", "/static/../server.py", "/api"):
        assert send(served, "GET", path)[0] == 401, path
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert send(served, "GET", "/nothing", headers=auth)[0] == 404
    assert send(served, "GET", "/api/nothing", headers=auth)[0] == 404
    status, body, headers = send(served, "GET", "/api/query", headers=auth)
    assert status == 405 and "answers POST" in json.loads(body)["error"]
    assert headers["Allow"] == "POST"  # RFC 9110: a 405 names the methods that work
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    for path in ("/api/runs/", "/static"):  # a stray slash is an unknown path, no redirect
        assert send(served, "GET", path, headers=auth)[0] == 404, path
    assert send(served, "POST", "/api/runs", QUERY_BODY, auth)[0] == 405
    assert send(served, "POST", "/api/query", QUERY_BODY)[0] == 401


def test_a_refused_post_keeps_the_connection_usable(served) -> None:
    """A refused POST's unread body is not taken for the next request: the server closes
    the connection, and a new one is answered."""
    conn = http.client.HTTPConnection(*served, timeout=30)
    try:
        conn.request("POST", "/api/query", body=b'{"sql": "GET /api/runs HTTP/1.1"}',
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        assert response.status == 401 and response.headers["Connection"] == "close"
    finally:
        conn.close()
    status, _body, _ = send(served, "GET", f"/api/runs?run={RUN}",
                            headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200


def test_tokens_are_checked(tmp_path: Path) -> None:
    """An empty token would let every request in; a token that cannot sit in a URL or a
    cookie unquoted would break the printed URL. A user's own token needs 16 characters."""
    db = write_history(tmp_path / "t.duckdb", np.ones((1, 2)))
    cursors = ReadCursors.open_read_only(Path(db))
    try:
        for bad in ("", "a b", "tok;en", "x\r\nSet-Cookie: y=1"):
            with pytest.raises(ValueError, match="token"):
                Dashboard(cursors, bad)
    finally:
        cursors.close()
    token = new_token()
    assert check_token(token) == token and re.fullmatch(r"[A-Za-z0-9_-]{43}", token)
    for bad in ("short", "x" * 15, "y" * 20 + "/", "é" * 20):
        with pytest.raises(ValueError, match="at least 16 characters"):
            check_token(bad)
    assert dashboard_url("http://127.0.0.1:8765", token) == (
        f"http://127.0.0.1:8765/?token={token}")


def test_the_endpoint_reader_sends_the_token(served, tmp_path: Path) -> None:
    """:class:`analysis.read.reader.EndpointReader` sends the sidecar's token with every
    request (the GET routes and ``POST /api/query``); with a stale token (a sidecar of a
    server since restarted) each read fails saying so."""
    from analysis.read.query import QueryError
    from analysis.read.reader import EndpointReader
    from analysis.read.sidecar import ServeInfo

    host, port = served

    def reader(token: str) -> EndpointReader:
        info = ServeInfo(url=f"http://{host}:{port}", pid=0, host="elsewhere", db="a.duckdb",
                         token=token, writer=False, started_at=0.0)
        return EndpointReader(tmp_path / "a.duckdb", info, timeout_s=30.0)

    good, stale = reader(TOKEN), reader(new_token())
    reads = {
        "sql": lambda r: r.sql("SELECT count(*) AS n FROM runs").column("n").to_pylist(),
        "report": lambda r: r.report(RUN).run_id,
        "heatmap": lambda r: len(r.heatmap(RUN)) > 0,
        "grid": lambda r: r.grid(RUN).row_labels,
        "analysis": lambda r: r.analysis("flow", RUN).run_id,
    }
    assert [read(good) for read in reads.values()] == [[1], RUN, True, ["x", "y", "z"], RUN]
    for name, read in reads.items():
        with pytest.raises(QueryError, match="missing or wrong token"):
            read(stale)
            pytest.fail(name)
